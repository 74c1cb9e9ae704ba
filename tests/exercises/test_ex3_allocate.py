"""Exercise 3: allocate with prefix (exercises/allocator.py). The touch and evict steps
only matter once blocks come back free, so exercise 4's tests check them."""

import pytest

from grading import exercise
from prefix_caching import OutOfBlocksError

impl = exercise("allocator")


def pool(num_blocks=10, block_size=4):
    return impl.PrefixCachingAllocator(num_blocks, block_size)


def test_a_cold_request_gets_blocks_from_the_head_and_hits_nothing():
    alloc = pool()
    assert alloc.allocate_with_prefix("r0", list(range(15))) == (0, 15)
    assert alloc.block_tables["r0"] == [0, 1, 2, 3]
    assert alloc.free_queue.block_ids() == [4, 5, 6, 7, 8, 9]
    assert [alloc.blocks[b].ref_cnt for b in range(5)] == [1, 1, 1, 1, 0]


def test_full_blocks_are_cached_at_once_and_the_partial_one_is_not():
    alloc = pool()
    alloc.allocate_with_prefix("r0", list(range(15)))
    assert [alloc.blocks[b].block_hash is not None for b in range(4)] == [True, True, True, False]


def test_a_request_sharing_full_blocks_reuses_them():
    alloc = pool()
    alloc.allocate_with_prefix("r0", list(range(15)))
    # the design doc's Time 3: 10 shared tokens, but only 2 full blocks (8 tokens) match
    assert alloc.allocate_with_prefix("r1", list(range(10)) + [100, 101, 102, 103]) == (8, 6)
    assert alloc.block_tables["r1"][:2] == [0, 1]
    assert alloc.blocks[0].ref_cnt == alloc.blocks[1].ref_cnt == 2
    assert alloc.blocks[2].ref_cnt == 1


def test_the_lookup_stops_at_the_first_miss():
    alloc = pool(20)
    alloc.allocate_with_prefix("a", list(range(13)))
    prompt = list(range(13))
    prompt[5] = 99  # block 1 differs; block 2 holds the same tokens but has another parent
    assert alloc.allocate_with_prefix("b", prompt).num_cached_tokens == 4


@pytest.mark.parametrize("length, expected", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_at_least_one_prompt_token_is_left_to_compute(length, expected):
    alloc = pool(20)
    alloc.allocate_with_prefix("warm", list(range(16)))
    assert alloc.allocate_with_prefix("r", list(range(length))).num_cached_tokens == expected


def test_a_hit_needs_the_same_tokens_not_only_the_same_hash():
    alloc = pool()
    alloc.allocate_with_prefix("a", list(range(9)))
    alloc.blocks[1].token_ids = [7, 7, 7, 7]  # pretend other content sits under block 1's hash
    assert alloc.allocate_with_prefix("b", list(range(9))).num_cached_tokens == 4


def test_cache_salt_keeps_tenants_apart():
    alloc = pool(20)
    alloc.allocate_with_prefix("a", list(range(9)), cache_salt="tenant-a")
    assert alloc.allocate_with_prefix("b", list(range(9)), cache_salt="tenant-b").num_cached_tokens == 0
    assert alloc.allocate_with_prefix("c", list(range(9)), cache_salt="tenant-a").num_cached_tokens == 8


def test_without_room_it_refuses_and_changes_nothing():
    alloc = pool(4)
    alloc.allocate_with_prefix("a", list(range(9)))  # 3 of the 4 blocks
    before = (alloc.free_queue.block_ids(), dict(alloc.block_tables), [alloc.blocks[b].ref_cnt for b in range(4)])
    with pytest.raises(OutOfBlocksError):
        alloc.allocate_with_prefix("b", list(range(100, 109)))  # needs 3, 1 is free
    assert before == (alloc.free_queue.block_ids(), dict(alloc.block_tables), [alloc.blocks[b].ref_cnt for b in range(4)])
    assert "b" not in alloc.block_tables
