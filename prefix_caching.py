"""
Automatic prefix caching, the way vLLM v1 does it, in one file you can read top to bottom.

When many requests start with the same tokens (a system prompt, a shared document, the
history of a chat) the key/value tensors of those tokens are the same every time. A serving
engine that keeps them around can skip recomputing them: that is prefix caching. This file
builds it in the order the ideas depend on each other:

    1. block hashes       a block of tokens is named by a hash chained to its parent block
    2. the free queue     a doubly linked list of blocks; its head is the next to be evicted
    3. the allocator      PrefixCachingAllocator: lookup, touch, allocate, cache, free
    4. rich views         pictures of the block tables, the free queue and the cache map
    5. the walkthrough    the design doc's worked example, replayed step by step

The allocator is pure Python and imports no torch. The model part that drives a real
Hugging Face model with this allocator comes later in the file.

References:
    vLLM v1 design doc, "Automatic Prefix Caching" (docs/design/prefix_caching.md)
    vLLM source: vllm/v1/core/block_pool.py, kv_cache_utils.py, kv_cache_manager.py
    nano-vllm: nanovllm/engine/block_manager.py
    SGLang RadixAttention: python/sglang/srt/mem_cache/radix_cache.py

Run:
    python prefix_caching.py --walkthrough      # the documented example, block for block
    python prefix_caching.py --bench allocator  # hashing cost, miss overhead, throughput
"""

from __future__ import annotations

import argparse
import hashlib
import json
from array import array
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Sequence

import xxhash

# -----------------------------------------------------------------------------
# 1. Block hashes
#
# A full block of `block_size` tokens is named by a hash of three things:
#   - the hash of the block before it (its parent), so a block's name depends on every
#     token before it: the same four tokens at position 0 and at position 40 get different
#     names, and a hit on block i implies hits on blocks 0..i-1;
#   - its own token ids;
#   - extra keys: anything else that changes the K/V values (a LoRA adapter) or that must
#     keep tenants apart (a cache_salt, which goes into the first block only: since every
#     later hash is chained to it, one salted block is enough to separate whole prompts).
# The encoding is a fixed byte layout, never Python's hash(), which is randomised per
# process: the same tokens must get the same hash in every process and on every machine.

BlockHash = bytes

HASH_ALGOS = ("sha256", "xxhash")

_DIGEST = {
    "sha256": lambda data: hashlib.sha256(data).digest(),  # 32 bytes, collision resistant
    "xxhash": xxhash.xxh3_128_digest,  # 16 bytes, several times faster, not collision resistant
}


# The parent of the first block: a fixed constant per algorithm, so every chain starts the
# same way everywhere, and every parent of one algorithm has the same length.
NONE_HASH: dict[str, BlockHash] = {algo: digest(b"prefix-caching/none-hash") for algo, digest in _DIGEST.items()}


def _encode_extra(extra_keys: tuple) -> bytes:
    return json.dumps(extra_keys, separators=(",", ":")).encode() if extra_keys else b""


def _encode(parent: BlockHash, token_bytes: bytes, extra: bytes) -> bytes:
    # The parent has a fixed length per algorithm, the tokens are length-prefixed and the
    # extra keys (if any) fill the rest: no two different inputs share an encoding.
    return parent + len(token_bytes).to_bytes(4, "little") + token_bytes + extra


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple = (),
    algo: str = "sha256",
) -> BlockHash:
    """Hash one block: (parent hash, token ids, extra keys) -> bytes.

    >>> h0 = hash_block_tokens(None, [1, 2, 3, 4])
    >>> h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    >>> h1 == hash_block_tokens(None, [5, 6, 7, 8])   # same tokens, other position
    False
    """
    parent = NONE_HASH[algo] if parent_hash is None else parent_hash
    return _DIGEST[algo](_encode(parent, array("q", token_ids).tobytes(), _encode_extra(extra_keys)))


