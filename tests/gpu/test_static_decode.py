"""The padded decode step (engine/static_decode.py), run eagerly on a CPU: the same logits and tokens
as the packed step of engine/batch_attention.py for every mix of decodes, whatever the padding holds;
the ladders pick the smallest rung that fits; a step that does not fit runs as before; and
the graphs that only a GPU captures, their calls faked here: each shape captured once after a
warm-up and replayed after, and a capture that fails turning that shape alone eager."""

import logging
import random

import pytest
import torch

from engine import model_runner
from engine.batch_engine import BatchRunner

from engine.model_runner import ModelRunner
from engine.one_request import greedy_reference
from helpers import random_prompts
from engine.request import SamplingParams
from engine.static_decode import block_counts, decode_sizes, forward, padded_to, rung

pytestmark = [pytest.mark.gpu, pytest.mark.model]

SHARED = list(range(300, 330))  # 30 tokens: 7 full blocks of 4 and a partial one
# Logits of the tiny model reach about 8; padded matmuls sum in another order, so in float32
# the two steps differ by about 1e-5 at most.
CLOSE = {"rtol": 1e-5, "atol": 3e-5}


def runners(engine, max_num_seqs: int = 8) -> tuple[ModelRunner, ModelRunner]:
    """Two model runners over one engine's parts: today's packed step, and the padded one."""
    eager = ModelRunner(engine.parts, max_num_seqs=max_num_seqs, static_decode=False)
    padded = ModelRunner(engine.parts, max_num_seqs=max_num_seqs, static_decode=True)
    return eager, padded


def decode_plans(engine, prompts: list[list[int]], max_tokens: int | list[int], max_num_seqs: int = 16):
    """Step the prompts through a BatchRunner of the engine, yielding each decode-only plan
    (with its block tables) before it runs; the caller sends back the step's greedy tokens.
    max_tokens: for all, or for each prompt."""
    runner = BatchRunner(engine.parts, choose_threads=False, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                         static_decode=False)
    each = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    requests = [runner.add(f"r{i}", prompt, SamplingParams(max_tokens=n), None)
                for i, (prompt, n) in enumerate(zip(prompts, each))]
    try:
        while any(r.status != "finished" for r in requests):
            plan = runner.schedule()
            if plan.num_tokens == len(plan.scheduled):
                tokens = yield plan, runner.block_tables
            else:
                logits = runner.model_runner.run(plan, runner.block_tables)
                tokens = logits.argmax(-1).tolist()
            runner.postprocess(plan, tokens)
    finally:  # closed early: every block back
        for request in requests:
            runner.scheduler.finish(request)


def iter_steps(steps, tokens_of):
    """Drive decode_plans to its end: each (plan, tables) yielded, then its tokens sent back."""
    try:
        plan, tables = next(steps)
        while True:
            yield plan, tables
            plan, tables = steps.send(tokens_of(plan, tables))
    except StopIteration:
        return


def compare_steps(engine, prompts, max_tokens, eager, padded, max_num_seqs=16) -> list[int]:
    """Every decode-only step run both ways: the same logits (CLOSE) and the same greedy tokens.
    Returns the batch sizes seen."""
    sizes = []
    steps = decode_plans(engine, prompts, max_tokens, max_num_seqs)
    try:
        plan, tables = next(steps)
        while True:
            with torch.inference_mode():
                want = eager.run(plan, tables)
                got = padded.run(plan, tables)
            assert torch.allclose(got, want, **CLOSE), len(plan.scheduled)
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
            sizes.append(len(plan.scheduled))
            plan, tables = steps.send(want.argmax(-1).tolist())
    except StopIteration:
        return sizes


# --- the ladders ---------------------------------------------------------------------------


def test_the_ladders_pick_the_smallest_rung_that_holds_the_step():
    assert decode_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_sizes(12) == [1, 2, 4, 8, 12] and decode_sizes(1) == [1]
    assert block_counts(64) == [1, 2, 4, 8, 16, 32, 64] and block_counts(1) == [1]
    sizes = decode_sizes(64)
    assert [padded_to(sizes, n) for n in (1, 2, 3, 5, 8, 9, 17, 64, 65)] == [1, 2, 4, 8, 8, 16, 24, 64, None]


