"""A correct exercise 3: one link() helper joins two neighbours."""

from exercises.given import LinkedFreeQueue


def link(left, right):
    left.next_free, right.prev_free = right, left


class FreeKVCacheBlockQueue(LinkedFreeQueue):
    def append(self, block):
        before = self._tail.prev_free
        link(before, block)
        link(block, self._tail)
        self.num_free_blocks += 1

    def appendleft(self, block):
        after = self._head.next_free
        link(self._head, block)
        link(block, after)
        self.num_free_blocks += 1

    def remove(self, block):
        if block.next_free is None:
            raise ValueError(f"block {block.block_id} is in use")
        link(block.prev_free, block.next_free)
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self):
        first = self._head.next_free
        if first is self._tail:
            raise IndexError("no free block")
        self.remove(first)
        return first
