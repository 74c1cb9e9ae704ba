"""A correct exercise 1, written into the starter from the lesson and the starter alone."""

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
    have 50,000 to 260,000 ids. It is an integer, whatever its type: ids that come as numpy
    integers (a list of numpy.int64, a numpy array) hash like the same Python ints.
    Never use Python's hash(): it changes from one process to the next for text, and squeezes
    the token ids into 64 bits.

    >>> len(hash_block_tokens(None, [1, 2, 3, 4]))
    32
    """
    h = hashlib.sha256()
    h.update(NONE_HASH if parent_hash is None else bytes(parent_hash))
    tokens = [int(t) for t in token_ids]
    h.update(len(tokens).to_bytes(8, "big"))
    for t in tokens:
        h.update(t.to_bytes(8, "big", signed=True))
    h.update(_encode(tuple(extra_keys)))
    return h.digest()


def _encode(value) -> bytes:
    """Type-tagged, length-prefixed bytes of a (nested) extra key."""
    if isinstance(value, (tuple, list)):
        parts = [_encode(v) for v in value]
        body = b"".join(parts)
        return b"T" + len(parts).to_bytes(8, "big") + len(body).to_bytes(8, "big") + body
    if isinstance(value, str):
        data = value.encode("utf-8")
        return b"S" + len(data).to_bytes(8, "big") + data
    if isinstance(value, bytes):
        return b"B" + len(value).to_bytes(8, "big") + value
    if isinstance(value, bool):
        return b"O" + (b"\x01" if value else b"\x00")
    if value is None:
        return b"N"
    if isinstance(value, int) or hasattr(value, "__index__"):
        data = str(int(value)).encode()
        return b"I" + len(data).to_bytes(8, "big") + data
    data = repr(value).encode("utf-8")
    return b"R" + len(data).to_bytes(8, "big") + data


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
    hashes: list[BlockHash] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        keys = tuple(extra_keys)
        if i == 0 and cache_salt is not None:
            keys = keys + (("cache_salt", cache_salt),)
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], keys)
        hashes.append(parent)
    return hashes
