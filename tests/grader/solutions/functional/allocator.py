"""A correct exercises 2 and 4: module functions over the allocator's state, the lookup a takewhile."""

from itertools import takewhile

from exercises.block_hash import compute_block_hashes
from exercises.given import Allocation, KVCacheBlock, OutOfBlocksError
from exercises.given import ListFreeQueue as FreeKVCacheBlockQueue


def chunks(tokens, size):
    return [tokens[start : start + size] for start in range(0, len(tokens), size)]


def first_holder(cached, block_hash):
    holders = cached.get(block_hash)
    return next(iter(holders.values())) if holders else None


def longest_hit(cached, pieces, hashes, most):
    pairs = ((first_holder(cached, h), piece) for h, piece in zip(hashes[:most], pieces))
    return [block for block, _ in takewhile(lambda pair: pair[0] is not None and pair[0].token_ids == pair[1], pairs)]


def forget(cached, block):
    holders = cached[block.block_hash]
    holders.pop(block.block_id)
    if not holders:
        cached.pop(block.block_hash)


def claim(state, piece, block_hash):
    block = state.free_queue.popleft()
    if block.block_hash is not None:
        forget(state.cached_blocks, block)
    block.ref_cnt, block.token_ids, block.block_hash = 1, piece, block_hash
    if block_hash is not None:
        state.cached_blocks.setdefault(block_hash, {})[block.block_id] = block
    return block


def share(state, block):
    if block.ref_cnt == 0:
        state.free_queue.remove(block)
    block.ref_cnt += 1
    return block


class PrefixCachingAllocator:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_blocks = {}
        self.block_tables = {}

    def allocate_with_prefix(self, request_id, token_ids, cache_salt=None):
        tokens = [int(t) for t in token_ids]
        pieces = chunks(tokens, self.block_size)
        hashes = compute_block_hashes(tokens, self.block_size, cache_salt)
        hits = longest_hit(self.cached_blocks, pieces, hashes, (len(tokens) - 1) // self.block_size)
        fresh_needed = len(pieces) - len(hits) + sum(block.ref_cnt == 0 for block in hits)
        if fresh_needed > len(self.free_queue):
            raise OutOfBlocksError(f"{request_id} needs {fresh_needed} free blocks")
        shared = [share(self, block) for block in hits]
        new = [claim(self, pieces[i], hashes[i] if i < len(hashes) else None) for i in range(len(hits), len(pieces))]
        self.block_tables[request_id] = [block.block_id for block in shared + new]
        cached = len(hits) * self.block_size
        return Allocation(cached, len(tokens) - cached)

    def free(self, request_id):
        released = [self.blocks[i] for i in reversed(self.block_tables.pop(request_id))]
        for block in released:
            block.ref_cnt -= 1
        for block in filter(lambda b: b.ref_cnt == 0, released):
            self.free_queue.append(block)
