"""A correct exercise 6: decodes with a nested retry loop, admission in a helper."""

from exercises.given import RUNNING, WAITING, OutOfBlocksError, SchedulerBase, ScheduledRequest, StepPlan


class Scheduler(SchedulerBase):
    def schedule(self, budget=None):
        left = min(budget or self.max_num_batched_tokens, self.max_num_batched_tokens)
        plan = StepPlan([], [])
        for request in list(self.running):
            if left == 0 or request not in self.running:
                break
            start = request.num_computed_tokens
            end = min(len(request.token_ids), start + left)
            while True:
                try:
                    self.allocator.append_tokens(request.request_id, request.token_ids[start:end])
                    break
                except OutOfBlocksError:
                    victim = self.running.pop()
                    self._preempt(victim)
                    plan.preempted.append(victim)
                    if victim is request:
                        break
            if request in self.running:
                plan.scheduled.append(ScheduledRequest(request, start, end))
                left -= end - start
        if not plan.preempted:
            while self.waiting and left and len(self.running) < self.max_num_seqs:
                admitted = self._admit(self.waiting[0], left)
                if admitted is None:
                    break
                plan.scheduled.append(admitted)
                left -= admitted.end - admitted.start
        return plan

    def _admit(self, request, left):
        hit = self.allocator.peek(request.token_ids, request.cache_salt)
        end = hit + min(left, len(request.token_ids) - hit)
        try:
            self.allocator.allocate_with_prefix(request.request_id, request.token_ids[:end], request.cache_salt)
        except OutOfBlocksError:
            return None
        self.waiting.popleft()
        self.running.append(request)
        request.status, request.num_computed_tokens = RUNNING, hit
        if not request.admitted:
            request.admitted, request.num_cached_tokens = True, hit
        return ScheduledRequest(request, hit, end)

    def _preempt(self, request):
        self.allocator.free(request.request_id)
        request.status = WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
