"""
The allocator: vLLM v1's automatic prefix caching as bookkeeping, in one file read top to
bottom (prefix_caching.py here: block hashes, the free queue, PrefixCachingAllocator). Pure
Python, no torch; every other package of the course is built on it.

    from allocator import PrefixCachingAllocator

The front door at the top of the repository (`from prefix_caching import ...`) gives the same
names.
"""

from allocator.prefix_caching import (HASH_ALGOS, MAX_CACHE_SALT_LENGTH, NONE_HASH, Allocation, BlockHash,
                                      CacheStats, FreeKVCacheBlockQueue, KVCacheBlock, OutOfBlocksError,
                                      PrefixCachingAllocator, block_extra_keys, check_cache_salt, check_text,
                                      compute_block_hashes, hash_block_tokens, short_hash)

__all__ = ["HASH_ALGOS", "MAX_CACHE_SALT_LENGTH", "NONE_HASH", "Allocation", "BlockHash", "CacheStats",
           "FreeKVCacheBlockQueue", "KVCacheBlock", "OutOfBlocksError", "PrefixCachingAllocator", "block_extra_keys",
           "check_cache_salt", "check_text", "compute_block_hashes", "hash_block_tokens", "short_hash"]
