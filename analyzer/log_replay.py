"""
A request log replayed: the part of the workload analyzer that measures (workload_analyzer.py
is the command that reports it).

Read request_logs.py (what a log holds), allocator/prefix_caching.py (the allocator it replays through)
and caching_models.py (its steps in a fast form, and two other servers' caches) first. In
this file:

    1. tokenize        the log as it streams, hundreds of prompts in one call, their token ids
                       to a temporary file that every replay reads back
    2. replay          one request after another through PrefixCachingAllocator: the tokens
                       each one found cached, on a pool of a given size
    3. the curve       hit rate and prefill saved from the smallest pool to one that never
                       evicts; the working set, where the curve flattens

workload_analyzer.py's docstring says what the replay is and is not beside a real server.
"""

from __future__ import annotations

import io
import itertools
import math
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from analyzer.caching_models import ENGINE, VLLM, LlamaCpp, RadixTree, SGLang, block_hash_ids, iter_block_hash_ids
from analyzer.request_logs import LoggedRequest, LogError
from engine.prompts import tokenize_prompts

# -----------------------------------------------------------------------------
# 1. Tokenize
#
# One batch call per few hundred prompts: the tokenizer's Rust code then works through them
# on every core, where one call per prompt spends most of its time in Python (about 1 ms for
# a 650-token chat on the 2-core VM of the README, against about 0.5 ms batched). Not more:
# what a batch call works in stays with the tokenizer's threads after it returns (2,000 chats
# of 500 tokens left about 130 MB more resident than 500 did).
# The log is read as it streams: each batch of requests is tokenized and its token ids
# written to a temporary file, 4 bytes a token, and the request itself let go. Every replay
# reads the token ids back from the file in order. What stays in memory is a length and a
# salt a request, and while the replays at one block size run, each request's block hashes
# (4 bytes a block): a few hundred bytes a request, where its prompt took kilobytes, beside
# the pool the replay keeps.

TOKENIZE_BATCH = 500


def tokenized_batches(requests: Iterable[LoggedRequest], tokenizer) -> Iterator[tuple[LoggedRequest, array]]:
    """(request, its token ids as Engine.tokenize makes them) for every request, in order,
    TOKENIZE_BATCH at a time; a request its chat template refuses raises LogError naming it."""
    requests = iter(requests)
    while batch := list(itertools.islice(requests, TOKENIZE_BATCH)):
        try:
            tokenized = tokenize_prompts(tokenizer, [r.prompt for r in batch], tools=[r.tools for r in batch])
        except ValueError:  # the model's chat template refused one: name it by its place in the log
            for r in batch:
                try:
                    tokenize_prompts(tokenizer, [r.prompt], tools=[r.tools])
                except ValueError as err:
                    raise LogError(f"{r.where}: {err}") from None
            raise
        for request, prompt_ids in zip(batch, tokenized):
            yield request, array("I", prompt_ids)


def tokenize_log(requests: list[LoggedRequest], tokenizer) -> list[array]:
    """The token ids of every logged prompt, kept in memory (a small log, a test)."""
    return [ids for _, ids in tokenized_batches(requests, tokenizer)]