def test_a_decode_step_runs_padded_to_its_rung_and_a_bigger_one_as_before(make_engine):
    engine = make_engine(num_blocks=64)
    eager, padded = runners(engine, max_num_seqs=4)
    prompts = [SHARED[:n] for n in (3, 5, 11)] + [list(range(500, 509)), [7, 8]]
    steps = decode_plans(engine, prompts, max_tokens=3)
    plan, tables = next(steps)  # five decodes: above the ladder (4)
    assert padded.padded_rung(plan) is None
    with torch.inference_mode():
        assert torch.equal(padded.run(plan, tables), eager.run(plan, tables))
    assert padded.last_step == eager.last_step  # the packed step's figures: no padding
    three = plan.__class__(plan.scheduled[:3], [])
    assert [s.end for s in three.scheduled] == [4, 6, 12]  # 1 + 2 + 3 blocks of 4, one for the padding row
    assert padded.padded_rung(three) == (4, 8)
    with torch.inference_mode():
        padded.run(three, tables)
    assert padded.last_step.num_slots_read == 8 * 4  # 8 blocks of 4 slots, padding included
    steps.close()


# --- the same numbers ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_random_decode_batches_give_the_same_logits_padded_or_packed(make_engine, seed):
    """Prompts of many lengths, some behind one shared prefix (cached), batches of 1 to 7
    that pad (3 to 4, 5 to 8) as requests finish."""
    rng = random.Random(seed)
    prompts = random_prompts(rng, (3, 7), 14, SHARED)
    engine = make_engine(num_blocks=96)
    eager, padded = runners(engine)
    lengths = [2 + i for i in range(len(prompts))]  # requests finish one a step: every batch size down to 1
    sizes = compare_steps(engine, prompts, lengths, eager, padded)
    assert sizes == list(range(len(prompts), 0, -1))


def test_decodes_behind_a_long_shared_prefix_match_the_cascade_step(make_engine):
    """Five decodes sharing 260 tokens: the packed step reads the prefix once (cascade
    attention); the padded one reads every row's blocks whole. The same logits."""
    prefix = list(range(1000, 1260))
    prompts = [prefix + [40 + i] * (i + 1) for i in range(5)]
    engine = make_engine(num_blocks=128)
    eager, padded = runners(engine)
    sizes = compare_steps(engine, prompts, 3, eager, padded)
    assert 5 in sizes and eager.last_step.num_slots_read < 5 * 264  # the eager step did share the prefix


