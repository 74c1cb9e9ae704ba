"""A correct exercise 6: the phases as methods, the share and the wait as functions of plain values."""

from exercises.given import RUNNING, WAITING, OutOfBlocksError, SchedulerBase, ScheduledRequest, StepPlan


def share(tokens, needs):
    """{id: tokens} for needs [(id, need)], smallest need first, each at most an equal share rounded up."""
    ordered = sorted(needs, key=lambda pair: pair[1])
    given = {}
    for k, (request_id, need) in enumerate(ordered):
        given[request_id] = min(need, -(-tokens // (len(ordered) - k)))
        tokens -= given[request_id]
    return given


def writes(writer, tokens, salt, end):
    """Whether the prefilling `writer` has yet to compute a block ending at `end` that holds tokens[:end]."""
    return (writer.cache_salt == salt and writer.num_computed_tokens < end <= len(writer.token_ids)
            and writer.token_ids[:end] == tokens[:end])


class Scheduler(SchedulerBase):
    def schedule(self, budget=None):
        budget = self.max_num_batched_tokens if budget is None else min(budget, self.max_num_batched_tokens)
        writers = [r for r in self.running if r.num_prefill_left > 0]
        scheduled, preempted, budget = self._running(budget, self._shares(budget, writers))
        if not preempted:
            scheduled += self._waiting(budget, writers)
        return StepPlan(scheduled, preempted)

    def _hit(self, request):
        return self.allocator.peek(request.token_ids, cache_salt=request.cache_salt)

    def _waits(self, request, writers):
        end = self._hit(request) + self.allocator.block_size
        return end <= len(request.token_ids) and any(
            writes(w, request.token_ids, request.cache_salt, end) for w in writers)

    def _shares(self, budget, writers):
        tokens = max(0, budget - (len(self.running) - len(writers)))
        needs = [(r.request_id, len(r.token_ids) - r.num_computed_tokens) for r in writers]
        seats = self.max_num_seqs - len(self.running)
        for request in [r for r in self.waiting if not self._waits(r, writers)][:seats]:
            if len(needs) >= tokens:
                break
            needs.append((request.request_id, len(request.token_ids) - self._hit(request)))
        return share(tokens, needs)

    def _running(self, budget, shares):
        scheduled, preempted, position = [], [], 0
        while position < len(self.running) and budget > 0:
            request = self.running[position]
            start = request.num_computed_tokens
            end = min(len(request.token_ids), start + budget, start + shares.get(request.request_id, 1))
            if end == start:
                position += 1
                continue
            try:
                self.allocator.append_tokens(request.request_id, request.token_ids[start:end])
            except OutOfBlocksError:
                preempted.append(self.running[-1])
                self._preempt(self.running.pop())
                continue
            scheduled.append(ScheduledRequest(request, start, end))
            budget, position = budget - (end - start), position + 1
        return scheduled, preempted, budget

    def _waiting(self, budget, writers):
        scheduled = []
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if self._waits(request, writers):
                continue
            tokens = request.token_ids
            hit = self._hit(request)
            end = min(len(tokens), hit + budget)
            try:
                self.allocator.allocate_with_prefix(request.request_id, tokens[:end], cache_salt=request.cache_salt)
            except OutOfBlocksError:
                break
            self.waiting.remove(request)
            self.running.append(request)
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