class TokenizedLog:
    """A log's token ids in a temporary file, read back in order as often as a replay asks:
    a sequence of prompts (array('I') each) like a list of them, with `lengths` and `salts`
    in memory. A context manager: the file goes when it closes.

    >>> with TokenizedLog() as log:
    ...     log.append(array("I", [1, 2, 3]), None); log.append(array("I", [4]), "tenant-a")
    ...     [p.tolist() for p in log], log.lengths.tolist(), log.salts
    ([[1, 2, 3], [4]], [3, 1], [None, 'tenant-a'])
    """

    READ_BYTES = 1 << 22  # read back at a time

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()
        self.lengths = array("Q")
        self.salts: list[str | None] = []

    def append(self, prompt: array, salt: str | None) -> None:
        self.file.seek(0, io.SEEK_END)  # a reader may have moved the position
        prompt.tofile(self.file)
        self.lengths.append(len(prompt))
        self.salts.append(salt)

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[array]:
        self.file.flush()
        buffered, at, position = array("I"), 0, 0  # its own position: two readers may take turns
        for length in self.lengths:
            if at + length > len(buffered):  # read on: what is left, and the next READ_BYTES at least
                buffered = buffered[at:]
                self.file.seek(position)
                chunk = self.file.read(4 * max(length - len(buffered), self.READ_BYTES // 4))
                position += len(chunk)
                buffered.frombytes(chunk)
                at = 0
            yield buffered[at : at + length]
            at += length

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> TokenizedLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def lengths_of(prompts) -> Sequence[int]:
    """Every prompt's length, without reading a TokenizedLog's file."""
    return prompts.lengths if isinstance(prompts, TokenizedLog) else [len(p) for p in prompts]


# -----------------------------------------------------------------------------
# 2. Replay
#
# The steps are the allocator's, the one the engine uses: allocate_with_prefix (lookup,
# touch, take, cache), then free, request after request, each freed before the next. They
# run in caching_models.py's fast form of PrefixCachingAllocator (the tests check the two
# agree on every request), on the prompts' block hashes numbered once per block size. With
# watch=True the replay also records which cached blocks were hit (for the tree of section
# 4) and every time a block many requests had hit was missed because LRU had evicted it.

HOT = 5  # a block hit by this many requests is a hot prefix: its eviction is worth a warning


@dataclass(slots=True)  # one for every block hit: slots and an array keep it to about 200 bytes
class PrefixBlock:
    """A cached block some request hit: where it sits in the chain, and how often it served."""

    parent: int | None  # the block (hash, numbered) before it in the prompt (None: the first block)
    token_ids: array  # its tokens, to show the prefix as text
    hits: int = 0  # requests that found it cached
    last_hit: int = 0  # the index of the last of them


@dataclass
class HotMiss:
    """A request that missed a hot block LRU had evicted."""

    request: int  # its index in the log
    hits_before: int  # requests that had hit the block before
    since_last_hit: int  # requests between the last hit and this miss (the burst that evicted it)
    tokens: int  # prompt tokens it computed again that were cached before (the hot blocks from there on)


CacheModel = VLLM | SGLang | LlamaCpp
LIKE = {"vllm": VLLM(), "sglang": SGLang(), "llamacpp": LlamaCpp(), "engine": ENGINE}  # --like, at the defaults


@dataclass
class Replay:
    num_blocks: int  # the pool, as given (with vLLM's null block in it, if the model has one)
    block_size: int
    cached: array  # num_cached_tokens of each request, in log order
    prompt_tokens: int  # of the requests the server serves: a refused one computes nothing and finds nothing
    evictions: int
    refused: array = field(default_factory=lambda: array("I"))  # requests llama-server turns away, by index
    prefix_blocks: dict[int, PrefixBlock] = field(default_factory=dict)  # by block hash number; watch=True only
    hot_misses: list[HotMiss] = field(default_factory=list)  # watch=True only

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def smallest_pool(prompts: list[array], block_size: int, model: CacheModel = LIKE["vllm"]) -> int:
    """The fewest blocks that hold the longest prompt (and vLLM's null block)."""
    longest = -(-max(lengths_of(prompts)) // block_size)
    return longest + (isinstance(model, VLLM) and model.null_block)


def replay(prompts: list[array], salts: list[str | None], num_blocks: int, block_size: int,
           *, model: CacheModel = LIKE["vllm"], watch: bool = False, hash_ids: list[array] | None = None) -> Replay:
    """Send the prompts one after another through a fresh cache of `num_blocks` blocks of
    `block_size` tokens: vLLM's pool, SGLang's tree of num_blocks x block_size tokens, or
    llama.cpp's slots with a prompt cache of that many tokens (caching_models.py).
    `hash_ids`: the prompts' block hashes at this block size, when the caller has them.

    >>> shared = list(range(40))                               # 2 full blocks of 16 and 8 over
    >>> prompts = [array("I", p) for p in (shared + [100], shared + [200], list(range(50, 90)))]
    >>> replay(prompts, [None] * 3, num_blocks=8, block_size=16).cached.tolist()
    [0, 32, 0]
    >>> replay(prompts, [None] * 3, num_blocks=8, block_size=16, model=LIKE["sglang"]).cached.tolist()
    [0, 40, 0]
    """
    if num_blocks < smallest_pool(prompts, block_size, model):
        raise ValueError(f"a pool of {num_blocks} blocks cannot hold the longest prompt; "
                         f"give at least {smallest_pool(prompts, block_size, model)}")
    lengths = lengths_of(prompts)
    result = Replay(num_blocks, block_size, array("I"), sum(lengths), 0)
    if watch and not isinstance(model, VLLM):
        raise ValueError("the prefix tree and the hot misses are read from vLLM's block hashes: use VLLM or ENGINE")
    if isinstance(model, VLLM):
        # Each prompt's hashes made as the replay reads them, unless the caller has them all.
        rows = iter(hash_ids) if hash_ids is not None else iter_block_hash_ids(prompts, salts, block_size)
        if watch:  # the watcher is called once a request, in the log's order, with the row just read
            in_order, last_row = iter(prompts), []

            def read_rows(made: Iterator[array]) -> Iterator[array]:
                for row in made:
                    last_row[:] = [row]
                    yield row

            rows = read_rows(rows)
            watcher = lambda i, num_hits: watch_request(next(in_order), last_row[0], i, num_hits, result)  # noqa: E731
        else:
            watcher = None
        counts = model.replay(rows, lengths, num_blocks, block_size, watch=watcher)
    elif isinstance(model, SGLang):
        counts = model.replay(prompts, salts, num_blocks * block_size)
    else:  # llama.cpp has no cache_salt: salted prompts share like any others
        counts = model.replay(prompts, num_blocks * block_size)
    result.cached, result.evictions, result.refused = counts.cached, counts.evictions, counts.refused
    result.prompt_tokens -= sum(lengths[i] for i in counts.refused)  # a TokenizedLog has lengths, no [i]
    return result


def watch_request(prompt: array, hash_ids: array, index: int, num_hits: int, result: Replay) -> None:
    """Count the hits on each cached block of the request, and note a hot miss."""
    block_size = result.block_size
    for i in range(num_hits):
        block = result.prefix_blocks.get(hash_ids[i])
        if block is None:
            parent = hash_ids[i - 1] if i else None
            tokens = prompt[i * block_size : (i + 1) * block_size]
            block = result.prefix_blocks[hash_ids[i]] = PrefixBlock(parent, tokens)
        block.hits += 1
        block.last_hit = index
    # The last block of a prompt that is all cached prefix is computed again on purpose (a
    # request computes at least one token): not a miss.
    could_hit = (len(prompt) - 1) // block_size
    first_miss = result.prefix_blocks.get(hash_ids[num_hits]) if num_hits < could_hit else None
    if first_miss is not None and first_miss.hits >= HOT:  # it was cached, hit often, and is gone
        lost = 0
        while num_hits + lost < len(hash_ids) and hash_ids[num_hits + lost] in result.prefix_blocks:
            lost += 1
        since = index - first_miss.last_hit - 1
        result.hot_misses.append(HotMiss(index, first_miss.hits, since, lost * block_size))


# -----------------------------------------------------------------------------
# 3. The curve and the working set
#
# A pool with room for every distinct full block of the log, and the longest prompt beside
# them, gives the most a log can save: in vLLM's order (blocks without a hash freed to the
# head) the replay never evicts there, and every full block is found by every later request
# that starts with it. One pass of hashing counts those blocks (no allocator needed). In the
# design doc's order a partly filled block freed to the tail can still push a cached one out.
# SGLang's tree never evicts with room for every distinct token it ends up holding (one
# replay on an unbounded pool counts them), llama.cpp's prompt cache with room for every
# prompt. The prompts are hashed once per block size, for every replay at that size.
# The curve replays the log at CURVE_POINTS pool sizes from the smallest that holds the
# longest prompt up to that one, each about the same factor above the last; the working set
# is the smallest pool that saves at least FLAT (95 %) of what the largest saves, narrowed
# between two sizes of the curve by replaying at their geometric mean a few times.

FLAT = 0.95
CURVE_POINTS = 7
NARROWING_STEPS = 3  # each halves the factor between two sizes: 3 leave an eighth of it


@dataclass
class Footprint:
    distinct_blocks: int  # full blocks with different hashes in the whole log
    shared_blocks: int  # of those, blocks some later request starts with (the article's "unique prefixes x blocks")
    whole_log_pool: int  # blocks for every distinct full block and the longest prompt


def footprint(prompts: list[array], salts: list[str | None], block_size: int, model: CacheModel = LIKE["vllm"],
              hash_ids: list[array] | None = None) -> Footprint:
    """Count the log's distinct and shared full blocks from every prompt's block hashes."""
    hash_ids = hash_ids if hash_ids is not None else block_hash_ids(prompts, salts, block_size)
    seen: set[int] = set()
    shared: set[int] = set()
    for prompt, ids in zip(prompts, hash_ids):
        for block_hash in ids[: (len(prompt) - 1) // block_size]:
            if block_hash not in seen:
                break
            shared.add(block_hash)
        seen.update(ids)
    smallest = smallest_pool(prompts, block_size, model)
    if isinstance(model, SGLang):
        tree = RadixTree(model, capacity=sum(lengths_of(prompts)))  # room for everything: it never evicts
        tree.replay(prompts, salts)
        return Footprint(len(seen), len(shared), -(-tree.size // block_size) + smallest)
    if isinstance(model, LlamaCpp):
        return Footprint(len(seen), len(shared), -(-sum(lengths_of(prompts)) // block_size) + smallest)
    return Footprint(len(seen), len(shared), len(seen) + smallest)


def pool_sizes(smallest: int, largest: int, points: int = CURVE_POINTS) -> list[int]:
    """`points` sizes from `smallest` to `largest`, each about the same factor above the last.

    >>> pool_sizes(33, 300, points=4)
    [33, 69, 144, 300]
    """
    if largest <= smallest:
        return [smallest]
    factor = (largest / smallest) ** (1 / (points - 1))
    sizes = sorted({round(smallest * factor**i) for i in range(points)} | {largest})
    return sizes


@dataclass
class Curve:
    replays: list[Replay]  # by pool size, the last one the whole log's pool
    working_set: int  # blocks: the smallest pool saving FLAT of the most
    footprint: Footprint

    def at(self, num_blocks: int) -> Replay | None:
        return next((r for r in self.replays if r.num_blocks == num_blocks), None)


def hit_rate_curve(prompts, salts, block_size: int, model: CacheModel = LIKE["vllm"]) -> Curve:
    """Replay the log at every pool size of the curve; find the working set."""
    hash_ids = block_hash_ids(prompts, salts, block_size)
    prints = footprint(prompts, salts, block_size, model, hash_ids)
    sizes = pool_sizes(smallest_pool(prompts, block_size, model), prints.whole_log_pool)
    replays = []
    for num_blocks in sizes:
        replays.append(replay(prompts, salts, num_blocks, block_size, model=model, hash_ids=hash_ids))
    enough = FLAT * replays[-1].cached_tokens
    first = next(i for i, r in enumerate(replays) if r.cached_tokens >= enough)
    low, high = (sizes[first - 1], sizes[first]) if first else (sizes[0], sizes[0])
    for _ in range(NARROWING_STEPS):  # the answer lies in (low, high]; halve the factor between them
        middle = round(math.sqrt(low * high))
        if not low < middle < high:
            break
        replays.append(replay(prompts, salts, middle, block_size, model=model, hash_ids=hash_ids))
        low, high = (low, middle) if replays[-1].cached_tokens >= enough else (middle, high)
    replays.sort(key=lambda r: r.num_blocks)
    return Curve(replays, high, prints)
