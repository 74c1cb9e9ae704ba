"""The allocator's spec: the vLLM v1 design doc's examples and each rule, one test apiece."""

import doctest
import subprocess
import sys

import pytest

from allocator import prefix_caching
from allocator import OutOfBlocksError, PrefixCachingAllocator, compute_block_hashes, hash_block_tokens

# --- the design doc's worked example (block size 4, 10 blocks) -------------------------


def test_design_doc_worked_example_block_for_block():
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    r0 = list(range(15))

    # Time 1: 15 tokens -> 4 blocks, the first 3 full and cached.
    assert alloc.allocate_with_prefix("r0", r0) == (0, 15)
    assert alloc.block_tables["r0"] == [0, 1, 2, 3]
    assert [alloc.block_hash(b) is not None for b in range(4)] == [True, True, True, False]
    assert alloc.free_queue.block_ids() == [4, 5, 6, 7, 8, 9]

    # Time 2: block 3 fills and is cached; the next token needs block 4.
    alloc.append_token("r0", 15)
    assert alloc.block_hash(3) is not None
    alloc.append_token("r0", 16)
    assert alloc.block_tables["r0"] == [0, 1, 2, 3, 4]

    # Time 3: 14 tokens, the first 10 shared: only 2 full blocks hit.
    assert alloc.allocate_with_prefix("r1", r0[:10] + [100, 101, 102, 103]) == (8, 6)
    assert alloc.block_tables["r1"] == [0, 1, 5, 6]
    assert alloc.ref_count(0) == alloc.ref_count(1) == 2

    # Time 4: free r0 in reverse; 0 and 1 stay with r1; 2 and 3 keep their hash.
    alloc.free("r0")
    assert alloc.free_queue.block_ids() == [7, 8, 9, 4, 3, 2]
    assert alloc.block_hash(2) is not None and alloc.block_hash(3) is not None

    # Time 5
    alloc.free("r1")
    assert alloc.free_queue.block_ids() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]

    # Time 6: 29 tokens, the first 12 shared: hits touched first, then 5 popped; 3 evicted.
    hash_of_3 = alloc.block_hash(3)
    assert alloc.allocate_with_prefix("r2", r0[:12] + list(range(200, 217))) == (12, 17)
    assert alloc.block_tables["r2"] == [0, 1, 2, 7, 8, 9, 4, 3]
    assert alloc.free_queue.block_ids() == [6, 5]
    assert alloc.stats.evictions == 1
    assert hash_of_3 not in alloc.cached_blocks
    alloc.free("r2")
    alloc.check_invariants()


def test_design_doc_duplicated_blocks():
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    A, B, C, D, E, F, G, H, I = range(9)
    alloc.allocate_with_prefix("req1", [A, B, C, D, E, F])
    alloc.append_token("req1", G)
    assert alloc.block_tables["req1"] == [0, 1] and alloc.block_hash(1) is None
    alloc.append_token("req1", H)
    alloc.append_token("req1", I)
    assert alloc.block_tables["req1"] == [0, 1, 2]
    assert {b for b in range(10) if alloc.block_hash(b)} == {0, 1}

    alloc.allocate_with_prefix("req2", [A, B, C, D, E, F])
    alloc.append_token("req2", G)
    assert alloc.block_tables["req2"] == [0, 3]
    alloc.append_token("req2", H)
    assert alloc.block_tables["req2"] == [0, 3]  # append-only: not rewritten to [0, 1]
    assert alloc.block_hash(3) == alloc.block_hash(1)
    assert sorted(alloc.cached_blocks[alloc.block_hash(1)]) == [1, 3]
    alloc.check_invariants()
    # A later lookup still finds a block with the right content.
    assert alloc.peek([A, B, C, D, E, F, G, H, 99]) == 8
    alloc.free("req1")
    alloc.free("req2")
    alloc.check_invariants()


def test_docstring_examples():
    assert doctest.testmod(prefix_caching).failed == 0


def test_importing_the_allocator_does_not_import_torch():
    code = "import sys, prefix_caching, allocator; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- hashing ---------------------------------------------------------------------------------


