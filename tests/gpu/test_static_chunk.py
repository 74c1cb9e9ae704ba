"""The padded step with a prompt's chunk (engine/static_chunk.py), run eagerly on a CPU: the same
logits and tokens as the packed step of engine/batch_attention.py for every mix of chunks and
decodes, whatever the padding holds; the ladders pick the smallest rung that fits; a step too
big runs as before; and the graphs a GPU captures, their calls faked: each shape captured
once and replayed after, a failed one running packed alone."""

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
from engine.static_chunk import MAX_SCORES, chunk_rung, chunk_sizes, forward

pytestmark = [pytest.mark.gpu, pytest.mark.model]

SHARED = list(range(300, 330))  # 30 tokens: 7 full blocks of 4 and a partial one
CLOSE = {"rtol": 1e-5, "atol": 3e-5}  # float32, sums in another order (tests/gpu/test_static_decode.py)


def runners(engine, max_num_seqs: int = 8) -> tuple[ModelRunner, ModelRunner]:
    """Today's packed step, and the padded one, over one engine's parts."""
    return (ModelRunner(engine.parts, max_num_seqs=max_num_seqs, static_decode=False),
            ModelRunner(engine.parts, max_num_seqs=max_num_seqs, static_decode=True))


def steps_of(engine, prompts, max_tokens, budget: int = 16, max_num_seqs: int = 8, arrivals=None):
    """Step the prompts through a BatchRunner with a small budget (so prompts come in chunks,
    beside decodes), yielding each plan with a prompt's chunk (and its block tables) before it
    runs; the caller sends back its greedy tokens. Decode-only steps run packed. arrivals:
    the step each prompt is added at (all at once by default)."""
    runner = BatchRunner(engine.parts, choose_threads=False, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=budget, static_decode=False)
    arrivals = arrivals or [0] * len(prompts)
    requests, step = [], 0
    try:
        while len(requests) < len(prompts) or any(r.status != "finished" for r in requests):
            requests += [runner.add(f"r{i}", p, SamplingParams(max_tokens=max_tokens), None)
                         for i, p in enumerate(prompts) if arrivals[i] == step]
            step += 1
            plan = runner.schedule()
            if not plan.scheduled:
                continue
            if plan.num_tokens > len(plan.scheduled):
                tokens = yield plan, runner.block_tables
            else:
                tokens = runner.model_runner.run(plan, runner.block_tables).argmax(-1).tolist()
            runner.postprocess(plan, tokens)
    finally:
        for request in requests:
            runner.scheduler.finish(request)


def compare(engine, prompts, eager, padded, **options) -> list[tuple[int, int]]:
    """Every step with a chunk run both ways: the same logits (CLOSE) and greedy tokens.
    Returns the (tokens, reads) each ran padded to."""
    shapes, steps = [], steps_of(engine, prompts, 4, **options)
    try:
        plan, tables = next(steps)
        while True:
            with torch.inference_mode():
                want = eager.run(plan, tables)
                shapes.append(padded.chunk_rung(plan))
                got = padded.run(plan, tables)
            assert got.shape == want.shape and torch.allclose(got, want, **CLOSE), plan.num_tokens
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
            plan, tables = steps.send(want.argmax(-1).tolist())
    except StopIteration:
        return shapes


# --- the ladders ---------------------------------------------------------------------------


def test_the_token_ladder_and_the_rung_of_a_step(make_engine):
    assert chunk_sizes() == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    engine = make_engine()
    eager, padded = runners(engine, max_num_seqs=4)
    runner = BatchRunner(engine.parts, choose_threads=False, max_num_seqs=4, max_num_batched_tokens=64)
    request = runner.add("a", SHARED[:10], SamplingParams(max_tokens=2))
    plan = runner.schedule()
    # 10 tokens padded to 16, reading 3 blocks of 4 and one for the padding tokens
    assert plan.num_tokens == 10 and padded.padded_rung(plan) is None and padded.chunk_rung(plan) == (16, 4)
    assert eager.chunk_rung(plan) is None  # no padded path, nothing padded
    with torch.inference_mode():
        assert torch.allclose(padded.run(plan, runner.block_tables), eager.run(plan, runner.block_tables), **CLOSE)
    assert padded.last_step.num_slots_read == 4 * 4 and padded.last_step.num_prefill_tokens == 10
    runner.scheduler.finish(request)


