"""A correct exercise 3, written into the starter from the lesson and the starter alone."""

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