def test_hash_is_stable_across_processes():
    code = "import prefix_caching as p; print(p.compute_block_hashes(list(range(8)), 4)[1].hex())"
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout for _ in range(2)}
    assert outputs == {compute_block_hashes(list(range(8)), 4)[1].hex() + "\n"}


def test_hash_depends_on_position_through_the_chain():
    a = compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = compute_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same tokens 5..8, different parent
    assert hash_block_tokens(None, [5, 6, 7, 8]) != a[1]


def test_only_full_blocks_get_a_hash():
    assert len(compute_block_hashes(list(range(11)), 4)) == 2
    alloc = PrefixCachingAllocator(num_blocks=4, block_size=4)
    alloc.allocate_with_prefix("r", list(range(11)))
    assert [alloc.block_hash(b) is not None for b in alloc.block_tables["r"]] == [True, True, False]


def test_encoding_is_unambiguous():
    assert hash_block_tokens(None, [1, 2], ("x",)) != hash_block_tokens(None, [1, 2], ())
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])
    assert hash_block_tokens(None, [1], ("a", "b")) != hash_block_tokens(None, [1], ("ab",))


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_both_hash_algorithms_cache_and_hit(algo):
    alloc = PrefixCachingAllocator(num_blocks=8, block_size=4, hash_algo=algo)
    alloc.allocate_with_prefix("a", list(range(9)))
    assert alloc.allocate_with_prefix("b", list(range(9))) == (8, 1)
    assert len(alloc.block_hash(0)) == (32 if algo == "sha256" else 16)


def test_salt_isolates_tenants_and_enters_only_the_first_block():
    plain = compute_block_hashes(list(range(8)), 4)
    salted = compute_block_hashes(list(range(8)), 4, cache_salt="tenant-a")
    assert plain[0] != salted[0] and plain[1] != salted[1]  # block 1 differs through the chain
    assert salted[1] == hash_block_tokens(salted[0], [4, 5, 6, 7])  # no salt in block 1 itself

    alloc = PrefixCachingAllocator(num_blocks=20, block_size=4)
    alloc.allocate_with_prefix("a", list(range(13)), cache_salt="tenant-a")
    assert alloc.allocate_with_prefix("b", list(range(13)), cache_salt="tenant-b").num_cached_tokens == 0
    assert alloc.allocate_with_prefix("c", list(range(13))).num_cached_tokens == 0
    assert alloc.allocate_with_prefix("d", list(range(13)), cache_salt="tenant-a").num_cached_tokens == 12


def test_extra_keys_separate_lora_style_variants():
    alloc = PrefixCachingAllocator(num_blocks=20, block_size=4)
    alloc.allocate_with_prefix("a", list(range(9)), extra_keys=("lora-1",))
    assert alloc.allocate_with_prefix("b", list(range(9)), extra_keys=("lora-2",)).num_cached_tokens == 0
    assert alloc.allocate_with_prefix("c", list(range(9)), extra_keys=("lora-1",)).num_cached_tokens == 8


# --- lookup ------------------------------------------------------------------------------------


@pytest.mark.parametrize("length, expected_hit", [(8, 4), (9, 8), (12, 8), (13, 12), (5, 4), (4, 0)])
def test_hit_is_capped_so_one_token_is_left_to_compute(length, expected_hit):
    alloc = PrefixCachingAllocator(num_blocks=20, block_size=4)
    alloc.allocate_with_prefix("warm", list(range(16)))
    assert alloc.allocate_with_prefix("r", list(range(length))).num_cached_tokens == expected_hit
    assert expected_hit == (length - 1) // 4 * 4


def test_lookup_stops_at_first_miss():
    alloc = PrefixCachingAllocator(num_blocks=20, block_size=4)
    alloc.allocate_with_prefix("a", list(range(13)))
    prompt = list(range(13))
    prompt[5] = 99  # block 1 differs; block 2 would match by tokens, but its chain does not
    assert alloc.allocate_with_prefix("b", prompt).num_cached_tokens == 4


