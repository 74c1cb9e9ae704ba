"""
Automatic prefix caching, the way vLLM v1 does it: the allocator, in one file you can read
top to bottom.

When many requests start with the same tokens (a system prompt, a shared document, the
history of a chat) the key/value tensors of those tokens are the same every time. A serving
engine that keeps them around can skip recomputing them: that is prefix caching. This file
is its bookkeeping, built in the order the ideas depend on each other:

    1. block hashes       a block of tokens is named by a hash chained to its parent block
    2. the free queue     a doubly linked list of blocks; its head is the next to be evicted
    3. the allocator      PrefixCachingAllocator.allocate_with_prefix (lookup, room, touch,
                          take, cache), append_token, free; touch and evict by name

It is pure Python: no torch, no model. The rest of the course builds on it, one role per
package: engine/ runs a real model over these blocks, serving/ puts the engine behind HTTP,
commands/ holds the course's commands. The README's table "The code, in reading order" lists
them (tests/project/test_layers.py checks that each module imports only the ones above it there).
The front door, prefix_caching.py at the top of the repository, re-exports this file's names
and runs the commands (python prefix_caching.py --walkthrough, --demo, --analyze, --bench).

References:
    vLLM v1 design doc, "Automatic Prefix Caching"
        https://docs.vllm.ai/en/latest/design/prefix_caching.html
    vLLM source: vllm/v1/core/block_pool.py, kv_cache_utils.py, kv_cache_manager.py
    nano-vllm: nanovllm/engine/block_manager.py, read at commit bb823b3 of its main branch
        (https://github.com/GeeeekExplorer/nano-vllm)
    SGLang RadixAttention: python/sglang/srt/mem_cache/radix_cache.py
"""

from __future__ import annotations

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


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = (),
                      algo: str = "sha256") -> BlockHash:
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


def compute_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                         extra_keys: tuple = (), algo: str = "sha256") -> list[BlockHash]:
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
        """The free block ids from head (handed out, or evicted, next) to tail."""
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
#   append_tokens         the same for several tokens at once, all or nothing: the next
#                         chunk of a prompt prefilled in pieces (chunked prefill)
#   free                  ref counts down, in reverse block order; blocks that reach 0 go
#                         to the tail of the free queue and keep their hash


class OutOfBlocksError(RuntimeError):
    """The free queue cannot supply the blocks a request needs (nothing was changed)."""


class Allocation(NamedTuple):
    num_cached_tokens: int  # prompt tokens whose K/V come from cached blocks
    num_new_tokens: int  # prompt tokens the model still has to compute


@dataclass
class CacheStats:
    """What the allocator counted. The hit rate is hit_tokens / queried_tokens: of the prompt
    tokens of the requests that came (a whole prompt, even when the allocator is handed its
    first chunk only), the share found cached, as vLLM's PrefixCacheStats counts its queries
    and hits (vllm/v1/metrics/stats.py). A preempted request looked up again on resuming is
    counted apart, in the preempted_ fields, so finding its own blocks again does not raise
    the rate."""

    requests: int = 0
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, tokens served from the cache
    preempted_requests: int = 0  # lookups of preempted requests, resuming
    preempted_queried_tokens: int = 0
    preempted_hit_tokens: int = 0
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
    # Of the request's full blocks, in order: at least those it holds (a caller's list may
    # run ahead, with blocks its next chunks will fill).
    block_hashes: list[BlockHash]
    # False after a hash collision: the request's later blocks would be named by a chain that
    # already names other tokens, so none of them is cached (see allocate_with_prefix).
    cacheable: bool = True


