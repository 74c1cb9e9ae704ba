"""A correct exercise 6, written into the starter from the lesson and the starter alone."""

from exercises.given import RUNNING, WAITING, OutOfBlocksError, Request, SchedulerBase, ScheduledRequest, StepPlan


class Scheduler(SchedulerBase):
    def schedule(self, budget: int | None = None) -> StepPlan:
        """Plan one step: StepPlan(scheduled, preempted), both lists in the order things
        happen. budget: the tokens this step may compute, at most self.max_num_batched_tokens
        (the default). Each ScheduledRequest(request, start, end) asks the model to compute
        tokens [start, end) of request.token_ids; the engine then sets num_computed_tokens to
        end and, when end reaches the end of its tokens, appends the token it samples."""
        left = self.max_num_batched_tokens if budget is None else min(budget, self.max_num_batched_tokens)
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        size = self.allocator.block_size

        # the blocks the prompts still prefilling have yet to compute, by their chained hashes
        coming = set()
        for r in self.running:
            if r.num_prefill_left > 0:
                coming.update(self._hashes(r)[r.num_computed_tokens // size:])

        def waits_for_hit(request: Request) -> bool:
            hashes = self._hashes(request)
            nxt = self.allocator.peek(request.token_ids, cache_salt=request.cache_salt) // size
            return nxt < len(hashes) and hashes[nxt] in coming

        # 1. shares: what the decodes leave, among the prompts prefilling and the waiting requests that could come in
        to_share = max(0, left - len([r for r in self.running if r.num_prefill_left == 0]))
        needs: dict[str, int] = {}
        for r in self.running:
            if r.num_prefill_left > 0:
                needs[r.request_id] = len(r.token_ids) - r.num_computed_tokens
        candidates = [r for r in self.waiting if not waits_for_hit(r)][: self.max_num_seqs - len(self.running)]
        for r in candidates:
            if len(needs) >= to_share:
                break
            needs[r.request_id] = len(r.token_ids) - self.allocator.peek(r.token_ids, cache_salt=r.cache_salt)
        shares: dict[str, int] = {}
        still_to_serve = len(needs)
        for request_id in sorted(needs, key=lambda i: needs[i]):
            shares[request_id] = min(needs[request_id], (to_share + still_to_serve - 1) // still_to_serve)
            to_share -= shares[request_id]
            still_to_serve -= 1

        # 2. running requests, in admission order: a decode, or a prompt's share
        i = 0
        while i < len(self.running) and left > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            end = min(len(request.token_ids), start + left)
            if request.num_prefill_left > 0:
                end = min(end, start + shares[request.request_id])
            if end <= start:
                i += 1
                continue
            while True:
                try:
                    self.allocator.append_tokens(request.request_id, request.token_ids[start:end])
                    break
                except OutOfBlocksError:
                    victim = self.running.pop()  # the one admitted last
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
            if request.status != RUNNING:
                break  # it preempted itself: everyone after it is gone too
            scheduled.append(ScheduledRequest(request, start, end))
            left -= end - start
            i += 1

        # 3. waiting requests, in arrival order, only if nothing was preempted; one waiting for
        # a hit lets the others by
        for request in list(self.waiting):
            if preempted or left <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if waits_for_hit(request):
                continue
            tokens = request.token_ids
            hit = self.allocator.peek(tokens, cache_salt=request.cache_salt)
            end = min(len(tokens), hit + left)
            try:
                allocation = self.allocator.allocate_with_prefix(
                    request.request_id, tokens[:end], cache_salt=request.cache_salt)
            except OutOfBlocksError:
                break  # no overtaking: everyone behind it waits too
            self.waiting.remove(request)
            start = allocation.num_cached_tokens
            request.status = RUNNING
            request.num_computed_tokens = start
            if not request.admitted:
                request.admitted = True
                request.num_cached_tokens = start
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, start, end))
            left -= end - start

        return StepPlan(scheduled, preempted)

    def _hashes(self, request: Request) -> list[bytes]:
        """The chained hashes of the request's full blocks, worked out afresh."""
        return self.allocator.hash_blocks(request.token_ids, request.cache_salt, [])

    def _preempt(self, request: Request) -> None:
        """Recompute preemption of `request`, already taken out of self.running: afterwards it
        holds no blocks, waits again with nothing computed, and counts one more preemption
        (request.num_preemptions and self.num_preemptions)."""
        self.allocator.free(request.request_id)
        request.status = WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