def test_a_hash_collision_is_caught_by_comparing_tokens():
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    alloc.allocate_with_prefix("a", list(range(9)))
    alloc.free("a")
    alloc.blocks[1].token_ids = [7, 7, 7, 7]  # pretend other content landed under this hash
    assert alloc.allocate_with_prefix("b", list(range(9))).num_cached_tokens == 4
    assert alloc.stats.hash_collisions == 1


def test_after_a_collision_the_request_caches_nothing_past_it():
    """Its later blocks would be named by a chain that already names other tokens: a block
    cached under it could be hit by a request whose earlier blocks differ. So none is cached,
    not even the blocks it fills while decoding, and the pool stays consistent."""
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    alloc.allocate_with_prefix("a", list(range(9)))
    alloc.free("a")
    alloc.blocks[1].token_ids = [7, 7, 7, 7]  # pretend other content landed under this hash
    alloc.allocate_with_prefix("b", list(range(9)))
    table = alloc.block_tables["b"]
    assert [alloc.block_hash(b) is not None for b in table] == [True, False, False]
    for token in range(9, 16):
        alloc.append_token("b", token)  # fills blocks 2 and 3
    assert [alloc.block_hash(b) is not None for b in alloc.block_tables["b"]] == [True, False, False, False]
    alloc.check_invariants()


def test_invariants_catch_one_hash_over_two_contents():
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    alloc.allocate_with_prefix("a", list(range(9)))
    alloc.allocate_with_prefix("b", [7, 7, 7, 7, 1])
    alloc._cache_block(alloc.blocks[alloc.block_tables["b"][0]], alloc.block_hash(0))  # a collision, cached
    with pytest.raises(AssertionError, match="different contents"):
        alloc.check_invariants()


@pytest.mark.parametrize("salt", [None, ""])
def test_an_empty_cache_salt_is_no_salt(salt):
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    alloc.allocate_with_prefix("a", list(range(9)))
    assert alloc.allocate_with_prefix("b", list(range(9)), cache_salt=salt).num_cached_tokens == 8


@pytest.mark.parametrize("salt, words", [
    ("x" * 129, "at most 128"), ("a@b", "'@'"), ("a/b", "'/'"), ("a\\b", "'\\\\\\\\'"), ("a\0b", "NUL"),
])
def test_cache_salts_follow_vllms_rules(salt, words):
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    with pytest.raises(ValueError, match=words):
        alloc.allocate_with_prefix("a", list(range(9)), cache_salt=salt)
    assert alloc.requests == {} and alloc.num_free_blocks == 10
    assert alloc.allocate_with_prefix("b", [1], cache_salt="x" * 128).num_new_tokens == 1  # 128 is fine


def test_a_block_remembers_the_tenant_that_filled_it():
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    alloc.allocate_with_prefix("a", list(range(6)), cache_salt="class-b")
    alloc.append_token("a", 6), alloc.append_token("a", 7), alloc.append_token("a", 8)  # a third block
    alloc.allocate_with_prefix("p", [1, 2])
    assert [alloc.blocks[b].cache_salt for b in alloc.block_tables["a"]] == ["class-b"] * 3
    assert alloc.blocks[alloc.block_tables["p"][0]].cache_salt is None


def test_peek_changes_nothing():
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    alloc.allocate_with_prefix("a", list(range(9)))
    alloc.free("a")
    before = (alloc.free_queue.block_ids(), alloc.stats.as_dict())
    assert alloc.peek(list(range(9))) == 8
    assert (alloc.free_queue.block_ids(), alloc.stats.as_dict()) == before


# --- allocation, eviction, free ---------------------------------------------------------------


def test_touching_a_free_cached_block_takes_it_out_of_the_middle_of_the_queue():
    alloc = PrefixCachingAllocator(num_blocks=6, block_size=4)
    alloc.allocate_with_prefix("a", list(range(9)))  # blocks 0 1 2
    alloc.free("a")
    assert alloc.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    alloc.allocate_with_prefix("b", list(range(5)))  # hits block 0, needs 1 new
    assert alloc.block_tables["b"] == [0, 3]
    assert alloc.free_queue.block_ids() == [4, 5, 2, 1]


