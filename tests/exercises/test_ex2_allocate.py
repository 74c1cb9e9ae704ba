"""Exercise 2: allocate with prefix (exercises/allocator.py).

Needs exercise 1 (the allocator hashes with your compute_block_hashes). The free queue is a
stand-in (exercises/given.py), and blocks come back free through `release`, exercise 4's
rule run by the grader: so this exercise is graded before you write the queue or free.
Every call also runs on prefix_caching's allocator, and the states are compared.

Token ids, request ids and salts are drawn anew each run (grading.SEED). A test writes small
token ids that stand for drawn ones (`vocabulary`), so its prompts share exactly the blocks
they share as written; the block ids and tables it expects are the allocator's own numbers
and stay as written.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator import OutOfBlocksError
from grading import GRADING, drawn
from twins import RemoteAllocator

EXERCISE = "allocator"
VOCAB = 262_144  # Gemma 3's vocabulary: every drawn id is a real one


def vocabulary(rng):
    """An injective map from the token ids below 300 a test writes to ids drawn for this run:
    ids = vocabulary(rng); ids(range(3)) -> [20_511, 7, 187_002]; ids([1, 1]) -> [7, 7]."""
    drawn_ids = rng.sample(range(VOCAB), 300)
    return lambda written: [drawn_ids[t] for t in written]


def inputs(test: str, *requests: str):
    """One test's token ids (a vocabulary) and request ids, drawn for this run:
    inputs("cold", "a", "b") -> (ids, ['a-4031', 'b-77160'])."""
    rng = drawn(test)
    numbers = rng.sample(range(10**6), len(requests))
    return vocabulary(rng), [f"{request}-{number}" for request, number in zip(requests, numbers)]


@pytest.fixture
def pool(child):
    def make(num_blocks=10, block_size=4):
        return RemoteAllocator(child, num_blocks, block_size)

    return make


def release(alloc, request_id: str) -> None:
    """What exercise 4's free does: ref counts down, last block first; a block that reaches
    0 joins the tail of the free queue and keeps its hash and tokens."""
    alloc.release(request_id)


def state(alloc) -> dict:
    return {
        "free queue": alloc.free_queue.block_ids(),
        "block tables": {r: list(t) for r, t in alloc.block_tables.items()},
        "ref counts": [b.ref_cnt for b in alloc.blocks],
    }


def assert_refused(alloc, request_id: str, prompt: list[int], why: str) -> None:
    """allocate_with_prefix must raise OutOfBlocksError and leave everything as it was."""
    before = state(alloc)
    try:
        alloc.allocate_with_prefix(request_id, prompt)
    except OutOfBlocksError:
        pass
    except IndexError as err:
        pytest.fail(f"the free queue ran dry halfway through allocating {request_id!r} (IndexError: {err}), "
                    f"leaving blocks taken that no block table holds: {why}. Check for room before touching "
                    "or taking any block, and raise OutOfBlocksError")
    else:
        pytest.fail(f"request {request_id!r} got blocks {alloc.block_tables.get(request_id)}, but {why}: "
                    "raise OutOfBlocksError")
    assert state(alloc) == before, (
        f"a refused request must change nothing (check for room before touch and take):\n"
        f"before {before}\nafter  {state(alloc)}"
    )


def test_a_cold_request_gets_blocks_from_the_head_and_hits_nothing(pool):
    ids, (r0,) = inputs("cold request", "r0")
    alloc = pool()
    got = alloc.allocate_with_prefix(r0, ids(range(15)))
    assert got == (0, 15), f"a cold request of 15 tokens hits nothing: expected (0, 15), got {tuple(got)}"
    assert alloc.block_tables[r0] == [0, 1, 2, 3], (
        f"15 tokens need ceil(15 / 4) = 4 blocks, taken from the head of the free queue: expected [0, 1, 2, 3], "
        f"got {alloc.block_tables[r0]}"
    )
    assert alloc.free_queue.block_ids() == [4, 5, 6, 7, 8, 9], "the 4 blocks taken must leave the free queue"
    assert [alloc.blocks[b].ref_cnt for b in range(5)] == [1, 1, 1, 1, 0], "each block taken has ref_cnt 1"


def test_full_blocks_are_cached_at_once_and_the_partial_one_is_not(pool):
    ids, (r0,) = inputs("full blocks cached", "r0")
    alloc = pool()
    alloc.allocate_with_prefix(r0, ids(range(15)))
    cached = [alloc.blocks[b].block_hash is not None for b in range(4)]
    assert cached == [True, True, True, False], (
        f"blocks 0-2 are full and get their hash at once; block 3 holds 3 of 4 tokens and gets none. Got {cached} "
        "(True = has a hash)"
    )


def test_a_request_sharing_full_blocks_reuses_them(pool):
    ids, (r0, r1) = inputs("sharing full blocks", "r0", "r1")
    alloc = pool()
    alloc.allocate_with_prefix(r0, ids(range(15)))
    # the design doc's Time 3: 10 shared tokens, but only 2 full blocks (8 tokens) match
    got = alloc.allocate_with_prefix(r1, ids([*range(10), 100, 101, 102, 103]))
    assert got == (8, 6), f"{r1} shares 2 full blocks (8 tokens) with {r0}: expected (8, 6), got {tuple(got)}"
    assert alloc.block_tables[r1][:2] == [0, 1], f"{r1}'s table starts with its hits, blocks 0 and 1"
    assert alloc.blocks[0].ref_cnt == alloc.blocks[1].ref_cnt == 2, "a hit adds 1 to the block's ref_cnt"
    assert alloc.blocks[2].ref_cnt == 1


def test_the_lookup_stops_at_the_first_miss(pool):
    ids, (a, b) = inputs("lookup stops", "a", "b")
    alloc = pool(20)
    alloc.allocate_with_prefix(a, ids(range(13)))
    # token 5 differs, so block 1 does; block 2 holds the same tokens but has another parent
    got = alloc.allocate_with_prefix(b, ids([*range(5), 99, *range(6, 13)])).num_cached_tokens
    assert got == 4, f"only block 0 is shared: expected 4 cached tokens, got {got}"


def test_a_hit_needs_the_same_tokens_and_the_block_table_stops_at_the_first_miss(pool):
    ids, (a, b) = inputs("same tokens", "a", "b")
    alloc = pool()
    alloc.allocate_with_prefix(a, ids(range(13)))  # blocks 0 1 2 cached, 3 partial
    alloc.blocks[1].token_ids = ids([7, 7, 7, 7])  # pretend other content sits under block 1's hash
    got = alloc.allocate_with_prefix(b, ids(range(13)))
    table = alloc.block_tables[b]
    assert table[0] == 0 and 1 not in table, (
        f"block 1's hash matches but its tokens do not: it is a miss, yet the block table is {table}"
    )
    assert 2 not in table, (
        f"the block table must stop at the first miss: block 1 missed, yet the table is {table}, so tokens 4-7 "
        f"would read block {table[1]}'s K/V, computed for other tokens. break, not continue"
    )
    assert tuple(got) == (4, 9) and table == [0, 4, 5, 6], (
        f"one hit (block 0), then 3 new blocks from the head: expected (4, 9) and [0, 4, 5, 6], "
        f"got {tuple(got)} and {table}"
    )


def test_a_block_cached_after_a_miss_is_not_a_hit(pool):
    ids, (a, b) = inputs("cached after a miss", "a", "b")
    alloc = pool(20)
    alloc.allocate_with_prefix(a, ids(range(13)))  # blocks 0 1 2 cached, 3 partial
    release(alloc, a)
    alloc.evict(1)  # block 1's hash leaves the cache map; block 2's stays
    got = alloc.allocate_with_prefix(b, ids(range(13)))
    table = alloc.block_tables[b]
    assert 2 not in table, (
        f"the block table must stop at the first miss: block 1's hash is no longer cached, yet {b}'s table is "
        f"{table}, so {b} would read block 2's K/V for tokens 8-11 with no K/V for tokens 4-7 beside them. A missed "
        "hash ends the lookup (break, not continue), as a missed token guard does"
    )
    assert tuple(got) == (4, 9) and table == [0, 4, 5, 6], (
        f"one hit (block 0), then 3 new blocks from the head: expected (4, 9) and [0, 4, 5, 6], "
        f"got {tuple(got)} and {table}"
    )


@pytest.mark.parametrize("length, expected", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_at_least_one_prompt_token_is_left_to_compute(pool, length, expected):
    ids, (warm, r) = inputs(f"one token left {length}", "warm", "r")
    alloc = pool(20)
    alloc.allocate_with_prefix(warm, ids(range(16)))
    got = alloc.allocate_with_prefix(r, ids(range(length))).num_cached_tokens
    assert got == expected, (
        f"a {length}-token prompt whose every block is cached may hit at most (len - 1) // block_size = "
        f"{expected // 4} blocks ({expected} tokens): the model must compute one token to give logits. Got {got}"
    )


def test_cache_salt_keeps_tenants_apart(pool):
    ids, (a, b, c, tenant_a, tenant_b) = inputs("tenants", "a", "b", "c", "tenant", "tenant")
    alloc = pool(20)
    alloc.allocate_with_prefix(a, ids(range(9)), cache_salt=tenant_a)
    got = alloc.allocate_with_prefix(b, ids(range(9)), cache_salt=tenant_b).num_cached_tokens
    assert got == 0, (
        f"tenant {tenant_b!r} hit {got} tokens of tenant {tenant_a!r}'s prompt: pass cache_salt on to "
        "compute_block_hashes")
    got = alloc.allocate_with_prefix(c, ids(range(9)), cache_salt=tenant_a).num_cached_tokens
    assert got == 8, f"tenant {tenant_a!r} must still hit its own 2 full blocks (8 tokens), got {got}"


def test_without_room_it_refuses_and_changes_nothing(pool):
    ids, (a, b) = inputs("without room", "a", "b")
    alloc = pool(4)
    alloc.allocate_with_prefix(a, ids(range(9)))  # 3 of the 4 blocks
    assert_refused(alloc, b, ids(range(100, 109)), "it needs 3 blocks and 1 is free")


def test_the_room_check_counts_the_hits_that_sit_in_the_free_queue(pool):
    ids, (a, x, c) = inputs("room for free hits", "a", "x", "c")
    alloc = pool(6)
    alloc.allocate_with_prefix(a, ids(range(9)))  # blocks 0 1 2; 0 and 1 full and cached
    alloc.allocate_with_prefix(x, ids(range(50, 62)))  # blocks 3 4 5: the pool is full
    release(alloc, a)  # free queue: 2 1 0, blocks 0 and 1 still cached
    # 14 tokens, 4 blocks: hits on 0 and 1, 2 new ones. 2 new <= 3 free, but touching the hits
    # takes 0 and 1 out of the free queue too, and 2 + 2 > 3.
    assert_refused(alloc, c, ids([*range(8), *range(70, 76)]),
                   "it needs 2 new blocks plus its 2 hits that are free (ref_cnt 0), 4 blocks of the free queue, "
                   "and only 3 are free")


def test_hits_in_use_take_no_free_block(pool):
    ids, (a, b) = inputs("hits in use", "a", "b")
    alloc = pool(4)
    alloc.allocate_with_prefix(a, ids(range(12)))  # blocks 0 1 2, all full and cached; 1 block free
    try:
        got = alloc.allocate_with_prefix(b, ids([*range(8), 70, 71, 72]))  # hits 0 and 1, 1 new block
    except OutOfBlocksError:
        pytest.fail(f"{b} was refused, but it fits: its 11 tokens need 3 blocks, its hits 0 and 1 are {a}'s (in use, "
                    "ref_cnt 1, not in the free queue) and only its third block is new, and 1 block is free. The "
                    "room check counts the new blocks and the hits whose ref_cnt is 0, not every hit", pytrace=False)
    assert tuple(got) == (8, 3) and alloc.block_tables[b] == [0, 1, 3], (
        f"{b} hits blocks 0 and 1 and takes block 3: expected (8, 3) and [0, 1, 3], got {tuple(got)} and "
        f"{alloc.block_tables[b]}"
    )


def test_a_hit_on_a_free_block_takes_it_out_of_the_middle_of_the_queue(pool):
    ids, (a, b) = inputs("hit in the middle", "a", "b")
    alloc = pool(6)
    alloc.allocate_with_prefix(a, ids(range(9)))  # 0 1 2
    release(alloc, a)  # free queue: 3 4 5 2 1 0
    got = alloc.allocate_with_prefix(b, ids(range(5)))
    assert tuple(got) == (4, 1), f"{b} hits block 0, free but still cached: expected (4, 1), got {tuple(got)}"
    assert alloc.block_tables[b] == [0, 3], f"expected the hit, then the head: [0, 3], got {alloc.block_tables[b]}"
    assert alloc.free_queue.block_ids() == [4, 5, 2, 1], (
        f"touching block 0 must remove it from the free queue, and block 3 must be taken from the head: expected "
        f"[4, 5, 2, 1], got {alloc.free_queue.block_ids()}"
    )
    assert alloc.blocks[0].ref_cnt == 1, "a touched block that was free goes from ref_cnt 0 to 1"


def test_hits_are_touched_before_new_blocks_are_taken(pool):
    ids, (a, b, c) = inputs("touch before take", "a", "b", "c")
    alloc = pool(3)
    alloc.allocate_with_prefix(a, ids(range(8)))  # blocks 0 1, both full and cached
    release(alloc, a)  # free queue: 2 1 0
    alloc.allocate_with_prefix(b, ids([90, 91, 92, 93]))  # takes 2
    release(alloc, b)  # free queue: 1 0 2, a cached hit at the head
    got = alloc.allocate_with_prefix(c, ids([*range(8), 9]))
    assert tuple(got) == (8, 1) and alloc.block_tables[c] == [0, 1, 2], (
        f"{c} hits blocks 0 and 1 and takes block 2: expected (8, 1) and [0, 1, 2], got {tuple(got)} and "
        f"{alloc.block_tables[c]}. Touch the hits before taking new blocks, or the take pops block 1 from the "
        f"head and evicts {c}'s own hit"
    )
    assert alloc.free_queue.block_ids() == [], (
        f"every block is in use, yet the free queue holds {alloc.free_queue.block_ids()}"
    )


def test_taking_a_cached_block_evicts_it(pool):
    ids, (a, b, c) = inputs("take evicts", "a", "b", "c")
    alloc = pool(3)
    alloc.allocate_with_prefix(a, ids(range(9)))
    release(alloc, a)
    alloc.allocate_with_prefix(b, ids(range(50, 62)))  # needs all 3 blocks: 0 and 1 are evicted
    release(alloc, b)
    got = alloc.allocate_with_prefix(c, ids(range(9))).num_cached_tokens
    assert got == 0, f"blocks 0 and 1 were reused by {b}, yet {c} hit {got} tokens of {a}'s old content"


def test_an_evicted_hash_leaves_the_cache_map(pool):
    ids, (a, x, b, c, d) = inputs("evicted hash", "a", "x", "b", "c", "d")
    block = ids([1, 2, 3, 4])
    alloc = pool(5)
    alloc.allocate_with_prefix(a, block)  # block 0, cached
    alloc.allocate_with_prefix(x, ids([9]))  # block 1
    release(alloc, a)
    release(alloc, x)  # free queue: 2 3 4 0 1
    evicted = alloc.blocks[0].block_hash
    alloc.allocate_with_prefix(b, ids(range(100, 116)))  # takes 2 3 4 0: block 0 is evicted
    still_mapped = evicted in alloc.cached_blocks  # a bool: the hash itself is a 32-byte blob
    assert not still_mapped, (
        f"block 0 was taken from the free queue and now holds {b}'s tokens, yet its old hash is still in "
        "self.cached_blocks: when a take evicts a block, its hash must leave the map too"
    )
    alloc.allocate_with_prefix(c, block)  # a's block again, computed into block 1
    release(alloc, c)
    release(alloc, b)
    got = alloc.allocate_with_prefix(d, ids([1, 2, 3, 4, 5])).num_cached_tokens
    assert got == 4, f"block 1 holds {block} and is cached: {d} should hit 4 tokens, got {got}"


def test_evicting_one_of_two_blocks_of_the_same_content_keeps_the_other(pool):
    ids, (a, b, x, c) = inputs("two blocks, one evicted", "a", "b", "x", "c")
    block, longer = ids([1, 2, 3, 4]), ids([1, 2, 3, 4, 5])
    alloc = pool(6)
    alloc.allocate_with_prefix(a, block)  # block 0
    alloc.allocate_with_prefix(b, block)  # all cached, but a token must be computed: block 1 again
    assert alloc.block_tables[b] == [1] and alloc.blocks[1].block_hash == alloc.blocks[0].block_hash, (
        f"{b}'s 4 tokens are all in block 0, but at least one token is computed, so {b}'s only block is a new one, "
        f"block 1, holding the same content under the same hash: got {b}'s table {alloc.block_tables[b]}")
    release(alloc, a)
    release(alloc, b)  # free queue: 2 3 4 5 0 1
    alloc.allocate_with_prefix(x, ids(range(100, 120)))  # takes 2 3 4 5 0: block 0 is evicted, block 1 is not
    release(alloc, x)
    got = alloc.allocate_with_prefix(c, longer)
    assert tuple(got) == (4, 1), (
        f"blocks 0 and 1 both held {block} under one hash; {x}'s take evicted block 0 alone, yet {c}, sending "
        f"{longer}, got {tuple(got)}, not (4, 1): block 1 still holds that content and is still cached. "
        "Evicting a block takes that block out of the cache map, not the hash with every block under it (that is "
        "why the map keeps {block_id: block} for each hash)"
    )


def test_of_two_blocks_under_one_hash_the_hit_is_the_one_cached_first(pool):
    ids, (f, a, g, b, c) = inputs("first cached", "f", "a", "g", "b", "c")
    alloc = pool(6)
    alloc.allocate_with_prefix(f, ids(range(100, 112)))  # blocks 0 1 2
    alloc.allocate_with_prefix(a, ids(range(1, 9)))  # blocks 3 4, both cached
    release(alloc, f)  # free queue: 5 2 1 0
    alloc.allocate_with_prefix(g, ids(range(200, 204)))  # block 5
    alloc.allocate_with_prefix(b, ids(range(1, 9)))  # hits 3; its last block computed again: block 2
    assert alloc.block_tables[b] == [3, 2], f"{b} should hit block 3 and take block 2, got {alloc.block_tables[b]}"
    got = alloc.allocate_with_prefix(c, ids(range(1, 10)))
    assert alloc.block_tables[c] == [3, 4, 1], (
        f"blocks 4 and 2 both hold {ids(range(5, 9))} after the same block 3, block 4 cached first; {c}, sending "
        f"{ids(range(1, 10))}, got the table {alloc.block_tables[c]}, not [3, 4, 1]: of the blocks under one hash, "
        "the hit is the block cached first (the first of the hash's {block_id: block} map, in the order blocks "
        f"joined it), not the lowest id. It found {tuple(got)}")


def test_a_refusal_after_hits_in_the_middle_of_the_free_queue_keeps_its_order(pool):
    ids, (a, x, y, c) = inputs("refusal keeps order", "a", "x", "y", "c")
    alloc = pool(7)
    alloc.allocate_with_prefix(a, ids(range(1, 10)))  # blocks 0 1 2; 0 and 1 cached
    alloc.allocate_with_prefix(x, ids(range(50, 62)))  # blocks 3 4 5
    alloc.allocate_with_prefix(y, ids(range(90, 94)))  # block 6, held
    release(alloc, a)
    release(alloc, x)  # free queue: 2 1 0 5 4 3, the hits 0 and 1 in the middle, not at the tail
    assert_refused(alloc, c, ids([*range(1, 9), *range(70, 87)]),
                   "it needs 5 new blocks beside its 2 hits that sit in the free queue, 7 of its 6 blocks. Check for "
                   "room before touching a hit: touched and put back, a hit goes to the tail, and the refusal has "
                   "changed the LRU order")


def test_a_hit_adds_one_to_the_ref_count_of_a_block_in_use(pool):
    ids, (a, b, c) = inputs("hit adds one", "a", "b", "c")
    alloc = pool()
    for i, request_id in enumerate((a, b, c)):
        alloc.allocate_with_prefix(request_id, ids([*range(8), 100 + i]))
    counts = [alloc.blocks[i].ref_cnt for i in (0, 1)]
    assert counts == [3, 3], (
        f"three requests hold blocks 0 and 1, yet their ref counts are {counts}: a hit adds one to ref_cnt (0 -> 1 "
        "for a free block, 2 -> 3 for one two requests hold), it does not set it. A block three requests share "
        "would go back to the free queue after two leave, and be evicted under the third"
    )
    release(alloc, a)
    release(alloc, b)
    assert 0 not in alloc.free_queue.block_ids(), (
        f"{c} still holds block 0: it must not be free after {a} and {b} leave")


def test_a_block_taken_from_the_free_queue_holds_only_its_new_tokens(pool):
    ids, (a, b) = inputs("only new tokens", "a", "b")
    alloc = pool(3)
    alloc.allocate_with_prefix(a, ids(range(12)))  # blocks 0 1 2, all full and cached
    release(alloc, a)  # free queue: 2 1 0
    alloc.allocate_with_prefix(b, ids([50, 51]))  # takes block 2 (evicts it): a partial block of 2 tokens
    got = alloc.blocks[2].token_ids
    assert got == ids([50, 51]), (
        f"block 2 held {a}'s tokens {ids(range(8, 12))}; {b} took it for its 2 tokens {ids([50, 51])}, yet its "
        f"token_ids are {got}: a block taken from the free queue holds only its new owner's tokens (a partial block "
        "too), or a later lookup compares against the previous owner's"
    )


# --- any sequence, compared with the reference ---------------------------------------------------------

# Prompts built from shared prefixes (none, a block, that block and the next, a block of one
# id four times), then up to 9 ids, each one of four: this run's ids, written as the ids they
# stand for (vocabulary).
ANY = vocabulary(drawn("any sequence"))
PREFIXES = [[], ANY([1, 2, 3, 4]), ANY([1, 2, 3, 4, 5, 6, 7, 8]), ANY([9, 9, 9, 9])]
ALLOCATE = st.tuples(st.just("allocate"), st.sampled_from(PREFIXES),
                     st.lists(st.sampled_from(ANY([0, 1, 2, 3])), max_size=9), st.sampled_from([None, None, "t"]))
OPERATIONS = st.lists(st.one_of(ALLOCATE, st.tuples(st.just("release"), st.integers(0, 7))), min_size=1, max_size=10)


def replay(alloc, operations) -> None:
    """Allocate prompts built from shared prefixes; release the running requests by index."""
    running, count = [], 0
    for operation in operations:
        if operation[0] == "allocate":
            _, prefix, rest, salt = operation
            prompt = (prefix + rest) or ANY([0])
            count += 1
            try:
                alloc.allocate_with_prefix(f"r{count}", prompt, salt)
                running.append(f"r{count}")
            except OutOfBlocksError:
                pass
        elif running:
            release(alloc, running.pop(operation[1] % len(running)))
        alloc.check()


@settings(GRADING, max_examples=40)
@given(OPERATIONS)
def test_any_sequence_of_requests_matches_the_reference(pool, operations):
    replay(pool(6), operations)