def _check_tokens(token_ids, what: str) -> list[int]:
    if isinstance(token_ids, array) and token_ids.typecode in "BHILQ":
        return token_ids.tolist()  # unsigned ints by construction: nothing to check per token
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

    def __init__(self, num_blocks: int, block_size: int, *, hash_algo: str = "sha256", enable_caching: bool = True,
                 free_uncached_first: bool = False) -> None:
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

    def hash_blocks(self, token_ids: list[int], cache_salt: str | None,
                    block_hashes: list[BlockHash]) -> list[BlockHash]:
        """Extend `block_hashes`, the chained hashes of the first full blocks of token_ids,
        to every full block, hashing only the new ones, and return it: a request keeps its
        list and never hashes a block twice (vLLM's Request.block_hashes, extended by its
        block_hasher). Trusts its caller: token_ids are ids, the salt checked (the engine's
        front did both).

        >>> alloc, hashes = PrefixCachingAllocator(num_blocks=4, block_size=4), []
        >>> len(alloc.hash_blocks([1, 2, 3, 4, 5], None, hashes))
        1
        >>> alloc.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], None, hashes) == compute_block_hashes(range(1, 9), 4)
        True
        """
        if not self.enable_caching:
            return block_hashes
        done, size = len(block_hashes), self.block_size
        if done == 0:
            block_hashes.extend(compute_block_hashes(token_ids, size, cache_salt, (), self.hash_algo))
            return block_hashes
        for i in range(done, len(token_ids) // size):
            keys = block_extra_keys(i, cache_salt, ())
            block_hashes.append(hash_block_tokens(block_hashes[-1], token_ids[i * size : (i + 1) * size], keys,
                                                  self.hash_algo))
        return block_hashes

    def peek(self, token_ids: Sequence[int], cache_salt: str | None = None, extra_keys=(),
             block_hashes: list[BlockHash] | None = None) -> int:
        """How many prompt tokens would hit right now, changing nothing. block_hashes: the
        prompt's full blocks' hashes, if the caller keeps them (hash_blocks), so none is
        hashed again; such a caller is trusted as hash_blocks trusts it (a scheduler looks
        up a waiting prompt every step: checking all of its tokens each time cost more than
        the lookup)."""
        if block_hashes is None:
            token_ids = _check_tokens(token_ids, "token_ids")
        if not self.enable_caching or not token_ids:
            return 0
        if block_hashes is None:
            block_hashes = compute_block_hashes(
                token_ids, self.block_size, check_cache_salt(cache_salt), tuple(extra_keys), self.hash_algo
            )
        hits, _ = self.find_longest_cache_hit(token_ids, block_hashes)
        return len(hits) * self.block_size

    # --- allocate ----------------------------------------------------------------------------

    def allocate_with_prefix(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None,
                             extra_keys: Sequence = (), block_hashes: list[BlockHash] | None = None, *,
                             num_query_tokens: int | None = None, preempted: bool = False) -> Allocation:
        """Give a new request blocks for its prompt, reusing the longest cached prefix.

        All or nothing: if the pool cannot hold the prompt, OutOfBlocksError is raised and
        nothing has changed. The five steps of vLLM's "new request" workflow:
        lookup, room, touch, take, cache.

        block_hashes: the caller's list of the request's full blocks' hashes (hash_blocks),
        if it keeps one: used instead of hashing the prompt again, and the blocks that fill
        later (append_token) take their hash from it while it has one.

        For the counters (CacheStats): num_query_tokens, the request's whole length when
        token_ids is only its first chunk (a scheduler's chunked prefill; default
        len(token_ids)); preempted: the request is resuming after a preemption.
        """
        token_ids, cache_salt, extra_keys = self._check_new_request(request_id, token_ids, cache_salt, extra_keys)
        num_query_tokens = len(token_ids) if num_query_tokens is None else num_query_tokens
        if not (isinstance(num_query_tokens, int) and num_query_tokens >= len(token_ids)):
            raise ValueError(f"num_query_tokens must be an int >= len(token_ids) ({len(token_ids)}), "
                             f"got {num_query_tokens!r:.40}")
        num_needed = -(-len(token_ids) // self.block_size)  # ceil division

        # 1. lookup: the cached blocks the prompt starts with.
        hashes: list[BlockHash] = []
        hits: list[KVCacheBlock] = []
        collided = False
        if self.enable_caching:
            if block_hashes is None:
                block_hashes = compute_block_hashes(token_ids, self.block_size, cache_salt, extra_keys, self.hash_algo)
            hashes = block_hashes
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
        num_full = len(token_ids) // self.block_size
        for i in range(len(hits), num_needed):
            block = self.blocks[table[i]]
            block.token_ids = token_ids[i * self.block_size : (i + 1) * self.block_size]
            block.cache_salt = cache_salt
            if i < min(len(hashes), num_full):
                self._cache_block(block, hashes[i])

        self.block_tables[request_id] = table
        self.requests[request_id] = _Request(token_ids, cache_salt, extra_keys, hashes, cacheable=not collided)
        num_cached = len(hits) * self.block_size
        if preempted:
            self.stats.preempted_requests += 1
            self.stats.preempted_queried_tokens += num_query_tokens
            self.stats.preempted_hit_tokens += num_cached
        else:
            self.stats.requests += 1
            self.stats.queried_tokens += num_query_tokens
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
            index, hashes = len(table) - 1, request.block_hashes
            if index == len(hashes):  # not hashed yet (a caller's list may hold it already)
                parent = hashes[-1] if hashes else None
                keys = block_extra_keys(index, request.cache_salt, request.extra_keys)
                hashes.append(hash_block_tokens(parent, block.token_ids, keys, self.hash_algo))
            self._cache_block(block, hashes[index])

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Add several tokens whose K/V are about to be computed, in one step: the next chunk
        of a prompt prefilled in pieces. Each block is cached as it fills, so a request finds
        a chunk's blocks from the step that computes them on, never earlier.

        All or nothing: raises OutOfBlocksError, changing nothing, when the new blocks the
        tokens need are more than the free ones.

        >>> alloc = PrefixCachingAllocator(num_blocks=4, block_size=4)
        >>> alloc.allocate_with_prefix("r", [1, 2, 3])          # a first chunk of 3 tokens
        Allocation(num_cached_tokens=0, num_new_tokens=3)
        >>> alloc.append_tokens("r", [4, 5, 6, 7]); alloc.block_tables["r"], alloc.num_cached_blocks  # block 0 full
        ([0, 1], 1)
        """
        request = self._request(request_id)
        token_ids = _check_tokens(token_ids, "token_ids")
        num_blocks = -(-(len(request.token_ids) + len(token_ids)) // self.block_size)
        num_new_blocks = num_blocks - len(self.block_tables[request_id])
        if num_new_blocks > self.num_free_blocks:
            self.stats.refused += 1
            raise OutOfBlocksError(
                f"request {request_id!r} needs {num_new_blocks} new blocks for {len(token_ids)} more tokens "
                f"but only {self.num_free_blocks} of {self.num_blocks} are free"
            )
        for token_id in token_ids:
            self.append_token(request_id, token_id)  # cannot run out now

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
        free_ids = self.free_queue.block_ids()
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
