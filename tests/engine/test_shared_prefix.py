"""Shared-prefix (cascade) attention only where it pays: the decision of decode_groups, pinned on
the cases that made an always-on cascade slower than none (a long member in a family, a member
sharing only the first block, short shared prefixes), and checked on random families: a step
never reads more slots with it than without, and attends to the same numbers (float32, 1e-5).

No model here: the steps are built from block tables over a pool of random K/V, and
pool_attention runs on random queries, as one layer of a model would."""

import contextlib
import itertools
from collections import defaultdict
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import batch_attention
from engine.batch_attention import MAX_GROUPS, build_step, pool_attention
from engine.kv_pool import PagedKVPool
from engine.scheduler import Request, ScheduledRequest, StepPlan

pytestmark = [pytest.mark.model]

# Constants under which every shared prefix that reads fewer slots is taken: the other paths
# of the decision (families cut by length, stragglers) come up in far more random cases.
EAGER = {"CASCADE_MIN_REQUESTS": 2, "CASCADE_MIN_TOKENS": 1, "CASCADE_OWN_COST": 1.0, "CASCADE_GROUP_SLOTS": 0}


def decode_step(decodes: list[tuple[int, int, int]], block_size: int):
    """A step of decodes, each (family, shared, own): its first `shared` tokens (whole blocks)
    in its family's blocks, then `own` tokens in blocks of its own. Returns the plan, the
    block tables, and a pool that holds them all, filled with random K/V.

    decode_step([(0, 8, 2), (0, 4, 3)], block_size=4): tables [0, 1, 2] and [0, 3], contexts
    of 10 and 7 tokens; the first 4 tokens of both are in block 0."""
    new_block = itertools.count()
    family_blocks = defaultdict(list)
    scheduled, tables = [], {}
    for i, (family, shared, own) in enumerate(decodes):
        blocks = family_blocks[family]
        while len(blocks) < shared // block_size:
            blocks.append(next(new_block))
        end = shared + own
        request = Request(f"r{i}", list(range(end)))
        own_blocks = [next(new_block) for _ in range(-(-own // block_size))]
        tables[request.request_id] = blocks[: shared // block_size] + own_blocks
        scheduled.append(ScheduledRequest(request, end - 1, end))
    pool = PagedKVPool(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=next(new_block), block_size=block_size)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    return StepPlan(scheduled, []), tables, pool


def attention(plan, tables, pool, cascade: bool):
    """One layer's attention over the step (4 query heads on the pool's 2 KV heads), and the step."""
    step = build_step(plan, pool, tables, "cpu", cascade)
    num_tokens = step.input_ids.shape[1]
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, num_tokens, 8, generator=generator)
    key, value = torch.randn(2, 1, 2, num_tokens, 8, generator=generator)
    out, _ = pool_attention(SimpleNamespace(layer_idx=0), query, key, value, None, pool_step=step)
    return out, step


def shared_groups(step) -> list[int]:
    """The number of decodes in each group of the step that reads a shared prefix once."""
    return [len(g.query_index) for g in step.groups if g.prefix_blocks is not None]


def check_on_against_off(decodes, block_size):
    """Cascade on reads no more slots than off and attends to the same numbers; returns both steps."""
    plan, tables, pool = decode_step(decodes, block_size)
    out_off, off = attention(plan, tables, pool, cascade=False)
    out_on, on = attention(plan, tables, pool, cascade=True)
    assert on.slots_needed == off.slots_needed and on.slots_read <= off.slots_read
    assert torch.allclose(out_on, out_off, rtol=1e-5, atol=1e-5)
    return on, off


# --- the cases an always-on cascade made slower ----------------------------------------------


def test_a_long_member_does_not_make_its_family_pad_to_it():
    # 16 chats behind a 448-token system prompt, one of them a 2,000-token conversation.
    decodes = [(0, 448, 30 + i) for i in range(15)] + [(0, 448, 2000 - 448)]
    on, off = check_on_against_off(decodes, block_size=16)
    assert shared_groups(on) == [15]  # the long one attends on its own, over its whole context
    assert on.slots_read == 448 + 15 * 44 + 2000
    assert off.slots_read == 15 * (448 + 44) + 2000


def test_a_chat_template_is_too_short_a_prefix_to_share():
    # 16 chats behind the chat template's first 32 tokens, one of them 2,000 tokens long.
    decodes = [(0, 32, 100 + i) for i in range(15)] + [(0, 32, 2000 - 32)]
    on, off = check_on_against_off(decodes, block_size=16)
    assert shared_groups(on) == [] and on.slots_read == off.slots_read
    assert off.slots_read <= 1.25 * off.slots_needed


def test_a_member_sharing_only_the_first_block_stays_out_of_the_family():
    decodes = [(0, 448, 20 + i) for i in range(16)] + [(0, 16, 500)]
    on, off = check_on_against_off(decodes, block_size=16)
    assert shared_groups(on) == [16]  # the prefix stays 448 tokens, not the one block all 17 share
    assert on.slots_read < off.slots_read


@pytest.mark.parametrize("shared", [32, 448])
@pytest.mark.parametrize("n", [2, 4, 16, 64])
def test_decodes_behind_one_prefix_share_it_only_where_it_pays(n, shared):
    on, off = check_on_against_off([(0, shared, 30 + i % 7) for i in range(n)], block_size=16)
    # Below CASCADE_MIN_TOKENS shared tokens or CASCADE_MIN_REQUESTS decodes, never.
    assert shared_groups(on) == ([n] if shared == 448 and n >= 4 else [])
    if shared_groups(on):
        assert on.slots_read == 448 + n * (29 + min(n, 7))  # the prefix once, each own part padded to the longest


def test_families_behind_different_prompts_each_share_their_own():
    decodes = [(0, 448, 20 + i) for i in range(8)] + [(1, 320, 40 + i) for i in range(6)] + [(2, 64, 9)] * 3
    on, _ = check_on_against_off(decodes, block_size=16)
    assert sorted(shared_groups(on)) == [6, 8]


# --- random families -----------------------------------------------------------------------------


@st.composite
def families(draw):
    """(decodes for decode_step, block size): up to 4 families of up to 12 decodes, each
    sharing its family's first blocks, up to 640 tokens (all of them, or fewer: a straggler),
    with 1 to 300 tokens of its own."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    decodes = []
    for family in range(draw(st.integers(1, 4))):
        blocks = draw(st.integers(0, 640 // block_size))
        shares = st.one_of(st.just(blocks), st.integers(0, blocks))
        members = draw(st.lists(st.tuples(shares, st.integers(1, 300)), min_size=1, max_size=12))
        decodes += [(family, shared * block_size, own) for shared, own in members]
    return draw(st.permutations(decodes)), block_size


@pytest.mark.parametrize("constants", ["measured", "eager"])
@settings(max_examples=100, deadline=None)
@given(case=families())
def test_with_the_decision_a_step_reads_no_more_than_cascade_off_and_attends_the_same(constants, case):
    decodes, block_size = case
    with mock.patch.multiple(batch_attention, **EAGER) if constants == "eager" else contextlib.nullcontext():
        on, _ = check_on_against_off(decodes, block_size)
    assert len(on.groups) <= 2 * MAX_GROUPS  # shared-prefix groups and plain ones
    assert sorted(t for g in on.groups for t in g.token_index.tolist()) == list(range(len(decodes)))