def test_a_step_above_512_tokens_or_the_score_cap_runs_packed(make_engine):
    engine = make_engine(num_blocks=256)
    eager, padded = runners(engine, max_num_seqs=4)
    runner = BatchRunner(engine.parts, choose_threads=False, max_num_seqs=4, max_num_batched_tokens=1024)
    request = runner.add("a", list(range(100, 700)), SamplingParams(max_tokens=1))
    plan = runner.schedule()
    assert plan.num_tokens == 600 and padded.chunk_rung(plan) is None
    with torch.inference_mode():
        assert torch.equal(padded.run(plan, runner.block_tables), eager.run(plan, runner.block_tables))
    assert padded.last_step == eager.last_step  # the packed step's figures
    runner.scheduler.finish(request)
    counts = padded.counts
    # 512 tokens of a 40,000-token context would score 512 x 10,000 blocks x 4 slots a head
    fake = type("Plan", (), {"num_tokens": 512, "scheduled": [type("S", (), {"end": 40_000})()]})()
    assert chunk_rung(fake, counts + [1 << 14], 4) is None and 512 * (1 << 14) * 4 > MAX_SCORES


# --- the same numbers ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_random_chunked_steps_give_the_same_logits_padded_or_packed(make_engine, seed):
    """Prompts of many lengths, some behind one cached shared prefix, arriving at different
    steps: chunks of one and of several prompts beside decodes, every one padded."""
    rng = random.Random(seed)
    prompts = random_prompts(rng, (3, 6), 25, SHARED)
    engine = make_engine(num_blocks=128)
    engine.generate(SHARED + [99], max_tokens=1)  # SHARED's blocks cached: hits beside misses
    eager, padded = runners(engine)
    shapes = compare(engine, prompts, eager, padded, budget=rng.choice([8, 16, 32]),
                     arrivals=[rng.randrange(4) for _ in prompts])
    assert shapes and None not in shapes


def test_padding_is_never_read_and_changes_no_request(make_engine):
    """The scratch block filled with NaN and the padding tokens given other ids and places:
    the real rows' logits are the packed step's, every block the allocator owns holds what
    the packed step wrote."""
    engine = make_engine()
    eager, padded = runners(engine)
    steps = steps_of(engine, [SHARED[:13], [7, 8, 9]], 3, budget=64)
    plan, tables = next(steps)
    assert plan.num_tokens == 16  # 13 + 3 tokens: no padding yet
    pool = engine.kv
    with torch.inference_mode():
        # a step of 16 tokens padded as if it had 32: 16 padding tokens, padding reads
        want = eager.run(plan, tables)
        written = pool.data.clone()
        _, reads = padded.chunk_rung(plan)
        buffers = padded.chunk_buffers
        buffers.fill(plan, tables, 32, reads * 2)
        for layer in range(pool.num_layers):
            pool.blocks(layer)[:, pool.scratch_block] = float("nan")
        buffers.input_ids[16:32] = 1234
        buffers.positions[16:32] = 3  # they see the scratch block's first slots, all NaN
        logits = forward(engine.model, buffers, 32, reads * 2)
    assert torch.allclose(logits[:2], want, **CLOSE)
    assert torch.allclose(pool.data, written, **CLOSE)
    steps.close()


def test_a_generation_with_padded_chunks_equals_one_without(make_engine, monkeypatch):
    """Greedy replies through the engine, with small steps so prompts come in chunks beside
    decodes: the same tokens and hits with the padded path forced on as off, and as generate
    on each prompt alone; every step with a chunk ran padded."""
    calls = []
    monkeypatch.setattr(model_runner, "chunk_forward", lambda *args: calls.append(args[2:]) or forward(*args))
    prompts = [SHARED + [40], SHARED[:20] + [41, 42, 43], [7], list(range(500, 541)), SHARED[:9], [8, 9]]
    params = SamplingParams(max_tokens=8)
    results = []
    for static in (False, True):
        engine = make_engine(static_decode=static, max_num_batched_tokens=24, max_num_seqs=8)
        engine.generate(SHARED + [99], max_tokens=1)
        results.append(engine.generate_batch(prompts, params=params))
        assert bool(calls) == static
    without, padded = results
    assert [r.token_ids for r in padded] == [r.token_ids for r in without]
    assert [r.cached_tokens for r in padded] == [r.cached_tokens for r in without]
    for prompt, reply in zip(prompts, padded):
        assert reply.token_ids == greedy_reference(engine.model, prompt, 8)
    assert all(tokens in chunk_sizes() for tokens, _ in calls)


