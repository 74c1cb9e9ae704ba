"""Exercise 4: free in reverse order (exercises/allocator.py), then what it makes possible:
touching free cached blocks, evicting from the head, and the design doc's worked example."""

from grading import exercise

impl = exercise("allocator")


def pool(num_blocks=10, block_size=4):
    return impl.PrefixCachingAllocator(num_blocks, block_size)


def test_blocks_join_the_tail_last_block_first():
    alloc = pool(5, 2)
    alloc.allocate_with_prefix("a", [1, 2, 3, 4, 5])  # blocks 0 1 2
    alloc.free("a")
    assert alloc.free_queue.block_ids() == [3, 4, 2, 1, 0]
    assert "a" not in alloc.block_tables
    assert [alloc.blocks[b].ref_cnt for b in range(5)] == [0] * 5


def test_freed_blocks_keep_their_hash():
    alloc = pool(5, 2)
    alloc.allocate_with_prefix("a", [1, 2, 3, 4, 5])
    hashes = [alloc.blocks[b].block_hash for b in range(3)]
    alloc.free("a")
    assert [alloc.blocks[b].block_hash for b in range(3)] == hashes


def test_a_shared_block_stays_until_its_last_user_leaves():
    alloc = pool()
    alloc.allocate_with_prefix("a", list(range(9)))  # 0 1 2
    alloc.allocate_with_prefix("b", list(range(8)) + [50])  # hits 0 1, new 3
    alloc.free("a")
    assert alloc.blocks[0].ref_cnt == alloc.blocks[1].ref_cnt == 1
    assert 0 not in alloc.free_queue.block_ids() and 1 not in alloc.free_queue.block_ids()
    alloc.free("b")
    assert alloc.free_queue.block_ids()[-2:] == [1, 0]


def test_a_hit_on_a_free_block_takes_it_out_of_the_middle_of_the_queue():
    alloc = pool(6)
    alloc.allocate_with_prefix("a", list(range(9)))  # 0 1 2
    alloc.free("a")
    assert alloc.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    assert alloc.allocate_with_prefix("b", list(range(5))) == (4, 1)  # hits block 0
    assert alloc.block_tables["b"] == [0, 3]
    assert alloc.free_queue.block_ids() == [4, 5, 2, 1]


def test_popping_a_cached_block_evicts_it():
    alloc = pool(3)
    alloc.allocate_with_prefix("a", list(range(9)))
    alloc.free("a")
    alloc.allocate_with_prefix("b", list(range(50, 62)))  # needs all 3 blocks: 0 and 1 are evicted
    alloc.free("b")
    assert alloc.allocate_with_prefix("c", list(range(9))).num_cached_tokens == 0


def test_hits_are_touched_before_new_blocks_are_popped():
    alloc = pool(3)
    alloc.allocate_with_prefix("a", list(range(8)))  # blocks 0 1, both full and cached
    alloc.free("a")  # queue: 2 1 0
    alloc.allocate_with_prefix("b", [90, 91, 92, 93])  # pops 2
    alloc.free("b")  # queue: 1 0 2, a cached hit at the head
    # Popping before touching would take block 1 from the head, evicting this request's own hit.
    assert alloc.allocate_with_prefix("c", list(range(8)) + [9]) == (8, 1)
    assert alloc.block_tables["c"] == [0, 1, 2]
    assert alloc.free_queue.block_ids() == []


def test_finish_line_the_design_docs_worked_example_block_for_block():
    alloc = pool()
    r0 = list(range(15))
    # Times 1 and 2 in one step: this allocator has no decode, so request 0 arrives with the
    # two tokens it would have decoded (block 3 full and cached, block 4 holding one token).
    alloc.allocate_with_prefix("request 0", r0 + [15, 16])
    assert alloc.block_tables["request 0"] == [0, 1, 2, 3, 4]
    # Time 3
    assert alloc.allocate_with_prefix("request 1", r0[:10] + [100, 101, 102, 103]) == (8, 6)
    assert alloc.block_tables["request 1"] == [0, 1, 5, 6]
    # Time 4: blocks 4, 3, 2 join the tail in reverse; 2 and 3 keep their hash
    alloc.free("request 0")
    assert alloc.free_queue.block_ids() == [7, 8, 9, 4, 3, 2]
    assert alloc.blocks[2].block_hash is not None and alloc.blocks[3].block_hash is not None
    # Time 5
    alloc.free("request 1")
    assert alloc.free_queue.block_ids() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    # Time 6: hits 0 1 2 touched first, then 5 blocks popped from the head; 3 is evicted
    assert alloc.allocate_with_prefix("request 2", r0[:12] + list(range(200, 217))) == (12, 17)
    assert alloc.block_tables["request 2"] == [0, 1, 2, 7, 8, 9, 4, 3]
    assert alloc.free_queue.block_ids() == [6, 5]
    assert alloc.blocks[3].block_hash is None, "block 3 was evicted and now holds request 2's partial last block"