def block_extra_keys(block_index: int, cache_salt: str | None, extra_keys: tuple) -> tuple:
    """The extra keys of block `block_index`: `extra_keys` always, the salt on block 0 only.

    The salt is tagged so it can never be mistaken for an extra key of the same text.

    >>> block_extra_keys(0, "tenant-a", ("lora-7",))
    ('lora-7', ('cache_salt', 'tenant-a'))
    >>> block_extra_keys(1, "tenant-a", ("lora-7",))
    ('lora-7',)
    """
    if block_index == 0 and cache_salt is not None:
        return (*extra_keys, ("cache_salt", cache_salt))
    return extra_keys


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    extra_keys: tuple = (),
    algo: str = "sha256",
) -> list[BlockHash]:
    """Chained hashes of every *full* block of `token_ids`; a partial tail gets none.

    The same result as calling hash_block_tokens block by block, but the tokens are
    turned into bytes once for the whole prompt: that conversion would otherwise cost
    more than the hashing itself.

    >>> [h.hex()[:8] for h in compute_block_hashes(list(range(10)), block_size=4)]  # 2 full blocks
    ['d1855706', 'b4a2fa65']
    """
    digest = _DIGEST[algo]
    raw = array("q", token_ids).tobytes()
    step = block_size * 8  # bytes per block: 8 per token id
    first_extra = _encode_extra(block_extra_keys(0, cache_salt, extra_keys))
    extra = _encode_extra(extra_keys)
    hashes: list[BlockHash] = []
    parent = NONE_HASH[algo]
    for i in range(len(token_ids) // block_size):
        parent = digest(_encode(parent, raw[i * step : (i + 1) * step], first_extra if i == 0 else extra))
        hashes.append(parent)
    return hashes


def short_hash(block_hash: BlockHash | None) -> str:
    """The first 8 hex digits, enough to tell blocks apart on screen."""
    return "-" if block_hash is None else block_hash.hex()[:8]


# -----------------------------------------------------------------------------
# 2. Blocks and the free queue
#
# Every block of the pool exists from the start (no objects created per request). A block
# with ref_cnt == 0 sits in the free queue, and may still hold a hash: its K/V values are
# still valid and a later request can hit it, until it reaches the head and is reused.
#
# Why a hand-made doubly linked list and not collections.deque? A cache hit on a free block
# must take it out of the *middle* of the queue. deque.remove and list.remove scan the whole
# queue, O(n); with prev/next pointers stored in the block itself, removal is O(1). The
# order is the eviction order: the head is evicted first, freed blocks join at the tail,
# so the least recently freed block goes first (LRU).


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set when the block is full and cached
    token_ids: list[int] = field(default_factory=list)  # what its slots hold, for lookups and views
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append, appendleft and remove.

    Two sentinel nodes (never handed out) sit before the head and after the tail, so no
    operation needs a special case for an empty queue.

    >>> blocks = [KVCacheBlock(i) for i in range(4)]
    >>> q = FreeKVCacheBlockQueue(blocks)
    >>> q.remove(blocks[2]); q.append(blocks[2]); q.popleft().block_id
    0
    >>> q.block_ids()
    [1, 3, 2]
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinel before the first free block
        self._tail = KVCacheBlock(-1)  # sentinel after the last free block
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def block_ids(self) -> list[int]:
        return [block.block_id for block in self]

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Add at the tail: evicted last."""
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Add at the head: handed out next."""
        self._insert_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is, in O(1)."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        """Take the head: the least recently freed block."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("the free queue is empty")
        self.remove(block)
        return block


# -----------------------------------------------------------------------------
# 3. The allocator
#
# PrefixCachingAllocator owns the block pool, the free queue, the cache map (block hash ->
# blocks holding that content) and one block table per running request. Its operations are
# those of vLLM v1's KVCacheManager + BlockPool, folded into one class:
#
#   allocate_with_prefix  lookup the longest cached prefix, touch the hits, pop new blocks
#                         from the head of the free queue (evicting their old hash), and
#                         cache every block that is already full
#   append_token          one decode step: a new block when the last one is full; a block
#                         is cached the moment it fills
#   free                  ref counts down, in reverse block order; blocks that reach 0 go
#                         to the tail of the free queue and keep their hash


class OutOfBlocksError(RuntimeError):
    """The free queue cannot supply the blocks a request needs (nothing was changed)."""


class Allocation(NamedTuple):
    num_cached_tokens: int  # prompt tokens whose K/V come from cached blocks
    num_new_tokens: int  # prompt tokens the model still has to compute


@dataclass
class CacheStats:
    requests: int = 0
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, tokens served from the cache
    evictions: int = 0  # cached blocks whose hash was dropped to reuse the block
    blocks_cached: int = 0  # times a full block was added to the cache map
    hash_collisions: int = 0  # hash matched but stored tokens differed (treated as a miss)
    refused: int = 0  # allocations refused with OutOfBlocksError

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "hit_rate": round(self.hit_rate, 4)}


