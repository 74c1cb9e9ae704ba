"""
Exercise 1: the chained block hash (stage 4).

Write the two functions below. The reference is `allocator/prefix_caching.py`, section 1; try
without reading it first.

Finish line:
    EXERCISE_IMPL=starter python -m pytest tests/exercises/test_ex1_block_hash.py
is green: your hashes are SHA-256 digests (32 bytes), the same in every process whatever
was hashed before, chained to the whole of their parent's hash, change with any token (of a
real vocabulary: ids up to 262,143) or extra key, exist only for full blocks, and add the
cache_salt to block 0's extra keys, tagged, in block 0 only.
"""

import hashlib
from typing import Sequence

BlockHash = bytes

# The parent of the first block. A constant, so the chain starts the same in every process.
NONE_HASH: BlockHash = hashlib.sha256(b"exercise/none-hash").digest()


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """SHA256 of (parent hash, token ids, extra keys) -> 32 bytes.

    `parent_hash` None means "first block": use NONE_HASH instead.
    Extra keys are strings (a LoRA name) and, in block 0 of a salted prompt, the pair
    ("cache_salt", salt) (see compute_block_hashes).

    Turn the three parts into bytes such that no two different inputs give the same bytes:
    [1, 23] and [12, 3] must differ, and so must extra keys ("a", "b"), ("ab",), ("a,b",)
    and ("b", "a"), whatever separator you pick. A token id is not a byte: real vocabularies
    have 50,000 to 260,000 ids, and the tests send ids of up to 8 bytes. It is an integer,
    whatever its type: ids that come as numpy integers (a list of numpy.int64, a numpy array)
    hash like the same Python ints.
    Never use Python's hash(): it changes from one process to the next for text, and squeezes
    the token ids into 64 bits.

    >>> len(hash_block_tokens(None, [1, 2, 3, 4]))
    32
    """
    # TODO exercise 1a
    raise NotImplementedError("exercise 1a: hash_block_tokens is not written yet (exercises/block_hash.py)")


def compute_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, extra_keys: tuple = ()
) -> list[BlockHash]:
    """Chained hashes of every *full* block of `token_ids`; a partial tail gets none.

    Block i's parent is block i-1's hash (None for block 0). Every block gets `extra_keys`;
    block 0 alone gets extra_keys + (("cache_salt", cache_salt),) when a salt is given:
    every later hash is chained to block 0, so one salted block separates whole prompts. The
    tag keeps a salt from hashing like an extra key of the same text (a tenant called
    "lora-1" must not share blocks with the adapter "lora-1"); allocator/prefix_caching.py's
    block_extra_keys does the same.

    >>> len(compute_block_hashes(list(range(10)), block_size=4))   # 2 full blocks, 2 tokens left over
    2
    """
    # TODO exercise 1b
    raise NotImplementedError("exercise 1b: compute_block_hashes is not written yet (exercises/block_hash.py)")
