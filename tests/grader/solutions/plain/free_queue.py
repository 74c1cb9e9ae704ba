"""A correct exercise 3: every operation rewires the block and its two neighbours."""

from exercises.given import KVCacheBlock, LinkedFreeQueue


class FreeKVCacheBlockQueue(LinkedFreeQueue):
    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block):
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block):
        self._insert_after(self._head, block)

    def remove(self, block):
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not free")
        block.prev_free.next_free, block.next_free.prev_free = block.next_free, block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self):
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("the free queue is empty")
        self.remove(block)
        return block