def test_eviction_drops_the_old_hash():
    alloc = PrefixCachingAllocator(num_blocks=3, block_size=4)
    alloc.allocate_with_prefix("a", list(range(9)))
    old = [alloc.block_hash(b) for b in (0, 1)]
    alloc.free("a")
    alloc.allocate_with_prefix("b", [50 + i for i in range(12)])  # needs all 3 blocks
    assert alloc.stats.evictions == 2
    assert all(h not in alloc.cached_blocks for h in old)
    alloc.free("b")
    assert alloc.allocate_with_prefix("c", list(range(9))).num_cached_tokens == 0


def test_refused_allocation_changes_nothing():
    alloc = PrefixCachingAllocator(num_blocks=4, block_size=4)
    alloc.allocate_with_prefix("a", list(range(9)))  # 3 blocks
    alloc.free("a")
    alloc.allocate_with_prefix("b", [90, 91, 92, 93, 94])  # takes block 3 and evicts 2 (head)
    snapshot = (alloc.free_queue.block_ids(), dict(alloc.block_tables), [b.ref_cnt for b in alloc.blocks],
                dict(alloc.cached_blocks), alloc.stats.evictions)
    # 2 hits among the free blocks + 2 new = 4 > 2 free
    with pytest.raises(OutOfBlocksError, match="free"):
        alloc.allocate_with_prefix("c", list(range(8)) + [60, 61, 62, 63, 64])
    assert snapshot == (alloc.free_queue.block_ids(), dict(alloc.block_tables), [b.ref_cnt for b in alloc.blocks],
                        dict(alloc.cached_blocks), alloc.stats.evictions)
    assert "c" not in alloc.block_tables and alloc.stats.refused == 1
    alloc.check_invariants()


def test_append_token_out_of_blocks_changes_nothing():
    alloc = PrefixCachingAllocator(num_blocks=2, block_size=2)
    alloc.allocate_with_prefix("a", [1, 2, 3, 4])
    with pytest.raises(OutOfBlocksError):
        alloc.append_token("a", 5)
    assert alloc.num_tokens("a") == 4
    alloc.check_invariants()


def test_free_returns_blocks_in_reverse_and_keeps_their_hashes():
    alloc = PrefixCachingAllocator(num_blocks=5, block_size=2)
    alloc.allocate_with_prefix("a", [1, 2, 3, 4, 5])
    alloc.free("a")
    assert alloc.free_queue.block_ids() == [3, 4, 2, 1, 0]
    assert alloc.block_hash(0) and alloc.block_hash(1) and alloc.block_hash(2) is None


def test_free_uncached_first_puts_hashless_blocks_at_the_head():
    alloc = PrefixCachingAllocator(num_blocks=5, block_size=2, free_uncached_first=True)
    alloc.allocate_with_prefix("a", [1, 2, 3, 4, 5])
    alloc.free("a")
    assert alloc.free_queue.block_ids() == [2, 3, 4, 1, 0]


def test_caching_disabled_is_the_plain_paged_pool():
    alloc = PrefixCachingAllocator(num_blocks=6, block_size=4, enable_caching=False)
    alloc.allocate_with_prefix("a", list(range(9)))
    alloc.free("a")
    assert alloc.allocate_with_prefix("b", list(range(9))) == (0, 9)
    assert alloc.num_cached_blocks == 0 and not alloc.cached_blocks


