"""Exercise 5: gather cached K/V into past_key_values (exercises/gather_kv.py). Needs no other
exercise.

The pool's data lives here; each gather sends it, with the block ids, to your code in the
child and builds a DynamicCache of the tensors it answers, which kv_pool's gather on the same
data must equal, bit for bit. The finish line is the oracle of stage 7: on the tiny model, a
prefix gathered from the pool plus the suffix computed on top of it gives the logits of one
full forward pass.

Every gather, timed or not, reaches your code the same way (child.py's op_pool_gather), with
each line of your file costing the same few microseconds (grading.LINE_COST), and what every
gather returned is compared with kv_pool's: nothing tells a timed gather from another.

The pool's shape is drawn anew each run (grading.SEED), its four sizes all different: keys
gathered per KV head where they belong per layer, or a block size taken for a head_dim, give
the wrong shape whatever the run.
"""

import time
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from grading import GRADING, SCALING_LIMIT, drawn, fastest_times, milliseconds, timed_call, times

from engine.kv_pool import PagedKVPool
from engine.one_request import generate, greedy_reference
from engine.request import SamplingParams
from twins import LINE_COST, remote_pool_class

pytestmark = [pytest.mark.model]

EXERCISE = "gather_kv"
SIZES = drawn("pool shape")
NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE = SIZES.sample(range(2, 8), 3)
HEAD_DIM = SIZES.choice([d for d in (4, 6, 8, 10) if d not in (NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE)])  # RoPE: even
SHAPE = {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM}
CONFIG = LlamaConfig(num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_KV_HEADS, num_key_value_heads=NUM_KV_HEADS,
                     hidden_size=NUM_KV_HEADS * HEAD_DIM)


@pytest.fixture
def numbered_pool(child):
    """A pool whose every number is its own flat index, so a value says where it came from."""
    def make(num_blocks: int = 6, dtype=torch.float32):
        pool = remote_pool_class()(child, **SHAPE, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=dtype)
        pool.data.copy_(torch.arange(pool.data.numel(), dtype=pool.data.dtype).view_as(pool.data))
        return pool

    return make


def where(pool, value: float) -> str:
    """Which slot of the pool a number of numbered_pool came from, in words."""
    layer, kv, block, slot, head, _ = torch.unravel_index(torch.tensor(int(value)), pool.data.shape)
    return f"layer {layer}, {'keys' if kv == 0 else 'values'}, block {block}, slot {slot}, head {head}"


def test_no_blocks_give_an_empty_cache(numbered_pool):
    cache = numbered_pool().gather([], CONFIG)
    assert cache.get_seq_length() == 0


def test_each_layer_gets_keys_and_values_in_attention_layout(numbered_pool):
    cache = numbered_pool().gather([3, 1], CONFIG)
    assert len(cache.layers) == NUM_LAYERS, (
        f"a pool of {NUM_LAYERS} layers and {NUM_KV_HEADS} KV heads gathered into {len(cache.layers)} (keys, values) "
        "pairs: one pair per layer, each holding every KV head")
    expected = (1, SHAPE["num_kv_heads"], 2 * BLOCK_SIZE, SHAPE["head_dim"])
    for i, layer in enumerate(cache.layers):
        for name, tensor in (("keys", layer.keys), ("values", layer.values)):
            assert tuple(tensor.shape) == expected, (
                f"layer {i} {name} have shape {tuple(tensor.shape)}; attention expects "
                f"(batch=1, num_kv_heads, tokens, head_dim) = {expected}"
            )


