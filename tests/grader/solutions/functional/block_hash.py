"""A correct exercise 1: one JSON document per block, hashed with an updating sha256."""

import hashlib
import json

NONE_HASH = b"\0" * 32


def hash_block_tokens(parent_hash, token_ids, extra_keys=()):
    digest = hashlib.sha256(parent_hash if parent_hash is not None else NONE_HASH)
    digest.update(json.dumps([[int(t) for t in token_ids], list(extra_keys)]).encode())
    return digest.digest()


def compute_block_hashes(token_ids, block_size, cache_salt=None, extra_keys=()):
    def keys(i):
        return (*extra_keys, ("cache_salt", cache_salt)) if i == 0 and cache_salt is not None else tuple(extra_keys)

    blocks = [token_ids[i : i + block_size] for i in range(0, len(token_ids) // block_size * block_size, block_size)]
    hashes = []
    for i, block in enumerate(blocks):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, block, keys(i)))
    return hashes
