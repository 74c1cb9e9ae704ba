"""A correct exercise 6: one index walking the running list, then admission."""

from exercises.given import RUNNING, WAITING, OutOfBlocksError, SchedulerBase, ScheduledRequest, StepPlan


class Scheduler(SchedulerBase):
    def schedule(self, budget=None):
        alloc = self.allocator
        budget = self.max_num_batched_tokens if budget is None else min(budget, self.max_num_batched_tokens)
        scheduled, preempted = [], []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            end = min(len(request.token_ids), start + budget)
            try:
                alloc.append_tokens(request.request_id, request.token_ids[start:end])
            except OutOfBlocksError:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                continue
            scheduled.append(ScheduledRequest(request, start, end))
            budget -= end - start
            i += 1
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0 and not preempted:
            request = self.waiting[0]
            hit = alloc.peek(request.token_ids, request.cache_salt)
            num_new = min(len(request.token_ids) - hit, budget)
            try:
                alloc.allocate_with_prefix(request.request_id, request.token_ids[: hit + num_new], request.cache_salt)
            except OutOfBlocksError:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status, request.num_computed_tokens = RUNNING, hit
            if not request.admitted:
                request.admitted, request.num_cached_tokens = True, hit
            scheduled.append(ScheduledRequest(request, hit, hit + num_new))
            budget -= num_new
        return StepPlan(scheduled, preempted)

    def _preempt(self, request):
        self.allocator.free(request.request_id)
        request.status, request.num_computed_tokens = WAITING, 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
