"""Exercise 1: the chained block hash (exercises/block_hash.py)."""

import os
import subprocess
import sys

from grading import exercise, module_name

impl = exercise("block_hash")
BLOCK = [1, 2, 3, 4]


def test_a_hash_is_bytes_and_the_same_every_time():
    first = impl.hash_block_tokens(None, BLOCK)
    assert isinstance(first, bytes) and len(first) >= 16
    assert impl.hash_block_tokens(None, list(BLOCK)) == first


def test_every_token_counts():
    assert impl.hash_block_tokens(None, [1, 2, 3, 4]) != impl.hash_block_tokens(None, [1, 2, 3, 5])
    assert impl.hash_block_tokens(None, [1, 2, 3, 4]) != impl.hash_block_tokens(None, [4, 3, 2, 1])


def test_the_parent_counts():
    parent_a = impl.hash_block_tokens(None, [9, 9, 9, 9])
    parent_b = impl.hash_block_tokens(None, [8, 8, 8, 8])
    assert impl.hash_block_tokens(parent_a, BLOCK) != impl.hash_block_tokens(parent_b, BLOCK)
    assert impl.hash_block_tokens(parent_a, BLOCK) != impl.hash_block_tokens(None, BLOCK)


def test_extra_keys_count():
    assert impl.hash_block_tokens(None, BLOCK, ("lora-1",)) != impl.hash_block_tokens(None, BLOCK)
    assert impl.hash_block_tokens(None, BLOCK, ("lora-1",)) != impl.hash_block_tokens(None, BLOCK, ("lora-2",))


def test_the_encoding_is_unambiguous():
    assert impl.hash_block_tokens(None, [1, 23]) != impl.hash_block_tokens(None, [12, 3]), (
        "[1, 23] and [12, 3] hash alike: separate the token ids in your encoding"
    )
    assert impl.hash_block_tokens(None, [1], ("a", "b")) != impl.hash_block_tokens(None, [1], ("ab",)), (
        "extra keys ('a', 'b') and ('ab',) hash alike: separate the keys in your encoding"
    )


def test_hashes_are_the_same_in_every_process():
    code = f"import {module_name('block_hash')} as m; print(m.compute_block_hashes(list(range(8)), 4)[1].hex())"
    outputs = []
    for seed in ("1", "2"):  # Python's own hash() would differ between these two processes
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert result.returncode == 0, result.stderr[-500:]
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1], "the hash changes between processes: do not use Python's hash()"


def test_only_full_blocks_get_a_hash():
    assert len(impl.compute_block_hashes(list(range(10)), 4)) == 2
    assert len(impl.compute_block_hashes(list(range(8)), 4)) == 2
    assert impl.compute_block_hashes([1, 2, 3], 4) == []


def test_each_hash_is_chained_to_the_one_before():
    tokens = list(range(12))
    hashes = impl.compute_block_hashes(tokens, 4)
    assert hashes[0] == impl.hash_block_tokens(None, tokens[0:4])
    assert hashes[1] == impl.hash_block_tokens(hashes[0], tokens[4:8])
    assert hashes[2] == impl.hash_block_tokens(hashes[1], tokens[8:12])


def test_the_same_block_at_another_position_is_another_block():
    a = impl.compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = impl.compute_block_hashes([5, 6, 7, 8, 1, 2, 3, 4], 4)
    assert a[1] != b[0] and a[0] != b[1]


def test_extra_keys_enter_every_block():
    tokens = list(range(8))
    plain = impl.compute_block_hashes(tokens, 4)
    lora = impl.compute_block_hashes(tokens, 4, extra_keys=("lora-1",))
    assert lora[0] == impl.hash_block_tokens(None, tokens[:4], ("lora-1",))
    assert lora[1] == impl.hash_block_tokens(lora[0], tokens[4:], ("lora-1",))
    assert plain[1] != lora[1]


def test_cache_salt_enters_block_0_only():
    tokens = list(range(8))
    plain = impl.compute_block_hashes(tokens, 4)
    salted = impl.compute_block_hashes(tokens, 4, cache_salt="tenant-a")
    assert salted[0] != plain[0], "the salt must change block 0's hash"
    assert salted[1] == impl.hash_block_tokens(salted[0], tokens[4:]), "block 1 must not carry the salt itself"
    assert salted[1] != plain[1], "block 1 differs from the unsalted one through the chain"
    assert impl.compute_block_hashes(tokens, 4, cache_salt="tenant-b")[0] != salted[0]