# Attention reads the cached keys as a set (each key already carries its position, rotated
# into it), so the logits of the finish line would not notice blocks gathered out of order.
# This test does.
@pytest.mark.parametrize("block_ids", [[3, 1], [5, 0, 2], [4]], ids=str)
def test_token_p_comes_from_block_ids_p_div_block_size_at_slot_p_mod_block_size(numbered_pool, block_ids):
    pool = numbered_pool()
    cache = pool.gather(block_ids, CONFIG)
    for layer in range(SHAPE["num_layers"]):
        for kv, name in enumerate(("keys", "values")):
            got = getattr(cache.layers[layer], name)[0]  # (heads, tokens, dim)
            for p in range(len(block_ids) * BLOCK_SIZE):
                for head in range(SHAPE["num_kv_heads"]):
                    want = pool.data[layer, kv, block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE, head]
                    assert torch.equal(got[head, p], want), (
                        f"with block_ids {block_ids}, token {p} of layer {layer}'s {name} (head {head}) holds the "
                        f"numbers of {where(pool, got[head, p, 0])}; expected {where(pool, want[0])}"
                    )


def test_a_bfloat16_pool_gives_bfloat16_keys_and_values(numbered_pool):
    cache = numbered_pool(dtype=torch.bfloat16).gather([3, 1], CONFIG)
    dtypes = {str(tensor.dtype) for layer in cache.layers for tensor in (layer.keys, layer.values)}
    assert dtypes == {"torch.bfloat16"}, (
        f"a bfloat16 pool was gathered into {sorted(dtypes)}: the gathered K/V keep the pool's dtype (a copy to "
        "float32 doubles the memory of every gather, and the model, in bfloat16, would have to cast it back)"
    )


def test_a_longer_prefix_takes_no_more_tensor_operations(child):
    spec = {**SHAPE, "num_blocks": 16, "block_size": BLOCK_SIZE}
    short, long = (counted["names"] for counted in child.call("gather_count", spec=spec,
                                                                  block_ids_list=[[3], list(range(12))]))
    more = {name: n - short.get(name, 0) for name, n in long.items() if n > short.get(name, 0)}
    extra = ", ".join(f"{name} x{n}" for name, n in sorted(more.items(), key=lambda item: -item[1])[:3])
    assert sum(long.values()) <= sum(short.values()), (
        f"gathering {12 * BLOCK_SIZE} tokens ran {sum(long.values())} tensor operations, gathering {BLOCK_SIZE} ran "
        f"{sum(short.values())} "
        f"(more: {extra}): the work grows with the prefix, so a Python loop runs over its tokens or blocks, and a "
        "real prefix has thousands. Pick every block at once (index_select, or indexing with a tensor of block "
        "ids), then reshape"
    )


# Two rules about cost, timed here in the grader's process (the counts above are taken in the
# child, beside the code they count). The pools are built in earlier calls, before the clock.
GATHERED = (4, 4096)  # blocks gathered from one pool
POOLS = (16, 16_384)  # blocks in the pool, 4 of them gathered
WHOLE_LIMIT = 20  # a gather of GATHERED[1] blocks over kv_pool's: about 2 to 3 when vectorized


def numbered(pool: PagedKVPool) -> PagedKVPool:
    """kv_pool's pool numbered as the child numbers the pools it times (op_pool_new)."""
    pool.data.copy_(torch.arange(pool.data.numel(), dtype=pool.data.dtype).view_as(pool.data))
    return pool


def assert_timed_gather_right(child, handle, reference: PagedKVPool, block_ids: list[int], config) -> None:
    """What the timed gather returned, fetched after the clock stopped, equals kv_pool's gather
    of the same blocks: a timed call answers like any other."""
    got = child.call("last_gathered", handle=handle)["layers"]
    want = reference.gather(block_ids, config)
    same = len(got) == len(want.layers) and all(
        torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
        for (keys, values), layer in zip(got, want.layers))
    assert same, (f"a timed gather of {len(block_ids)} blocks returned keys and values other than kv_pool's gather of "
                  "the same blocks: a gather that is timed must be as right as one that is not")