# --- the graphs, as far as a CPU goes --------------------------------------------------------


def test_each_chunk_shape_is_captured_once_then_replayed_and_a_failed_one_runs_packed(make_engine, caplog,
                                                                                      fake_graphs):
    """ChunkGraphs' bookkeeping with torch's graph calls faked: a new (tokens, reads) is
    captured after a warm-up pass, later steps of it replay; a shape whose capture fails says
    so once and runs packed from then on, the others keep their graphs; /health's figures
    count both kinds of graph."""
    engine = make_engine()
    eager, padded = runners(engine)
    padded.chunk_graphs = graphs = model_runner.ChunkGraphs(engine.model, padded.chunk_buffers)
    capture, tries = graphs.capture, []
    failing = (8, 8)

    def capture_or_fail(*shape):
        tries.append(shape)
        if shape == failing:
            raise RuntimeError("out of memory")
        capture(*shape)

    graphs.capture = capture_or_fail
    steps = steps_of(engine, [SHARED[:13], [7, 8, 9], SHARED[:7] + [5]], 3, budget=8)
    shapes = []
    with caplog.at_level(logging.WARNING, logger="engine"), torch.inference_mode():
        plan, tables = next(steps)
        try:
            while True:
                want = eager.run(plan, tables)
                shapes.append(padded.chunk_rung(plan) or failing)
                got = padded.run(plan, tables)
                if shapes[-1] == failing:
                    assert torch.allclose(got, want, **CLOSE) and padded.last_step == eager.last_step
                plan, tables = steps.send(want.argmax(-1).tolist())
        except StopIteration:
            pass
    assert failing in shapes and tries.count(failing) == 1
    assert len([r for r in caplog.records if r.name == "engine"]) == 1
    new = list(dict.fromkeys(s for s in shapes if s != failing))
    assert new and [shape for shape, _ in graphs.captures] == new and len(fake_graphs) == len(new)
    assert sum(graph.replays for graph in fake_graphs) == len([s for s in shapes if s != failing])
    assert padded.captures == len(new) and padded.graph_figures()["failed"] == 1


# --- captured before any request -------------------------------------------------------------


def test_the_loops_graphs_are_captured_at_start_over_padding_only_and_replayed_after(make_engine, fake_graphs,
                                                                                    monkeypatch):
    """ModelRunner.capture_at_start (torch's graph calls faked): every decode shape of rows
    within the bound and every chunk shape within it, each captured once over padding (the
    allocator's blocks untouched), none twice; later steps of those shapes only replay.
    Engine.warm_up calls it on the loop's runner, unless told the loop will not run (the demo)."""
    engine = make_engine(static_decode=True, max_num_seqs=4, num_blocks=64)
    runner = engine.loop.runner.model_runner
    runner.graphs = model_runner.DecodeGraphs(engine.model, runner.buffers)
    runner.chunk_graphs = model_runner.ChunkGraphs(engine.model, runner.chunk_buffers)
    shapes = runner.start_shapes(up_to=16)  # 4 blocks of 4 a row
    # sizes 1, 2, 4; each reading from one block a row to four; chunks of 2 to 16 tokens
    assert shapes["decode"] == [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16)]
    assert shapes["chunk"] == [(2, 2), (2, 4), (2, 8), (4, 2), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8)]
    before = engine.kv.data.clone()
    assert runner.capture_at_start(up_to=16) == 18 and runner.capture_at_start(up_to=16) == 0
    assert torch.equal(engine.kv.data, before)
    assert [s for s, _ in runner.graphs.captures] == shapes["decode"]
    assert [s for s, _ in runner.chunk_graphs.captures] == shapes["chunk"]
    captured = runner.captures
    engine.generate_batch([[5, 6, 7], [8, 9]], max_tokens=3)  # a chunk of 5 (8, 4), then decodes (2, 2)
    assert runner.captures == captured  # those shapes were there: replayed, none captured
    calls = []
    real = model_runner.ModelRunner.capture_at_start
    monkeypatch.setattr(model_runner.ModelRunner, "capture_at_start",
                        lambda self, *args: calls.append(self) or real(self, *args))
    engine.warm_up(stage_7=False)
    assert calls == [runner]
    engine.warm_up(loop_graphs=False)  # the demo's: its requests never run in the loop
    assert calls == [runner]
