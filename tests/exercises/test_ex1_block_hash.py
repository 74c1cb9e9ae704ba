"""Exercise 1: the chained block hash (exercises/block_hash.py). Needs no other exercise."""

import builtins
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grading import exercise, module_name

impl = exercise("block_hash")
GRADED = ["hash_block_tokens", "compute_block_hashes"]  # what exercise 1 writes
BLOCK = [1, 2, 3, 4]


# Hashes are 32-byte blobs that say nothing on screen: these two fail with the rule alone.
def assert_differ(a: bytes, b: bytes, rule: str) -> None:
    if a == b:
        pytest.fail(rule, pytrace=False)


def assert_same(a: bytes, b: bytes, rule: str) -> None:
    if a != b:
        pytest.fail(rule, pytrace=False)


def test_a_hash_is_bytes_and_the_same_every_time():
    first = impl.hash_block_tokens(None, BLOCK)
    assert isinstance(first, bytes) and len(first) >= 16, (
        f"a block hash is a digest of 16 bytes or more, got {first!r:.80}"
    )
    assert_same(impl.hash_block_tokens(None, list(BLOCK)), first, "the same block must get the same hash every time")


def test_every_token_counts():
    assert_differ(impl.hash_block_tokens(None, [1, 2, 3, 4]), impl.hash_block_tokens(None, [1, 2, 3, 5]),
                  "[1, 2, 3, 4] and [1, 2, 3, 5] hash alike: every token id must enter the hash")
    assert_differ(impl.hash_block_tokens(None, [1, 2, 3, 4]), impl.hash_block_tokens(None, [4, 3, 2, 1]),
                  "[1, 2, 3, 4] and [4, 3, 2, 1] hash alike: the order of the tokens must enter the hash")


# Real vocabularies are large: SmolLM2 has 49,152 token ids, Llama 3 128,256, Gemma 3 262,144.
# A hash that takes each id as one byte works on ids below 256 and nowhere else.
@pytest.mark.parametrize("token_ids, other", [
    ([49_151, 128_255, 262_143, 256], [49_151, 128_255, 262_143, 257]),
    ([256, 1, 2, 3], [0, 1, 2, 3]),  # 256 must not wrap round to 0
    ([65_543, 1, 2, 3], [7, 1, 2, 3]),  # nor 65,543 to 7 (two bytes are not enough either)
], ids=["large ids", "256 vs 0", "65543 vs 7"])
def test_token_ids_of_a_real_vocabulary_hash_and_stay_apart(token_ids, other):
    try:
        a, b = impl.hash_block_tokens(None, token_ids), impl.hash_block_tokens(None, other)
    except (ValueError, OverflowError) as err:
        pytest.fail(f"hashing token ids {token_ids} failed ({type(err).__name__}: {err}): a token id is not a "
                    "byte; give each id 8 bytes (array('q', token_ids).tobytes(), or int.to_bytes(8, ...))")
    assert_differ(a, b, f"{token_ids} and {other} hash alike: each token id must keep all its bits in the encoding")


def test_the_parent_counts():
    parent_a = impl.hash_block_tokens(None, [9, 9, 9, 9])
    parent_b = impl.hash_block_tokens(None, [8, 8, 8, 8])
    assert_differ(impl.hash_block_tokens(parent_a, BLOCK), impl.hash_block_tokens(parent_b, BLOCK),
                  "the same tokens under two different parents hash alike: the parent hash must enter the hash")
    assert_differ(impl.hash_block_tokens(parent_a, BLOCK), impl.hash_block_tokens(None, BLOCK),
                  "a block with a parent hashes like a first block: the parent hash must enter the hash")


def test_extra_keys_count():
    assert_differ(impl.hash_block_tokens(None, BLOCK, ("lora-1",)), impl.hash_block_tokens(None, BLOCK),
                  "a block with extra key 'lora-1' hashes like one without: the extra keys must enter the hash")
    assert_differ(impl.hash_block_tokens(None, BLOCK, ("lora-1",)), impl.hash_block_tokens(None, BLOCK, ("lora-2",)),
                  "extra keys 'lora-1' and 'lora-2' hash alike: each key's text must enter the hash")


def test_the_encoding_is_unambiguous():
    assert_differ(impl.hash_block_tokens(None, [1, 23]), impl.hash_block_tokens(None, [12, 3]),
                  "[1, 23] and [12, 3] hash alike: separate the token ids in your encoding")
    assert_differ(impl.hash_block_tokens(None, [1], ("a", "b")), impl.hash_block_tokens(None, [1], ("ab",)),
                  "extra keys ('a', 'b') and ('ab',) hash alike: separate the keys in your encoding")


def test_extra_keys_keep_their_order_and_their_bounds():
    def h(*keys):
        return impl.hash_block_tokens(None, [1], keys)

    assert_differ(h("a", "b"), h("b", "a"),
                  "extra keys ('a', 'b') and ('b', 'a') hash alike: keep the keys in their order (a tuple, not a set)")
    assert_differ(h("a,b"), h("a", "b"),
                  "extra keys ('a,b',) and ('a', 'b') hash alike: a separator that can occur inside a key separates "
                  "nothing. Encode the keys so none can be read two ways (json.dumps, or each key's length before it)")


