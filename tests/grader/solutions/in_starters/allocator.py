"""A correct exercises 2 and 4, written into the starter from the lesson and the starter alone."""

from typing import Sequence

from exercises.block_hash import BlockHash, compute_block_hashes
from exercises.given import Allocation, KVCacheBlock, OutOfBlocksError
from exercises.given import ListFreeQueue as FreeKVCacheBlockQueue  # exercise 4's tests use your own (exercise 3)


class PrefixCachingAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        # block hash -> the blocks holding that content, {block_id: block}, in the order they
        # were cached. Usually one; two when a request computed a block that was already
        # cached (the design doc's "duplicated blocks": a hit leaves one token to compute, so
        # a prompt that is all cached blocks computes its last block again). A lookup hits the
        # first of them; an evicted block leaves its entry, and an empty entry leaves the map.
        self.cached_blocks: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.block_tables: dict[str, list[int]] = {}

    # --- exercise 2 ---------------------------------------------------------------------

    def allocate_with_prefix(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> Allocation:
        """Give a new request its blocks, reusing the longest cached prefix.

        In this order (the design doc's "Block Allocation"; allocator/prefix_caching.py names the
        same five steps):
          1. lookup  Hash the prompt's full blocks. Walk them from block 0: block i hits while
                     its hash is in self.cached_blocks AND that block's token_ids equal the
                     prompt's tokens of block i (a cheap guard against collisions). Stop at
                     the first miss (break, not continue: block i + 1's K/V were computed
                     after block i's tokens, not after this prompt's). Hit at most
                     (len(token_ids) - 1) // block_size blocks: the model must compute at
                     least one token to produce logits.
          2. room    The prompt needs ceil(len / block_size) blocks; the hits cover some.
                     Hits whose ref_cnt is 0 sit in the free queue, so taking them uses up
                     free blocks too. Not enough free blocks: raise OutOfBlocksError before
                     changing anything.
          3. touch   Each hit: ref_cnt 0 means it is in the free queue, so remove it from
                     there; then ref_cnt += 1. Touch before taking new blocks: a pop must
                     never evict a block this request is about to reuse.
          4. take    Each new block comes from the head of the free queue. If it still holds
                     a hash, evict it: drop that hash from self.cached_blocks, set block_hash
                     None (its slots are about to hold other tokens). Its ref_cnt becomes 1.
          5. cache   Store each new block's tokens in block.token_ids. A full one gets its
                     block_hash and joins self.cached_blocks under it.
        Record the block table (hits first, then new blocks) and return
        Allocation(num_cached_tokens, num_new_tokens).
        """
        tokens = [int(t) for t in token_ids]
        bs = self.block_size
        num_needed = -(-len(tokens) // bs)
        hashes = compute_block_hashes(tokens, bs, cache_salt)

        # 1. lookup
        hits: list[KVCacheBlock] = []
        max_hits = (len(tokens) - 1) // bs
        for i, h in enumerate(hashes[:max_hits]):
            entry = self.cached_blocks.get(h)
            if not entry:
                break
            block = next(iter(entry.values()))
            if list(block.token_ids) != tokens[i * bs:(i + 1) * bs]:
                break
            hits.append(block)

        # 2. room
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        num_new = num_needed - len(hits)
        if num_new > len(self.free_queue) - free_hits:
            raise OutOfBlocksError(
                f"request {request_id!r} needs {num_new} new blocks, "
                f"{len(self.free_queue) - free_hits} free")

        # 3. touch
        for b in hits:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

        # 4. take
        new_blocks = []
        for _ in range(num_new):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            new_blocks.append(b)

        # 5. cache
        table = [b.block_id for b in hits]
        for i, b in enumerate(new_blocks, start=len(hits)):
            b.token_ids = tokens[i * bs:(i + 1) * bs]
            b.cache_salt = cache_salt
            if i < len(hashes):
                b.block_hash = hashes[i]
                self.cached_blocks.setdefault(hashes[i], {})[b.block_id] = b
            table.append(b.block_id)

        self.block_tables[request_id] = table
        num_cached = len(hits) * bs
        return Allocation(num_cached, len(tokens) - num_cached)

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a reused block's old hash from the cache map."""
        if block.block_hash is None:
            return
        entry = self.cached_blocks.get(block.block_hash)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached_blocks[block.block_hash]
        block.block_hash = None

    # --- exercise 4 ---------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Release a request's blocks, last block first, and forget its block table.

        Each block: ref_cnt -= 1; one that reaches 0 joins the tail of the free queue. Keep
        its hash and tokens: a later request can still hit it until it is popped again.
        Why last first: the last block names the longest prefix and is the least likely to
        be shared, so it should be evicted first.
        """
        table = self.block_tables.pop(request_id)
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
