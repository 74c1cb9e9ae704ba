"""A correct exercise 1: fixed-width token ids, JSON extra keys, each part length-prefixed."""

import hashlib
import json

NONE_HASH = hashlib.sha256(b"exercise/none-hash").digest()


def hash_block_tokens(parent_hash, token_ids, extra_keys=()):
    parent = NONE_HASH if parent_hash is None else parent_hash
    tokens = b"".join(int(t).to_bytes(8, "little") for t in token_ids)
    keys = json.dumps(list(extra_keys)).encode()
    return hashlib.sha256(parent + len(tokens).to_bytes(4, "little") + tokens + keys).digest()


def compute_block_hashes(token_ids, block_size, cache_salt=None, extra_keys=()):
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        keys = tuple(extra_keys) + ((("cache_salt", cache_salt),) if i == 0 and cache_salt is not None else ())
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], keys)
        hashes.append(parent)
    return hashes
