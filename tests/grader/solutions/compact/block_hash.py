"""A correct exercise 1: array('q') for the ids, each key's length before it."""

import hashlib
from array import array

NONE_HASH = hashlib.sha256(b"none").digest()


def _key(key) -> bytes:
    text = repr(tuple(key)) if isinstance(key, (tuple, list)) else "s" + str(key)
    data = text.encode()
    return len(data).to_bytes(4, "big") + data


def hash_block_tokens(parent_hash, token_ids, extra_keys=()):
    tokens = array("q", [int(t) for t in token_ids]).tobytes()
    data = (parent_hash or NONE_HASH) + len(tokens).to_bytes(4, "big") + tokens + b"".join(map(_key, extra_keys))
    return hashlib.sha256(data).digest()


def compute_block_hashes(token_ids, block_size, cache_salt=None, extra_keys=()):
    first = (*extra_keys, ("cache_salt", cache_salt)) if cache_salt is not None else tuple(extra_keys)
    out = []
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        out.append(hash_block_tokens(out[-1] if out else None, token_ids[i : i + block_size],
                                     first if i == 0 else tuple(extra_keys)))
    return out
