"""The three caching models of analyzer/caching_models.py and llama_slots.py, each against a hand replay of its rules:
vLLM's fast replay gives what the allocator gives, SGLang's tree matches token by token (or by
page) and evicts in its policy's order, llama.cpp's slots keep one sequence each and its
prompt cache brings back a whole one. (Against the real servers: benchmarks/caching_models.py.)"""

import itertools
import random
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from allocator import PrefixCachingAllocator
from analyzer import caching_models
from analyzer.caching_models import (ENGINE, EVICTION_POLICIES, RADIX_CACHE_ONLY_POLICIES, SERVER_EVICTION_POLICIES,
                                     VLLM, SGLang, common_prefix)
from analyzer.llama_slots import LlamaCpp, SlotServer, StateBytes
from analyzer.log_replay import (LIKE, BlockRuns, TokenizedLog, block_hash_ids, footprint, hit_rate_curve, replay,
                                 smallest_pool, tokenize_log)
from analyzer.request_logs import Log, interleave

EXAMPLE_LOGS = sorted((Path(__file__).resolve().parents[2] / "lessons" / "data").glob("*.jsonl.xz"))


def ids(*runs) -> array:
    """ids((1, 3), (2, 2)) -> [1, 1, 1, 2, 2]: runs of (token, count)."""
    return array("I", [token for token, count in runs for _ in range(count)])


def random_log(seed: int, n: int = 120) -> tuple[list[array], list]:
    """Prompts that share starts of many lengths (a tree of prefixes), some salted."""
    rng = random.Random(seed)
    starts = [array("I", [rng.randrange(50) for _ in range(rng.randint(1, 40))]) for _ in range(8)]
    prompts, salts = [], []
    for _ in range(n):
        prompt = array("I", rng.choice(starts))
        prompt += array("I", [rng.randrange(50) for _ in range(rng.randint(1, 30))])
        if rng.random() < 0.3:  # a later turn: an earlier prompt and more
            prompt = rng.choice(prompts or [prompt]) + prompt[:10]
        prompts.append(prompt)
        salts.append("b" if rng.random() < 0.1 else None)
    return prompts, salts


def test_common_prefix_counts_the_shared_start():
    assert common_prefix(ids((1, 9), (2, 1)), ids((1, 9), (3, 4))) == 9
    assert common_prefix(ids((1, 5)), ids((1, 7))) == 5
    assert common_prefix(ids(), ids((1, 2))) == 0


def allocator_replay(prompts, salts, num_blocks: int, block_size: int, model: VLLM) -> tuple[list[int], int]:
    """The reference: the log through PrefixCachingAllocator itself, one request at a time."""
    alloc = PrefixCachingAllocator(num_blocks - model.null_block, block_size,
                                   free_uncached_first=model.free_uncached_first)
    cached = []
    for prompt, salt in zip(prompts, salts):
        cached.append(alloc.allocate_with_prefix("r", prompt, salt).num_cached_tokens)
        alloc.free("r")
    return cached, alloc.stats.evictions


