"""
The scheduler: which requests run in the next forward pass, and how many tokens each.

Read prefix_caching.py (the allocator) first; batch_engine.py runs what this file plans.
Pure Python, like the allocator: the rules below are tested without a model.

One step, as vLLM v1's Scheduler.schedule and nano-vllm's Scheduler do it:

    1. running requests first: each decodes one token (the one it sampled last step). Its
       K/V needs a slot; when the last block is full that takes a new block. If the pool has
       none, the most recently admitted running request is preempted: its blocks are freed
       (last block first; the full ones stay cached), and it goes back to the front of the
       waiting queue. vLLM v1 calls this recompute preemption: when it is admitted again, it
       usually finds most of its prompt and reply still in the pool.
    2. then waiting requests, in arrival order, while the step's token budget and the pool
       allow. allocate_with_prefix does the capacity check after the prefix hit (a hit on a
       free cached block takes that block out of the free queue) and changes nothing when it
       refuses; the first request that does not fit stops admission (no overtaking).

A request admitted in this step can hit blocks another request admitted in this step is
about to compute: allocate_with_prefix caches a full block the moment it is allocated, and
batch_engine.py writes every new K/V of the step into the pool before anything attends.

Not done here: chunked prefill. A prompt is prefilled in one step; the token budget counts
only its uncached tokens (as nano-vllm does), and a prompt longer than the budget runs in a
step of its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prefix_caching import OutOfBlocksError, PrefixCachingAllocator

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Request:
    """One request's life: its tokens, where it stands, and what the scheduler did to it."""

    request_id: str
    prompt_ids: list[int]
    cache_salt: str | None = None
    max_tokens: int = 64
    output_ids: list[int] = field(default_factory=list)  # sampled so far
    status: str = WAITING
    num_computed_tokens: int = 0  # of prompt_ids + output_ids, tokens whose K/V are in the pool
    num_cached_tokens: int = 0  # prompt tokens hit at first admission (what the client is told)
    num_preemptions: int = 0
    admitted: bool = False  # ever admitted (num_cached_tokens is set)
    payload: Any = None  # whatever the engine keeps with it (sampling state, the reply)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and reply: what a resumed request recomputes, minus what the pool still holds."""
        return self.prompt_ids + self.output_ids


@dataclass
class ScheduledRequest:
    """Compute tokens [start, end) of request.token_ids in this step, then sample one more."""

    request: Request
    start: int
    end: int

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


class Scheduler:
    """A waiting queue and a running list over one allocator.

    >>> from prefix_caching import PrefixCachingAllocator
    >>> s = Scheduler(PrefixCachingAllocator(num_blocks=8, block_size=4))
    >>> s.add(Request("a", list(range(10)))); s.add(Request("b", list(range(9)) + [99]))
    >>> [(r.request.request_id, r.start, r.end) for r in s.schedule().scheduled]  # b hits a's 2 blocks
    [('a', 0, 10), ('b', 8, 10)]
    """

    def __init__(self, allocator: PrefixCachingAllocator, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        alloc = self.allocator
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        budget = self.max_num_batched_tokens

        # 1. Running requests decode their last sampled token.
        i = 0
        while i < len(self.running):
            request = self.running[i]
            try:
                alloc.append_token(request.request_id, request.output_ids[-1])
            except OutOfBlocksError:
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                continue  # retry `request`, unless it was the victim (then the loop ends)
            scheduled.append(ScheduledRequest(request, request.num_computed_tokens, request.num_computed_tokens + 1))
            budget -= 1
            i += 1

        # 2. Waiting requests, in arrival order, while there is room. A request preempted in
        # this very step waits for the next one: the pool was just too small for it.
        while self.waiting and len(self.running) < self.max_num_seqs and self.waiting[0] not in preempted:
            request = self.waiting[0]
            tokens = request.token_ids
            uncached = len(tokens) - alloc.peek(tokens, request.cache_salt)
            if uncached > budget and scheduled:
                break  # over the token budget: next step (alone in a step, any length runs)
            try:
                num_cached, _ = alloc.allocate_with_prefix(request.request_id, tokens, request.cache_salt)
            except OutOfBlocksError:
                break  # the pool is full for now: wait until running requests finish
            self.waiting.popleft()
            self.running.append(request)
            request.status = RUNNING
            request.num_computed_tokens = num_cached
            if not request.admitted:
                request.admitted, request.num_cached_tokens = True, num_cached
            scheduled.append(ScheduledRequest(request, num_cached, len(tokens)))
            budget -= len(tokens) - num_cached
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
