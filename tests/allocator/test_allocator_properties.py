"""Random operation sequences must never break the pool's invariants (hypothesis)."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from allocator import OutOfBlocksError, PrefixCachingAllocator, compute_block_hashes

# A tiny vocabulary and shared prefixes make hits, duplicates and evictions common.
PREFIXES = [[], [1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [9, 9, 9, 9, 9, 9]]
prompts = st.builds(
    lambda prefix, tail: prefix + tail,
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 3), min_size=1, max_size=9),
)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = None
        self.next_id = 0
        self.content = {}  # every block hash ever computed -> the tokens it names

    @rule(
        num_blocks=st.integers(1, 8),
        block_size=st.integers(1, 4),
        free_uncached_first=st.booleans(),
        algo=st.sampled_from(["sha256", "xxhash"]),
    )
    @precondition(lambda self: self.alloc is None)
    def make_pool(self, num_blocks, block_size, free_uncached_first, algo):
        self.alloc = PrefixCachingAllocator(
            num_blocks, block_size, hash_algo=algo, free_uncached_first=free_uncached_first
        )

    @rule(tokens=prompts, salt=st.sampled_from([None, None, "t1"]))
    @precondition(lambda self: self.alloc is not None)
    def allocate(self, tokens, salt):
        alloc = self.alloc
        rid = f"r{self.next_id}"
        self.next_id += 1
        expected_hit = alloc.peek(tokens, cache_salt=salt)
        before = (alloc.free_queue.block_ids(), {k: list(v) for k, v in alloc.block_tables.items()})
        try:
            result = alloc.allocate_with_prefix(rid, tokens, cache_salt=salt)
        except (OutOfBlocksError, ValueError):
            assert before == (alloc.free_queue.block_ids(), {k: list(v) for k, v in alloc.block_tables.items()})
            assert rid not in alloc.block_tables
            return
        assert result.num_cached_tokens == expected_hit
        assert result.num_cached_tokens + result.num_new_tokens == len(tokens)
        assert result.num_new_tokens >= 1

    @rule(data=st.data(), token=st.integers(0, 3))
    @precondition(lambda self: self.alloc is not None and self.alloc.block_tables)
    def append(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.alloc.block_tables)))
        n = self.alloc.num_tokens(rid)
        try:
            self.alloc.append_token(rid, token)
        except OutOfBlocksError:
            assert self.alloc.num_tokens(rid) == n

    @rule(data=st.data())
    @precondition(lambda self: self.alloc is not None and self.alloc.block_tables)
    def free(self, data):
        self.alloc.free(data.draw(st.sampled_from(sorted(self.alloc.block_tables))))

    @invariant()
    def pool_is_consistent(self):
        if self.alloc is None:
            return
        # every block free xor referenced, exactly once; ref counts = holders;
        # block contents match the requests' tokens
        self.alloc.check_invariants()
        assert self.alloc.num_blocks_in_use == sum(1 for b in self.alloc.blocks if b.ref_cnt > 0)
        size = self.alloc.block_size
        for request in self.alloc.requests.values():
            # hashes made block by block during decode equal hashing the whole sequence
            expected = compute_block_hashes(request.token_ids, size, request.cache_salt, algo=self.alloc.hash_algo)
            assert request.block_hashes == expected
            for i, block_hash in enumerate(expected):
                self.content[block_hash] = request.token_ids[i * size : (i + 1) * size]
        # every cached hash maps to blocks holding exactly the tokens it names
        for block_hash, blocks in self.alloc.cached_blocks.items():
            for block in blocks.values():
                assert block.token_ids == self.content[block_hash]

    def teardown(self):
        if self.alloc is None:
            return
        for rid in list(self.alloc.block_tables):
            self.alloc.free(rid)
        self.alloc.check_invariants()
        assert self.alloc.num_free_blocks == self.alloc.num_blocks
        assert all(b.ref_cnt == 0 for b in self.alloc.blocks)


AllocatorMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = pytest.mark.slow(AllocatorMachine.TestCase)  # 300 random sequences: seconds
