"""A correct exercises 2 and 4: the lookup and the eviction as helpers."""

from exercises.block_hash import compute_block_hashes
from exercises.given import Allocation, KVCacheBlock, OutOfBlocksError
from exercises.given import ListFreeQueue as FreeKVCacheBlockQueue


class PrefixCachingAllocator:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_blocks = {}
        self.block_tables = {}

    def _lookup(self, tokens, hashes):
        bs, hits = self.block_size, []
        for i, h in enumerate(hashes[: (len(tokens) - 1) // bs]):
            found = list(self.cached_blocks.get(h, {}).values())
            if not found or found[0].token_ids != tokens[i * bs : (i + 1) * bs]:
                return hits
            hits.append(found[0])
        return hits

    def _take(self):
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            self.cached_blocks[block.block_hash].pop(block.block_id)
            if not self.cached_blocks[block.block_hash]:
                del self.cached_blocks[block.block_hash]
        block.block_hash, block.token_ids, block.ref_cnt = None, [], 1
        return block

    def allocate_with_prefix(self, request_id, token_ids, cache_salt=None):
        tokens, bs = list(token_ids), self.block_size
        hashes = compute_block_hashes(tokens, bs, cache_salt)
        hits = self._lookup(tokens, hashes)
        needed = (len(tokens) + bs - 1) // bs
        if needed - len(hits) + len([b for b in hits if not b.ref_cnt]) > len(self.free_queue):
            raise OutOfBlocksError(request_id)
        for block in hits:
            if not block.ref_cnt:
                self.free_queue.remove(block)
            block.ref_cnt += 1
        new = [self._take() for _ in range(needed - len(hits))]
        for i, block in enumerate(new, start=len(hits)):
            block.token_ids = tokens[i * bs : (i + 1) * bs]
            if i < len(hashes):
                block.block_hash = hashes[i]
                self.cached_blocks.setdefault(hashes[i], {})[block.block_id] = block
        self.block_tables[request_id] = [b.block_id for b in hits + new]
        return Allocation(len(hits) * bs, len(tokens) - len(hits) * bs)

    def free(self, request_id):
        table = self.block_tables.pop(request_id)
        for block in (self.blocks[i] for i in table[::-1]):
            block.ref_cnt -= 1
            if not block.ref_cnt:
                self.free_queue.append(block)
