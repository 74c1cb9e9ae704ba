"""
Exercises 2 and 4: allocate with prefix (stage 5), and free in reverse order (stage 6).

A small PrefixCachingAllocator: the ideas of prefix_caching.py without decode, argument
checks or views. It runs on your hashes (exercise 1), so do that first. Its free queue is a
stand-in on a Python list (exercises/given.py) until you write your own in exercise 3:
exercise 4's tests then run this allocator on yours.

Finish lines:
    EXERCISE_IMPL=starter python -m pytest tests/exercises/test_ex2_allocate.py
    EXERCISE_IMPL=starter python -m pytest tests/exercises/test_ex4_free.py
Exercise 2's tests free blocks with exercise 4's rule written into the test, so you can do
it before free. Exercise 4's finish line is the design doc's worked example, replayed block
for block on all four of your pieces: request 2 gets blocks [0, 1, 2, 7, 8, 9, 4, 3] and
block 3's old hash is evicted.
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
        """Give a new request its blocks, reusing the longest cached prefix.

        In this order (the design doc's "Block Allocation"; prefix_caching.py names the
        same five steps):
          1. lookup  Hash the prompt's full blocks. Walk them from block 0: block i hits while
                     its hash is in self.cached_blocks AND that block's token_ids equal the
                     prompt's tokens of block i (a cheap guard against collisions). Stop at
                     the first miss (break, not continue: block i + 1's K/V were computed
                     after block i's tokens, not after this prompt's). Hit at most
                     (len(token_ids) - 1) // block_size blocks: the model must compute at
                     least one token to produce logits.
          2. room    The prompt needs ceil(len / block_size) blocks; the hits cover some.
                     Hits whose ref_cnt is 0 sit in the free queue, so taking them uses up
                     free blocks too. Not enough free blocks: raise OutOfBlocksError before
                     changing anything.
          3. touch   Each hit: ref_cnt 0 means it is in the free queue, so remove it from
                     there; then ref_cnt += 1. Touch before taking new blocks: a pop must
                     never evict a block this request is about to reuse.
          4. take    Each new block comes from the head of the free queue. If it still holds
                     a hash, evict it: drop that hash from self.cached_blocks, set block_hash
                     None (its slots are about to hold other tokens). Its ref_cnt becomes 1.
          5. cache   Store each new block's tokens in block.token_ids. A full one gets its
                     block_hash and joins self.cached_blocks under it.
        Record the block table (hits first, then new blocks) and return
        Allocation(num_cached_tokens, num_new_tokens).
        """
        # TODO exercise 2
        raise NotImplementedError("exercise 2: allocate_with_prefix is not written yet (exercises/allocator.py)")

    # --- exercise 4 ---------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Release a request's blocks, last block first, and forget its block table.

        Each block: ref_cnt -= 1; one that reaches 0 joins the tail of the free queue. Keep
        its hash and tokens: a later request can still hit it until it is popped again.
        Why last first: the last block names the longest prefix and is the least likely to
        be shared, so it should be evicted first.
        """
        # TODO exercise 4
        raise NotImplementedError("exercise 4: free is not written yet (exercises/allocator.py)")
