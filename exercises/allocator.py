"""
Exercises 2 and 4: allocate with prefix (stage 5), and free in reverse order (stage 6).

A small PrefixCachingAllocator: the ideas of allocator/prefix_caching.py without decode, argument
checks or views. It runs on your hashes (exercise 1), so do that first. Its free queue is a
stand-in on a Python list (exercises/given.py) until you write your own in exercise 3:
exercise 4's tests then run this allocator on yours.

Finish lines:
    EXERCISE_IMPL=starter python -m pytest tests/exercises/test_ex2_allocate.py
    EXERCISE_IMPL=starter python -m pytest tests/exercises/test_ex4_free.py
Exercise 2's tests free blocks with exercise 4's rule written into the test, so you can do
it before free. Exercise 4's finish line is the design doc's worked example, replayed block
for block on all four of your pieces: request 2 gets blocks [0, 1, 2, 7, 8, 9, 4, 3] and
block 3's old hash is evicted; and allocate and free take as long on a pool of 100,000 blocks
as on one of 100 (timed by the grader: no call walks the pool or the free queue).
"""

from typing import Sequence

from exercises.block_hash import BlockHash, compute_block_hashes
from exercises.given import Allocation, KVCacheBlock, OutOfBlocksError
from exercises.given import ListFreeQueue as FreeKVCacheBlockQueue  # exercise 4's tests use your own (exercise 3)


class PrefixCachingAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        # block hash -> the blocks holding that content, {block_id: block}, in the order they
        # were cached. Usually one; two when a request computed a block that was already
        # cached (the design doc's "duplicated blocks": a hit leaves one token to compute, so
        # a prompt that is all cached blocks computes its last block again). A lookup hits the
        # first of them; an evicted block leaves its entry, and an empty entry leaves the map.
        self.cached_blocks: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.block_tables: dict[str, list[int]] = {}

    # --- exercise 2 ---------------------------------------------------------------------

    def allocate_with_prefix(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> Allocation:
        """Give a new request its blocks, reusing the longest cached prefix; return
        Allocation(num_cached_tokens, num_new_tokens). The design doc's "Block Allocation",
        and stage 5, show it at work; what follows is what must hold, not how to get there.

        When it returns:
          - The block table (self.block_tables[request_id]) holds ceil(len / block_size)
            blocks, in prompt order: first the hits, then blocks taken new.
          - A hit is a cached block whose K/V are exactly what this prompt needs there: the
            same tokens, computed after the same tokens before them. A matching hash is not
            enough on its own: the block's token_ids must equal the prompt's tokens there (a
            guard against hash collisions). Ask yourself which blocks can still be hits once
            one block of the prompt is not.
          - The model computes at least one prompt token, or it has no logits to sample from.
          - ref_cnt of every block = the number of block tables that hold it.
          - The free queue holds exactly the blocks with ref_cnt 0, in the order they were
            freed; blocks taken new come from its head, and a block this request hits is
            never taken as new.
          - Every full block of the prompt is cached: it has its hash and the cache map finds
            it under that hash. A block taken new answers to no old hash any more and holds
            only its new tokens. Two blocks may hold the same content (see the cache map
            above): losing one of them must not lose the other.
          - If the free queue cannot supply every block this request takes out of it (count
            them: new blocks, and hits that are sitting in it), raise OutOfBlocksError and
            leave everything exactly as it was.
        """
        # TODO exercise 2
        raise NotImplementedError("exercise 2: allocate_with_prefix is not written yet (exercises/allocator.py)")

    # --- exercise 4 ---------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Release a request's blocks and forget its block table.

        When it returns:
          - ref_cnt of every block = the number of block tables that still hold it, and the
            free queue holds exactly the blocks with ref_cnt 0: a block another request
            still holds is not free.
          - A block that became free stays cached (its hash, its tokens, findable in the cache
            map) until a later allocation takes it: until then a request can still hit it.
          - Eviction order: the head of the free queue is taken first, so blocks freed now go
            behind every block already free (least recently used first). Among this
            request's own blocks, the first to be evicted should be the one least likely to
            be hit again. Which one is that, and why? (The design doc's Time 4 and stage 6.)
        """
        # TODO exercise 4
        raise NotImplementedError("exercise 4: free is not written yet (exercises/allocator.py)")