@pytest.mark.parametrize("model", [VLLM(), ENGINE], ids=["vllm", "engine"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fast_vllm_replay_is_the_allocators_request_by_request(model, seed):
    prompts, salts = random_log(seed)
    for block_size in (1, 4, 16):
        smallest = smallest_pool(prompts, block_size, model)
        for num_blocks in (smallest, smallest + 3, 2 * smallest, 10 * smallest):
            fast = replay(prompts, salts, num_blocks, block_size, model=model, watch=num_blocks == smallest)
            assert (fast.cached.tolist(), fast.evictions) == allocator_replay(prompts, salts, num_blocks,
                                                                              block_size, model)


def test_block_hashes_are_numbered_once_for_all_replays():
    shared = ids((7, 8))
    numbered = block_hash_ids([shared + ids((1, 4)), shared + ids((2, 4)), shared], [None, None, "t"], 4)
    assert numbered[0][:2] == numbered[1][:2] and numbered[0][2] != numbered[1][2]
    assert set(numbered[2]).isdisjoint(numbered[0])  # a salt changes every hash after it


def numbered_by_a_dict(prompts, salts, block_size: int) -> list[array]:
    """The reference: every block numbered in a dict keyed by (its parent's number, its tokens)."""
    numbers, rows = {}, []
    for prompt, salt in zip(prompts, salts):
        parent, row = ("cache_salt", salt), array("I")
        for start in range(0, len(prompt) - block_size + 1, block_size):
            parent = numbers.setdefault((parent, tuple(prompt[start : start + block_size])), len(numbers))
            row.append(parent)
        rows.append(row)
    return rows


@pytest.mark.parametrize("collide", [False, True], ids=["hashed", "every key colliding"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_tree_of_runs_numbers_blocks_as_a_dict_of_every_block_does(monkeypatch, seed, collide):
    if collide:  # every run filed under one key: found, split and filed again through the chain alone
        monkeypatch.setattr(BlockRuns, "key", staticmethod(lambda parent, block: 0))
    prompts, salts = random_log(seed)
    for block_size in (1, 4, 16):
        assert block_hash_ids(prompts, salts, block_size) == numbered_by_a_dict(prompts, salts, block_size)
    with TokenizedLog() as streamed:  # the earlier prompts read back from the file
        for prompt, salt in zip(prompts, salts):
            streamed.append(prompt, salt)
        assert block_hash_ids(streamed, salts, 4) == numbered_by_a_dict(prompts, salts, 4)


def test_the_footprint_counts_from_the_numbers_what_sets_of_them_count():
    prompts, salts = random_log(5, n=300)
    for block_size in (1, 4, 16):
        seen, shared = set(), set()
        for prompt, row in zip(prompts, numbered_by_a_dict(prompts, salts, block_size)):
            for number in itertools.takewhile(seen.__contains__, row[: (len(prompt) - 1) // block_size]):
                shared.add(number)
            seen.update(row)
        prints = footprint(prompts, salts, block_size)
        assert (prints.distinct_blocks, prints.shared_blocks) == (len(seen), len(shared)) and shared


@pytest.mark.parametrize("model", [VLLM(), ENGINE], ids=["vllm", "engine"])
def test_the_pool_counts_the_same_packed_often_or_holding_its_hashes_in_a_dict(monkeypatch, model):
    """A pool much smaller than the log's numbers keeps its hashes in a dict, a larger one in an
    array by number; packed after every request, the free queue still serves the allocator's order."""
    prompts, salts = random_log(6, n=300)
    rows, lengths = block_hash_ids(prompts, salts, 4), [len(p) for p in prompts]
    num_ids = max(row[-1] for row in rows if row) + 1
    for num_blocks in (smallest_pool(prompts, 4, model), 3 * smallest_pool(prompts, 4, model), num_ids):
        expected = allocator_replay(prompts, salts, num_blocks, 4, model)
        for numbers in (num_ids, 1000 * num_ids):  # a dict below 1/25 of the numbers (the smallest pool), else an array
            for slack in (1 << 16, 0):
                monkeypatch.setattr(caching_models, "QUEUE_SLACK", slack)
                counts = model.replay(rows, lengths, num_blocks, 4, numbers)
                assert (counts.cached.tolist(), counts.evictions) == expected


# -----------------------------------------------------------------------------
# SGLang: by hand, [1,2,3,4,5] then [1,2,3,9,9] then [1,2,3,4,7]. Page 1: the second finds
# [1,2,3] (the node [1,2,3,4,5] is split there), the third [1,2,3,4] (split again); a
# request never finds its last token. Page 2: only whole pages, [1,2] then [1,2,3,4].


@pytest.mark.parametrize("page_size, cached", [(1, [0, 3, 4]), (2, [0, 2, 4])])
def test_sglang_matches_token_by_token_or_by_page(page_size, cached):
    prompts = [array("I", p) for p in ([1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [1, 2, 3, 4, 7])]
    assert SGLang(page_size).replay(prompts, [None] * 3, max_total_tokens=100).cached.tolist() == cached


# A pool of 8 tokens: [1]*4 twice (the second hit splits it: [1,1,1] and [1], each hit
# twice), then [2]*4 (the pool is full), then [3]*4 must evict 4 tokens. LRU and FIFO drop
# the older [1]-branch (the [1] leaf, then its parent), LFU the less used [2]*4: only under
# LFU does [1]*4 find 3 tokens at the end.
@pytest.mark.parametrize("policy, cached", [("lru", [0, 3, 0, 0, 0]), ("fifo", [0, 3, 0, 0, 0]),
                                            ("lfu", [0, 3, 0, 0, 3])])
def test_sglang_evicts_leaves_in_its_policys_order(policy, cached):
    prompts = [ids((1, 4)), ids((1, 4)), ids((2, 4)), ids((3, 4)), ids((1, 4))]
    assert SGLang(eviction_policy=policy).replay(prompts, [None] * 5, max_total_tokens=8).cached.tolist() == cached


# SLRU, by hand, on the same pool. A leaf hit fewer than 2 times goes before any other, however
# recent: [2]*4 (hit once) goes for [3]*4 where LRU takes the older [1]-branch (hit twice), so
# [1]*4 finds 3 at the end. With --radix-eviction-policy-config '{"protected_threshold": 3}'
# the [1]-branch is not protected either, and the order is LRU's. Among the protected the least
# recently used goes, not the least hit: [1]*4 three times, [2]*4 twice, then [3]*4 takes the
# [1]-branch where LFU takes [2]*4, and [2]*4 finds 3 at the end.
def test_sglang_slru_evicts_leaves_hit_once_first_then_the_least_recently_used():
    a, b, c = ids((1, 4)), ids((2, 4)), ids((3, 4))

    def cached(prompts, **model):
        return SGLang(**model).replay(prompts, [None] * len(prompts), max_total_tokens=8).cached.tolist()

    assert cached([a, a, b, c, a], eviction_policy="slru") == [0, 3, 0, 0, 3]
    assert cached([a, a, b, c, a], eviction_policy="lru") == [0, 3, 0, 0, 0]
    assert cached([a, a, b, c, a], eviction_policy="slru", slru_protected_threshold=3) == [0, 3, 0, 0, 0]
    assert cached([a, a, a, b, b, c, b], eviction_policy="slru") == [0, 3, 3, 0, 3, 0, 3]
    assert cached([a, a, a, b, b, c, b], eviction_policy="lfu") == [0, 3, 3, 0, 3, 0, 0]


# Priority: a node keeps the highest priority of the requests that inserted it, and a request
# without one inserts 0. A log carries none, so every node ties and the order is LRU's.
def test_sglang_priority_evicts_as_lru_when_no_request_carries_one():
    prompts, salts = random_log(4)
    longest = max(map(len, prompts))
    for pool in (longest, 2 * longest):  # evicting on most requests
        assert (SGLang(eviction_policy="priority").replay(prompts, salts, pool).cached.tolist()
                == SGLang(eviction_policy="lru").replay(prompts, salts, pool).cached.tolist())
    hand = [ids((1, 4)), ids((1, 4)), ids((2, 4)), ids((3, 4)), ids((1, 4))]
    assert SGLang(eviction_policy="priority").replay(hand, [None] * 5, 8).cached.tolist() == [0, 3, 0, 0, 0]


# T-LRU, threshold 4 (next_prompt_estimate 0): a branch keeps (the deepest it has been - 4)
# tokens; a leaf wholly past that goes before any other. A pool of 16: [3]*8 (a branch 8
# deep: its leaf starts at 0, inside its budget of 4), then a conversation, [1]*4 and
# [1]*4+[2]*4 (the branch is 8 deep; the [2]*4 leaf starts at 4, past it). [4]*4 needs 4:
# T-LRU takes the [2]*4 tail, where LRU takes the older [3]*8, so [3]*8 comes back finding 7.
# It needs 1 token more: the leaves past their budget now are [4]*4 (a branch of 4: budget 0)
# and the [3] split off [3]*8; [4]*4, the older, goes. The trimmed conversation's [1]*4 stays:
# its branch remembers it was 8 deep (a budget of 4 it starts inside), so its next turn finds
# 4 tokens; judged by the 4 left, it would be past its budget and gone.
def test_sglang_tlru_evicts_a_branchs_tail_past_its_budget_first_and_remembers_its_depth():
    prompts = [ids((3, 8)), ids((1, 4)), ids((1, 4), (2, 4)), ids((4, 4)), ids((3, 8)), ids((1, 4), (2, 4))]
    tlru = SGLang(eviction_policy="tlru", tlru_threshold=4)
    assert tlru.replay(prompts, [None] * 6, max_total_tokens=16).cached.tolist() == [0, 0, 4, 0, 7, 4]
    assert SGLang().replay(prompts, [None] * 6, max_total_tokens=16).cached.tolist() == [0, 0, 4, 0, 0, 4]


# T-LRU, threshold 8, a pool of 28: [8]*12 (its budget 4: inside it), [5]*12, then [5]*4+[6]*4
# splits [5]*12 after 4 tokens. The upper half, [5]*4, takes its branch's depth, 12, so its
# budget is 4 and it starts inside it. [9]*20 needs 20: first the leaves past their budgets,
# [5]*8 and [6]*4 (12 tokens), then by recency [8]*12, older than [5]*4, which stays: the
# last request finds 4. Were the upper half as deep as its own path (8 with [6]*4), it would
# be past its budget and go first; LRU takes [8]*12 and [5]*8 and keeps [6]*4, finding 7.
def test_sglang_tlru_the_upper_half_of_a_split_keeps_its_branchs_depth():
    prompts = [ids((8, 12)), ids((5, 12)), ids((5, 4), (6, 4)), ids((9, 20)), ids((5, 4), (6, 4))]
    tlru = SGLang(eviction_policy="tlru", tlru_threshold=8)
    assert tlru.replay(prompts, [None] * 5, max_total_tokens=28).cached.tolist() == [0, 0, 4, 0, 4]
    assert SGLang().replay(prompts, [None] * 5, max_total_tokens=28).cached.tolist() == [0, 0, 4, 0, 7]


def test_sglang_takes_the_servers_policies_and_radix_caches_and_refuses_tlru_past_its_threshold():
    assert EVICTION_POLICIES == SERVER_EVICTION_POLICIES + RADIX_CACHE_ONLY_POLICIES
    assert SERVER_EVICTION_POLICIES == ("lru", "lfu", "slru", "priority", "tlru")  # sglang 0.5.23's choices.py
    for estimate, threshold in [(0, 0), (512, 512), (-1, 8)]:  # 0 and 0: the server's defaults, refused
        with pytest.raises(ValueError, match="tlru needs 0 <= next_prompt_estimate < threshold"):
            SGLang(eviction_policy="tlru", tlru_threshold=threshold, tlru_next_prompt_estimate=estimate)


# SGLang's demand for room, by hand: a pool of 8 tokens, [1]*4, [2]*4, then [1]*4 again. At
# page size 1 the second asks for its 4 new tokens, 4 are free, nothing is evicted, and the
# third finds 3. At page size 2 the scheduler asks for the new tokens and one page more
# (alloc_paged_token_slots_extend): the second wants 6 where 4 are free, [1]*4 is evicted,
# and the third finds nothing (it would find its first page, 2 tokens, were only its 4 asked).
@pytest.mark.parametrize("page_size, cached", [(1, [0, 0, 3]), (2, [0, 0, 0])])
def test_sglang_asks_for_one_page_more_than_a_requests_new_tokens_at_page_size_above_1(page_size, cached):
    prompts = [ids((1, 4)), ids((2, 4)), ids((1, 4))]
    assert SGLang(page_size).replay(prompts, [None] * 3, max_total_tokens=8).cached.tolist() == cached


def test_sglang_keeps_salted_prompts_apart_and_refuses_unknown_policies():
    prompts = [ids((1, 6)), ids((1, 6)), ids((1, 6))]
    assert SGLang().replay(prompts, [None, "a", "a"], 100).cached.tolist() == [0, 0, 5]
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        SGLang(eviction_policy="random")


# -----------------------------------------------------------------------------
# llama.cpp, two slots and no prompt cache, by hand. [1]*10 goes to the later slot (LRU,
# all unused), [2]*10 to the other; [1]*5+[3]*5 shares half of itself with the first slot
# (above the 0.1 threshold), finds 5 tokens and cuts [1]*5 from that slot's sequence, so
# [1]*10 again finds only 5 (a radix tree would find 9).


def test_llamacpp_picks_the_slot_with_the_longest_common_prefix_and_cuts_the_rest():
    prompts = [ids((1, 10)), ids((2, 10)), ids((1, 5), (3, 5)), ids((1, 10))]
    model = LlamaCpp(parallel=2, kv_unified=False)
    assert model.replay(prompts, cache_room=0).cached.tolist() == [0, 0, 5, 5]
    assert SGLang().replay(prompts, [None] * 4, 100).cached.tolist() == [0, 0, 5, 9]


def test_llamacpp_below_the_similarity_threshold_takes_the_least_recently_used_slot():
    # [1]*2+[4]*18 shares 2 of 20 tokens (0.1, not above it) with the slot of [1]*10: the
    # other slot, least recently used, is taken, and nothing is found.
    prompts = [ids((2, 10)), ids((1, 10)), ids((1, 2), (4, 18))]
    assert LlamaCpp(parallel=2, kv_unified=False).replay(prompts, 0).cached.tolist() == [0, 0, 0]
    looser = LlamaCpp(parallel=2, slot_prompt_similarity=0.05, kv_unified=False)
    assert looser.replay(prompts, 0).cached.tolist() == [0, 0, 2]


# One slot: [2]*10 takes the slot of [1]*10 by LRU, which saves [1]*10 to the prompt cache;
# [1]*10 again takes the slot by LRU, saves [2]*10 and loads [1]*10 back: 9 tokens found.
# A prompt cache of 15 tokens has no room for both: the older, [1]*10, is dropped.
@pytest.mark.parametrize("cache_tokens, cached, evictions", [(0, [0, 0, 0], 0), (100, [0, 0, 9], 0),
                                                             (15, [0, 0, 0], 1)])
def test_llamacpps_prompt_cache_brings_back_a_whole_sequence(cache_tokens, cached, evictions):
    counts = LlamaCpp(parallel=1).replay([ids((1, 10)), ids((2, 10)), ids((1, 10))], cache_tokens)
    assert counts.cached.tolist() == cached and counts.evictions == evictions


def test_llamacpp_refuses_prompts_longer_than_a_slots_context():
    # -c 1000 (1,024, a multiple of 256) over 4 slots without a unified KV cache: 256 tokens a
    # slot, and a prompt of 256 is refused; with one, every slot may use all 1,024.
    prompts = [ids((1, 256)), ids((1, 255)), ids((1, 255))]
    split = LlamaCpp(parallel=4, kv_unified=False, n_ctx=1000).replay(prompts, 0)
    assert split.cached.tolist() == [0, 0, 254] and split.refused.tolist() == [0]
    unified = LlamaCpp(parallel=4, n_ctx=1000).replay(prompts, 0)
    assert unified.cached.tolist() == [0, 254, 254] and unified.refused.tolist() == []


def test_a_refused_request_finds_nothing_and_leaves_the_hit_rate():
    # -c 8192 (the default model's training context) over --parallel 4: 2,048 tokens a
    # slot. [1]*100, then [1]*3000 (refused: it takes a slot, computes nothing, and that slot
    # keeps its sequence), then [1]*101 finds 100 in the slot of [1]*100. The hit rate counts
    # the 201 tokens the server computed or found: 100 / 201.
    prompts = [ids((1, 100)), ids((1, 3000)), ids((1, 101))]
    model = LlamaCpp(parallel=4, kv_unified=False, n_ctx=8192)
    counts = model.replay(prompts, 0)
    assert counts.cached.tolist() == [0, 0, 100] and counts.refused.tolist() == [1]
    result = replay(prompts, [None] * 3, num_blocks=200, block_size=16, model=model)
    assert result.refused.tolist() == [1] and result.prompt_tokens == 201
    assert result.hit_rate == pytest.approx(100 / 201)


def test_a_refused_request_still_takes_a_slot_and_marks_it_used():
    # Two slots of 4,096 tokens, no prompt cache (--parallel 2 --cache-ram 0). A and B take
    # the two slots; R (5,000 tokens, nothing shared) takes A's, the least recently used, and
    # is refused there, but that slot is now the most recently used and still holds A. So C
    # (nothing shared) takes B's slot, and A with 10 more tokens finds A's 300 where it was.
    # llama-server build 10434 answered the same (0, 0, refused, 0, 300); had the refusal not
    # touched the slot, C would have taken A's and the last request found nothing.
    a, b, r, c = ids((7, 300)), ids((8, 200)), ids((9, 5000)), ids((10, 100))
    prompts = [a, b, r, c, a + ids((11, 10))]
    counts = LlamaCpp(parallel=2, kv_unified=False, n_ctx=8192).replay(prompts, 0)
    assert counts.cached.tolist() == [0, 0, 0, 0, 300] and counts.refused.tolist() == [2]


# A unified KV cache (llama-server's default) holds every slot's sequence in the same -c
# cells. Four slots, -c 1000 (1,024 cells). A (600 tokens) takes slot 3, B (600, nothing
# shared) slot 2, and A goes to the prompt cache as B starts (--cache-idle-slots, then cleared).
# A again takes slot 1 by LRU and finds A in the prompt cache, but restoring it needs 600 free
# cells beside B's 600: "failed to find 600 available cells in kv cache". The entry stays in
# the prompt cache, the slot is cleared, the whole prompt is computed. With -c 2000 it fits.


@pytest.mark.parametrize("n_ctx, cached, unrestored", [(1000, [0, 0, 0, 0], [2, 3]), (2000, [0, 0, 599, 599], [])])
def test_llamacpp_restores_a_cached_prompt_only_where_it_fits_beside_the_other_slots(n_ctx, cached, unrestored):
    a, b = ids((1, 600)), ids((2, 600))
    counts = LlamaCpp(parallel=4, n_ctx=n_ctx).replay([a, b, a, b], cache_room=10**6)
    assert counts.cached.tolist() == cached and counts.unrestored.tolist() == unrestored
    assert LlamaCpp(parallel=4, n_ctx=None).replay([a, b, a, b], 10**6).cached.tolist() == [0, 0, 599, 599]  # no -c
    # each slot has a stream of its own without a unified cache: 1,024 x 4 cells, A fits in its slot's
    split = LlamaCpp(parallel=4, kv_unified=False, n_ctx=4096).replay([a, b, a, b], 10**6)
    assert split.cached.tolist() == [0, 0, 599, 599] and not split.unrestored


def test_llamacpp_clears_idle_slots_to_make_room_for_a_prompt():
    # No prompt cache (--cache-ram 0, which turns --cache-idle-slots off): the slots keep their
    # sequences. B does not fit beside A in 1,024 cells, so llama_decode finds no room and
    # try_clear_idle_slots clears A's slot, unsaved: A again finds nothing. 2,048 cells hold both.
    a, b = ids((1, 600)), ids((2, 600))
    assert LlamaCpp(parallel=4, n_ctx=1000).replay([a, b, a], 0).cached.tolist() == [0, 0, 0]
    assert LlamaCpp(parallel=4, n_ctx=2000).replay([a, b, a], 0).cached.tolist() == [0, 0, 599]


def test_a_slots_context_is_at_most_the_models_training_context():
    # llama-server build 11434 caps n_ctx_slot at the training context: -c 16384 unified gives
    # 16,384 cells, yet a prompt of 8,192 tokens is refused on a model trained on 8,192.
    model = LlamaCpp(n_ctx=16384, n_ctx_train=8192)
    counts = model.replay([ids((1, 8191)), ids((2, 8192))], 10**6)
    assert counts.refused.tolist() == [1] and model.kv_cells() == 16384
    said = model.refusals([8191, 8192], [1])
    assert "a slot holds 8,192 tokens (the model's training context, below all of -c" in said
    assert said.endswith("only a model trained on a longer context lets them in.")  # not a larger --ctx-size
    assert LlamaCpp(n_ctx=4096, n_ctx_train=8192).refusals([5000], [0]).endswith("or --kv-unified lets them in.")


def test_the_prompt_cache_counts_what_llamacpp_copies_when_given_bytes():
    # llama.cpp's --cache-ram counts the bytes of each entry's state: 752 of headers and 23,052
    # a token for the default model (f16 K and V, 12 bytes of cell). Room for 10 tokens and one
    # header holds A of 10 alone; a second entry pushes it out. In tokens the same room holds both.
    state = StateBytes.llama_cpp(30, 23_040)
    assert (state.per_token, state.per_entry) == (23_052, 752)
    room = state.of(10)
    prompts = [ids((1, 10)), ids((2, 5)), ids((1, 10))]
    in_bytes = LlamaCpp(parallel=1).replay(prompts, room, state)
    assert in_bytes.cached.tolist() == [0, 0, 0] and in_bytes.evictions == 1
    in_tokens = LlamaCpp(parallel=1).replay(prompts, 15)
    assert in_tokens.cached.tolist() == [0, 0, 9] and in_tokens.evictions == 0
    assert LlamaCpp(parallel=1).replay(prompts, state.of(10) - 1, state).cached.tolist() == [0, 0, 0]


# The prompt cache as a radix tree answers what llama.cpp's own search, entry by entry,
# answers (EntryByEntry, the replay's form before the tree): the same slot found, the same
# entry loaded, the same evicted, on random logs and on the example logs, at every setting.


@dataclass
class EntryByEntry:
    """server_prompt_cache searched as llama.cpp searches it: every entry, oldest first."""

    entries: list = field(default_factory=list)
    evictions: int = 0

    def save(self, tokens, room):
        if not tokens or len(tokens) > room or any(common_prefix(e, tokens) == len(tokens) for e in self.entries):
            return
        self.entries = [e for e in self.entries if common_prefix(e, tokens) < len(e)]
        held = sum(map(len, self.entries))
        while self.entries and held + len(tokens) > room:
            held -= len(self.entries.pop(0))
            self.evictions += 1
        self.entries.append(tokens)

    def find(self, tokens, prompt):
        shared = common_prefix(tokens, prompt)
        keep_best, similarity_best, best = (shared / len(tokens) if tokens else -1.0), shared / len(prompt), None
        for i, entry in enumerate(self.entries):
            shared = common_prefix(entry, prompt)
            keep, similarity = shared / len(entry), shared / len(prompt)
            if keep >= 0.25 and keep_best < keep and similarity_best < similarity:
                best, keep_best, similarity_best = i, keep, similarity
        return None if best is None else (best, self.entries[best])

    def remove(self, i):
        del self.entries[i]


def llamacpp_settings():
    for parallel in (1, 2, 4):
        for similarity in (0.0, 0.1, 0.5):
            for kv_unified in (True, False):
                yield LlamaCpp(parallel, similarity, kv_unified)
    yield LlamaCpp(4, n_ctx=100)  # unified cells too few for two sequences: restores fail


def assert_same_as_entry_by_entry(prompts, cache_sizes, settings):
    for model in settings:
        for room in cache_sizes:
            tree = model.replay(prompts, room)
            plain = SlotServer(model, room, prompt_cache=EntryByEntry()).replay(prompts)
            assert (tree.cached.tolist(), tree.evictions, tree.unrestored) == (
                plain.cached.tolist(), plain.evictions, plain.unrestored), (model, room)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_prompt_cache_tree_answers_as_llamacpps_search_on_random_logs(seed):
    prompts, _ = random_log(seed, n=150)
    assert_same_as_entry_by_entry(prompts, [0, 40, 300, 10**9], llamacpp_settings())


@pytest.mark.parametrize("path", EXAMPLE_LOGS, ids=lambda p: p.name.split(".")[0])
def test_the_prompt_cache_tree_answers_as_llamacpps_search_on_the_example_logs(path, tokenizer):
    prompts = tokenize_log(interleave(Log.read(path, 2**31, False).requests, 3), tokenizer)
    total = sum(map(len, prompts))
    settings = [LlamaCpp(), LlamaCpp(1, 0.0), LlamaCpp(2, 0.1, False), LlamaCpp(4, 0.5, False)]
    assert_same_as_entry_by_entry(prompts, [max(map(len, prompts)), total // 8, total], settings)


# -----------------------------------------------------------------------------
# In the analyzer: every model's curve ends on a pool that never evicts and saves the most.


@pytest.mark.parametrize("like", ["sglang", "llamacpp"])
def test_every_models_curve_ends_on_a_pool_that_never_evicts(like):
    prompts, salts = random_log(3)
    curve = hit_rate_curve(prompts, salts, block_size=4, model=LIKE[like])
    last = curve.replays[-1]
    assert last.evictions == 0 and last.cached_tokens >= max(r.cached_tokens for r in curve.replays)
    assert curve.at(curve.working_set).cached_tokens >= 0.95 * last.cached_tokens


def test_the_command_names_each_model_and_keeps_the_old_flag():
    from analyzer.workload_analyzer import build_parser, cache_model

    parser = build_parser()
    assert parser.parse_args(["log.jsonl", "--like-engine"]).like == "engine"
    args = parser.parse_args(["log.jsonl", "--like", "sglang", "--page-size", "16", "--eviction-policy", "lfu"])
    assert cache_model(args) == SGLang(16, "lfu")
    args = parser.parse_args(["log.jsonl", "--like", "llamacpp", "--parallel", "2"])
    # an explicit --parallel: no unified KV, and -c 0 gives each slot's stream the training context (--fit)
    assert cache_model(args) == LlamaCpp(parallel=2, kv_unified=False, n_ctx=0, n_ctx_train=8192)
    assert cache_model(args).kv_cells() == cache_model(args).n_ctx_slot() == 8192
    defaults = cache_model(parser.parse_args(["log.jsonl", "--like", "llamacpp"]))
    assert defaults == LlamaCpp(n_ctx=0, n_ctx_train=8192) and defaults.kv_cells() == 8192  # one stream, unified
    with pytest.raises(ValueError, match="-c 0 is the model's training context for each KV stream"):
        LlamaCpp(n_ctx=0)
    args = parser.parse_args(["log.jsonl", "--like", "llamacpp", "--parallel", "4", "--kv-unified", "--ctx-size", "1000"])
    assert cache_model(args) == LlamaCpp(parallel=4, kv_unified=True, n_ctx=1000, n_ctx_train=8192)
    with pytest.raises(ValueError, match="--slot-prompt-similarity must be between 0 and 1"):
        cache_model(parser.parse_args(["log.jsonl", "--like", "llamacpp", "--slot-prompt-similarity", "2"]))


def test_the_command_passes_sglangs_policy_settings_and_refuses_one_for_another_policy():
    from analyzer.workload_analyzer import build_parser, cache_model

    parser = build_parser()

    def model(*flags):
        return cache_model(parser.parse_args(["log.jsonl", "--like", "sglang", *flags]))

    assert model("--eviction-policy", "slru", "--slru-protected-threshold", "3") == SGLang(
        eviction_policy="slru", slru_protected_threshold=3)
    tlru = model("--eviction-policy", "tlru", "--tlru-threshold", "4096", "--tlru-next-prompt-estimate", "512")
    assert tlru == SGLang(eviction_policy="tlru", tlru_threshold=4096, tlru_next_prompt_estimate=512)
    assert model("--eviction-policy", "filo") == SGLang(eviction_policy="filo")  # RadixCache's alone, still modelled
    with pytest.raises(ValueError, match="--eviction-policy tlru needs --tlru-threshold"):
        model("--eviction-policy", "tlru")
    with pytest.raises(ValueError, match="--tlru-threshold is a setting of --eviction-policy tlru, not lru"):
        model("--tlru-threshold", "64")
    with pytest.raises(ValueError, match="next_prompt_estimate < threshold, got 64 and 64"):
        model("--eviction-policy", "tlru", "--tlru-threshold", "64", "--tlru-next-prompt-estimate", "64")


def test_llama_servers_default_context_is_the_default_models_training_context():
    import json

    from engine.model_files import training_context
    from engine.model_loader import default_model_dir

    config = json.loads((default_model_dir() / "config.json").read_text())
    assert training_context() == config["max_position_embeddings"]  # what -c 0 gives, from the same GGUF


# --bench caching_models starts llama-server: one that dies is reported at once, with its exit
# code and its last lines, not after a timeout. A stand-in that fails as a binary built for
# another CPU does (SIGILL), and one that exits with an error.
@pytest.mark.parametrize("script, how, last_line", [
    ("echo loading model >&2\necho AMX is not ready to be used! >&2\nkill -ILL $$\n", "killed by SIGILL",
     "AMX is not ready to be used!"),
    ("echo 'error: invalid argument: --bad' >&2\nexit 3\n", "exit code 3", "error: invalid argument: --bad"),
])
def test_the_benchmark_fails_fast_when_llama_server_dies(tmp_path, script, how, last_line):
    from benchmarks.caching_models import ServerDied, llama_server_cached

    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n" + script)
    binary.chmod(0o755)
    with pytest.raises(ServerDied, match=how) as err:
        llama_server_cached(binary, [], [ids((1, 4))])
    assert last_line in str(err.value)
