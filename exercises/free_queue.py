"""
Exercise 3: the free queue, a doubly linked list with O(1) remove (stage 6).

The blocks carry their own links (KVCacheBlock.prev_free / next_free), so taking a block
out of the middle only rewires its two neighbours: no scan, whatever the queue's length.
Two sentinel blocks, self._head before the first free block and self._tail after the
last, mean no method needs a special case for an empty queue.

The constructor, len(), iteration and block_ids() come from exercises/given.py (the
constructor links the blocks in with *your* append). Write the four methods marked TODO,
using only the links: no Python list or deque, not even one kept beside the links (keeping
it in step means a list.remove, a scan of the whole queue, in every remove).

Finish line:
    EXERCISE_IMPL=starter python -m pytest tests/exercises/test_ex3_free_queue.py
is green: the design doc's free queue replays from Time 1 to Time 6
(7 8 9 4 3 2 6 5 1 0, then 6 5), each of the four operations takes as long in a queue of
100,000 blocks as in one of 100 (timed by the grader, outside your process), and remove()
reads a handful of links and compares no blocks. Exercise 4 then runs the allocator on your
queue.
"""

from exercises.given import KVCacheBlock, LinkedFreeQueue


class FreeKVCacheBlockQueue(LinkedFreeQueue):
    def append(self, block: KVCacheBlock) -> None:
        """Link `block` in at the tail, just before self._tail; count it in self.num_free_blocks."""
        # TODO exercise 3a: four links to set
        raise NotImplementedError("exercise 3a: FreeKVCacheBlockQueue.append is not written yet (exercises/free_queue.py)")

    def appendleft(self, block: KVCacheBlock) -> None:
        """Link `block` in at the head, just after self._head."""
        # TODO exercise 3b
        raise NotImplementedError("exercise 3b: FreeKVCacheBlockQueue.appendleft is not written yet (exercises/free_queue.py)")

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is, in O(1): its two neighbours point at each other.

        Set the block's own links back to None afterwards. A block whose links are None is
        not in the queue: raise ValueError for it.
        """
        # TODO exercise 3c
        raise NotImplementedError("exercise 3c: FreeKVCacheBlockQueue.remove is not written yet (exercises/free_queue.py)")

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the first free block; raise IndexError if the queue is empty."""
        # TODO exercise 3d
        raise NotImplementedError("exercise 3d: FreeKVCacheBlockQueue.popleft is not written yet (exercises/free_queue.py)")
