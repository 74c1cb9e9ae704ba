"""
The scheduler: which requests run in the next forward pass, and how many tokens each.

Read prefix_caching.py (the allocator) and request.py (a request's state) first;
batch_engine.py runs what this file plans.
Pure Python, like the allocator: the rules below are tested without a model.

There is no prefill phase and no decode phase, as in vLLM v1's Scheduler.schedule
(vllm/v1/core/sched/scheduler.py): every request knows how many of its tokens have K/V in
the pool (num_computed_tokens), and each step hands out a token budget,
max_num_batched_tokens:

    1. running requests first, in admission order. One that is decoding takes 1 token (the
       one it sampled last step); one still prefilling takes its next chunk, as much of the
       rest of its prompt as the budget left allows. Its new tokens need slots; when that
       takes a new block and the pool has none, the most recently admitted running request
       is preempted: its blocks are freed (last block first; the full ones stay cached), and
       it goes back to the front of the waiting queue. vLLM v1 calls this recompute
       preemption: when it is admitted again, it usually finds most of its tokens still in
       the pool.
    2. then waiting requests, in arrival order, while the budget, max_num_seqs and the pool
       allow. After its prefix hit, a request's uncached tokens are scheduled up to the
       budget left; the rest come in later steps (chunked prefill). allocate_with_prefix does
       the capacity check after the prefix hit and changes nothing when it refuses; the first
       request that does not fit stops admission (no overtaking).

A step allocates slots only for the tokens it schedules, and a block is cached the moment
its last token gets a slot: so another request can find a block from the step that computes
its K/V on, never earlier. Within that step it may: the step's attention (batch_attention.py,
pool_attention) writes every new K/V of the step into the pool before anything attends, so a
request admitted in the same step as another can hit the blocks the other computes in that
very step.

A request's block hashes are computed once and kept on it (request.py: Request.block_hashes,
extended through the allocator's hash_blocks), so a request that waits at the head of a full
pool, or comes back after a preemption, is never hashed again. The scheduler trusts what it
is given (the Engine's front checked the request); the allocator keeps its own checks, as the
public API the lessons teach.

How many tokens a step may compute, and how many of them each request may take, is a budget
policy's to say (step_budget.py): schedule(budget) takes a Budget (a total, and a cap per
request if the policy wants one), and candidates() is what a policy sees before it decides:
each running request and each waiting one that could be admitted, with its cached, computed
and remaining tokens and its tenant.

enable_chunked_prefill=False restores the older rule, for comparison: a prompt is prefilled
whole in one step, its uncached tokens counted against the budget, and one longer than the
budget left waits for a step of its own, which comes only when every running request has
finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prefix_caching import OutOfBlocksError, PrefixCachingAllocator
from request import FINISHED, RUNNING, WAITING, Request

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # tokens one step computes at most (vLLM's flag of that name)

__all__ = ["Budget", "DEFAULT_MAX_NUM_BATCHED_TOKENS", "Candidate", "FINISHED", "RUNNING", "Request",
           "ScheduledRequest", "Scheduler", "StepPlan", "WAITING", "check_step_size"]


@dataclass
class ScheduledRequest:
    """Compute tokens [start, end) of request.token_ids in this step; if that reaches the end
    of its tokens, sample one more (a chunk that stops part-way through a prompt samples
    nothing: its next token is already known)."""

    request: Request
    start: int
    end: int
    samples: bool = field(init=False)  # set when planned: sampling adds a token to request.token_ids

    def __post_init__(self):
        self.samples = self.end == len(self.request.token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.end - self.start > 1 or self.start < len(self.request.prompt_ids)


@dataclass
class StepPlan:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.scheduled)


@dataclass(frozen=True)
class Candidate:
    """A request the next step could run, as a budget policy sees it (Scheduler.candidates).

    num_cached_tokens: tokens it finds in the pool (waiting: what a lookup finds now; running:
    what it hit when admitted). num_computed_tokens: where its next chunk starts (waiting: at
    its hit). num_remaining_tokens: what it still has to compute before it samples again (a
    decode: 1)."""

    request: Request
    running: bool
    num_cached_tokens: int
    num_computed_tokens: int
    num_remaining_tokens: int

    @property
    def tenant(self) -> str | None:
        return self.request.tenant


@dataclass(frozen=True)
class Budget:
    """What one step may compute: `tokens` in all, and at most chunks[request_id] for a
    request the policy caps (absent: no cap of its own; 0: not this step)."""

    tokens: int
    chunks: dict[str, int] = field(default_factory=dict)


def check_step_size(max_num_seqs, max_num_batched_tokens) -> None:
    """Refuse (ValueError) a step size that cannot work."""
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r:.40}")
    if max_num_batched_tokens < max_num_seqs:
        # vLLM refuses it too: with fewer tokens than requests, a step could not decode every
        # running request, and a new request would wait for a budget never left over.
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs "
            f"({max_num_seqs}): every running request decodes a token each step"
        )


class Scheduler:
    """A waiting queue and a running list over one allocator.

    >>> from prefix_caching import PrefixCachingAllocator
    >>> s = Scheduler(PrefixCachingAllocator(num_blocks=8, block_size=4), max_num_seqs=4, max_num_batched_tokens=8)
    >>> s.add(Request("a", list(range(10)))); s.add(Request("b", list(range(9)) + [99]))
    >>> plan = s.schedule(); [(r.request.request_id, r.start, r.end) for r in plan.scheduled]  # a's first chunk
    [('a', 0, 8)]
    >>> for r in plan.scheduled: r.request.num_computed_tokens = r.end   # the model ran it (batch_engine.py)
    >>> [(r.request.request_id, r.start, r.end) for r in s.schedule().scheduled]  # b hits a's 2 blocks
    [('a', 8, 10), ('b', 8, 10)]
    """

    def __init__(self, allocator: PrefixCachingAllocator, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 enable_chunked_prefill: bool = True) -> None:
        check_step_size(max_num_seqs, max_num_batched_tokens)
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def candidates(self) -> list[Candidate]:
        """The running requests, then as many waiting ones as could be admitted, in order."""
        found = []
        for request in self.running:
            remaining = len(request.token_ids) - request.num_computed_tokens
            found.append(Candidate(request, True, request.num_cached_tokens, request.num_computed_tokens, remaining))
        for request in list(self.waiting)[: self.max_num_seqs - len(self.running)]:
            num_cached = self._lookup(request)
            found.append(Candidate(request, False, num_cached, num_cached, len(request.token_ids) - num_cached))
        return found

    def _lookup(self, request: Request) -> int:
        """Tokens of the request the pool holds now; its block hashes extended, never redone."""
        request.block_hashes = self.allocator.hash_blocks(request.token_ids, request.cache_salt, request.block_hashes)
        return self.allocator.peek(request.token_ids, request.cache_salt, block_hashes=request.block_hashes)

    def schedule(self, budget: int | Budget | None = None) -> StepPlan:
        """The next step's plan. budget: the tokens this step may compute (at most
        max_num_batched_tokens, the default), or a Budget that also caps single requests;
        step_budget.py's policies pick one."""
        alloc = self.allocator
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        if not isinstance(budget, Budget):
            budget = Budget(self.max_num_batched_tokens if budget is None else budget)
        caps = budget.chunks
        left = min(budget.tokens, self.max_num_batched_tokens)

        # 1. Running requests: a decode takes 1 token, a prompt still prefilling its next chunk.
        i = 0
        while i < len(self.running) and left > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            end = min(len(request.token_ids), start + min(left, caps.get(request.request_id, left)))
            if end == start:  # its policy's cap is 0: not this step
                i += 1
                continue
            try:
                alloc.append_tokens(request.request_id, request.token_ids[start:end])
            except OutOfBlocksError:
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                continue  # retry `request`, unless it was the victim (then the loop ends)
            scheduled.append(ScheduledRequest(request, start, end))
            left -= end - start
            i += 1

        # 2. Waiting requests, in arrival order, while there is room. A request preempted in
        # this very step waits for the next one: the pool was just too small for it.
        while (self.waiting and len(self.running) < self.max_num_seqs and left > 0
               and self.waiting[0] not in preempted):
            request = self.waiting[0]
            tokens = request.token_ids
            num_cached = self._lookup(request)
            num_new = len(tokens) - num_cached
            if self.enable_chunked_prefill:
                num_new = min(num_new, left, caps.get(request.request_id, left))  # the rest in later steps
                if num_new == 0:
                    break  # its policy's cap is 0: it waits, and nobody overtakes it
            elif num_new > left and scheduled:
                break  # over the token budget: next step (alone in a step, any length runs)
            try:
                alloc.allocate_with_prefix(request.request_id, tokens[: num_cached + num_new], request.cache_salt,
                                           block_hashes=request.block_hashes)
            except OutOfBlocksError:
                break  # the pool is full for now: wait until running requests finish
            self.waiting.popleft()
            self.running.append(request)
            request.status = RUNNING
            request.num_computed_tokens = num_cached
            if not request.admitted:
                request.admitted, request.num_cached_tokens = True, num_cached
            scheduled.append(ScheduledRequest(request, num_cached, num_cached + num_new))
            left -= num_new
        return StepPlan(scheduled, preempted)

    def _preempt(self, request: Request) -> None:
        # Every token the allocator holds for it has its K/V written (this step's token was
        # not appended), so its full blocks stay cached for when it comes back.
        self.allocator.free(request.request_id)
        request.status, request.num_computed_tokens = WAITING, 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Take a request out (finished, or its client left) and free its blocks."""
        if request.status == RUNNING:
            self.running.remove(request)
            # Normally every token it holds was computed (its last sampled token is never
            # appended). After a failed step, blocks past what was computed lose their hash.
            self.allocator.free(request.request_id, num_computed_tokens=request.num_computed_tokens)
        elif request.status == WAITING:
            self.waiting.remove(request)
        request.status = FINISHED

    def shared_blocks(self) -> dict[int, list[str]]:
        """Blocks in more than one running request's table: block id -> those requests."""
        holders: dict[int, list[str]] = {}
        for request in self.running:
            for block_id in self.allocator.block_tables[request.request_id]:
                holders.setdefault(block_id, []).append(request.request_id)
        return {block_id: ids for block_id, ids in sorted(holders.items()) if len(ids) > 1}

    def check_invariants(self) -> None:
        """No request both waiting and running; a block is in a running request's table only
        with a ref count for it; free + in use = the pool."""
        alloc = self.allocator
        running_ids = {r.request_id for r in self.running}
        assert not running_ids & {r.request_id for r in self.waiting}, "a request both waiting and running"
        assert set(alloc.block_tables) == running_ids, "block tables belong to running requests only"
        assert all(r.status == RUNNING for r in self.running) and all(r.status == WAITING for r in self.waiting)
        assert alloc.num_free_blocks + alloc.num_blocks_in_use == alloc.num_blocks
        alloc.check_invariants()
