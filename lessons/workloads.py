"""
Simulated serving workloads, replayed through the real PrefixCachingAllocator.

A workload is a list of requests (prompt token ids + the tokens the model will answer).
`replay` runs them through the allocator the way a tiny engine would: at most `concurrency`
requests hold blocks at once, each request's answer is decoded with append_token (so its
blocks are cached as they fill, like vLLM), and when the pool is full the oldest running
request finishes first to make room. The allocator's own stats give the hit rate.

Shapes follow the long-form article on vLLM v1 prefix caching (README, Sources): a
512-token chatbot system prompt, multi-turn histories of 1k to 4k tokens, RAG with 256
shared instruction tokens and ~2k-token documents, and unique prompts. Token ids are random: only which
ones repeat matters. Everything is seeded, so every run prints the same numbers.

    >>> reqs = chatbot(num_requests=3)
    >>> [len(r.prompt) > 512 for r in reqs], reqs[0].prompt[:512] == reqs[2].prompt[:512]
    ([True, True, True], True)
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from allocator import OutOfBlocksError, PrefixCachingAllocator
from lessons.radix_tree import RadixTree

VOCAB_SIZE = 32_000
BLOCK_SIZE = 16  # vLLM's default block size


@dataclass
class Request:
    prompt: list[int]
    output: list[int]  # the tokens the model "answers", decoded one at a time


def _tokens(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(low, high))]


# -----------------------------------------------------------------------------
# The workloads


def chatbot(num_requests: int = 200, seed: int = 0) -> list[Request]:
    """Every request = the same 512-token system prompt + a short user message."""
    rng = random.Random(seed)
    system = _tokens(rng, 512, 512)
    return [Request(system + _tokens(rng, 20, 120), _tokens(rng, 30, 150)) for _ in range(num_requests)]


def multi_turn(num_conversations: int = 16, turns: int = 6, seed: int = 0) -> list[Request]:
    """Interleaved conversations; each turn resends the whole history (system prompt,
    earlier questions and answers) plus one new user message."""
    rng = random.Random(seed)
    system = _tokens(rng, 256, 256)
    histories = [list(system) for _ in range(num_conversations)]
    turns_left = [turns] * num_conversations
    requests = []
    while any(turns_left):
        c = rng.choice([i for i, left in enumerate(turns_left) if left])
        prompt = histories[c] + _tokens(rng, 40, 200)
        answer = _tokens(rng, 100, 300)
        requests.append(Request(prompt, answer))
        histories[c] = prompt + answer
        turns_left[c] -= 1
    return requests


def rag(num_requests: int = 200, num_documents: int = 100, seed: int = 0) -> list[Request]:
    """256 shared instruction tokens + one retrieved ~2k-token document + a question.
    Documents are drawn with a skewed (Zipf-like) popularity: a few are retrieved often."""
    rng = random.Random(seed)
    instruction = _tokens(rng, 256, 256)
    documents = [_tokens(rng, 1500, 2500) for _ in range(num_documents)]
    weights = [1 / (rank + 1) for rank in range(num_documents)]
    requests = []
    for _ in range(num_requests):
        (doc,) = rng.choices(documents, weights)
        requests.append(Request(instruction + doc + _tokens(rng, 20, 60), _tokens(rng, 50, 150)))
    return requests


def unique(num_requests: int = 200, seed: int = 0) -> list[Request]:
    """Nothing shared: random prompts, the benchmark case. The hit rate should be ~0."""
    rng = random.Random(seed)
    return [Request(_tokens(rng, 200, 2000), _tokens(rng, 50, 150)) for _ in range(num_requests)]


WORKLOADS = {"chatbot": chatbot, "multi-turn chat": multi_turn, "RAG": rag, "unique prompts": unique}

# -----------------------------------------------------------------------------
# Replaying a workload through the allocator


def replay(requests: list[Request], alloc: PrefixCachingAllocator, concurrency: int = 4, name: str = "req") -> list[int]:
    """Run `requests` in order through `alloc`; return each request's num_cached_tokens.

    alloc.stats hold the totals. An allocator that already served requests starts warm.
    """
    hits = []
    running: deque[str] = deque()

    def finish_oldest() -> None:
        if not running:
            raise RuntimeError(f"a single request does not fit in {alloc.num_blocks} blocks; use a bigger pool")
        alloc.free(running.popleft())

    def with_room(step):
        while True:
            try:
                return step()
            except OutOfBlocksError:  # the pool is full: the oldest request finishes first
                finish_oldest()

    for i, request in enumerate(requests):
        request_id = f"{name}-{i}"
        while len(running) >= concurrency:
            finish_oldest()
        hits.append(with_room(lambda: alloc.allocate_with_prefix(request_id, request.prompt)).num_cached_tokens)
        for token in request.output:
            with_room(lambda: alloc.append_token(request_id, token))
        running.append(request_id)
    while running:
        finish_oldest()
    return hits


def hit_rate_table(num_blocks_list: list[int], workloads: dict = WORKLOADS, **options) -> dict[str, list[float]]:
    """{workload name: [hit rate at each pool size]}: the data of the hit rate figure."""
    table = {}
    for name, make in workloads.items():
        requests = make()
        table[name] = []
        for num_blocks in num_blocks_list:
            alloc = PrefixCachingAllocator(num_blocks, BLOCK_SIZE, **options)
            replay(requests, alloc)
            table[name].append(alloc.stats.hit_rate)
    return table


# -----------------------------------------------------------------------------
# LRU under a burst: unique requests push a hot system prompt out of the cache


def lru_burst(burst_sizes: list[int], num_blocks: int = 256, seed: int = 0) -> list[tuple[int, int, int]]:
    """For each burst size k: warm the cache with chatbot traffic (the system prompt is hot:
    used by 20 requests), send k unique 400-token requests, then one more chatbot request.

    Returns [(k, burst tokens, tokens the next chatbot request hit)].
    """
    rng = random.Random(seed)
    chat = chatbot(num_requests=21, seed=seed)
    burst = [Request(_tokens(rng, 400, 400), []) for _ in range(max(burst_sizes))]
    rows = []
    for k in burst_sizes:
        alloc = PrefixCachingAllocator(num_blocks, BLOCK_SIZE)
        replay(chat[:20], alloc, name="chat")
        replay(burst[:k], alloc, name="burst")
        hit = alloc.allocate_with_prefix("after the burst", chat[20].prompt).num_cached_tokens
        rows.append((k, k * 400, hit))
    return rows


# -----------------------------------------------------------------------------
# The same workload through a radix tree (SGLang) and through the hash table (vLLM)


@dataclass
class RadixComparison:
    hash_table: list[int]  # num_cached_tokens from the allocator, per request
    radix_tokens: list[int]  # tokens the radix tree matched, per request
    radix_blocks: list[int]  # the same, rounded down to full blocks and capped like the allocator
    evictions: int  # in the allocator; 0 means the two caches held the same sequences


def radix_vs_hash(requests: list[Request], num_blocks: int = 16_384, block_size: int = BLOCK_SIZE) -> RadixComparison:
    """Replay `requests` through the allocator and insert the same sequences into a radix
    tree (prompt + answer, once the answer is decoded, as replay caches them)."""
    alloc = PrefixCachingAllocator(num_blocks, block_size)
    hash_hits = replay(requests, alloc)
    tree, radix_tokens = RadixTree(), []
    for request in requests:
        radix_tokens.append(tree.match_prefix(request.prompt))
        tree.insert(request.prompt + request.output)
    # The allocator leaves at least one prompt token to compute and only reuses full blocks.
    radix_blocks = [
        min(hit, len(r.prompt) - 1) // block_size * block_size for hit, r in zip(radix_tokens, requests)
    ]
    return RadixComparison(hash_hits, radix_tokens, radix_blocks, alloc.stats.evictions)
