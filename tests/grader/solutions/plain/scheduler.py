"""A correct exercise 6: one index walking the running list, then admission; blocks compared by their tokens."""

from exercises.given import RUNNING, WAITING, OutOfBlocksError, SchedulerBase, ScheduledRequest, StepPlan


class Scheduler(SchedulerBase):
    def schedule(self, budget=None):
        alloc = self.allocator
        budget = self.max_num_batched_tokens if budget is None else min(budget, self.max_num_batched_tokens)
        scheduled, preempted = [], []
        coming = self._coming()
        shares = self._shares(budget, [r for r in self.waiting if not self._waits(r, coming)])
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            end = min(len(request.token_ids), start + min(budget, shares.get(request.request_id, 1)))
            if end == start:
                i += 1
                continue
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
        for request in list(self.waiting):
            if preempted or len(self.running) >= self.max_num_seqs or budget <= 0:
                break
            if self._waits(request, coming):
                continue
            hit = self._hit(request)
            num_new = min(len(request.token_ids) - hit, budget)
            try:
                alloc.allocate_with_prefix(request.request_id, request.token_ids[: hit + num_new], request.cache_salt)
            except OutOfBlocksError:
                break
            self.waiting.remove(request)
            self.running.append(request)
            request.status, request.num_computed_tokens = RUNNING, hit
            if not request.admitted:
                request.admitted, request.num_cached_tokens = True, hit
            scheduled.append(ScheduledRequest(request, hit, hit + num_new))
            budget -= num_new
        return StepPlan(scheduled, preempted)

    def _hit(self, request):
        return self.allocator.peek(request.token_ids, request.cache_salt)

    def _coming(self):
        """(salt, tokens up to the block's end) of each block a prefilling prompt has yet to compute."""
        size = self.allocator.block_size
        coming = set()
        for r in self.running:
            if r.num_prefill_left:
                for end in range(r.num_computed_tokens // size * size + size, len(r.token_ids) + 1, size):
                    coming.add((r.cache_salt, tuple(r.token_ids[:end])))
        return coming

    def _waits(self, request, coming):
        end = self._hit(request) + self.allocator.block_size
        return end <= len(request.token_ids) and (request.cache_salt, tuple(request.token_ids[:end])) in coming

    def _shares(self, budget, waiting):
        needs = {r.request_id: len(r.token_ids) - r.num_computed_tokens for r in self.running if r.num_prefill_left}
        tokens = max(0, budget - sum(1 for r in self.running if not r.num_prefill_left))
        for request in waiting[: self.max_num_seqs - len(self.running)]:
            if len(needs) >= tokens:
                break
            needs[request.request_id] = len(request.token_ids) - self._hit(request)
        shares = {}
        order = sorted(needs, key=needs.get)
        for k, request_id in enumerate(order):
            shares[request_id] = min(needs[request_id], -(-tokens // (len(order) - k)))
            tokens -= shares[request_id]
        return shares

    def _preempt(self, request):
        self.allocator.free(request.request_id)
        request.status, request.num_computed_tokens = WAITING, 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
