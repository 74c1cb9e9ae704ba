"""Exercise 1: the chained block hash (exercises/block_hash.py). Needs no other exercise.

The encoding a block's hash digests is the student's choice (any unambiguous one will do), so
these tests compare hashes with each other, never with the reference's: each is a SHA-256
digest (32 bytes); equal inputs, equal hashes; different inputs, different hashes; chained
to the whole parent hash; the same in every process, whatever was hashed before. Token ids
and prompt lengths are drawn anew each run (grading.SEED).
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grading import Child, GRADING, RemoteBlockHash, drawn

EXERCISE = "block_hash"
BLOCK = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def impl(child):
    return RemoteBlockHash(child)


# Hashes are 32-byte blobs that say nothing on screen: these two fail with the rule alone.
def assert_differ(a: bytes, b: bytes, rule: str) -> None:
    if a == b:
        pytest.fail(rule, pytrace=False)


def assert_same(a: bytes, b: bytes, rule: str) -> None:
    if a != b:
        pytest.fail(rule, pytrace=False)


def test_a_hash_is_bytes_and_the_same_every_time(impl):
    first = impl.hash_block_tokens(None, BLOCK)
    assert isinstance(first, bytes) and len(first) >= 16, (
        f"a block hash is a digest of 16 bytes or more, got {first!r:.80}"
    )
    assert_same(impl.hash_block_tokens(None, list(BLOCK)), first, "the same block must get the same hash every time")


def test_every_token_counts(impl):
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
def test_token_ids_of_a_real_vocabulary_hash_and_stay_apart(impl, token_ids, other):
    try:
        a, b = impl.hash_block_tokens(None, token_ids), impl.hash_block_tokens(None, other)
    except (ValueError, OverflowError) as err:
        pytest.fail(f"hashing token ids {token_ids} failed ({type(err).__name__}: {err}): a token id is not a "
                    "byte; give each id 8 bytes (array('q', token_ids).tobytes(), or int.to_bytes(8, ...))")
    assert_differ(a, b, f"{token_ids} and {other} hash alike: each token id must keep all its bits in the encoding")


def test_the_parent_counts(impl):
    parent_a = impl.hash_block_tokens(None, [9, 9, 9, 9])
    parent_b = impl.hash_block_tokens(None, [8, 8, 8, 8])
    assert_differ(impl.hash_block_tokens(parent_a, BLOCK), impl.hash_block_tokens(parent_b, BLOCK),
                  "the same tokens under two different parents hash alike: the parent hash must enter the hash")
    assert_differ(impl.hash_block_tokens(parent_a, BLOCK), impl.hash_block_tokens(None, BLOCK),
                  "a block with a parent hashes like a first block: the parent hash must enter the hash")


def test_extra_keys_count(impl):
    assert_differ(impl.hash_block_tokens(None, BLOCK, ("lora-1",)), impl.hash_block_tokens(None, BLOCK),
                  "a block with extra key 'lora-1' hashes like one without: the extra keys must enter the hash")
    assert_differ(impl.hash_block_tokens(None, BLOCK, ("lora-1",)), impl.hash_block_tokens(None, BLOCK, ("lora-2",)),
                  "extra keys 'lora-1' and 'lora-2' hash alike: each key's text must enter the hash")


def test_the_encoding_is_unambiguous(impl):
    assert_differ(impl.hash_block_tokens(None, [1, 23]), impl.hash_block_tokens(None, [12, 3]),
                  "[1, 23] and [12, 3] hash alike: separate the token ids in your encoding")
    assert_differ(impl.hash_block_tokens(None, [1, 2]), impl.hash_block_tokens(None, [1], ("2",)),
                  "tokens [1, 2] and tokens [1] with extra key '2' hash alike: keep the tokens apart from the keys")
    assert_differ(impl.hash_block_tokens(None, [1], ("a", "b")), impl.hash_block_tokens(None, [1], ("ab",)),
                  "extra keys ('a', 'b') and ('ab',) hash alike: separate the keys in your encoding")


def test_extra_keys_keep_their_order(impl):
    assert_differ(impl.hash_block_tokens(None, [1], ("a", "b")), impl.hash_block_tokens(None, [1], ("b", "a")),
                  "extra keys ('a', 'b') and ('b', 'a') hash alike: keep the keys in their order (a tuple, not a set)")


@pytest.mark.parametrize("separator", [",", "|", ":", " ", ";", "\\", "\n", "\x00", "-"], ids=repr)
def test_no_separator_inside_a_key_can_split_it(impl, separator):
    joined, split = (f"a{separator}b",), ("a", "b")
    assert_differ(impl.hash_block_tokens(None, [1], joined), impl.hash_block_tokens(None, [1], split),
                  f"extra keys {joined} and {split} hash alike: a separator that can occur inside a key separates "
                  "nothing. Encode the keys so none can be read two ways (json.dumps, or each key's length before it)")


@pytest.mark.parametrize("kind", ["numpy ints", "int64", "int32"])
def test_numpy_token_ids_hash_like_python_ints(impl, kind):
    """Token ids often come out of a tokenizer or a tensor as numpy integers."""
    tokens = [5, 300, 70_000, 262_143]
    rule = (f"token ids given as {'a list of numpy.int64' if kind == 'numpy ints' else f'a numpy {kind} array'} "
            "hash differently from the same ids as Python ints: a token id is its integer value, whatever its type "
            "(encode int(t), or array('q', token_ids), never str() or the array's own bytes)")
    try:
        as_numpy = impl.hash_block_tokens(None, tokens, ("k",), numpy=kind)
        blocks = impl.compute_block_hashes(tokens * 2, 4, "s", ("k",), numpy=kind)
    except (TypeError, ValueError, OverflowError) as err:
        pytest.fail(f"{rule}; it raised {type(err).__name__}: {err}", pytrace=False)
    assert_same(as_numpy, impl.hash_block_tokens(None, tokens, ("k",)), rule)
    assert_same(blocks[1], impl.compute_block_hashes(tokens * 2, 4, "s", ("k",))[1], rule)


def test_python_hash_is_never_used(impl):
    called = impl.calls_python_hash(list(range(8)), ("lora-1",), "tenant-a")
    assert not called, (
        f"hashing called Python's hash() (on {', '.join(sorted(set(called)))}): it squeezes the token ids into 64 "
        "bits, so two blocks can share a name, and for text it changes from one process to the next. Hash an "
        "unambiguous encoding of the parent, the token ids and the keys with SHA256"
    )


# Python's hash() of an int is the int modulo 2**61 - 1, so ids that differ by that much hash
# alike under it, and so do tuples of them: this catches hash() however the code reaches it,
# where the spy above sees only the builtin it replaced, in the child, at call time.
def test_ids_that_pythons_hash_confuses_hash_apart(impl):
    modulus = 2**61 - 1
    tokens, block_size = prompts_of_this_run("python hash")[0]
    block = tokens[:block_size]
    other = [block[0] + modulus, *block[1:]]
    try:
        a, b = impl.hash_block_tokens(None, block), impl.hash_block_tokens(None, other)
    except (ValueError, OverflowError) as err:
        pytest.fail(f"hashing token id {other[0]} (2**61 + {block[0] - 1}) failed ({type(err).__name__}: {err}): a "
                    "token id is an integer of up to 8 bytes; give each id 8 bytes (array('q', token_ids).tobytes(), "
                    "or int.to_bytes(8, ...))", pytrace=False)
    assert_differ(a, b, f"token ids {block[0]} and {other[0]} (= {block[0]} + 2**61 - 1) give a block the same hash: "
                        "Python's hash() made the block's name, which squeezes an int into 61 bits (hash(n) is n mod "
                        "2**61 - 1, and a tuple's hash is built from those). Hash an encoding that keeps every bit of "
                        "every id with SHA-256")


def test_ids_whose_bytes_split_into_other_ids_hash_apart(impl):
    # Each id in as few bytes as it needs, with nothing before it: the two ids [x, y] and the
    # two ids the same bytes read another way give one encoding, in either byte order.
    rng = drawn("split bytes")
    for _ in range(3):
        x, y = rng.randrange(257, 65_536), rng.randrange(1, 256)
        if x % 256 == 0:
            x += 1
        little = [x % 256, x // 256 + y * 256]  # x's low byte; then x's high byte and y, little-endian
        big = [x // 256, (x % 256) * 256 + y]  # x's high byte; then x's low byte and y, big-endian
        for other in (little, big):
            assert_differ(impl.hash_block_tokens(None, [x, y]), impl.hash_block_tokens(None, other),
                          f"tokens {[x, y]} and {other} hash alike: their bytes run together the same way when each "
                          "id takes only the bytes it needs. Give every id the same width (8 bytes: "
                          "int.to_bytes(8, ...) or array('q', token_ids)), or its length before it")


# CPython's tuple hash (Objects/tupleobject.c, xxHash's round) can be run backwards: for a
# drawn block [a, b] and a drawn first id c, the second id d that gives (c, d) the same hash.
XXPRIME_1, XXPRIME_2, XXPRIME_5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
MASK = 2**64 - 1


def tuple_hash_partner(a: int, b: int, c: int) -> int | None:
    """The id d < 2**61 - 1 for which hash((c, d)) == hash((a, b)), if there is one."""
    def lane_round(acc: int, lane: int) -> int:
        acc = (acc + lane * XXPRIME_2) & MASK
        return ((((acc << 31) | (acc >> 33)) & MASK) * XXPRIME_1) & MASK

    target = lane_round(lane_round(XXPRIME_5, hash(a)), hash(b))
    after_c = lane_round(XXPRIME_5, hash(c))
    rotated = (target * pow(XXPRIME_1, -1, 2**64)) & MASK
    acc = ((rotated >> 31) | (rotated << 33)) & MASK  # undo the rotation by 31
    d = ((acc - after_c) * pow(XXPRIME_2, -1, 2**64)) & MASK
    return d if d < 2**61 - 1 and hash((c, d)) == hash((a, b)) else None


def test_blocks_that_pythons_tuple_hash_confuses_hash_apart(impl):
    rng = drawn("tuple hash")
    found = []
    while len(found) < 2:  # about one first id in eight has a partner below 2**61 - 1
        a, b, c = (rng.randrange(262_144) for _ in range(3))
        d = tuple_hash_partner(a, b, c)
        if d is not None:
            found.append(([a, b], [c, d]))
    for block, other in found:
        assert_differ(impl.hash_block_tokens(None, block), impl.hash_block_tokens(None, other),
                      f"tokens {block} and {other} give a block the same hash: they are a collision of Python's "
                      "hash() of a tuple (hash((a, b)) is built from the ids by a round anyone can run backwards). "
                      "Hash an encoding that keeps every bit of every id with SHA-256")


def prompts_of_this_run(name: str) -> list[tuple[list[int], int]]:
    """Three (token ids, block size) of a real vocabulary, drawn for this run."""
    rng = drawn(name)
    prompts = []
    for _ in range(3):
        block_size = rng.choice([4, 16, 32])
        length = rng.randrange(2 * block_size, 6 * block_size)
        prompts.append(([rng.randrange(262_144) for _ in range(length)], block_size))
    return prompts


def test_each_block_hash_is_a_sha256_digest_of_32_bytes(impl):
    for tokens, block_size in prompts_of_this_run("digest"):
        hashes = impl.compute_block_hashes(tokens, block_size, "tenant-a", ("lora-1",))
        for i, block_hash in enumerate(hashes):
            if not isinstance(block_hash, bytes) or len(block_hash) != 32:
                size = f"{len(block_hash)} bytes" if isinstance(block_hash, bytes) else f"a {type(block_hash).__name__}"
                pytest.fail(f"block {i} of a {len(tokens)}-token prompt (blocks of {block_size}) hashed to {size}: a "
                            "block hash is the SHA-256 digest of your encoding, 32 bytes "
                            "(hashlib.sha256(encoding).digest()). MD5 gives 16 bytes and fewer bits to keep blocks "
                            "apart; the encoding itself grows with the block, and a hash that grows is no hash",
                            pytrace=False)


def test_every_byte_of_the_parent_hash_counts(impl):
    tokens, block_size = prompts_of_this_run("parent bytes")[0]
    parent, block = impl.hash_block_tokens(None, tokens[:block_size]), tokens[block_size : 2 * block_size]
    expected = impl.hash_block_tokens(parent, block)
    for i in range(len(parent)):
        changed = parent[:i] + bytes([parent[i] ^ 0xFF]) + parent[i + 1 :]
        assert_differ(impl.hash_block_tokens(changed, block), expected,
                      f"two parents that differ in byte {i} alone give a block the same hash: the whole parent hash "
                      f"(all {len(parent)} bytes) enters the encoding, not a part of it (parent_hash[:8] keeps 64 "
                      "bits of the chain, and prompts whose prefixes collide there would share blocks)")


def test_hashes_are_the_same_in_every_process_whatever_came_before():
    prompts = prompts_of_this_run("processes")
    outputs = []
    # Python's own hash() differs between these two processes, and a hash that depends on what
    # was hashed before (a counter, a table of inputs seen) differs between the two orders.
    for hash_seed, order in (("1", prompts), ("2", prompts[::-1])):
        process = Child(EXERCISE, env={"PYTHONHASHSEED": hash_seed})
        try:
            remote = RemoteBlockHash(process)
            outputs.append({tuple(tokens): remote.compute_block_hashes(tokens, size, "tenant-a", ("lora-1",))
                            for tokens, size in order})
        finally:
            process.stop()
    assert outputs[0] == outputs[1], (
        "the same prompts hash differently in two processes (another PYTHONHASHSEED, the prompts in another "
        "order): a block's hash depends on its parent, tokens and keys alone. Do not use Python's hash(), nor "
        "number the blocks in the order they were seen"
    )


def test_only_full_blocks_get_a_hash(impl):
    for length, expected in ((10, 2), (8, 2), (3, 0)):
        got = len(impl.compute_block_hashes(list(range(length)), 4))
        assert got == expected, (
            f"{length} tokens in blocks of 4 got {got} hashes, not {expected}: only full blocks get one"
        )


def test_each_hash_is_chained_to_the_one_before(impl):
    for tokens, size in prompts_of_this_run("chained"):
        hashes = impl.compute_block_hashes(tokens, size)
        assert len(hashes) == len(tokens) // size, (
            f"{len(tokens)} tokens in blocks of {size} have {len(tokens) // size} full blocks, got {len(hashes)} hashes"
        )
        assert_same(hashes[0], impl.hash_block_tokens(None, tokens[0:size]),
                    f"block 0's hash must be hash_block_tokens(None, its {size} tokens)")
        for i in range(1, len(hashes)):
            assert_same(hashes[i], impl.hash_block_tokens(hashes[i - 1], tokens[size * i : size * i + size]),
                        f"block {i}'s hash must be hash_block_tokens(block {i - 1}'s hash, its own {size} tokens): "
                        "the parent is the hash of the block just before, not None and not block 0's")


def test_the_same_block_at_another_position_is_another_block(impl):
    a = impl.compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = impl.compute_block_hashes([5, 6, 7, 8, 1, 2, 3, 4], 4)
    rule = ("the same 4 tokens got the same hash in block 0 and in block 1: a block's hash must depend on every "
            "token before it, through its parent")
    assert_differ(a[1], b[0], rule)
    assert_differ(a[0], b[1], rule)


def test_extra_keys_enter_every_block(impl):
    tokens = list(range(8))
    plain = impl.compute_block_hashes(tokens, 4)
    lora = impl.compute_block_hashes(tokens, 4, extra_keys=("lora-1",))
    assert_same(lora[0], impl.hash_block_tokens(None, tokens[:4], ("lora-1",)), "block 0 must carry the extra keys")
    assert_same(lora[1], impl.hash_block_tokens(lora[0], tokens[4:], ("lora-1",)),
                "block 1 must carry the extra keys too: a LoRA adapter changes the K/V of every block")
    assert_differ(plain[1], lora[1], "block 1 with extra key 'lora-1' hashes like block 1 without")


def test_cache_salt_enters_block_0_only(impl):
    tokens = list(range(8))
    plain = impl.compute_block_hashes(tokens, 4)
    salted = impl.compute_block_hashes(tokens, 4, cache_salt="tenant-a")
    assert_differ(salted[0], plain[0], "the salt must change block 0's hash")
    assert_same(salted[1], impl.hash_block_tokens(salted[0], tokens[4:]), "block 1 must not carry the salt itself")
    assert_differ(salted[1], plain[1], "block 1 differs from the unsalted one through the chain")
    assert_differ(impl.compute_block_hashes(tokens, 4, cache_salt="tenant-b")[0], salted[0],
                  "tenants 'tenant-a' and 'tenant-b' share block 0: the salt's text must enter the hash")


def test_a_cache_salt_joins_the_extra_keys_of_block_0_and_does_not_replace_them(impl):
    tokens = list(range(8))
    lora_1 = impl.compute_block_hashes(tokens, 4, cache_salt="tenant-a", extra_keys=("lora-1",))
    lora_2 = impl.compute_block_hashes(tokens, 4, cache_salt="tenant-a", extra_keys=("lora-2",))
    assert_differ(lora_1[0], lora_2[0],
                  "with a cache_salt, block 0 hashes alike under LoRA adapters 'lora-1' and 'lora-2': the salt "
                  "replaced the extra keys, so one tenant's two adapters share block 0 although its K/V differ. "
                  "Block 0's keys are extra_keys + (('cache_salt', cache_salt),): the extra keys, then the salt, "
                  "tagged")
    unsalted = impl.compute_block_hashes(tokens, 4, extra_keys=("lora-1",))
    assert_differ(lora_1[0], unsalted[0], "with extra keys, the salt must still change block 0's hash")


def test_a_salt_is_never_mistaken_for_an_extra_key_of_the_same_text(impl):
    tokens = list(range(8))
    salted = impl.compute_block_hashes(tokens, 4, cache_salt="lora-1")
    keyed = impl.compute_block_hashes(tokens, 4, extra_keys=("lora-1",))
    assert_differ(salted[0], keyed[0],
                  "cache_salt 'lora-1' and extra key 'lora-1' give block 0 the same hash: a tenant named after an "
                  "adapter would share its blocks. Tag the salt: block 0's keys are "
                  "extra_keys + (('cache_salt', cache_salt),)")


# --- any inputs, not only the ones above ---------------------------------------------------------

KEYS = st.lists(st.text(alphabet="ab,|: 1", max_size=3), max_size=3)
BLOCKS = st.tuples(st.sampled_from([None, 0, 1]), st.lists(st.sampled_from([0, 1, 12, 23, 256, 65_543]), max_size=4),
                   KEYS)


@settings(GRADING, max_examples=60)
@given(st.lists(BLOCKS, min_size=2, max_size=6, unique_by=lambda b: (b[0], tuple(b[1]), tuple(b[2]))))
def test_different_blocks_get_different_hashes(impl, blocks):
    parents = [None, impl.hash_block_tokens(None, [9]), impl.hash_block_tokens(None, [8])]
    hashes = {}
    for parent, tokens, keys in blocks:
        block_hash = impl.hash_block_tokens(parents[0 if parent is None else parent + 1], tokens, tuple(keys))
        assert block_hash not in hashes, (
            f"(parent {parent}, tokens {tokens}, extra keys {tuple(keys)}) and {hashes.get(block_hash)} hash alike: "
            "every part of a block must enter its encoding so that no two blocks share one"
        )
        hashes[block_hash] = (parent, tokens, tuple(keys))


@settings(GRADING, max_examples=60)
@given(st.lists(st.integers(0, 262_143), max_size=14), st.integers(1, 5), st.sampled_from([None, "t", "lora"]), KEYS)
def test_compute_block_hashes_is_the_chain_of_hash_block_tokens(impl, tokens, size, salt, keys):
    hashes = impl.compute_block_hashes(tokens, size, salt, tuple(keys))
    assert len(hashes) == len(tokens) // size, (
        f"{len(tokens)} tokens in blocks of {size} have {len(tokens) // size} full blocks, got {len(hashes)} hashes")
    parent = None
    for i, block_hash in enumerate(hashes):
        block_keys = (*keys, ("cache_salt", salt)) if i == 0 and salt is not None else tuple(keys)
        expected = impl.hash_block_tokens(parent, tokens[size * i : size * i + size], block_keys)
        assert block_hash == expected, (
            f"block {i} of {tokens} (blocks of {size}, salt {salt!r}, extra keys {tuple(keys)}) is not "
            f"hash_block_tokens(block {i - 1}'s hash, its {size} tokens, {block_keys}): block i's parent is block "
            "i - 1's hash, every block has the extra keys, and block 0 alone has ('cache_salt', salt) after them"
        )
        parent = block_hash
