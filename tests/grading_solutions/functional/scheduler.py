"""A correct exercise 6: the two phases as two methods."""

from exercises.given import RUNNING, WAITING, OutOfBlocksError, SchedulerBase, ScheduledRequest, StepPlan


class Scheduler(SchedulerBase):
    def schedule(self, budget=None):
        budget = self.max_num_batched_tokens if budget is None else min(budget, self.max_num_batched_tokens)
        scheduled, preempted, budget = self._running(budget)
        if not preempted:
            scheduled += self._waiting(budget)
        return StepPlan(scheduled, preempted)

    def _running(self, budget):
        scheduled, preempted, position = [], [], 0
        while position < len(self.running) and budget > 0:
            request = self.running[position]
            start, end = request.num_computed_tokens, min(len(request.token_ids), request.num_computed_tokens + budget)
            try:
                self.allocator.append_tokens(request.request_id, request.token_ids[start:end])
            except OutOfBlocksError:
                preempted.append(self.running[-1])
                self._preempt(self.running.pop())
                continue
            scheduled.append(ScheduledRequest(request, start, end))
            budget, position = budget - (end - start), position + 1
        return scheduled, preempted, budget

    def _waiting(self, budget):
        scheduled = []
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            tokens = request.token_ids
            hit = self.allocator.peek(tokens, cache_salt=request.cache_salt)
            end = min(len(tokens), hit + budget)
            try:
                self.allocator.allocate_with_prefix(request.request_id, tokens[:end], cache_salt=request.cache_salt)
            except OutOfBlocksError:
                break
            self.running.append(self.waiting.popleft())
            request.status, request.num_computed_tokens = RUNNING, hit
            if not request.admitted:
                request.admitted, request.num_cached_tokens = True, hit
            scheduled.append(ScheduledRequest(request, hit, end))
            budget -= end - hit
        return scheduled

    def _preempt(self, request):
        self.allocator.free(request.request_id)
        request.status, request.num_computed_tokens = WAITING, 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
