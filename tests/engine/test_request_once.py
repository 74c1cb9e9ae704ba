"""A request is one object (engine/request.py) whose block hashes are computed once: the scheduler
and the allocator extend the list kept on it, so a request that waits at the head of a full
pool, or is preempted and comes back, never has a block hashed again (vLLM's
Request.block_hashes). Counted by wrapping the digest the allocator hashes with."""

import pytest

from allocator import prefix_caching
from allocator import PrefixCachingAllocator, compute_block_hashes
from engine.request import Request, SamplingParams
from engine.scheduler import FINISHED, Scheduler


@pytest.fixture
def digests(monkeypatch):
    """Every digest the allocator computes, counted (one per block hashed)."""
    count = []
    real = prefix_caching._DIGEST["sha256"]

    def counting(data: bytes) -> bytes:
        count.append(1)
        return real(data)

    monkeypatch.setitem(prefix_caching._DIGEST, "sha256", counting)
    return count


def play(scheduler: Scheduler, requests: list[Request], max_tokens: int) -> dict:
    """Step until every request has max_tokens outputs; what happened on the way."""
    seen = {"steps": 0, "waited_at_head": 0, "preempted": 0}
    while any(r.status != FINISHED for r in requests):
        head = scheduler.waiting[0] if scheduler.waiting else None
        plan = scheduler.schedule()
        seen["steps"] += 1
        seen["preempted"] += len(plan.preempted)
        if head is not None and head in scheduler.waiting and head not in plan.preempted:
            seen["waited_at_head"] += 1
        for s in plan.scheduled:
            s.request.num_computed_tokens = s.end
            if s.samples:
                s.request.append_output(100 + seen["steps"])
                if len(s.request.output_ids) == max_tokens:
                    scheduler.finish(s.request)
        scheduler.check_invariants()
        assert seen["steps"] < 500
    return seen


@pytest.mark.parametrize("budget", [64, 6])  # whole prompts a step, or chunks of 6 tokens
def test_each_full_block_is_hashed_once_per_request(digests, budget):
    alloc = PrefixCachingAllocator(num_blocks=9, block_size=4)
    scheduler = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=budget)
    shared = list(range(12))
    requests = [Request(f"r{i}", shared + [50 + i] * (5 + i)) for i in range(4)]
    for request in requests:
        scheduler.add(request)
    seen = play(scheduler, requests, max_tokens=7)
    assert seen["waited_at_head"] > 0, "a request should have waited at the head of a full pool"
    assert seen["preempted"] > 0, "a request should have been preempted and come back"
    hashed = sum(len(r.block_hashes) for r in requests)
    assert len(digests) == hashed, f"{len(digests)} digests for {hashed} blocks: some block was hashed twice"
    digests.clear()
    for request in requests:  # and what was kept is the chain a fresh hash gives
        assert request.block_hashes == compute_block_hashes(request.token_ids, 4)[: len(request.block_hashes)]
        assert len(request.block_hashes) >= len(request.prompt_ids) // 4


def test_a_request_keeps_its_tokens_appended_not_concatenated():
    request = Request("a", [1, 2, 3], params=SamplingParams(max_tokens=2))
    tokens = request.token_ids
    request.append_output(9)
    assert request.token_ids is tokens and tokens == [1, 2, 3, 9] and request.output_ids == [9]
    resumed = Request("b", [1, 2], output_ids=[3, 4])
    assert resumed.token_ids == [1, 2, 3, 4] and resumed.num_prefill_left == 3


def test_peek_and_allocate_take_the_callers_hashes_and_trust_them():
    alloc = PrefixCachingAllocator(num_blocks=8, block_size=4)
    alloc.allocate_with_prefix("a", list(range(10)))
    hashes: list = []
    alloc.hash_blocks(list(range(9)) + [99], None, hashes)
    assert alloc.peek(list(range(9)) + [99], block_hashes=hashes) == 8
    assert alloc.allocate_with_prefix("b", list(range(9)) + [99], block_hashes=hashes).num_cached_tokens == 8
    alloc.append_tokens("b", [5, 6])  # block 2 fills: its hash joins the caller's list
    assert len(hashes) == 3 and hashes == compute_block_hashes(list(range(9)) + [99, 5, 6], 4)


def test_a_waiting_prompt_is_checked_once_not_at_every_step(monkeypatch):
    """The scheduler looks up each waiting request up to three times a step; none of those
    walks its whole token list again (the Engine's front checked it once). Token checks are
    counted by the tokens each reads: an admission's first chunk and each chunk's slots only."""
    read = []
    real = prefix_caching._check_tokens
    monkeypatch.setattr(prefix_caching, "_check_tokens", lambda ids, what: read.append(len(ids)) or real(ids, what))
    alloc = PrefixCachingAllocator(num_blocks=400, block_size=4)
    scheduler = Scheduler(alloc, max_num_seqs=2, max_num_batched_tokens=8)
    requests = [Request(f"r{i}", [i] * 200 + list(range(300))) for i in range(8)]  # 500 tokens each
    for request in requests:
        scheduler.add(request)
    steps = 0
    while scheduler.waiting and steps < 40:  # 8-token steps: six requests wait through all of them
        for s in scheduler.schedule().scheduled:
            s.request.num_computed_tokens = s.end
        steps += 1
    admitted = sum(r.admitted for r in requests)
    assert steps == 40 and admitted == 2
    # An admission reads its first chunk, a step its chunks' tokens (at most the step's 8):
    # never a 500-token prompt.
    assert max(read) <= 8, f"a check read {max(read)} tokens: a whole prompt, looked up again"
