"""
Three servers' prefix caches, replayed request after request: what each would find cached.

The workload analyzer (workload_analyzer.py) replays a log through one of these. Read
allocator/prefix_caching.py first: vLLM's cache is the one this course builds. The other two keep the
same K/V for the same reason but decide differently what to keep and what a prompt finds:

    1. vLLM       blocks named by chained hashes; the free queue evicts the least recently
                  freed block (PrefixCachingAllocator, here in a fast form for the serial case)
    2. SGLang     a radix tree of token ids: a prompt finds every token it shares with an
                  earlier one (page_size 1), or whole pages; leaves are evicted by a policy
    3. llama.cpp  a few slots, each keeping one sequence: a request takes the slot whose
                  sequence shares the longest prefix with it, and the rest of that slot's
                  sequence is cut away; a prompt cache in host memory keeps whole sequences
                  (in llama_slots.py, which reads this file's Counts and common_prefix)

Where each replay is approximate. All three send one request at a time and decode nothing
(max_tokens=1), as the analyzer's replay does. A server runs many requests at once: running
requests hold blocks a serial replay hands to the cache (all three), and llama.cpp picks only
among the slots that are idle, which a serial replay cannot see (all of them are idle here).
SGLang's scheduler may also reorder a waiting queue (longest prefix first); here the log's
order is kept.

Every function takes token ids as arrays and returns `Counts`: the tokens each request found
cached, in log order, how many cached units were evicted, and the requests the server refuses
(llama.cpp's, longer than a slot's context).
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence


@dataclass
class Counts:
    cached: array  # cached tokens of each request, in log order
    evictions: int  # blocks (vLLM), tree nodes (SGLang) or prompt-cache entries (llama.cpp) evicted
    refused: array = field(default_factory=lambda: array("I"))  # requests the server turns away (llama.cpp)
    unrestored: array = field(default_factory=lambda: array("I"))  # llama.cpp: a cached prompt found, no room to load it


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many tokens (or characters: fleet.py's text tree) `a` and `b` share from the start,
    comparing slices (C speed) by halves.

    >>> common_prefix(array("I", [1, 2, 3, 4]), array("I", [1, 2, 9]))
    2
    """
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low + 1 < high:  # a[:low] == b[:low] and a[:high] != b[:high]
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


# -----------------------------------------------------------------------------
# 1. vLLM: the block pool
#
# In a serial replay every block is free between two requests, so the allocator's state is
# the free queue and the map of cached hashes; its checks, stats and block objects are not
# needed. This is PrefixCachingAllocator's allocate_with_prefix then free, step for step, on
# arrays, each block hash replaced by a small int, numbered once per block size for every
# replay of the log (log_replay.py numbers them). tests/analyzer/test_caching_models.py checks
# it against the allocator, request by request.
#
# A free block matters only by the hash it holds, so the free queue is the hashes of its
# blocks, head first, in an array: a block taken out of the middle (a hit) is marked where it
# stands, and the array is packed once such entries, and those passed at the head, are most
# of it. Blocks without a hash at the head (where vLLM's order frees a partial block) are only
# counted. A hash points to the entry of the first block cached with it: an array by number,
# or for a pool much smaller than the log a dict of the hashes it holds. A hash cached in two
# blocks at once (a prompt's last full block is never looked up, so the same prompt sent again
# caches it again) keeps the others in a dict, first cached first, as the allocator's map
# does. At most about 12 bytes a block of the pool, where an OrderedDict and a dict of dicts
# took about 500.

TAKEN = 0xFFFFFFFF  # a free-queue entry whose block was taken out of the middle (a hit)
HASHLESS = 0xFFFFFFFE  # a free block without a hash, in the queue (the design doc's order)
QUEUE_SLACK = 1 << 16  # entries taken or passed the queue may hold beyond twice its free blocks before it is packed


