"""A correct exercise 6: decodes with a nested retry loop, admission in a helper; blocks compared by hash."""

from exercises.given import RUNNING, WAITING, OutOfBlocksError, SchedulerBase, ScheduledRequest, StepPlan


class Scheduler(SchedulerBase):
    def schedule(self, budget=None):
        left = min(budget or self.max_num_batched_tokens, self.max_num_batched_tokens)
        plan = StepPlan([], [])
        size = self.allocator.block_size
        coming = {h for r in self.running if r.num_prefill_left
                  for h in self._hashes(r)[r.num_computed_tokens // size:]}
        shares = self._shares(left, [r for r in self.waiting if not self._waits(r, coming)])
        for request in list(self.running):
            if left == 0 or request not in self.running:
                break
            start = request.num_computed_tokens
            end = min(len(request.token_ids), start + left, start + shares.get(request.request_id, 1))
            if end == start:
                continue
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
        for request in [] if plan.preempted else list(self.waiting):
            if not left or len(self.running) >= self.max_num_seqs:
                break
            if self._waits(request, coming):
                continue
            admitted = self._admit(request, left)
            if admitted is None:
                break
            plan.scheduled.append(admitted)
            left -= admitted.end - admitted.start
        return plan

    def _hashes(self, request):
        request.block_hashes = self.allocator.hash_blocks(request.token_ids, request.cache_salt, request.block_hashes)
        return request.block_hashes

    def _hit(self, request):
        return self.allocator.peek(request.token_ids, request.cache_salt, block_hashes=self._hashes(request))

    def _waits(self, request, coming):
        nxt = self._hit(request) // self.allocator.block_size
        return nxt < len(request.block_hashes) and request.block_hashes[nxt] in coming

    def _shares(self, left, waiting):
        needs = {r.request_id: len(r.token_ids) - r.num_computed_tokens for r in self.running if r.num_prefill_left}
        left = max(0, left - sum(not r.num_prefill_left for r in self.running))
        for request in waiting[: self.max_num_seqs - len(self.running)]:
            if len(needs) >= left:
                break
            needs[request.request_id] = len(request.token_ids) - self._hit(request)
        shares = {}
        for k, (request_id, need) in enumerate(sorted(needs.items(), key=lambda item: item[1])):
            shares[request_id] = min(need, -(-left // (len(needs) - k)))
            left -= shares[request_id]
        return shares

    def _admit(self, request, left):
        hit = self._hit(request)
        end = hit + min(left, len(request.token_ids) - hit)
        try:
            self.allocator.allocate_with_prefix(request.request_id, request.token_ids[:end], request.cache_salt,
                                                block_hashes=request.block_hashes)
        except OutOfBlocksError:
            return None
        self.waiting.remove(request)
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
