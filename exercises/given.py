"""
What the starters are given: the types and plain parts around the code you write.

The grading tests run your files in a process of their own, where the reference modules
(allocator/prefix_caching.py, engine/kv_pool.py, engine/request.py, engine/scheduler.py)
cannot be imported (exercises/README.md says why). So the pieces a starter builds on live here, in the shapes
the reference gives them: the same names and fields, none of the code an exercise asks for.

    KVCacheBlock, OutOfBlocksError, Allocation   the allocator's types (allocator/prefix_caching.py)
    LinkedFreeQueue    the free queue's sentinels, length and iteration; exercise 3 adds
                       the four operations
    ListFreeQueue      a stand-in free queue on a Python list: right, but O(n) remove, for
                       exercise 2 until exercise 3's queue replaces it
    PoolBase           the K/V pool's tensor and shape (engine/kv_pool.py); exercise 5 adds gather
    Request, ScheduledRequest, StepPlan, SchedulerBase
                       the scheduler's types and queues (engine/request.py, engine/scheduler.py);
                       exercise 6 adds schedule and _preempt

tests/grader/test_given_types.py checks that each of these matches the reference's, and lists
what is left out on purpose.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

# --- the allocator's types -----------------------------------------------------------------


class OutOfBlocksError(RuntimeError):
    """The free queue cannot supply the blocks a request needs (nothing was changed)."""


class Allocation(NamedTuple):
    num_cached_tokens: int  # prompt tokens whose K/V come from cached blocks
    num_new_tokens: int  # prompt tokens the model still has to compute


@dataclass(eq=False)
class KVCacheBlock:
    """One block of the pool: the bookkeeping for block_size slots of K/V memory."""

    block_id: int  # its index in the pool, fixed for life
    ref_cnt: int = 0  # how many running requests have it in their block table; 0 = free
    block_hash: bytes | None = None  # set once the block is full and cached, dropped on eviction
    token_ids: list[int] = field(default_factory=list)  # what its slots hold: hits compare them
    cache_salt: str | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)  # free queue links, None while
    next_free: KVCacheBlock | None = field(default=None, repr=False)  # the block is in use


# --- free queues -----------------------------------------------------------------------------


class LinkedFreeQueue:
    """A doubly linked list of free blocks whose links live in the blocks themselves.

    Two sentinel blocks, self._head before the first free block and self._tail after the
    last, are never handed out. The constructor links every block in with self.append, so
    a queue starts as blocks 0, 1, 2, ... from head to tail.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
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

    def append(self, block: KVCacheBlock) -> None:
        raise NotImplementedError("exercise 3a: FreeKVCacheBlockQueue.append is not written yet (exercises/free_queue.py)")


class ListFreeQueue:
    """The free queue's behaviour on a Python list: append, appendleft, remove and popleft
    in the right order, but remove scans the list. Exercise 2 runs on it; exercise 3 writes
    the O(1) queue that exercise 4 runs on."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._blocks = list(blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(list(self._blocks))

    def block_ids(self) -> list[int]:
        return [block.block_id for block in self._blocks]

    def append(self, block: KVCacheBlock) -> None:
        self._blocks.append(block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._blocks.insert(0, block)

    def remove(self, block: KVCacheBlock) -> None:
        if not any(b is block for b in self._blocks):
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._blocks = [b for b in self._blocks if b is not block]

    def popleft(self) -> KVCacheBlock:
        if not self._blocks:
            raise IndexError("the free queue is empty")
        return self._blocks.pop(0)


# --- the K/V pool ------------------------------------------------------------------------------


class PoolBase:
    """The K/V tensors behind the allocator's blocks:

        data[layer, 0, block, slot]  the key of one token,   shape (num_kv_heads, head_dim)
        data[layer, 1, block, slot]  the value of that token
    """

    def __init__(self, *, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype=None, device=None):
        import torch

        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.data = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype or torch.float32, device=device
        )

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def device(self):
        return self.data.device


# --- the scheduler's types -----------------------------------------------------------------------

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Request:
    """One request's life: its tokens, where it stands, and what the scheduler did to it
    (engine/request.py's Request, less the engine's side: its sampling, its reply, its events).

    token_ids is prompt_ids then output_ids, one list that grows: add a sampled token with
    append_output, never by appending to output_ids alone. block_hashes: the chained hashes
    of its full blocks, kept so a scheduler need not hash them again (allocator.hash_blocks
    extends it and returns it); a scheduler may also leave it alone."""

    request_id: str
    prompt_ids: list[int]
    cache_salt: str | None = None
    output_ids: list[int] = field(default_factory=list)  # sampled so far
    status: str = WAITING
    num_computed_tokens: int = 0  # of token_ids, tokens whose K/V are in the pool
    num_cached_tokens: int = 0  # prompt tokens hit at first admission (what the client is told)
    num_preemptions: int = 0
    admitted: bool = False  # ever admitted (num_cached_tokens is set)
    token_ids: list[int] = field(init=False)  # prompt_ids + output_ids, appended to
    block_hashes: list[bytes] = field(init=False, default_factory=list)  # of its full blocks

    def __post_init__(self):
        self.token_ids = [*self.prompt_ids, *self.output_ids]

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        self.token_ids.append(token)

    @property
    def num_prefill_left(self) -> int:
        """Tokens still to compute before it can sample again, beyond the one it decodes next:
        above 0 while a prompt (or a resumed request's text) comes in chunks."""
        return max(0, len(self.token_ids) - (1 if self.output_ids else 0) - self.num_computed_tokens)


@dataclass
class ScheduledRequest:
    """Compute tokens [start, end) of request.token_ids in this step; if that reaches the end
    of its tokens, sample one more (a chunk that stops part-way samples nothing: its next
    token is already known)."""

    request: Request
    start: int
    end: int
    samples: bool = field(init=False)

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


class SchedulerBase:
    """A waiting queue and a running list over one allocator (engine/scheduler.py's, less the two
    methods of exercise 6 and their helpers, and less the tenant counters of its fair_share:
    exercise 6 reads the waiting queue in arrival order)."""

    def __init__(self, allocator, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """Take a request out (finished, or its client left) and free its blocks."""
        if request.status == RUNNING:
            self.running.remove(request)
            # Normally every token it holds was computed (its last sampled token is never
            # appended). After a failed step, blocks past what was computed lose their hash.
            self.allocator.free(request.request_id, num_computed_tokens=request.num_computed_tokens)
        elif request.status == WAITING:
            self.waiting.remove(request)
        else:
            return  # finished already
        request.status = FINISHED