@dataclass
class _Request:
    token_ids: list[int]
    cache_salt: str | None
    extra_keys: tuple
    block_hashes: list[BlockHash]  # of the request's full blocks, in order


def _check_tokens(token_ids, what: str) -> list[int]:
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"{what} must be a list of int token ids, got {type(token_ids).__name__}")
    token_ids = list(token_ids)
    # `type(t) is int` rather than isinstance: True and False are ints to isinstance.
    if not all(type(t) is int for t in token_ids) or (token_ids and min(token_ids) < 0):
        bad = next(t for t in token_ids if type(t) is not int or t < 0)
        raise TypeError(f"{what} must hold non-negative int token ids, found {bad!r}")
    return token_ids


class PrefixCachingAllocator:
    """A paged KV block pool with automatic prefix caching (vLLM v1 semantics).

    >>> alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    >>> alloc.allocate_with_prefix("r0", list(range(10)))       # cold: nothing cached
    Allocation(num_cached_tokens=0, num_new_tokens=10)
    >>> alloc.allocate_with_prefix("r1", list(range(9)) + [99])  # shares 2 full blocks
    Allocation(num_cached_tokens=8, num_new_tokens=2)
    >>> alloc.block_tables
    {'r0': [0, 1, 2], 'r1': [0, 1, 3]}
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        hash_algo: str = "sha256",
        enable_caching: bool = True,
        free_uncached_first: bool = False,
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {hash_algo!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.enable_caching = enable_caching
        self.free_uncached_first = free_uncached_first

        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        # One hash can map to several blocks: see "duplicated blocks" in allocate_with_prefix.
        self.cached_blocks: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.requests: dict[str, _Request] = {}
        self.stats = CacheStats()

    # --- read-only views of the state --------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached hash, in use or free."""
        return sum(1 for b in self.blocks if b.block_hash is not None)

    def free_queue_ids(self) -> list[int]:
        """Free block ids from head (handed out / evicted next) to tail."""
        return self.free_queue.block_ids()

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self.blocks[block_id].block_hash

    def num_tokens(self, request_id: str) -> int:
        return len(self._request(request_id).token_ids)

    def slot(self, request_id: str, position: int) -> tuple[int, int]:
        """(block id, offset in block) where token `position` of the request lives."""
        table = self.block_tables[request_id]
        return table[position // self.block_size], position % self.block_size

    # --- lookup --------------------------------------------------------------------------

    def _request(self, request_id: str) -> _Request:
        if request_id not in self.requests:
            raise KeyError(f"unknown request id {request_id!r}: it was never allocated or is already freed")
        return self.requests[request_id]

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        blocks = self.cached_blocks.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def find_longest_cache_hit(
        self, token_ids: list[int], block_hashes: list[BlockHash]
    ) -> tuple[list[KVCacheBlock], bool]:
        """Walk the full blocks from the start; stop at the first miss.

        At most (len(token_ids) - 1) // block_size blocks are hits, so at least one token is
        left to compute: the model must run on something to give the next token's logits.
        Returns (hit blocks, whether a hash matched blocks holding other tokens).
        """
        max_hits = (len(token_ids) - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for i, block_hash in enumerate(block_hashes[:max_hits]):
            block = self.get_cached_block(block_hash)
            if block is None:
                break
            # A fast hash can collide; comparing the tokens makes a collision a miss.
            if block.token_ids != token_ids[i * self.block_size : (i + 1) * self.block_size]:
                return hits, True
            hits.append(block)
        return hits, False

    def peek(self, token_ids: Sequence[int], cache_salt: str | None = None, extra_keys=()) -> int:
        """How many prompt tokens would hit right now, changing nothing."""
        token_ids = _check_tokens(token_ids, "token_ids")
        if not self.enable_caching or not token_ids:
            return 0
        hashes = compute_block_hashes(token_ids, self.block_size, cache_salt, tuple(extra_keys), self.hash_algo)
        hits, _ = self.find_longest_cache_hit(token_ids, hashes)
        return len(hits) * self.block_size

    # --- allocate --------------------------------------------------------------------------

    def allocate_with_prefix(
        self,
        request_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        extra_keys: Sequence = (),
    ) -> Allocation:
        """Give a new request blocks for its prompt, reusing the longest cached prefix.

        All or nothing: if the pool cannot hold the prompt, OutOfBlocksError is raised and
        nothing has changed.
        """
        token_ids = _check_tokens(token_ids, "token_ids")
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running; free it first or pick another id")
        if not token_ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        extra_keys = tuple(extra_keys)
        for key in extra_keys:
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(f"extra_keys must hold str or int values (e.g. a LoRA name), found {key!r}")
        num_needed = -(-len(token_ids) // self.block_size)  # ceil division
        if num_needed > self.num_blocks:
            raise ValueError(
                f"a prompt of {len(token_ids)} tokens needs {num_needed} blocks of {self.block_size} "
                f"but the whole pool has {self.num_blocks}; shorten it or make the pool bigger"
            )

        hashes: list[BlockHash] = []
        hits: list[KVCacheBlock] = []
        collided = False
        if self.enable_caching:
            hashes = compute_block_hashes(token_ids, self.block_size, cache_salt, extra_keys, self.hash_algo)
            hits, collided = self.find_longest_cache_hit(token_ids, hashes)

        # Capacity check before touching anything. Hit blocks with ref count 0 are sitting
        # in the free queue, so touching them uses up free blocks too.
        num_new = num_needed - len(hits)
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new + num_free_hits > self.num_free_blocks:
            self.stats.refused += 1
            raise OutOfBlocksError(
                f"request {request_id!r} needs {num_new} new blocks (+{num_free_hits} cached ones "
                f"now free) but only {self.num_free_blocks} of {self.num_blocks} are free; "
                f"free a running request or make the pool bigger"
            )

        # Touch the hits first, so popping new blocks below can never evict them.
        for block in hits:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
        table = [b.block_id for b in hits]
        for _ in range(num_new):
            table.append(self._pop_free_block().block_id)

        # Fill the new blocks and cache the ones that are full right away. A full block whose
        # hash is already cached elsewhere is cached again ("duplicated blocks"): block
        # tables are append-only, so the request keeps its own copy until it is freed.
        for i in range(len(hits), num_needed):
            block = self.blocks[table[i]]
            block.token_ids = token_ids[i * self.block_size : (i + 1) * self.block_size]
            if i < len(hashes):
                self._cache_block(block, hashes[i])

        self.block_tables[request_id] = table
        self.requests[request_id] = _Request(token_ids, cache_salt, extra_keys, hashes)
        num_cached = len(hits) * self.block_size
        self.stats.requests += 1
        self.stats.queried_tokens += len(token_ids)
        self.stats.hit_tokens += num_cached
        self.stats.hash_collisions += collided
        return Allocation(num_cached, len(token_ids) - num_cached)

    def _pop_free_block(self) -> KVCacheBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:  # evict: its content is about to be overwritten
            del self.cached_blocks[block.block_hash][block.block_id]
            if not self.cached_blocks[block.block_hash]:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
            self.stats.evictions += 1
        block.token_ids = []
        block.ref_cnt = 1
        return block

    def _cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        block.block_hash = block_hash
        self.cached_blocks.setdefault(block_hash, {})[block.block_id] = block
        self.stats.blocks_cached += 1

    # --- decode ------------------------------------------------------------------------------

    def append_token(self, request_id: str, token_id: int) -> None:
        """Add one token whose K/V is about to be computed; cache its block if it fills.

        Raises OutOfBlocksError (nothing changed) when a new block is needed and none is free.
        """
        request = self._request(request_id)
        (token_id,) = _check_tokens([token_id], "token_id")
        table = self.block_tables[request_id]
        position = len(request.token_ids)
        if position == len(table) * self.block_size:  # the last block is full
            if self.num_free_blocks == 0:
                self.stats.refused += 1
                raise OutOfBlocksError(
                    f"request {request_id!r} needs a new block for token {position} "
                    f"but all {self.num_blocks} blocks are in use"
                )
            table.append(self._pop_free_block().block_id)
        request.token_ids.append(token_id)
        block = self.blocks[table[-1]]
        block.token_ids.append(token_id)
        if self.enable_caching and len(block.token_ids) == self.block_size:
            index = len(table) - 1
            parent = request.block_hashes[-1] if request.block_hashes else None
            keys = block_extra_keys(index, request.cache_salt, request.extra_keys)
            block_hash = hash_block_tokens(parent, block.token_ids, keys, self.hash_algo)
            request.block_hashes.append(block_hash)
            self._cache_block(block, block_hash)

    # --- free ----------------------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Release a request's blocks, last block first.

        Blocks that reach ref count 0 join the tail of the free queue in reverse order: the
        last block of a request hashes the most tokens and is the least likely to be shared,
        so it should be evicted first. They keep their hash: a later request can still hit.
        """
        self._request(request_id)
        table = self.block_tables.pop(request_id)
        del self.requests[request_id]
        freed: list[KVCacheBlock] = []
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        uncached = [b for b in freed if b.block_hash is None]
        for block in uncached:
            block.token_ids = []  # nothing can ever hit it: forget its content
        if self.free_uncached_first:
            # Newer vLLM: blocks without a hash can never be hit, so hand them out before
            # any cached block, which keeps more of the cache alive.
            for block in reversed(uncached):
                self.free_queue.appendleft(block)
            freed = [b for b in freed if b.block_hash is not None]
        for block in freed:
            self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refuses (returns False, changes nothing) while any
        request holds blocks, since their hashes describe K/V values still in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = []
        self.cached_blocks.clear()
        self.stats = CacheStats()
        return True

    def check_invariants(self) -> None:
        """Assert the pool is consistent; the property tests call this after every step."""
        free_ids = self.free_queue_ids()
        assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks, "free queue corrupt"
        holders: dict[int, int] = {}
        for table in self.block_tables.values():
            for block_id in table:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), f"block {block.block_id} ref count"
            in_queue = block.block_id in free_ids
            assert in_queue == (block.ref_cnt == 0), f"block {block.block_id} free xor referenced"
        for block_hash, blocks in self.cached_blocks.items():
            assert blocks, "empty entry in the cache map"
            for block in blocks.values():
                assert block.block_hash == block_hash and len(block.token_ids) == self.block_size
        assert sum(map(len, self.cached_blocks.values())) == self.num_cached_blocks
        for request_id, table in self.block_tables.items():
            tokens = self.requests[request_id].token_ids
            assert len(table) == -(-len(tokens) // self.block_size), f"{request_id}: block count"
            for i, block_id in enumerate(table):
                expected = tokens[i * self.block_size : (i + 1) * self.block_size]
                assert self.blocks[block_id].token_ids == expected, f"{request_id}: block {block_id} content"


# -----------------------------------------------------------------------------
# 4. Rich views: see the state
#
# Colours used everywhere: green = in use (ref count > 0), yellow = free but still cached
# (a later request can hit it), dim = free and empty.

IN_USE, CACHED_FREE, EMPTY = "bold green", "yellow", "dim"


def _style(block: KVCacheBlock) -> str:
    if block.ref_cnt > 0:
        return IN_USE
    return CACHED_FREE if block.block_hash is not None else EMPTY


def _tokens(block: KVCacheBlock, block_size: int, token_repr) -> str:
    shown = [token_repr(t) for t in block.token_ids]
    return " ".join(shown + ["·"] * (block_size - len(shown)))  # · = empty slot


def render_block_table(alloc: PrefixCachingAllocator, request_id: str, token_repr=str):
    """A request's block table: logical block -> physical block, tokens, hash, ref count."""
    from rich.table import Table

    table = Table(title=f"block table of {request_id!r}", title_justify="left")
    for column in ("logical", "block", "tokens", "hash", "ref"):
        table.add_column(column, justify="right" if column in ("logical", "block", "ref") else "left")
    for i, block_id in enumerate(alloc.block_tables[request_id]):
        block = alloc.blocks[block_id]
        table.add_row(
            str(i), str(block_id), _tokens(block, alloc.block_size, token_repr),
            short_hash(block.block_hash), str(block.ref_cnt), style=_style(block),
        )
    return table


def render_free_queue(alloc: PrefixCachingAllocator, max_blocks: int = 256):
    """The free queue from head (evicted first) to tail, cached blocks in yellow.

    Up to 16 blocks: a table with each block's short hash. More: a wrapped line of ids.
    """
    from rich.table import Table
    from rich.text import Text

    blocks = list(alloc.free_queue)
    title = f"free queue: {len(blocks)} blocks, head (evicted first) -> tail"
    if len(blocks) > 16:
        line = Text(f"{title} (yellow: still cached)\n", style="italic")
        for block in blocks[:max_blocks]:
            line.append(str(block.block_id), style=_style(block)).append(" ")
        if len(blocks) > max_blocks:
            line.append(f"... {len(blocks) - max_blocks} more", style="italic")
        return line
    table = Table(title=title, title_justify="left", show_header=False, min_width=len(title))
    table.add_column("", style="bold")
    for _ in blocks:
        table.add_column(justify="center")
    table.add_row("block", *[f"[{_style(b)}]{b.block_id}" for b in blocks])
    table.add_row("hash", *[f"[{_style(b)}]{short_hash(b.block_hash)[:4]}" for b in blocks])
    return table


def render_cache_map(alloc: PrefixCachingAllocator, token_repr=str):
    """The cache map: block hash -> the block(s) holding that content."""
    from rich.table import Table

    table = Table(title=f"cache map: {len(alloc.cached_blocks)} hashes", title_justify="left")
    for column in ("hash", "blocks", "tokens", "ref counts"):
        table.add_column(column)
    for block_hash, blocks in alloc.cached_blocks.items():
        first = next(iter(blocks.values()))
        table.add_row(
            short_hash(block_hash),
            ", ".join(f"[{_style(b)}]{b.block_id}[/]" for b in blocks.values()),
            _tokens(first, alloc.block_size, token_repr),
            ", ".join(str(b.ref_cnt) for b in blocks.values()),
        )
    return table


def render_stats(alloc: PrefixCachingAllocator):
    from rich.table import Table

    table = Table(title="stats", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    s = alloc.stats
    rows = {
        "requests": s.requests,
        "hit rate": f"{s.hit_rate:.1%} ({s.hit_tokens}/{s.queried_tokens} tokens)",
        "blocks free / in use / cached": (
            f"{alloc.num_free_blocks} / {alloc.num_blocks - alloc.num_free_blocks} / {alloc.num_cached_blocks}"
        ),
        "evictions": s.evictions,
        "hash collisions": s.hash_collisions,
        "refused allocations": s.refused,
    }
    for name, value in rows.items():
        table.add_row(name, str(value))
    return table


def render_pool(alloc: PrefixCachingAllocator, token_repr=str, title: str = "block pool"):
    """Everything at once: every block, the free queue, the block tables, the cache map."""
    from rich.columns import Columns
    from rich.console import Group
    from rich.panel import Panel

    cells = [
        Panel(
            f"{_tokens(b, alloc.block_size, token_repr)}\n{short_hash(b.block_hash)} ref={b.ref_cnt}",
            title=str(b.block_id), style=_style(b), expand=False,
        )
        for b in alloc.blocks[:64]
    ]
    parts = [Columns(cells), render_free_queue(alloc)]
    parts += [render_block_table(alloc, rid, token_repr) for rid in alloc.block_tables]
    if alloc.cached_blocks:
        parts.append(render_cache_map(alloc, token_repr))
    parts.append(render_stats(alloc))
    legend = f"[{IN_USE}]in use[/]  [{CACHED_FREE}]free, cached[/]  [{EMPTY}]free, empty[/]"
    return Panel(Group(*parts), title=title, subtitle=legend)


# -----------------------------------------------------------------------------
# 5. The walkthrough: the design doc's examples, replayed
#
# Block size 4, 10 blocks. Token ids are made up; only which ones repeat matters.

_R0 = list(range(15))  # request 0's prompt; later requests share its first 10 or 12 tokens

# (title, what happens, the step, the request whose block table to show) for Time 1 to 6.
DESIGN_DOC_STEPS = [
    ("Time 1", "Request 0 arrives with 15 prompt tokens: 3 full blocks are cached, the 4th holds 3 tokens.",
     lambda a: a.allocate_with_prefix("request 0", _R0), "request 0"),
    ("Time 2", "Request 0 decodes token 15 (block 3 fills and is cached), then 16 (needs block 4).",
     lambda a: (a.append_token("request 0", 15), a.append_token("request 0", 16)), "request 0"),
    ("Time 3", "Request 1 arrives with 14 tokens; its first 10 equal request 0's. Only 2 full blocks "
     "(8 tokens) hit: the 3rd block matches just 2 of its 4 tokens.",
     lambda a: a.allocate_with_prefix("request 1", _R0[:10] + [100, 101, 102, 103]), "request 1"),
    ("Time 4", "Request 0 finishes. Blocks 4, 3, 2 join the free queue in reverse order (2 and 3 keep "
     "their hash); 0 and 1 stay, request 1 still uses them.",
     lambda a: a.free("request 0"), None),
    ("Time 5", "Request 1 finishes: blocks 6, 5, 1, 0 join the tail.",
     lambda a: a.free("request 1"), None),
    ("Time 6", "Request 2 arrives with 29 tokens; its first 12 equal request 0's. Hits 0, 1, 2 are touched "
     "(taken out of the free queue) before 5 new blocks are popped from the head; block 3 still held a "
     "hash, so it is evicted.",
     lambda a: a.allocate_with_prefix("request 2", _R0[:12] + list(range(200, 217))), "request 2"),
]

# What the doc's figures show after each step: (label, how to read it off, expected).
DESIGN_DOC_STATES = {
    "Time 1": [("block table of request 0", lambda a: a.block_tables["request 0"], [0, 1, 2, 3])],
    "Time 2": [("block table of request 0", lambda a: a.block_tables["request 0"], [0, 1, 2, 3, 4])],
    "Time 3": [("cached tokens of request 1", lambda a: a.stats.hit_tokens, 8),
               ("block table of request 1", lambda a: a.block_tables["request 1"], [0, 1, 5, 6])],
    "Time 4": [("free queue", lambda a: a.free_queue_ids(), [7, 8, 9, 4, 3, 2])],
    "Time 5": [("free queue", lambda a: a.free_queue_ids(), [7, 8, 9, 4, 3, 2, 6, 5, 1, 0])],
    "Time 6": [("block table of request 2", lambda a: a.block_tables["request 2"], [0, 1, 2, 7, 8, 9, 4, 3]),
               ("blocks evicted", lambda a: a.stats.evictions, 1),
               ("free queue", lambda a: a.free_queue_ids(), [6, 5])],
}


def design_doc_example(until: int = 6, **allocator_options) -> PrefixCachingAllocator:
    """The allocator after Time 1..`until` of the design doc's example; `allocator_options`
    replay it with other settings (e.g. free_uncached_first=True).

    >>> design_doc_example(until=5).free_queue_ids()
    [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    """
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4, **allocator_options)
    for _, _, step, _ in DESIGN_DOC_STEPS[:until]:
        step(alloc)
    return alloc


def _check(console, label: str, got, expected) -> None:
    mark = "[green]matches the design doc[/]" if got == expected else f"[red]differs from the doc: {expected}[/]"
    console.print(f"  {label}: {got}  {mark}")


def walkthrough(console=None) -> PrefixCachingAllocator:
    """Replay 'Example' (Time 1 to 6) and 'Duplicated blocks' from the vLLM v1 design doc."""
    from rich.console import Console
    from rich.rule import Rule

    console = console or Console()

    def step(title: str, text: str) -> None:
        console.print(Rule(title))
        console.print(text)

    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    for title, text, action, shown in DESIGN_DOC_STEPS:
        step(title, text)
        action(alloc)
        if shown:
            console.print(render_block_table(alloc, shown))
        console.print(render_free_queue(alloc))
        if title == "Time 5":
            console.print(render_cache_map(alloc))
        for label, read, expected in DESIGN_DOC_STATES[title]:
            _check(console, label, read(alloc), expected)
    alloc.free("request 2")

    letters = lambda t: chr(ord("A") + t)  # noqa: E731  token 0 is A, 1 is B, ...
    dup = PrefixCachingAllocator(num_blocks=10, block_size=4)
    step("Duplicated blocks", "Request 1: prompt ABCDEF, greedy output GHI. Tokens join as they are decoded.")
    dup.allocate_with_prefix("request 1", [0, 1, 2, 3, 4, 5])  # A B C D E F
    for token in (6, 7, 8):  # G H I
        dup.append_token("request 1", token)
    console.print(render_block_table(dup, "request 1", letters))
    _check(console, "block table of request 1", dup.block_tables["request 1"], [0, 1, 2])
    console.print("Request 2 sends the same prompt and decodes the same G, H. ABCD hits block 0; EFGH "
                  "fills a new block 3 that is cached again under block 1's hash: tables are append-only.")
    dup.allocate_with_prefix("request 2", [0, 1, 2, 3, 4, 5])
    for token in (6, 7):
        dup.append_token("request 2", token)
    console.print(render_block_table(dup, "request 2", letters), render_cache_map(dup, letters))
    _check(console, "block table of request 2", dup.block_tables["request 2"], [0, 3])
    efgh = dup.block_hash(1)
    _check(console, "blocks cached under EFGH's hash", sorted(dup.cached_blocks[efgh]), [1, 3])
    dup.free("request 1")
    dup.free("request 2")
    console.print(render_pool(dup, letters, title="after both are freed"))
    return alloc


# -----------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--walkthrough", action="store_true", help="replay the vLLM design doc's worked example")
    mode.add_argument("--bench", choices=["allocator", "ttft"], help="run a benchmark (extra flags go to it)")
    args, rest = parser.parse_known_args(argv)
    if args.bench:
        import importlib

        importlib.import_module(f"benchmarks.{args.bench}").main(rest)
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    elif args.walkthrough:
        walkthrough()


if __name__ == "__main__":
    main()
