"""Exercise 1: the chained block hash (exercises/block_hash.py). Needs no other exercise.

The encoding a block's hash digests is the student's choice (any unambiguous one will do), so
these tests compare hashes with each other, never with the reference's: each is a SHA-256
digest (32 bytes); equal inputs, equal hashes; different inputs, different hashes; chained
to the whole parent hash; the same in every process, whatever was hashed before. Token ids,
extra keys, salts and prompt lengths are drawn anew each run (grading.SEED); what a test keeps
fixed is the shape (how many tokens, which of them repeat, which inputs a weak encoding confuses).
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grading import Child, GRADING, drawn
from twins import RemoteBlockHash

EXERCISE = "block_hash"
VOCAB = 262_144  # Gemma 3's vocabulary (the largest named below): every drawn id is a real one


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


# --- this run's inputs: drawn, in the shape each test needs ----------------------------------------


def tokens(rng, n: int) -> list[int]:
    """n different token ids of a real vocabulary: tokens(rng, 3) -> [20_511, 7, 187_002]."""
    return rng.sample(range(VOCAB), n)


def names(rng, *prefixes: str) -> list[str]:
    """Different texts for extra keys and salts: names(rng, "lora", "lora") -> ['lora-4031', 'lora-77160']."""
    numbers = rng.sample(range(10**6), len(prefixes))
    return [f"{prefix}-{number}" for prefix, number in zip(prefixes, numbers)]


def same_digits(rng) -> tuple[list[int], list[int]]:
    """Two blocks whose ids' decimal digits run together into one string, split at another
    place: same_digits(rng) -> ([1, 23], [12, 3])."""
    a, b, c = (str(rng.randrange(1, 250)) for _ in range(3))  # two run together: at most 249,249 < VOCAB
    return [int(a), int(b + c)], [int(a + b), int(c)]


def same_low_bytes(rng, width: int) -> tuple[int, int]:
    """An id of a real vocabulary at or above `width` (256: one byte; 65,536: two) and the id
    its low bytes hold: same_low_bytes(rng, 256) -> (3 * 256 + 7, 7) = (775, 7)."""
    low = rng.randrange(width)
    return rng.randrange(1, VOCAB // width) * width + low, low


def prompts_of_this_run(rng) -> list[tuple[list[int], int]]:
    """Three (token ids, block size) of a real vocabulary."""
    prompts = []
    for _ in range(3):
        block_size = rng.choice([4, 16, 32])
        length = rng.randrange(2 * block_size, 6 * block_size)
        prompts.append(([rng.randrange(VOCAB) for _ in range(length)], block_size))
    return prompts


# --- one block ---------------------------------------------------------------------------------------


def test_a_hash_is_bytes_and_the_same_every_time(impl):
    block = tokens(drawn("same every time"), 4)
    first = impl.hash_block_tokens(None, block)
    assert isinstance(first, bytes) and len(first) >= 16, (
        f"a block hash is a digest of 16 bytes or more, got {first!r:.80}"
    )
    assert_same(impl.hash_block_tokens(None, list(block)), first,
                f"the same block {block} must get the same hash every time")


def test_every_token_counts(impl):
    ids = tokens(drawn("every token"), 5)
    block, changed, reordered = ids[:4], [*ids[:3], ids[4]], ids[3::-1]
    assert_differ(impl.hash_block_tokens(None, block), impl.hash_block_tokens(None, changed),
                  f"{block} and {changed} hash alike: every token id must enter the hash")
    assert_differ(impl.hash_block_tokens(None, block), impl.hash_block_tokens(None, reordered),
                  f"{block} and {reordered} hash alike: the order of the tokens must enter the hash")


# Real vocabularies are large: SmolLM2 has 49,152 token ids, Llama 3 128,256, Gemma 3 262,144.
# A hash that takes each id as one byte works on ids below 256 and nowhere else; one that
# takes two bytes, below 65,536.
@pytest.mark.parametrize("width", [None, 256, 65_536], ids=["large ids", "one byte wraps", "two bytes wrap"])
def test_token_ids_of_a_real_vocabulary_hash_and_stay_apart(impl, width):
    rng = drawn(f"real vocabulary {width}")
    if width is None:  # ids above one byte, the last ones one apart
        large = rng.sample(range(256, VOCAB - 1), 4)
        token_ids, other, why = large, [*large[:3], large[3] + 1], ""
    else:  # an id must not wrap round to the id its low bytes hold
        high, low = same_low_bytes(rng, width)
        rest = tokens(rng, 3)
        token_ids, other, why = [high, *rest], [low, *rest], f" ({high} is {low} + {high // width} * {width:,})"
    try:
        a, b = impl.hash_block_tokens(None, token_ids), impl.hash_block_tokens(None, other)
    except (ValueError, OverflowError) as err:
        pytest.fail(f"hashing token ids {token_ids} failed ({type(err).__name__}: {err}): a token id is not a "
                    "byte; give each id 8 bytes (array('q', token_ids).tobytes(), or int.to_bytes(8, ...))")
    assert_differ(a, b, f"{token_ids} and {other} hash alike{why}: each token id must keep all its bits in the "
                        "encoding")


def test_the_parent_counts(impl):
    ids = tokens(drawn("parent counts"), 12)
    parent_a = impl.hash_block_tokens(None, ids[:4])
    parent_b = impl.hash_block_tokens(None, ids[4:8])
    block = ids[8:]
    assert_differ(impl.hash_block_tokens(parent_a, block), impl.hash_block_tokens(parent_b, block),
                  f"the same tokens {block} under two different parents (the hashes of {ids[:4]} and {ids[4:8]}) "
                  "hash alike: the parent hash must enter the hash")
    assert_differ(impl.hash_block_tokens(parent_a, block), impl.hash_block_tokens(None, block),
                  f"block {block} with a parent (the hash of {ids[:4]}) hashes like a first block: the parent hash "
                  "must enter the hash")


def test_extra_keys_count(impl):
    rng = drawn("extra keys")
    block, (key, other_key) = tokens(rng, 4), names(rng, "lora", "lora")
    assert_differ(impl.hash_block_tokens(None, block, (key,)), impl.hash_block_tokens(None, block),
                  f"a block with extra key {key!r} hashes like one without: the extra keys must enter the hash")
    assert_differ(impl.hash_block_tokens(None, block, (key,)), impl.hash_block_tokens(None, block, (other_key,)),
                  f"extra keys {key!r} and {other_key!r} hash alike: each key's text must enter the hash")


def test_the_encoding_is_unambiguous(impl):
    rng = drawn("unambiguous")
    run_together, split_elsewhere = same_digits(rng)
    (first, second), (a, b) = tokens(rng, 2), names(rng, "a", "b")
    assert_differ(impl.hash_block_tokens(None, run_together), impl.hash_block_tokens(None, split_elsewhere),
                  f"{run_together} and {split_elsewhere} hash alike: separate the token ids in your encoding")
    assert_differ(impl.hash_block_tokens(None, [first, second]), impl.hash_block_tokens(None, [first], (str(second),)),
                  f"tokens {[first, second]} and tokens {[first]} with extra key '{second}' hash alike: keep the "
                  "tokens apart from the keys")
    assert_differ(impl.hash_block_tokens(None, [first], (a, b)), impl.hash_block_tokens(None, [first], (a + b,)),
                  f"extra keys {(a, b)} and {(a + b,)} hash alike: separate the keys in your encoding")


def test_extra_keys_keep_their_order(impl):
    rng = drawn("key order")
    block, (a, b) = tokens(rng, 1), names(rng, "a", "b")
    assert_differ(impl.hash_block_tokens(None, block, (a, b)), impl.hash_block_tokens(None, block, (b, a)),
                  f"extra keys {(a, b)} and {(b, a)} hash alike: keep the keys in their order (a tuple, not a set)")


@pytest.mark.parametrize("separator", [",", "|", ":", " ", ";", "\\", "\n", "\x00", "-"], ids=repr)
def test_no_separator_inside_a_key_can_split_it(impl, separator):
    rng = drawn(f"separator {separator!r}")
    block, (a, b) = tokens(rng, 1), names(rng, "a", "b")
    joined, split = (f"{a}{separator}{b}",), (a, b)
    assert_differ(impl.hash_block_tokens(None, block, joined), impl.hash_block_tokens(None, block, split),
                  f"extra keys {joined} and {split} hash alike: a separator that can occur inside a key separates "
                  "nothing. Encode the keys so none can be read two ways (json.dumps, or each key's length before it)")


@pytest.mark.parametrize("kind", ["numpy ints", "int64", "int32"])
def test_numpy_token_ids_hash_like_python_ints(impl, kind):
    """Token ids often come out of a tokenizer or a tensor as numpy integers."""
    rng = drawn(f"numpy {kind}")
    # an id of one byte, one of two, one of three, one at the top of the vocabulary
    block = [rng.randrange(256), rng.randrange(256, 65_536), rng.randrange(65_536, VOCAB),
             rng.randrange(VOCAB - 256, VOCAB)]
    salt, key = names(rng, "tenant", "lora")
    given_as = "a list of numpy.int64" if kind == "numpy ints" else f"a numpy {kind} array"
    rule = (f"token ids {block} given as {given_as} "
            "hash differently from the same ids as Python ints: a token id is its integer value, whatever its type "
            "(encode int(t), or array('q', token_ids), never str() or the array's own bytes)")
    try:
        as_numpy = impl.hash_block_tokens(None, block, (key,), numpy=kind)
        blocks = impl.compute_block_hashes(block * 2, 4, salt, (key,), numpy=kind)
    except (TypeError, ValueError, OverflowError) as err:
        pytest.fail(f"{rule}; it raised {type(err).__name__}: {err}", pytrace=False)
    assert_same(as_numpy, impl.hash_block_tokens(None, block, (key,)), rule)
    assert_same(blocks[1], impl.compute_block_hashes(block * 2, 4, salt, (key,))[1], rule)


def test_python_hash_is_never_used(impl):
    rng = drawn("python hash never used")
    key, salt = names(rng, "lora", "tenant")
    called = impl.calls_python_hash(tokens(rng, 8), (key,), salt)
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
    prompt, block_size = prompts_of_this_run(drawn("python hash"))[0]
    block = prompt[:block_size]
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
        a, b, c = (rng.randrange(VOCAB) for _ in range(3))
        d = tuple_hash_partner(a, b, c)
        if d is not None:
            found.append(([a, b], [c, d]))
    for block, other in found:
        assert_differ(impl.hash_block_tokens(None, block), impl.hash_block_tokens(None, other),
                      f"tokens {block} and {other} give a block the same hash: they are a collision of Python's "
                      "hash() of a tuple (hash((a, b)) is built from the ids by a round anyone can run backwards). "
                      "Hash an encoding that keeps every bit of every id with SHA-256")


# --- a prompt's chain of blocks --------------------------------------------------------------------


def test_each_block_hash_is_a_sha256_digest_of_32_bytes(impl):
    rng = drawn("digest")
    salt, key = names(rng, "tenant", "lora")
    for prompt, block_size in prompts_of_this_run(rng):
        hashes = impl.compute_block_hashes(prompt, block_size, salt, (key,))
        for i, block_hash in enumerate(hashes):
            if not isinstance(block_hash, bytes) or len(block_hash) != 32:
                size = f"{len(block_hash)} bytes" if isinstance(block_hash, bytes) else f"a {type(block_hash).__name__}"
                pytest.fail(f"block {i} of a {len(prompt)}-token prompt (blocks of {block_size}) hashed to {size}: a "
                            "block hash is the SHA-256 digest of your encoding, 32 bytes "
                            "(hashlib.sha256(encoding).digest()). MD5 gives 16 bytes and fewer bits to keep blocks "
                            "apart; the encoding itself grows with the block, and a hash that grows is no hash",
                            pytrace=False)


def test_every_byte_of_the_parent_hash_counts(impl):
    prompt, block_size = prompts_of_this_run(drawn("parent bytes"))[0]
    parent, block = impl.hash_block_tokens(None, prompt[:block_size]), prompt[block_size : 2 * block_size]
    expected = impl.hash_block_tokens(parent, block)
    for i in range(len(parent)):
        changed = parent[:i] + bytes([parent[i] ^ 0xFF]) + parent[i + 1 :]
        assert_differ(impl.hash_block_tokens(changed, block), expected,
                      f"two parents that differ in byte {i} alone give a block the same hash: the whole parent hash "
                      f"(all {len(parent)} bytes) enters the encoding, not a part of it (parent_hash[:8] keeps 64 "
                      "bits of the chain, and prompts whose prefixes collide there would share blocks)")


def test_hashes_are_the_same_in_every_process_whatever_came_before():
    rng = drawn("processes")
    prompts, (salt, key) = prompts_of_this_run(rng), names(rng, "tenant", "lora")
    outputs = []
    # Python's own hash() differs between these two processes, and a hash that depends on what
    # was hashed before (a counter, a table of inputs seen) differs between the two orders.
    for hash_seed, order in (("1", prompts), ("2", prompts[::-1])):
        process = Child(EXERCISE, env={"PYTHONHASHSEED": hash_seed})
        try:
            remote = RemoteBlockHash(process)
            outputs.append({tuple(prompt): remote.compute_block_hashes(prompt, size, salt, (key,))
                            for prompt, size in order})
        finally:
            process.stop()
    assert outputs[0] == outputs[1], (
        "the same prompts hash differently in two processes (another PYTHONHASHSEED, the prompts in another "
        "order): a block's hash depends on its parent, tokens and keys alone. Do not use Python's hash(), nor "
        "number the blocks in the order they were seen"
    )


def test_only_full_blocks_get_a_hash(impl):
    rng = drawn("full blocks")
    for length, expected in ((10, 2), (8, 2), (3, 0)):
        prompt = tokens(rng, length)
        got = len(impl.compute_block_hashes(prompt, 4))
        assert got == expected, (
            f"{length} tokens {prompt} in blocks of 4 got {got} hashes, not {expected}: only full blocks get one"
        )


def test_each_hash_is_chained_to_the_one_before(impl):
    for prompt, size in prompts_of_this_run(drawn("chained")):
        hashes = impl.compute_block_hashes(prompt, size)
        assert len(hashes) == len(prompt) // size, (
            f"{len(prompt)} tokens in blocks of {size} have {len(prompt) // size} full blocks, got {len(hashes)} hashes"
        )
        assert_same(hashes[0], impl.hash_block_tokens(None, prompt[0:size]),
                    f"block 0's hash must be hash_block_tokens(None, its {size} tokens)")
        for i in range(1, len(hashes)):
            assert_same(hashes[i], impl.hash_block_tokens(hashes[i - 1], prompt[size * i : size * i + size]),
                        f"block {i}'s hash must be hash_block_tokens(block {i - 1}'s hash, its own {size} tokens): "
                        "the parent is the hash of the block just before, not None and not block 0's")


def test_the_same_block_at_another_position_is_another_block(impl):
    ids = tokens(drawn("position"), 8)
    first, second = ids[:4], ids[4:]
    a = impl.compute_block_hashes(first + second, 4)
    b = impl.compute_block_hashes(second + first, 4)
    rule = (f"prompts {first + second} and {second + first}: the same 4 tokens got the same hash in block 0 and in "
            "block 1: a block's hash must depend on every token before it, through its parent")
    assert_differ(a[1], b[0], rule)
    assert_differ(a[0], b[1], rule)


def test_extra_keys_enter_every_block(impl):
    rng = drawn("keys in every block")
    prompt, (key,) = tokens(rng, 8), names(rng, "lora")
    plain = impl.compute_block_hashes(prompt, 4)
    lora = impl.compute_block_hashes(prompt, 4, extra_keys=(key,))
    assert_same(lora[0], impl.hash_block_tokens(None, prompt[:4], (key,)), "block 0 must carry the extra keys")
    assert_same(lora[1], impl.hash_block_tokens(lora[0], prompt[4:], (key,)),
                "block 1 must carry the extra keys too: a LoRA adapter changes the K/V of every block")
    assert_differ(plain[1], lora[1], f"block 1 with extra key {key!r} hashes like block 1 without")


def test_cache_salt_enters_block_0_only(impl):
    rng = drawn("salt in block 0")
    prompt, (salt, other_salt) = tokens(rng, 8), names(rng, "tenant", "tenant")
    plain = impl.compute_block_hashes(prompt, 4)
    salted = impl.compute_block_hashes(prompt, 4, cache_salt=salt)
    assert_differ(salted[0], plain[0], "the salt must change block 0's hash")
    assert_same(salted[1], impl.hash_block_tokens(salted[0], prompt[4:]), "block 1 must not carry the salt itself")
    assert_differ(salted[1], plain[1], "block 1 differs from the unsalted one through the chain")
    assert_differ(impl.compute_block_hashes(prompt, 4, cache_salt=other_salt)[0], salted[0],
                  f"tenants {salt!r} and {other_salt!r} share block 0: the salt's text must enter the hash")


def test_a_cache_salt_joins_the_extra_keys_of_block_0_and_does_not_replace_them(impl):
    rng = drawn("salt joins keys")
    prompt, (salt, key_1, key_2) = tokens(rng, 8), names(rng, "tenant", "lora", "lora")
    lora_1 = impl.compute_block_hashes(prompt, 4, cache_salt=salt, extra_keys=(key_1,))
    lora_2 = impl.compute_block_hashes(prompt, 4, cache_salt=salt, extra_keys=(key_2,))
    assert_differ(lora_1[0], lora_2[0],
                  f"with a cache_salt, block 0 hashes alike under LoRA adapters {key_1!r} and {key_2!r}: the salt "
                  "replaced the extra keys, so one tenant's two adapters share block 0 although its K/V differ. "
                  "Block 0's keys are extra_keys + (('cache_salt', cache_salt),): the extra keys, then the salt, "
                  "tagged")
    unsalted = impl.compute_block_hashes(prompt, 4, extra_keys=(key_1,))
    assert_differ(lora_1[0], unsalted[0], "with extra keys, the salt must still change block 0's hash")


def test_a_salt_is_never_mistaken_for_an_extra_key_of_the_same_text(impl):
    rng = drawn("salt or key")
    prompt, (text,) = tokens(rng, 8), names(rng, "lora")
    salted = impl.compute_block_hashes(prompt, 4, cache_salt=text)
    keyed = impl.compute_block_hashes(prompt, 4, extra_keys=(text,))
    assert_differ(salted[0], keyed[0],
                  f"cache_salt {text!r} and extra key {text!r} give block 0 the same hash: a tenant named after an "
                  "adapter would share its blocks. Tag the salt: block 0's keys are "
                  "extra_keys + (('cache_salt', cache_salt),)")


# --- any inputs, not only the ones above ---------------------------------------------------------
# The token ids the blocks are built from are this run's: the two blocks of same_digits, an id
# and the one its low byte holds (same_low_bytes), and the single ids of the two parent blocks.

KEYS = st.lists(st.text(alphabet="ab,|: 1", max_size=3), max_size=3)
_RNG = drawn("different blocks")
BLOCK_IDS = [*(t for block in same_digits(_RNG) for t in block), *same_low_bytes(_RNG, 256)]
PARENT_IDS = tokens(_RNG, 2)
BLOCKS = st.tuples(st.sampled_from([None, *PARENT_IDS]), st.lists(st.sampled_from(BLOCK_IDS), max_size=4), KEYS)


@settings(GRADING, max_examples=60)
@given(st.lists(BLOCKS, min_size=2, max_size=6, unique_by=lambda b: (b[0], tuple(b[1]), tuple(b[2]))))
def test_different_blocks_get_different_hashes(impl, blocks):
    parents = {None: None} | {t: impl.hash_block_tokens(None, [t]) for t in PARENT_IDS}
    hashes = {}
    for parent, block, keys in blocks:
        block_hash = impl.hash_block_tokens(parents[parent], block, tuple(keys))
        parent_text = "no parent" if parent is None else f"the parent hash of [{parent}]"
        assert block_hash not in hashes, (
            f"({parent_text}, tokens {block}, extra keys {tuple(keys)}) and {hashes.get(block_hash)} hash alike: "
            "every part of a block must enter its encoding so that no two blocks share one"
        )
        hashes[block_hash] = (parent_text, block, tuple(keys))


@settings(GRADING, max_examples=60)
@given(st.lists(st.integers(0, 262_143), max_size=14), st.integers(1, 5), st.sampled_from([None, "t", "lora"]), KEYS)
def test_compute_block_hashes_is_the_chain_of_hash_block_tokens(impl, prompt, size, salt, keys):
    hashes = impl.compute_block_hashes(prompt, size, salt, tuple(keys))
    assert len(hashes) == len(prompt) // size, (
        f"{len(prompt)} tokens in blocks of {size} have {len(prompt) // size} full blocks, got {len(hashes)} hashes")
    parent = None
    for i, block_hash in enumerate(hashes):
        block_keys = (*keys, ("cache_salt", salt)) if i == 0 and salt is not None else tuple(keys)
        expected = impl.hash_block_tokens(parent, prompt[size * i : size * i + size], block_keys)
        assert block_hash == expected, (
            f"block {i} of {prompt} (blocks of {size}, salt {salt!r}, extra keys {tuple(keys)}) is not "
            f"hash_block_tokens(block {i - 1}'s hash, its {size} tokens, {block_keys}): block i's parent is block "
            "i - 1's hash, every block has the extra keys, and block 0 alone has ('cache_salt', salt) after them"
        )
        parent = block_hash
