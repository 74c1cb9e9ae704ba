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

        # 1. running requests, in admission order: a decode, or a prompt's next chunk
        i = 0
        while i < len(self.running) and left > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            end = min(len(request.token_ids), start + left)
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

        # 2. waiting requests, in arrival order, only if nothing was preempted
        while not preempted and self.waiting and left > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            tokens = request.token_ids
            hit = self.allocator.peek(tokens, cache_salt=request.cache_salt)
            end = min(len(tokens), hit + left)
            try:
                allocation = self.allocator.allocate_with_prefix(
                    request.request_id, tokens[:end], cache_salt=request.cache_salt)
            except OutOfBlocksError:
                break  # no overtaking: everyone behind it waits too
            self.waiting.popleft()
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
