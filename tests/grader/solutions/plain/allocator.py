"""A correct exercises 2 and 4, step by step as the design doc names them."""

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

    def allocate_with_prefix(self, request_id, token_ids, cache_salt=None):
        size = self.block_size
        hashes = compute_block_hashes(token_ids, size, cache_salt)
        hits = []
        for i, block_hash in enumerate(hashes[: (len(token_ids) - 1) // size]):
            holders = self.cached_blocks.get(block_hash)
            block = next(iter(holders.values())) if holders else None
            if block is None or block.token_ids != list(token_ids[i * size : (i + 1) * size]):
                break
            hits.append(block)
        num_needed = -(-len(token_ids) // size)
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed - len(hits) + num_free_hits > len(self.free_queue):
            raise OutOfBlocksError(f"{request_id} does not fit")
        for block in hits:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
        table = [b.block_id for b in hits]
        for i in range(len(hits), num_needed):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                holders = self.cached_blocks[block.block_hash]
                del holders[block.block_id]
                if not holders:
                    del self.cached_blocks[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            block.token_ids = list(token_ids[i * size : (i + 1) * size])
            if i < len(hashes):
                block.block_hash = hashes[i]
                self.cached_blocks.setdefault(hashes[i], {})[block.block_id] = block
            table.append(block.block_id)
        self.block_tables[request_id] = table
        return Allocation(len(hits) * size, len(token_ids) - len(hits) * size)

    def free(self, request_id):
        for block_id in reversed(self.block_tables.pop(request_id)):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
