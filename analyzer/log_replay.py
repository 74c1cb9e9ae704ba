"""
A request log replayed: the part of the workload analyzer that measures (workload_analyzer.py
is the command that reports it).

Read request_logs.py (what a log holds), allocator/prefix_caching.py (the allocator it replays through)
and caching_models.py (its steps in a fast form, and two other servers' caches) first. In
this file:

    1. tokenize        the log as it streams, hundreds of prompts in one call, their token ids
                       to a temporary file that every replay reads back
    2. replay          the blocks numbered by what they hold (a tree of runs), then one
                       request after another through PrefixCachingAllocator: the tokens
                       each one found cached, on a pool of a given size
    3. the curve       hit rate and prefill saved from the smallest pool to one that never
                       evicts; the working set, where the curve flattens

workload_analyzer.py's docstring says what the replay is and is not beside a real server.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from analyzer.caching_models import ENGINE, VLLM, RadixTree, SGLang, common_prefix
from analyzer.llama_slots import LlamaCpp
from analyzer.request_logs import LoggedRequest, LogError
from analyzer.vllm_requests import VllmChats, token_ids

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
# reads the token ids back from the file in order (and the numbering of section 2 an earlier
# prompt by its place), and the block hashes numbered at one block size go to a file of their
# own, 4 bytes a block. What stays in memory is a length and a salt a request, where its
# prompt took kilobytes, beside the pool the replay keeps.

TOKENIZE_BATCH = 500


def tokenized_batches(requests: Iterable[LoggedRequest], tokenizer,
                      chats: VllmChats | None = None) -> Iterator[tuple[LoggedRequest, array]]:
    """(request, its token ids as Engine.tokenize makes them, or with `chats` as vLLM's server
    rewrites its chats: vllm_requests.server_chats) for every request, in order,
    TOKENIZE_BATCH at a time; a request its chat template refuses raises LogError naming it."""
    requests = iter(requests)
    while batch := list(itertools.islice(requests, TOKENIZE_BATCH)):
        try:
            tokenized = token_ids(tokenizer, batch, chats)
        except ValueError:  # the model's chat template refused one: name it by its place in the log
            for r in batch:
                try:
                    token_ids(tokenizer, [r], chats)
                except ValueError as err:
                    raise LogError(f"{r.where}: {err}") from None
            raise
        for request, prompt_ids in zip(batch, tokenized):
            yield request, array("I", prompt_ids)


def tokenize_log(requests: list[LoggedRequest], tokenizer, chats: VllmChats | None = None) -> list[array]:
    """The token ids of every logged prompt, kept in memory (a small log, a test)."""
    return [ids for _, ids in tokenized_batches(requests, tokenizer, chats)]


class TokenizedLog:
    """A log's token ids in a temporary file, read back in order as often as a replay asks:
    a sequence of prompts (array('I') each) like a list of them, with `lengths` and `salts`
    in memory; log[i] reads one prompt back. A context manager: the file goes when it closes.

    >>> with TokenizedLog() as log:
    ...     log.append(array("I", [1, 2, 3]), None); log.append(array("I", [4]), "tenant-a")
    ...     [p.tolist() for p in log], log.lengths.tolist(), log.salts, log[0].tolist()
    ([[1, 2, 3], [4]], [3, 1], [None, 'tenant-a'], [1, 2, 3])
    """

    READ_BYTES = 1 << 22  # read back at a time

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()
        self.lengths = array("Q")
        self.salts: list[str | None] = []
        self.starts = array("Q", [0])  # where each prompt starts in the file, in tokens (made when first asked)

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

    def __getitem__(self, index: int) -> array:
        if len(self.starts) != len(self) + 1:
            self.starts = array("Q", itertools.accumulate(self.lengths, initial=0))
        self.file.flush()
        prompt = array("I")
        prompt.frombytes(os.pread(self.file.fileno(), 4 * self.lengths[index], 4 * self.starts[index]))
        return prompt

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
#
# The numbers. Two blocks get the same number when they hold the same tokens after the same
# blocks, under the same salt: what a chained block hash names (prefix_caching.
# compute_block_hashes), exactly, where a 128-bit hash is only nearly so. Blocks are numbered
# in the order they first appear, in a tree of runs (BlockRuns): a run is blocks that follow
# one another in the prompt that brought them first, numbered one after another; its children
# are the runs that go on from it differently, filed under the hash of their first block and
# checked against its tokens, read back from that prompt. The tree keeps a few numbers a run,
# and a log has about one run a prompt; a dict of every block keyed by (its parent's number,
# its tokens) kept about 200 bytes a block, most of the analyzer's memory on distinct prompts.


def as_ids(prompt) -> array:
    """A prompt's token ids as an array('I'), which slices and compares at C speed."""
    return prompt if isinstance(prompt, array) and prompt.typecode == "I" else array("I", prompt)


