"""
Exercise 2: the free queue, a doubly linked list with O(1) remove (stage 6).

The blocks carry their own links (KVCacheBlock.prev_free / next_free), so taking a block
out of the middle only rewires its two neighbours: no scan, whatever the queue's length.
Two sentinel blocks, self._head before the first free block and self._tail after the
last, mean no method needs a special case for an empty queue.

The constructor, len(), iteration and block_ids() come from prefix_caching's queue (the
constructor links the blocks in with *your* append). Write the four methods marked TODO,
using only the links: no Python list, no deque.

Finish line:
    EXERCISE_IMPL=starter python -m pytest tests/exercises/test_ex2_free_queue.py
is green: the design doc's free queue replays from Time 1 to Time 6
(7 8 9 4 3 2 6 5 1 0, then 6 5), and remove() reads a handful of links even in a queue
of 10,000 blocks.
"""

import prefix_caching
from prefix_caching import KVCacheBlock


class FreeKVCacheBlockQueue(prefix_caching.FreeKVCacheBlockQueue):
    def append(self, block: KVCacheBlock) -> None:
        """Link `block` in at the tail, just before self._tail; count it in self.num_free_blocks."""
        # TODO exercise 2a: four links to set
        raise NotImplementedError("exercise 2a: FreeKVCacheBlockQueue.append is not written yet (exercises/free_queue.py)")

    def appendleft(self, block: KVCacheBlock) -> None:
        """Link `block` in at the head, just after self._head."""
        # TODO exercise 2b
        raise NotImplementedError("exercise 2b: FreeKVCacheBlockQueue.appendleft is not written yet (exercises/free_queue.py)")

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is, in O(1): its two neighbours point at each other.

        Set the block's own links back to None afterwards. A block whose links are None is
        not in the queue: raise ValueError for it.
        """
        # TODO exercise 2c
        raise NotImplementedError("exercise 2c: FreeKVCacheBlockQueue.remove is not written yet (exercises/free_queue.py)")

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the first free block; raise IndexError if the queue is empty."""
        # TODO exercise 2d
        raise NotImplementedError("exercise 2d: FreeKVCacheBlockQueue.popleft is not written yet (exercises/free_queue.py)")