def test_python_hash_is_never_used(monkeypatch):
    def forbidden(obj):
        pytest.fail("hashing called Python's hash(): it squeezes the token ids into 64 bits, so two blocks can "
                    "share a name, and for text it changes from one process to the next. Hash an unambiguous "
                    "encoding of the parent, the token ids and the keys with SHA256", pytrace=False)

    with monkeypatch.context() as patched:  # only around the calls: pytest itself hashes
        patched.setattr(builtins, "hash", forbidden)
        impl.hash_block_tokens(None, BLOCK, ("lora-1",))
        impl.compute_block_hashes(list(range(8)), 4, cache_salt="tenant-a", extra_keys=("lora-1",))


def test_hashes_are_the_same_in_every_process():
    code = f"import {module_name('block_hash')} as m; print(m.compute_block_hashes(list(range(8)), 4)[1].hex())"
    outputs = []
    for seed in ("1", "2"):  # Python's own hash() would differ between these two processes
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert result.returncode == 0, f"compute_block_hashes failed in a fresh process:\n{result.stderr[-500:]}"
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1], "the hash changes between processes: do not use Python's hash()"


def test_only_full_blocks_get_a_hash():
    for length, expected in ((10, 2), (8, 2), (3, 0)):
        got = len(impl.compute_block_hashes(list(range(length)), 4))
        assert got == expected, (
            f"{length} tokens in blocks of 4 got {got} hashes, not {expected}: only full blocks get one"
        )


def test_each_hash_is_chained_to_the_one_before():
    tokens = list(range(12))
    hashes = impl.compute_block_hashes(tokens, 4)
    assert_same(hashes[0], impl.hash_block_tokens(None, tokens[0:4]),
                "block 0's hash must be hash_block_tokens(None, its 4 tokens)")
    for i in (1, 2):
        assert_same(hashes[i], impl.hash_block_tokens(hashes[i - 1], tokens[4 * i : 4 * i + 4]),
                    f"block {i}'s hash must be hash_block_tokens(block {i - 1}'s hash, its own 4 tokens): the "
                    "parent is the hash of the block just before, not None and not block 0's")


def test_the_same_block_at_another_position_is_another_block():
    a = impl.compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = impl.compute_block_hashes([5, 6, 7, 8, 1, 2, 3, 4], 4)
    rule = ("the same 4 tokens got the same hash in block 0 and in block 1: a block's hash must depend on every "
            "token before it, through its parent")
    assert_differ(a[1], b[0], rule)
    assert_differ(a[0], b[1], rule)


def test_extra_keys_enter_every_block():
    tokens = list(range(8))
    plain = impl.compute_block_hashes(tokens, 4)
    lora = impl.compute_block_hashes(tokens, 4, extra_keys=("lora-1",))
    assert_same(lora[0], impl.hash_block_tokens(None, tokens[:4], ("lora-1",)), "block 0 must carry the extra keys")
    assert_same(lora[1], impl.hash_block_tokens(lora[0], tokens[4:], ("lora-1",)),
                "block 1 must carry the extra keys too: a LoRA adapter changes the K/V of every block")
    assert_differ(plain[1], lora[1], "block 1 with extra key 'lora-1' hashes like block 1 without")


def test_cache_salt_enters_block_0_only():
    tokens = list(range(8))
    plain = impl.compute_block_hashes(tokens, 4)
    salted = impl.compute_block_hashes(tokens, 4, cache_salt="tenant-a")
    assert_differ(salted[0], plain[0], "the salt must change block 0's hash")
    assert_same(salted[1], impl.hash_block_tokens(salted[0], tokens[4:]), "block 1 must not carry the salt itself")
    assert_differ(salted[1], plain[1], "block 1 differs from the unsalted one through the chain")
    assert_differ(impl.compute_block_hashes(tokens, 4, cache_salt="tenant-b")[0], salted[0],
                  "tenants 'tenant-a' and 'tenant-b' share block 0: the salt's text must enter the hash")


def test_a_cache_salt_joins_the_extra_keys_of_block_0_and_does_not_replace_them():
    tokens = list(range(8))
    lora_1 = impl.compute_block_hashes(tokens, 4, cache_salt="tenant-a", extra_keys=("lora-1",))
    lora_2 = impl.compute_block_hashes(tokens, 4, cache_salt="tenant-a", extra_keys=("lora-2",))
    assert_differ(lora_1[0], lora_2[0],
                  "with a cache_salt, block 0 hashes alike under LoRA adapters 'lora-1' and 'lora-2': the salt "
                  "replaced the extra keys, so one tenant's two adapters share block 0 although its K/V differ. "
                  "Block 0's keys are extra_keys + (cache_salt,)")
    unsalted = impl.compute_block_hashes(tokens, 4, extra_keys=("lora-1",))
    assert_differ(lora_1[0], unsalted[0], "with extra keys, the salt must still change block 0's hash")


def test_a_salt_is_never_mistaken_for_an_extra_key_of_the_same_text():
    tokens = list(range(8))
    salted = impl.compute_block_hashes(tokens, 4, cache_salt="lora-1")
    keyed = impl.compute_block_hashes(tokens, 4, extra_keys=("lora-1",))
    assert_differ(salted[0], keyed[0],
                  "cache_salt 'lora-1' and extra key 'lora-1' give block 0 the same hash: a tenant named after an "
                  "adapter would share its blocks. Tag the salt: block 0's keys are "
                  "extra_keys + (('cache_salt', cache_salt),)")
