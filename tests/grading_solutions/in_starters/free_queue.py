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
(7 8 9 4 3 2 6 5 1 0, then 6 5), and remove() reads a handful of links and compares no
blocks, even in a queue of 10,000. Exercise 4 then runs the allocator on your queue.
"""

from exercises.given import KVCacheBlock, LinkedFreeQueue


class FreeKVCacheBlockQueue(LinkedFreeQueue):
    def _link_between(self, block: KVCacheBlock, before: KVCacheBlock, after: KVCacheBlock) -> None:
        block.prev_free = before
        block.next_free = after
        before.next_free = block
        after.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Link `block` in at the tail, just before self._tail; count it in self.num_free_blocks."""
        self._link_between(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Link `block` in at the head, just after self._head."""
        self._link_between(block, self._head, self._head.next_free)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is, in O(1): its two neighbours point at each other.

        Set the block's own links back to None afterwards. A block whose links are None is
        not in the queue: raise ValueError for it.
        """
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the first free block; raise IndexError if the queue is empty."""
        if self.num_free_blocks == 0:
            raise IndexError("the free queue is empty")
        block = self._head.next_free
        self.remove(block)
        return block