def test_each_block_gathered_costs_no_more_than_a_few_times_the_references(child):
    """A vectorized gather spends about 0.1 µs on each block id here (the list made a tensor,
    index_select); a Python loop over the blocks a few times that, too close to tell apart on
    a busy machine. So in every gather each line of Python in the graded file costs LINE_COST
    (the child's costly_lines): the few lines of a vectorized gather cost the same for 4 blocks
    as for 4,096, a loop costs LINE_COST or more a block. Then, timed here: the extra time of
    4,096 blocks over 4, yours against kv_pool's on the same pool (which runs here, untraced),
    and the time of 4,096 blocks against kv_pool's, so that 4 blocks made as slow as 4,096 (a
    sleep) do not hide a loop. The fastest of 5 runs each."""
    spec = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 2, "num_blocks": GATHERED[1], "block_size": 1}
    handle = child.call("pool_new", spec=spec)
    reference = numbered(PagedKVPool(**spec))
    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, hidden_size=2)
    rng = drawn("gather scaling")
    block_ids = {n: rng.sample(range(GATHERED[1]), n) for n in GATHERED}

    def yours(n: int):
        def timed(r: int) -> float:
            (length, _), seconds = timed_call(child, "pool_gather", handle=handle, block_ids=block_ids[n],
                                              line_cost=LINE_COST)
            assert length == n, f"gathering {n} blocks of 1 token gave a cache of {length} tokens"
            assert_timed_gather_right(child, handle, reference, block_ids[n], config)
            return seconds
        return timed

    def references(n: int):
        def timed(r: int) -> float:
            start = time.perf_counter()
            reference.gather(block_ids[n], config)
            return time.perf_counter() - start
        return timed

    few, many = fastest_times(yours(GATHERED[0]), yours(GATHERED[1]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the child does for these gathers
    try:
        reference_few, reference_many = fastest_times(references(GATHERED[0]), references(GATHERED[1]))
    finally:
        torch.set_num_threads(threads)
    per_block = (many - few) / (GATHERED[1] - GATHERED[0])
    reference_per_block = max(reference_many - reference_few, 1e-6) / (GATHERED[1] - GATHERED[0])
    advice = ("the gather runs Python code for every block (a loop, a comprehension, a tensor or a numpy copy made "
              "per block), and a real prefix has hundreds of blocks in every step. One index of all the block ids "
              "picks them at once (index_select, or indexing with a tensor of block ids), then views reshape")
    assert per_block < SCALING_LIMIT * reference_per_block, (
        f"gathering {GATHERED[1]:,} blocks took {milliseconds(many)} and {GATHERED[0]} blocks {milliseconds(few)}: "
        f"{per_block * 1e6:.2f} µs more a block, {times(per_block / reference_per_block)} kv_pool's "
        f"{reference_per_block * 1e6:.2f} µs (timed by the grader, each line of your file costing "
        f"{LINE_COST * 1e6:.0f} µs): {advice}"
    )
    assert many < WHOLE_LIMIT * reference_many, (
        f"gathering {GATHERED[1]:,} blocks took {milliseconds(many)}, {times(many / reference_many)} kv_pool's "
        f"{milliseconds(reference_many)} (timed by the grader, each line of your file costing "
        f"{LINE_COST * 1e6:.0f} µs), over the limit of {WHOLE_LIMIT} times; {GATHERED[0]} blocks took "
        f"{milliseconds(few)}. A gather of many blocks costs a few times kv_pool's at most, whatever a gather of few "
        f"costs: {advice}"
    )


def test_a_gather_takes_as_long_from_a_pool_of_16_384_blocks_as_from_one_of_16(child):
    """4 blocks gathered from pools of 16 and 16,384 blocks (64 MB): the fastest of 5 runs."""
    spec = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 16}

    def at(num_blocks: int):
        handle = child.call("pool_new", spec={**spec, "num_blocks": num_blocks})
        reference = numbered(PagedKVPool(**spec, num_blocks=num_blocks))
        config = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=16)

        def timed(r: int) -> float:
            seconds = timed_call(child, "pool_gather", handle=handle, block_ids=[3, 1, 2, 0], line_cost=LINE_COST)[1]
            assert_timed_gather_right(child, handle, reference, [3, 1, 2, 0], config)
            return seconds
        return timed

    small, big = fastest_times(at(POOLS[0]), at(POOLS[1]))
    assert big < SCALING_LIMIT * small, (
        f"gathering 4 blocks took {milliseconds(small)} from a pool of {POOLS[0]} blocks and {milliseconds(big)} from "
        f"one of {POOLS[1]:,}, {times(big / small)} longer (timed by the grader): the gather copies or walks the "
        "whole pool (clone, contiguous or tolist of self.data, a loop over its blocks). Index the pool for the "
        "blocks asked for; it holds every request's K/V, and a gather copies one request's"
    )