def test_padding_is_never_read_and_changes_no_request(make_engine):
    """The scratch block filled with NaN and the padding rows given other tokens and places:
    the real rows' logits and every block the allocator owns are as the packed step left them."""
    engine = make_engine(num_blocks=64)
    eager, padded = runners(engine)
    prompts = [SHARED[:9], SHARED[:14] + [50], [7, 8, 9]]  # 3 decodes: padded to 4
    steps = decode_plans(engine, prompts, max_tokens=3)
    plan, tables = next(steps)
    pool = engine.kv
    with torch.inference_mode():
        want = eager.run(plan, tables)
        written = pool.data.clone()
        size, reads = padded.padded_rung(plan)
        assert size == 4
        padded.buffers.fill(plan, tables, size, reads)
        for layer in range(pool.num_layers):
            pool.blocks(layer)[:, pool.scratch_block] = float("nan")
        padded.buffers.input_ids[3:] = 1234
        padded.buffers.positions[3:] = 77
        real = sum(-(-s.end // pool.block_size) for s in plan.scheduled)
        padded.buffers.read_lens[real:] = 2  # the padding reads even take a NaN slot: only their own rows see it
        logits = forward(engine.model, padded.buffers, size, reads)
    assert torch.allclose(logits[:3], want, **CLOSE)
    assert logits[3].isnan().any()  # the poison was there to read
    assert torch.allclose(pool.data, written, **CLOSE)
    steps.close()


# --- whole generations ---------------------------------------------------------------------


def test_a_generation_with_the_padded_step_equals_one_without(make_engine, monkeypatch):
    """Greedy replies of requests of different lengths, some hitting a cached prefix, through
    the engine: the same tokens with static_decode forced on (eagerly, on this CPU) as off,
    and as generate on each prompt alone."""
    calls = []
    monkeypatch.setattr(model_runner, "forward", lambda *args: calls.append(args[2:]) or forward(*args))
    prompts = [SHARED + [40], SHARED[:20] + [41, 42, 43], [7], list(range(500, 523)), SHARED[:9], [8, 9]]
    engine = make_engine()
    engine.generate(SHARED + [99], max_tokens=1)  # SHARED's blocks cached before the batch
    params = SamplingParams(max_tokens=10)
    without = engine.generate_batch(prompts, params=params)
    assert not calls
    padded = make_engine(static_decode=True)
    padded.generate(SHARED + [99], max_tokens=1)
    replies = padded.generate_batch(prompts, params=params)
    # The first decode step: 6 rows padded to 8, reading 8 + 6 + 1 + 6 + 3 + 1 blocks of 4 and
    # one for each padding row, 27 padded to 32 (each row reading the longest row's 8: 64).
    assert calls[0] == (8, 32)
    assert [r.token_ids for r in replies] == [r.token_ids for r in without]
    assert [r.cached_tokens for r in replies] == [r.cached_tokens for r in without] and replies[0].cached_tokens == 28
    for prompt, reply in zip(prompts, replies):
        assert reply.token_ids == greedy_reference(engine.model, prompt, 10)


def test_every_padded_step_reads_its_inputs_from_the_same_buffers(make_engine, tiny_model):
    """A decode step's token ids, positions and slots are read where the runner keeps them
    (what a CUDA graph replays), step after step, and the replies stay exact."""
    engine = make_engine()
    runner = BatchRunner(engine.parts, choose_threads=False, max_num_seqs=4, max_num_batched_tokens=64,
                         static_decode=True)
    prompts = [list(range(10, 22)), list(range(30, 37)), list(range(50, 59))]
    requests = [runner.add(f"r{i}", p, SamplingParams(max_tokens=6), None) for i, p in enumerate(prompts)]
    buffers, seen = runner.model_runner.buffers, []

    def watch(module, args, kwargs):
        step = kwargs["pool_step"]
        if kwargs["input_ids"].shape[1] == 4:  # the padded decode steps (3 requests, padded to 4)
            seen.append((kwargs["input_ids"].data_ptr(), kwargs["position_ids"].data_ptr(),
                         step.slot_mapping.data_ptr()))

    hook = tiny_model.register_forward_pre_hook(watch, with_kwargs=True)
    try:
        replies = runner.run(requests)
    finally:
        hook.remove()
    assert [r.token_ids for r in replies] == [greedy_reference(tiny_model, p, 6) for p in prompts]
    where = (buffers.input_ids.data_ptr(), buffers.positions.data_ptr(), buffers.slot_mapping.data_ptr())
    assert len(seen) == 5 and all(s == where for s in seen), "a decode step's inputs moved"


# --- the graphs, as far as a CPU goes --------------------------------------------------------


def test_a_cpu_runs_the_packed_step_unless_asked_and_never_captures(make_engine):
    engine = make_engine()
    assert ModelRunner(engine.parts, max_num_seqs=8).buffers is None  # the default on a CPU: as before
    forced = ModelRunner(engine.parts, max_num_seqs=8, static_decode=True)
    assert forced.buffers is not None and forced.graphs is None  # padded, eagerly: nothing to capture


def test_each_shape_is_captured_once_after_a_warm_up_then_replayed(make_engine, monkeypatch, fake_graphs):
    """DecodeGraphs' bookkeeping, with torch's graph calls faked: a new (size, reads) runs a
    warm-up pass and a captured one, later steps of it only replay, every graph after the first
    allocates from the first one's memory pool, all of them write their logits into one buffer,
    and the runner counts its captures."""
    passes = []
    monkeypatch.setattr(model_runner, "forward", lambda *args: passes.append(args[2:]) or forward(*args))
    engine = make_engine()
    eager, padded = runners(engine)
    padded.graphs = model_runner.DecodeGraphs(engine.model, padded.buffers)
    steps = decode_plans(engine, [SHARED[:9], [7, 8, 9], SHARED[:5]], max_tokens=[3, 6, 6])
    shapes, outputs = [], set()
    with torch.inference_mode():
        for plan, tables in iter_steps(steps, lambda plan, tables: eager.run(plan, tables).argmax(-1).tolist()):
            shapes.append(padded.padded_rung(plan))
            padded.run(plan, tables)
            outputs.add(padded.graphs.replay(*shapes[-1]).untyped_storage().data_ptr())
    new = list(dict.fromkeys(shapes))  # each shape once, in the order they came
    # 3 rows reading 3 + 1 + 2 blocks and one for the padding row; later 2 rows of 2 blocks each
    assert shapes[:2] == [(4, 8), (4, 8)] and (2, 4) in new and len(new) < len(shapes)
    assert passes == [shape for shape in new for _ in ("warm-up", "capture")]  # no pass of its own for a replay
    assert len(fake_graphs) == len(new) and sum(graph.replays for graph in fake_graphs) == 2 * len(shapes)
    first, *later = fake_graphs
    assert first.captured_in is None and all(graph.captured_in == ("pool of", first) for graph in later)
    assert len(outputs) == 1  # one logits buffer for every graph
    assert padded.captures == len(new) and [shape for shape, _ in padded.graphs.captures] == new


def test_a_failed_capture_says_why_once_and_only_its_shape_runs_eagerly(make_engine, caplog, fake_graphs):
    """A capture that fails (an operation a graph cannot hold, or no memory for a wide shape)
    turns off that shape alone: one warning naming it, its later steps packed as the eager
    runner's (no second try), every other shape captured and replayed, every step's logits
    those of the packed step."""
    engine = make_engine()
    eager, padded = runners(engine)
    padded.graphs = graphs = model_runner.DecodeGraphs(engine.model, padded.buffers)
    capture, tries = graphs.capture, []

    def failing(*shape):
        tries.append(shape)
        if shape == (4, 8):
            raise RuntimeError("operation not permitted when stream is capturing")
        capture(*shape)

    graphs.capture = failing
    steps = decode_plans(engine, [SHARED[:9], [7, 8, 9], SHARED[:5]], max_tokens=[3, 6, 6])
    shapes = []
    with caplog.at_level(logging.WARNING, logger="engine"), torch.inference_mode():
        for plan, tables in iter_steps(steps, lambda plan, tables: eager.run(plan, tables).argmax(-1).tolist()):
            shapes.append(rung(plan, padded.sizes, padded.counts, engine.kv.block_size))
            got = padded.run(plan, tables)
            if not graphs.has(*shapes[-1]):  # a replay gives what the capture left (the fake records no pass)
                assert torch.allclose(got, eager.run(plan, tables), **CLOSE)
                assert padded.last_step == eager.last_step  # the packed step, not the padded one
    messages = [r.getMessage() for r in caplog.records if r.name == "engine"]
    assert shapes[:2] == [(4, 8), (4, 8)] and tries.count((4, 8)) == 1 and len(messages) == 1
    assert "(4, 8)" in messages[0] and "operation not permitted" in messages[0]
    assert graphs.failed == {(4, 8)} and set(graphs.graphs) == set(shapes) - {(4, 8)} != set()
    assert padded.buffers is not None and padded.captures == len(graphs.graphs)


def test_a_long_row_among_short_ones_reads_only_its_own_blocks(make_engine):
    """One 120-token context among seven of a few tokens: the padded step reads each row's own
    blocks (30 + 7 x 1, padded to 64), not the longest row's 30 for every row (240), and gives
    the packed step's logits."""
    engine = make_engine(num_blocks=96)
    eager, padded = runners(engine)
    prompts = [list(range(600, 719))] + [[10 + i, 20 + i] for i in range(7)]
    steps = decode_plans(engine, prompts, max_tokens=2)
    plan, tables = next(steps)
    assert [s.end for s in plan.scheduled] == [120] + [3] * 7
    assert padded.padded_rung(plan) == (8, 64)
    with torch.inference_mode():
        assert torch.allclose(padded.run(plan, tables), eager.run(plan, tables), **CLOSE)
    assert padded.last_step.num_slots_read == 64 * 4
    steps.close()


def test_the_engine_publishes_its_graphs_for_health(make_engine, fake_graphs):
    """What /health shows of the graphs, from the loop's snapshot: null on a CPU; with graphs
    (torch's calls faked), the shapes captured, the time they took and the shapes that failed."""
    assert make_engine().snapshot().cuda_graphs is None
    engine = make_engine(static_decode=True)
    runner = engine.loop.runner.model_runner
    runner.graphs = model_runner.DecodeGraphs(engine.model, runner.buffers)
    engine.generate_batch([SHARED[:9], [7, 8, 9]], max_tokens=4)
    figures = engine.snapshot().cuda_graphs
    assert figures["captured"] == len(runner.graphs.captures) > 0 and figures["failed"] == 0
    assert figures["capture_s"] == round(sum(seconds for _, seconds in runner.graphs.captures), 3)