def test_stats_count_requests_hits_and_rate():
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    alloc.allocate_with_prefix("a", list(range(9)))
    alloc.allocate_with_prefix("b", list(range(9)))
    s = alloc.stats
    assert (s.requests, s.queried_tokens, s.hit_tokens) == (2, 18, 8)
    assert s.hit_rate == pytest.approx(8 / 18)
    assert s.as_dict()["hit_rate"] == round(8 / 18, 4)


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    alloc = PrefixCachingAllocator(num_blocks=6, block_size=4)
    alloc.allocate_with_prefix("a", list(range(9)))
    hashes = [alloc.block_hash(b) for b in range(6)]
    assert alloc.reset_prefix_cache() is False
    assert [alloc.block_hash(b) for b in range(6)] == hashes
    alloc.free("a")
    assert alloc.reset_prefix_cache() is True
    assert alloc.num_cached_blocks == 0 and alloc.peek(list(range(9))) == 0


# --- bad input: clear errors, nothing changed ----------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"num_blocks": 0, "block_size": 4}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
        ({"num_blocks": 4.0, "block_size": 4}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 4, "hash_algo": "md5"}, "hash_algo"),
    ],
)
def test_bad_pool_arguments(kwargs, error):
    with pytest.raises(ValueError, match=error):
        PrefixCachingAllocator(**kwargs)


@pytest.mark.parametrize(
    "request_id, tokens, salt, exc, message",
    [
        ("r", [], None, ValueError, "empty"),
        ("r", [1, "2"], None, TypeError, "int token ids"),
        ("r", [1, 2.0], None, TypeError, "int token ids"),
        ("r", [1, -2], None, TypeError, "non-negative"),
        ("r", [True], None, TypeError, "int token ids"),
        ("r", "hello", None, TypeError, "list of int"),
        ("r", list(range(17)), None, ValueError, "whole pool"),
        ("r", [1], 5, TypeError, "cache_salt"),
        ("", [1], None, TypeError, "request_id"),
        ("busy", [1], None, ValueError, "already running"),
    ],
)
def test_bad_allocations_raise_and_change_nothing(request_id, tokens, salt, exc, message):
    alloc = PrefixCachingAllocator(num_blocks=4, block_size=4)
    alloc.allocate_with_prefix("busy", [7, 7, 7, 7, 7])
    before = (alloc.free_queue.block_ids(), dict(alloc.block_tables), alloc.stats.as_dict())
    with pytest.raises(exc, match=message):
        alloc.allocate_with_prefix(request_id, tokens, cache_salt=salt)
    assert before == (alloc.free_queue.block_ids(), dict(alloc.block_tables), alloc.stats.as_dict())
    alloc.check_invariants()


def test_unknown_request_ids_are_refused():
    alloc = PrefixCachingAllocator(num_blocks=4, block_size=4)
    with pytest.raises(KeyError, match="unknown request"):
        alloc.free("nope")
    with pytest.raises(KeyError, match="unknown request"):
        alloc.append_token("nope", 1)
    alloc.allocate_with_prefix("r", [1])
    alloc.free("r")
    with pytest.raises(KeyError, match="already freed"):
        alloc.free("r")
    alloc.allocate_with_prefix("s", [1])
    with pytest.raises(TypeError, match="token"):
        alloc.append_token("s", "x")
    assert alloc.num_tokens("s") == 1


def test_a_salt_never_equals_an_extra_key_with_the_same_text():
    assert compute_block_hashes([1, 2], 2, cache_salt="x") != compute_block_hashes([1, 2], 2, extra_keys=("x",))


def test_free_with_num_computed_tokens_uncaches_blocks_nobody_wrote():
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    alloc.allocate_with_prefix("warm", list(range(9)))
    alloc.free("warm")
    # 13 tokens: 2 blocks hit, blocks for tokens 8..11 and 12 are new; the model "fails"
    # after computing token 9, so the block of tokens 8..11 was cached but never fully written.
    alloc.allocate_with_prefix("r", list(range(12)) + [50])
    alloc.free("r", num_computed_tokens=10)
    assert alloc.peek(list(range(13))) == 8  # the two hit blocks are still cached; block 2 is not
    alloc.check_invariants()
    alloc.allocate_with_prefix("s", [1, 2])
    with pytest.raises(ValueError, match="num_computed_tokens"):
        alloc.free("s", num_computed_tokens=3)
    assert alloc.block_tables["s"]  # a refused free changes nothing


