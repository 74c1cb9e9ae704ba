"""A correct exercise 3: each method spelled out, no shared helper."""

from exercises.given import LinkedFreeQueue


class FreeKVCacheBlockQueue(LinkedFreeQueue):
    def append(self, block):
        last = self._tail.prev_free
        last.next_free, block.prev_free, block.next_free, self._tail.prev_free = block, last, self._tail, block
        self.num_free_blocks += 1

    def appendleft(self, block):
        first = self._head.next_free
        self._head.next_free, block.prev_free, block.next_free, first.prev_free = block, self._head, first, block
        self.num_free_blocks += 1

    def remove(self, block):
        before, after = block.prev_free, block.next_free
        if before is None:
            raise ValueError("not in the free queue")
        before.next_free, after.prev_free = after, before
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self):
        if self.num_free_blocks == 0:
            raise IndexError("empty")
        block = self._head.next_free
        self.remove(block)
        return block