def block_hash_ids(prompts: Sequence, salts: Iterable[str | None], block_size: int) -> list[array]:
    """Each prompt's full blocks as ints: two blocks get the same int when they hold the same
    tokens after the same blocks, under the same salt, numbered in the order they first appear.

    >>> block_hash_ids([array("I", range(10)), array("I", range(9)), array("I", [0, 1, 2, 3, 7])], [None] * 3, 4)
    [array('I', [0, 1]), array('I', [0, 1]), array('I', [0])]
    """
    return list(iter_block_hash_ids(prompts, salts, block_size))


def iter_block_hash_ids(prompts: Sequence, salts: Iterable[str | None], block_size: int) -> Iterator[array]:
    """block_hash_ids one prompt at a time, in order; an earlier prompt is read again by its
    index (prompts[i]) to check a match, so a TokenizedLog serves as well as a list."""
    runs = BlockRuns(prompts, block_size)
    for index, (prompt, salt) in enumerate(zip(prompts, salts)):
        yield runs.number(index, as_ids(prompt), salt)


class BlockRuns:
    """The tree of runs that numbers the blocks of the prompts seen so far (above)."""

    def __init__(self, prompts: Sequence, block_size: int) -> None:
        self.prompts, self.block_size = prompts, block_size
        self.prompt = array("i")  # the prompt holding the run's tokens, by its index (-1: a root)
        self.start = array("I")  # the run's first block in that prompt
        self.size = array("I")  # its blocks
        self.first = array("I")  # the number of its first block; the others follow it
        self.parent = array("i")  # the run it goes on from (-1: a root)
        self.same_key = array("i")  # the next run filed under the same key (a hash collision), or -1
        self.by_key: dict[int, int] = {}  # key(parent, its first block) -> the last run filed there
        self.roots: dict = {}  # cache_salt -> the root its prompts start from: salted prompts never share
        self.numbered = 0  # numbers given

    def new_run(self, prompt: int, start: int, size: int, first: int, parent: int) -> int:
        for column, value in ((self.prompt, prompt), (self.start, start), (self.size, size), (self.first, first),
                              (self.parent, parent), (self.same_key, -1)):
            column.append(value)
        return len(self.size) - 1

    @staticmethod
    def key(parent: int, block: array) -> int:
        """What a run is filed under: its parent and its first block's tokens, hashed."""
        return hash((parent, block.tobytes()))

    def file(self, run: int, key: int) -> None:
        self.same_key[run] = self.by_key.get(key, -1)
        self.by_key[key] = run

    def number(self, index: int, prompt: array, salt: str | None) -> array:
        """The numbers of the full blocks of `prompt`, the prompts[index] of the log."""
        size, blocks = self.block_size, len(prompt) // self.block_size
        node = self.roots.get(salt)
        if node is None:
            node = self.roots[salt] = self.new_run(-1, 0, 0, 0, -1)
        row, done = array("I"), 0
        while done < blocks:
            key = self.key(node, prompt[done * size : (done + 1) * size])
            run, shared, theirs = self.find(key, node, prompt, done)
            if run < 0:  # new from here on: one run
                self.file(self.new_run(index, done, blocks - done, self.numbered, node), key)
                row.extend(range(self.numbered, self.numbered + blocks - done))
                self.numbered += blocks - done
                break
            row.extend(range(self.first[run], self.first[run] + shared))
            done += shared
            if shared < self.size[run] and done < blocks:  # the prompt leaves the run inside it
                self.split(run, shared, key, theirs[shared * size : (shared + 1) * size])
                node = self.parent[run]
            else:
                node = run
        return row

    def find(self, key: int, node: int, prompt: array, done: int) -> tuple[int, int, array | None]:
        """The child of `node` whose first block is the prompt's block `done`, how many blocks
        the two share from there, and the run's tokens read back; (-1, 0, None) if none."""
        size, run = self.block_size, self.by_key.get(key, -1)
        while run >= 0:
            if self.parent[run] == node:
                blocks = min(self.size[run], len(prompt) // size - done)
                start = self.start[run] * size
                theirs = as_ids(self.prompts[self.prompt[run]])[start : start + blocks * size]
                shared = common_prefix(theirs, prompt[done * size : (done + blocks) * size]) // size
                if shared:
                    return run, shared, theirs
            run = self.same_key[run]
        return -1, 0, None

    def split(self, run: int, at: int, key: int, rest_first_block: array) -> None:
        """The first `at` blocks of `run` become a run of their own above it, in its place."""
        top = self.new_run(self.prompt[run], self.start[run], at, self.first[run], self.parent[run])
        if self.by_key[key] == run:
            self.by_key[key] = top
        else:
            before = self.by_key[key]
            while self.same_key[before] != run:
                before = self.same_key[before]
            self.same_key[before] = top
        self.same_key[top] = self.same_key[run]
        self.start[run] += at
        self.size[run] -= at
        self.first[run] += at
        self.parent[run] = top
        self.file(run, self.key(top, rest_first_block))


class NumberedLog(TokenizedLog):
    """numbered_log's file: a row of block numbers a prompt, and how many numbers were given
    (what a replay sizes its tables by, known without reading the file again)."""

    def __init__(self) -> None:
        super().__init__()
        self.numbered = 0


def numbered_log(prompts, salts: Iterable[str | None], block_size: int) -> NumberedLog:
    """Every prompt's block hashes at `block_size` in a temporary file, a row of numbers a
    prompt: the tree that numbers them is let go before a replay reads them back."""
    hash_ids = NumberedLog()
    for row in iter_block_hash_ids(prompts, salts, block_size):
        hash_ids.append(row, None)
        if row:  # a row's numbers grow: its last is its largest
            hash_ids.numbered = max(hash_ids.numbered, row[-1] + 1)
    return hash_ids


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
    unrestored: array = field(default_factory=lambda: array("I"))  # llama.cpp: a cached prompt with no room to load
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
           *, model: CacheModel = LIKE["vllm"], watch: bool = False, hash_ids: NumberedLog | None = None) -> Replay:
    """Send the prompts one after another through a fresh cache of `num_blocks` blocks of
    `block_size` tokens: vLLM's pool, SGLang's tree of num_blocks x block_size tokens, or
    llama.cpp's slots with a prompt cache of that many tokens (llama_slots.py).
    `hash_ids`: the prompts' block hashes at this block size (numbered_log's file), when
    the caller has them.

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
    if isinstance(model, VLLM) and hash_ids is None:  # numbered first, in a file the replay then reads
        with numbered_log(prompts, salts, block_size) as hash_ids:
            return replay(prompts, salts, num_blocks, block_size, model=model, watch=watch, hash_ids=hash_ids)
    if isinstance(model, VLLM):
        num_ids, rows = hash_ids.numbered, iter(hash_ids)
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
        counts = model.replay(rows, lengths, num_blocks, block_size, num_ids, watch=watcher)
    elif isinstance(model, SGLang):
        counts = model.replay(prompts, salts, num_blocks * block_size)
    else:  # llama.cpp has no cache_salt: salted prompts share like any others
        counts = model.replay(prompts, num_blocks * block_size)
    result.cached, result.evictions, result.refused, result.unrestored = (counts.cached, counts.evictions,
                                                                          counts.refused, counts.unrestored)
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
              hash_ids: NumberedLog | None = None) -> Footprint:
    """Count the log's distinct and shared full blocks from every prompt's block hashes. They
    are numbered in the order they first appear: a block came before its prompt exactly when
    its number is below all those given before it, so no set of the numbers seen is needed."""
    if hash_ids is None:
        with numbered_log(prompts, salts, block_size) as hash_ids:
            return footprint(prompts, salts, block_size, model, hash_ids)
    numbered = 0  # numbers given before the prompt
    shared = bytearray()  # by number: 1 for a block some later request starts with
    for length, ids in zip(lengths_of(prompts), hash_ids):
        for block_hash in ids[: (length - 1) // block_size]:
            if block_hash >= numbered:
                break
            shared[block_hash] = 1
        if ids and ids[-1] >= numbered:  # a prompt's numbers grow: its last is its largest
            shared.extend(bytes(ids[-1] + 1 - numbered))
            numbered = ids[-1] + 1
    distinct, num_shared = numbered, shared.count(1)
    smallest = smallest_pool(prompts, block_size, model)
    if isinstance(model, SGLang):
        tree = RadixTree(model, capacity=sum(lengths_of(prompts)))  # room for everything: it never evicts
        tree.replay(prompts, salts)
        return Footprint(distinct, num_shared, -(-tree.size // block_size) + smallest)
    if isinstance(model, LlamaCpp):
        return Footprint(distinct, num_shared, -(-sum(lengths_of(prompts)) // block_size) + smallest)
    return Footprint(distinct, num_shared, distinct + smallest)


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
    with numbered_log(prompts, salts, block_size) as hash_ids:
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