@dataclass(frozen=True)
class VLLM:
    """vLLM v1's pool: one block is the null block; freed blocks without a hash go first."""

    null_block: bool = True  # vllm/v1/core/block_pool.py keeps block 0 aside
    free_uncached_first: bool = True
    vllm_server: bool = True  # its chats are rewritten as vLLM's OpenAI server does (vllm_requests.py)

    def replay(self, hash_ids: Iterable[array], lengths: Sequence[int], num_blocks: int, block_size: int,
               num_ids: int, watch: Callable[[int, int], None] | None = None) -> Counts:
        """`num_blocks` counts vLLM's num_gpu_blocks (the null block among them, if any);
        `hash_ids`: each prompt's blocks numbered from 0 as log_replay.block_hash_ids numbers
        them, `num_ids` numbers in all; `watch(i, num_hits)` is called for each request, once
        its hits are known."""
        usable = num_blocks - self.null_block
        spare = usable  # free blocks without a hash at the head of the free queue: all of them, at first
        queue, head = array("I"), 0  # the rest of the free queue from `head` on: its blocks' hashes
        # hash -> the queue entry of the first block cached with it, -1 if none: an array by
        # number, or for a pool much smaller than the log a dict of the hashes it holds
        small = 25 * usable < num_ids  # about 100 bytes a hash in a dict, 4 a number in an array
        first = NotHeld() if small else array("i", [-1]) * num_ids
        others: dict[int, list[int]] = {}  # hash -> the entries of the blocks cached with it after the first
        cached = array("I")
        evictions = numbered = 0  # numbers given before the prompt: no block holds a larger one yet
        for index, (ids, length) in enumerate(zip(hash_ids, lengths)):
            num_hits = 0
            for h in ids[: (length - 1) // block_size]:  # lookup: at least one token is computed
                at = first[h]
                if at < 0:
                    break
                queue[at] = TAKEN  # touch: out of the free queue, so taking blocks below cannot evict it
                num_hits += 1
            if watch is not None:
                watch(index, num_hits)
            need = -(-length // block_size) - num_hits
            taken = min(spare, need)
            spare, need = spare - taken, need - taken
            while need:  # take from the head, evicting
                h = queue[head]
                head += 1
                if h == TAKEN:
                    continue
                need -= 1
                if h != HASHLESS:
                    evictions += 1
                    more = others.get(h)
                    if first[h] == head - 1:
                        if more:
                            first[h] = more.pop(0)
                        elif small:
                            del first[h]
                        else:
                            first[h] = -1
                    else:
                        more.remove(head - 1)
                    if more == []:
                        del others[h]
            if length % block_size:  # the partial last block, hashless, is freed first
                if self.free_uncached_first:
                    spare += 1  # to the head
                else:
                    queue.append(HASHLESS)
            last = len(queue) + len(ids) - 1  # free: last block first, so block i goes to entry last - i
            for i in range(num_hits):
                first[ids[i]] = last - i
            for i in range(num_hits, len(ids)):  # cache the full blocks
                h = ids[i]
                if h >= numbered or first[h] < 0:
                    first[h] = last - i
                else:
                    others.setdefault(h, []).append(last - i)
            queue.extend(ids[::-1])
            numbered = max(numbered, ids[-1] + 1) if ids else numbered
            cached.append(num_hits * block_size)
            if len(queue) > 2 * (usable - spare) + QUEUE_SLACK:  # entries taken or passed are most of it
                pack(queue, head, first, others)
                head = 0
        return Counts(cached, evictions)


class NotHeld(dict):
    """hash -> queue entry, -1 for a hash the pool does not hold."""

    def __missing__(self, h: int) -> int:
        return -1


def pack(queue: array, head: int, first: array | NotHeld, others: dict[int, list[int]]) -> None:
    """Drop the free queue's taken entries and those before `head`, in place, and point each
    hash at its entries' new places."""
    kept = 0
    for at in range(head, len(queue)):
        h = queue[at]
        if h == TAKEN:
            continue
        if h != HASHLESS:
            if first[h] == at:
                first[h] = kept
            else:
                more = others[h]
                more[more.index(at)] = kept
        queue[kept] = h
        kept += 1
    del queue[kept:]


# this course's Engine: the design doc's order, and its chats rendered as they are sent
ENGINE = VLLM(null_block=False, free_uncached_first=False, vllm_server=False)


# -----------------------------------------------------------------------------
# 2. SGLang: the radix tree
#
# python/sglang/srt/mem_cache/radix_cache.py (RadixCache, as released in sglang 0.5.23; the
# same file at commit 95769b2 of its main branch): a node holds a run of token ids
# and their K/V; its children are keyed by their first token (or first page). A request
# matches at most all its tokens but one (schedule_batch.py, _compute_max_prefix_len), cut
# down to whole pages; the match splits a node where it ends inside one and touches the
# path. Its new tokens need room, as the scheduler asks for it (mem_cache/allocation.py):
# alloc_token_slots wants the request's new tokens at page size 1, and
# alloc_paged_token_slots_extend, at a larger page size, its new tokens and one page more
# ("assume each request needs a new page"; allocator/base.py, get_extend_allocation_demand,
# returns that sum, and evict_to_free_tokens evicts what the free pages lack). When the pool
# has too little, evict() pops the evictable
# leaves (nothing running holds them) in the policy's order until enough tokens are freed,
# a parent left childless joining the heap. A finished request
# inserts its tokens (page-aligned), which counts a hit on every node it passes. Time is a
# counter here: one tick for each call and each new node, where SGLang reads a clock. SGLang
# builds its heap from every evictable leaf at each eviction; over a long log that is a walk
# of the whole tree per request, so here one heap lives on: a leaf is pushed whenever a
# request touches it, and an entry whose node has changed since is skipped when popped.
#
# The policies: each is a key, and the leaf with the smallest goes first (evict_policy.py).
# The server's --radix-eviction-policy takes five (arg_groups/choices.py):
#
#   lru       last access
#   lfu       hit count, then last access
#   slru      a leaf hit fewer than protected_threshold times (2; the server's
#             --radix-eviction-policy-config '{"protected_threshold": N}') before any other,
#             then last access
#   priority  the node's priority, then last access. A node keeps the highest priority of the
#             requests that inserted it, `req.priority or 0` (radix_cache.py, _insert_cache;
#             unified_radix_cache.py, checkpoint_into_tree). A log carries none, and a request
#             without one inserts 0 (with --enable-priority-scheduling, managers/scheduler.py
#             gives them all the same value): every node ties, and the order is lru's. (A
#             server that decodes inserts a finished request's prompt again at its priority
#             + 1, so its reply goes first; the replay decodes nothing.)
#   tlru      Tail-optimized LRU (arXiv:2510.15152): first the leaves that lie wholly past
#             their branch's budget, then last access. The budget is the deepest the branch
#             has ever reached (a high-water mark that eviction does not lower) plus
#             next_prompt_estimate minus threshold, in tokens ('{"threshold": T,
#             "next_prompt_estimate": Q}'); the server refuses tlru unless T > Q >= 0
#             (arg_groups/kv_cache_hook.py), so its defaults, 0 and 0, are refused
#
# RadixCache itself also takes fifo (creation), mru and filo (lru's and fifo's reverse),
# which the server's flag refuses. The server does not run RadixCache: 0.5.23 builds a
# UnifiedRadixCache (mem_cache/registry.py), whose tree (a Rust TreeCore, or
# unified_cache/unified_tree_core.py in Python) keys its leaves with the same strategies.
# tlru runs only there (registry.py refuses it on any other cache), and the depths it reads
# are kept as unified_tree_core.py keeps them: a new node raises its ancestors' high-water
# mark (_set_tlru_lens_and_raise_history), the upper half of a split takes the lower
# half's (_split_node).

SERVER_EVICTION_POLICIES = ("lru", "lfu", "slru", "priority", "tlru")  # --radix-eviction-policy
RADIX_CACHE_ONLY_POLICIES = ("fifo", "mru", "filo")  # RadixCache(eviction_policy=...); the server refuses them
EVICTION_POLICIES = SERVER_EVICTION_POLICIES + RADIX_CACHE_ONLY_POLICIES


class RadixNode:
    __slots__ = ("key", "children", "parent", "last_access", "created", "hits", "lock", "depth", "high_water")

    def __init__(self, key: array, parent: RadixNode | None, now: int) -> None:
        self.key = key  # the token ids this node adds to its parent's
        self.children: dict = {}
        self.parent = parent
        self.last_access = self.created = now
        self.hits = 0
        self.lock = 0  # running requests that use it
        self.depth = len(key) + (parent.depth if parent is not None else 0)  # tokens from the root to its end
        self.high_water = self.depth  # the deepest its branch has been, it included (tlru's history length)


@dataclass(frozen=True)
class SGLang:
    page_size: int = 1  # SGLang's --page-size
    eviction_policy: str = "lru"  # --radix-eviction-policy, or one RadixCache alone takes
    slru_protected_threshold: int = 2  # --radix-eviction-policy-config's protected_threshold
    tlru_threshold: int = 0  # ... threshold, in tokens
    tlru_next_prompt_estimate: int = 0  # ... next_prompt_estimate, in tokens

    def __post_init__(self) -> None:
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}")
        if self.eviction_policy == "tlru" and not 0 <= self.tlru_next_prompt_estimate < self.tlru_threshold:
            raise ValueError(
                f"tlru needs 0 <= next_prompt_estimate < threshold, got {self.tlru_next_prompt_estimate} and "
                f"{self.tlru_threshold}: SGLang's server refuses anything else (with a threshold no larger than the "
                f"estimate no token is ever past the budget, and T-LRU is LRU). Give the threshold, the tokens a "
                f"prefill may compute within your time-to-first-token target, and the tokens you expect a "
                f"conversation's next prompt to add")

    def replay(self, prompts: list[array], salts: list[str | None], max_total_tokens: int) -> Counts:
        """`max_total_tokens`: the pool in tokens, SGLang's --max-total-tokens."""
        return RadixTree(self, max_total_tokens).replay(prompts, salts)


@dataclass
class RadixTree:
    model: SGLang
    capacity: int
    roots: dict = field(default_factory=dict)  # one root per cache_salt: salted prompts never share
    size: int = 0  # tokens held by the tree
    clock: int = 0
    evictions: int = 0
    heap: list = field(default_factory=list)  # (priority, created, push number, node), stale entries too
    pushes: Iterator[int] = field(default_factory=itertools.count)
    touched: list = field(default_factory=list)  # the nodes the running request touched

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def child_key(self, key: array, start: int = 0):
        return key[start] if self.model.page_size == 1 else tuple(key[start : start + self.model.page_size])

    def aligned(self, key: array) -> array:
        return key[: len(key) // self.model.page_size * self.model.page_size]

    def shared(self, a: array, b: array) -> int:
        """RadixKey.match: the common prefix, cut down to whole pages."""
        n = common_prefix(a, b)
        return n - n % self.model.page_size

    def priority(self, node: RadixNode):
        policy = self.model.eviction_policy
        if policy == "lru":
            return (node.last_access,)
        if policy == "lfu":
            return node.hits, node.last_access
        if policy == "slru":
            return node.hits >= self.model.slru_protected_threshold, node.last_access
        if policy == "priority":
            return 0, node.last_access  # no request carries a priority: every node's is 0
        if policy == "tlru":
            budget = max(node.high_water + self.model.tlru_next_prompt_estimate - self.model.tlru_threshold, 0)
            past_budget = node.depth - len(node.key) >= budget
            return -past_budget, node.last_access
        if policy == "fifo":
            return (node.created,)
        if policy == "mru":
            return (-node.last_access,)
        return (-node.created,)

    def replay(self, prompts: list[array], salts: list[str | None]) -> Counts:
        cached = array("I")
        for prompt, salt in zip(prompts, salts):
            root = self.roots.get(salt)
            if root is None:
                root = self.roots[salt] = RadixNode(array("I"), None, self.tick())
                root.lock = 1
            matched, last = self.match(root, self.aligned(prompt[: len(prompt) - 1]))
            self.lock(last, +1)
            for node in self.touched:  # a node the match split: its lower half, unlocked, may be evicted
                self.offer(node)
            self.touched.append(last)  # a leaf again when unlocked, if eviction took its children
            need = self.demand(len(prompt) - matched)
            shortfall = need - (self.capacity - self.size)
            if shortfall > 0:
                self.evict(shortfall)
            self.insert(root, self.aligned(prompt))
            self.lock(last, -1)
            for node in self.touched:
                self.offer(node)
            self.touched.clear()
            cached.append(matched)
        return Counts(cached, self.evictions)

    def match(self, node: RadixNode, key: array) -> tuple[int, RadixNode]:
        """_match_prefix_helper: the tokens of `key` the tree holds, and the node they end in."""
        now = self.tick()
        node.last_access = now
        matched = 0
        while matched < len(key):
            child = node.children.get(self.child_key(key, matched))
            if child is None:
                break
            child.last_access = now
            self.touched.append(child)
            shared = self.shared(child.key, key[matched:])
            matched += shared
            if shared < len(child.key):
                node = self.split(child, shared)
                break
            node = child
        return matched, node

    def split(self, child: RadixNode, at: int) -> RadixNode:
        """_split_node: the first `at` tokens of `child` become a new node above it."""
        parent = child.parent
        top = RadixNode(child.key[:at], parent, self.tick())
        top.hits, top.lock, top.high_water = child.hits, child.lock, child.high_water
        parent.children[self.child_key(child.key)] = top
        child.key = child.key[at:]
        child.parent = top
        top.children[self.child_key(child.key)] = child
        return top

    def insert(self, node: RadixNode, key: array) -> None:
        """_insert_helper: walk the shared part (a hit on each node), add the rest as a new leaf."""
        now = self.tick()
        node.last_access = now
        done = 0
        while done < len(key):
            child = node.children.get(self.child_key(key, done))
            if child is None:
                break
            child.last_access = now
            self.touched.append(child)
            shared = self.shared(child.key, key[done:])
            node = self.split(child, shared) if shared < len(child.key) else child
            done += shared
            node.hits += 1
            self.touched.append(node)
        if done < len(key):
            leaf = RadixNode(key[done:], node, self.tick())
            leaf.hits = 1
            node.children[self.child_key(leaf.key)] = leaf
            while node is not None and node.high_water < leaf.depth:
                node.high_water = leaf.depth
                node = node.parent
            self.size += len(leaf.key)
            self.touched.append(leaf)

    def demand(self, new_tokens: int) -> int:
        """The room the scheduler asks for before a request's new tokens are allocated.

        >>> RadixTree(SGLang(page_size=1), 100).demand(30), RadixTree(SGLang(page_size=16), 100).demand(30)
        (30, 46)
        """
        page_size = self.model.page_size
        return new_tokens if page_size == 1 else new_tokens + page_size

    def lock(self, node: RadixNode, delta: int) -> None:
        while node.parent is not None:
            node.lock += delta
            node = node.parent

    def offer(self, node: RadixNode) -> None:
        """Push `node` on the heap if it is an evictable leaf: in the tree, childless, unused."""
        if node.parent is not None and not node.children and node.lock == 0:
            heapq.heappush(self.heap, (self.priority(node), node.created, next(self.pushes), node))

    def evict(self, num_tokens: int) -> None:
        """Pop the evictable leaves in the policy's order until `num_tokens` are freed; a parent
        left childless becomes a leaf to pop in its turn."""
        freed = 0
        while freed < num_tokens and self.heap:
            priority, _, _, leaf = heapq.heappop(self.heap)
            if leaf.parent is None or leaf.children or leaf.lock or priority != self.priority(leaf):
                continue  # evicted, no longer a leaf, in use, or touched since it was pushed
            parent = leaf.parent
            del parent.children[self.child_key(leaf.key)]
            leaf.parent = None
            freed += len(leaf.key)
            self.size -= len(leaf.key)
            self.evictions += 1
            self.offer(parent)