def test_every_tensor_is_made_on_the_pools_device(child):
    # A pool on the "meta" device holds no data, so any tensor the gather makes elsewhere shows
    # (on a GPU, an index built on the CPU costs a copy to the GPU every gather, or fails).
    spec = {**SHAPE, "num_blocks": 6, "block_size": BLOCK_SIZE, "device": "meta"}
    (counted,) = child.call("gather_count", spec=spec, block_ids_list=[[3, 1]])
    elsewhere = {name: set(devices) - {"meta"} for name, devices in counted["devices"].items()
                 if set(devices) - {"meta"}}
    assert not elsewhere, (
        f"with the pool on the meta device, the gather made tensors on {elsewhere}: build the index on the pool's "
        "device (torch.tensor(block_ids, device=self.device)), or `python prefix_caching.py --device cuda` "
        "copies it there on every gather"
    )


@settings(GRADING, max_examples=25)
@given(st.lists(st.integers(0, 5), max_size=7), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_any_blocks_in_any_order_match_the_reference(numbered_pool, block_ids, dtype):
    pool = numbered_pool(dtype=dtype)
    pool.gather(block_ids, CONFIG)
    pool.twin.check()


def test_the_finish_line_cached_prefix_plus_suffix_logits_equal_a_full_forward(child, tiny_model):
    model = tiny_model
    pool = remote_pool_class()(child, **PagedKVPool.shape_from_config(model.config), num_blocks=16,
                               block_size=BLOCK_SIZE)
    prefix = 4 * BLOCK_SIZE  # 4 full blocks, then a suffix of 5 tokens
    prompt = list(range(200, 200 + prefix + 5))
    block_table = [9, 2, 14, 5, 0, 7]  # anywhere in the pool, in any order
    with torch.no_grad():
        computed = model(torch.tensor([prompt[:prefix]]), use_cache=True).past_key_values
        pool.write(computed, block_table, 0, prefix)  # what an earlier request left in the pool

        cache = pool.gather(block_table[:4], model.config)
        assert cache.get_seq_length() == prefix, (
            f"the gathered cache holds {cache.get_seq_length()} tokens, not {prefix}")
        cached = model(torch.tensor([prompt[prefix:]]), past_key_values=cache).logits[0]
        full = model(torch.tensor([prompt])).logits[0, prefix:]
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"cached prefix + suffix logits differ from a full forward pass: {m}")


def test_an_engine_running_on_your_gather_replies_like_model_generate(child, make_engine):
    engine = make_engine()
    pool = remote_pool_class()(child, **PagedKVPool.shape_from_config(engine.model.config),
                               num_blocks=engine.allocator.num_blocks, block_size=engine.allocator.block_size)
    parts = replace(engine.parts, kv=pool)  # stage 7's path over your pool: its gather is yours
    prompt = list(range(100, 123))  # 23 tokens: 5 full blocks of 4 and a partial one
    cold = generate(parts, "cold", prompt, SamplingParams(max_tokens=8))
    warm = generate(parts, "warm", prompt[:20] + [7, 8, 9], SamplingParams(max_tokens=8))
    assert warm.cached_tokens == 20
    assert cold.token_ids == greedy_reference(engine.model, prompt, 8)
    assert warm.token_ids == greedy_reference(engine.model, prompt[:20] + [7, 8, 9], 8), (
        "the warm reply, built on your gathered prefix, differs from model.generate on the whole prompt"
    )
