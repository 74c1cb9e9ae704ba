"""Each step's token budget from a target step time (engine/step_budget.py): the costs it learns, the
budgets it picks, the hard cap never passed, and exact replies whatever chunks it picks."""

import threading

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from allocator import PrefixCachingAllocator
from engine import batch_attention
from engine import model_runner
from engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, Engine
from engine.batch_engine import BatchRunner
from engine.one_request import greedy_reference
from engine.request import FINISHED, SamplingParams
from engine.scheduler import Budget, Candidate, Request, ScheduledRequest, Scheduler, StepPlan
from engine.step_budget import (CALIBRATION_TOKENS, DEFAULT_TARGET_STEP_MS, FAIR_SLACK, FAIR_STALL, FIRST_CHUNK,
                                FLOOR, GAP_MAX, MIN_CHUNK, STALL, AttentionCosts, HeldCosts, ModelShape, StepBudget,
                                StepCosts, chunk_flops, keys_attended)
from helpers import call, serve
from server import create_app

SMOL = ModelShape(body_params=106_000_000, layers=30, heads=9, head_dim=64)  # SmolLM2-135M's sizes


def test_the_model_shape_is_read_from_the_model(tiny_model):
    shape = ModelShape.of(tiny_model)
    assert (shape.layers, shape.heads, shape.head_dim) == (2, 4, 16)
    embedding = tiny_model.get_input_embeddings().weight.numel()
    assert shape.body_params == sum(p.numel() for p in tiny_model.parameters()) - embedding


def test_a_chunk_costs_its_tokens_and_the_keys_they_attend_to():
    assert keys_attended(0, 3) + keys_attended(3, 5) == keys_attended(0, 5) == 15
    # The same 100 tokens cost more late in a long prompt: each attends to every key before it.
    assert chunk_flops(SMOL, 3_900, 4_000) > 1.9 * chunk_flops(SMOL, 0, 100)


def test_timed_attention_prices_its_pairs_and_the_keys_each_request_reads():
    counted = SMOL.attention
    assert counted == AttentionCosts(per_pair=4 * 30 * 9 * 64, per_key=0.0)
    timed = AttentionCosts(per_pair=1.5 * counted.per_pair, per_key=2e6)
    # a chunk reads its whole context whatever its size: a 16-token chunk after 3,000 cached tokens
    # costs the 3,016 keys it reads on top of its pairs
    read = chunk_flops(SMOL, 3_000, 3_016, timed) - chunk_flops(SMOL, 3_000, 3_016, AttentionCosts(timed.per_pair))
    assert read == 3_016 * 2e6
    assert chunk_flops(SMOL, 0, 100, counted) == chunk_flops(SMOL, 0, 100)


def test_attention_costs_from_timed_steps_solve_for_pairs_and_reads():
    pair_s, key_s, per_flop = 3e-9, 2e-8, 1e-11
    chunks = ((2_080, 64, 1e-3), (133_152, 2_112, 1e-3 + 131_072 * pair_s + 2_048 * key_s))
    decodes = ((128, 128, 5e-4), (8_192, 8_192, 5e-4 + 8_064 * (pair_s + key_s)))
    got = AttentionCosts.timed(SMOL.attention, per_flop, chunks, decodes)
    assert got == AttentionCosts(pytest.approx(300.0), pytest.approx(2_000.0))
    # Noise that makes reading come out negative: the pairs take the chunks' whole difference.
    no_reads = ((128, 128, 5e-4), (8_192, 8_192, 5e-4 + 8_064 * 1e-10))
    got = AttentionCosts.timed(SMOL.attention, per_flop, chunks, no_reads)
    assert got.per_key == 0 and got.per_pair == pytest.approx((131_072 * pair_s + 2_048 * key_s) / 131_072 / per_flop)
    # Nothing to tell: the counted costs stay.
    assert AttentionCosts.timed(SMOL.attention, 0.0, chunks, decodes) == SMOL.attention
    flat = ((2_080, 64, 1e-3), (133_152, 2_112, 1e-3))
    assert AttentionCosts.timed(SMOL.attention, per_flop, flat, ((128, 128, 1e-3), (8_192, 8_192, 1e-3))) == SMOL.attention


def test_a_budget_with_timed_attention_gives_a_late_chunk_fewer_tokens_and_keeps_within_the_target():
    budget, counted = learned(0.05, 2e-11), learned(0.05, 2e-11)
    budget.attention = AttentionCosts(per_pair=2 * SMOL.attention.per_pair, per_key=1e6)
    late = Candidate(Request("turn", [1] * 4000), False, 3000, 3000, 1000)
    chunk = budget.budget([late], threads=2).tokens
    assert chunk < counted.budget([late], threads=2).tokens
    fixed, per_flop = budget.costs.fit(2)
    target = DEFAULT_TARGET_STEP_MS / 1e3
    step = [chunk_flops(SMOL, 3000, 3000 + n, budget.attention) for n in (chunk, chunk + 1)]
    assert fixed + per_flop * step[0] <= target < fixed + per_flop * step[1]


def test_an_engine_times_its_own_attention_when_made(tiny_model, tokenizer):
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=16, num_blocks=512)  # room for 2,048 + 64, and 8 x 1,024
    try:
        timed = engine._timed_attention()
        (short, long), (few, many) = timed["chunks"], timed["decodes"]
        assert (short[:2], long[:2]) == ((keys_attended(0, 64), 64), (keys_attended(2048, 2112), 2112))
        assert (few[:2], many[:2]) == ((8 * 16, 8 * 16), (8 * 1024, 8 * 1024))
        assert all(seconds > 0 for *_, seconds in (short, long, few, many))
        assert engine.allocator.num_free_blocks == 512 and not engine.allocator.block_tables  # nothing held or cached
        assert engine.allocator.num_cached_blocks == 0
        budget = engine.step_budget
        assert budget.attention.per_pair >= 0 and budget.attention.per_key >= 0
        assert budget.describe()["attention_flops"] == {"per_pair": pytest.approx(budget.attention.per_pair, rel=0.01),
                                                        "per_key_read": pytest.approx(budget.attention.per_key, rel=0.01)}
        small = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=64)  # too small to time
        assert small._timed_attention() is None and small.step_budget.attention == small.step_budget.shape.attention
        small.close()
    finally:
        engine.close()


def test_costs_are_fitted_per_thread_count():
    costs = StepCosts()
    for flops in (1e9, 4e9, 2e10, 1e9):
        costs.record(2, flops, 0.040 + flops * 5e-12)  # 40 ms a step, 5 ms a GFLOP with two threads
        costs.record(1, flops, 0.030 + flops * 9e-12)  # one thread: slower per GFLOP
    assert costs.fit(2) == pytest.approx((0.040, 5e-12))
    assert costs.fit(1) == pytest.approx((0.030, 9e-12))
    assert not costs.known(None)  # a GPU's steps would be learned apart


def test_steps_of_one_size_are_all_counted_per_flop():
    costs = StepCosts()
    for _ in range(5):
        costs.record(2, 3e9, 0.12)  # decodes only: the fixed part cannot be told apart
    assert costs.fit(2) == (0.0, pytest.approx(0.12 / 3e9))


def test_the_fixed_part_is_kept_while_the_steps_are_too_alike_to_tell_it_apart():
    costs = StepCosts()
    for flops in (1e9, 1e10, 2e10):
        costs.record(2, flops, 0.040 + flops * 5e-12)
    assert costs.fit(2) == pytest.approx((0.040, 5e-12))
    alike = StepCosts()
    alike.last_fit = costs.last_fit  # then only a long prompt's equal chunks, each a little slower
    alike.record(2, 1.2e10, 0.040 + 1.2e10 * 6e-12)
    assert alike.fit(2) == pytest.approx((0.040, 6e-12))  # the fixed part kept, the rest per flop


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_slow_minute_does_not_move_what_was_learned():
    clock = Clock()
    costs = StepCosts(clock)
    for second in range(120):  # two quiet minutes of decodes and prompt chunks
        clock.now = second
        for flops in (1e9, 3e10):
            costs.record(2, flops, 0.040 + flops * 5e-12)
    quiet = costs.fit(2)
    for second in range(120, 180):  # then a minute with another program on the cores: 2.5x slower
        clock.now = second
        for flops in (1e9, 3e10):
            costs.record(2, flops, 2.5 * (0.040 + flops * 5e-12))
    assert costs.fit(2) == pytest.approx(quiet)
    for second in range(180, 400):  # a machine that stays busy is learned as busy
        clock.now = second
        for flops in (1e9, 3e10):
            costs.record(2, flops, 2.5 * (0.040 + flops * 5e-12))
    assert costs.fit(2) == pytest.approx((2.5 * 0.040, 2.5 * 5e-12))


def test_a_bucket_keeps_one_step_a_second():
    clock = Clock()
    costs = StepCosts(clock)
    for _ in range(50):  # fifty decode steps within one second: one is kept
        costs.record(2, 1e9, 0.05)
    assert costs.num_steps(2) == 1
    clock.now = 1.0
    costs.record(2, 1e9, 0.05)
    assert costs.num_steps(2) == 2


def decoding(request_id: str, context: int) -> Request:
    request = Request(request_id, list(range(context)))
    request.output_ids, request.num_computed_tokens = [7], context  # its next step is one decode
    return request


def learned(fixed_s: float, per_flop: float, threads=2) -> StepBudget:
    budget = StepBudget(SMOL, DEFAULT_TARGET_STEP_MS, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    for flops in (1e9, 1e10, 1e11):
        budget.costs.record(threads, flops, fixed_s + per_flop * flops)
    return budget


def predicted(budget: StepBudget, decodes: list[Request], prompt_start: int, chunk: int) -> float:
    fixed, per_flop = budget.costs.fit(2)
    flops: float = sum(chunk_flops(SMOL, r.num_computed_tokens, r.num_computed_tokens + 1) for r in decodes)
    return fixed + per_flop * (flops + chunk_flops(SMOL, prompt_start, prompt_start + chunk))


def test_before_any_step_is_timed_a_prompt_gets_a_first_chunk():
    budget = StepBudget(SMOL, 400, 2048)
    assert budget.tokens([], [Request("long", [1] * 4000)], threads=2) == FIRST_CHUNK


def test_with_nothing_to_prefill_the_budget_is_the_cap():
    assert learned(0.05, 5e-12).tokens([decoding("a", 100)], [], threads=2) == DEFAULT_MAX_NUM_BATCHED_TOKENS


def test_alone_a_prompt_fills_the_target():
    budget = learned(0.05, 2e-11)
    chunk = budget.tokens([], [Request("long", [1] * 4000)], threads=2)
    target = DEFAULT_TARGET_STEP_MS / 1e3
    assert predicted(budget, [], 0, chunk) <= target < predicted(budget, [], 0, chunk + 1)


def test_beside_decodes_a_step_takes_at_most_stall_times_theirs():
    budget = learned(0.005, 5e-12)  # a small fixed cost: the floor is below the streams' bound
    decodes = [decoding(f"s{i}", 300) for i in range(30)]
    decode_s = predicted(budget, decodes, 0, 0)  # about 38 ms: the streams' gap between tokens
    chunk = budget.tokens(decodes, [Request("long", [1] * 4000)], threads=2) - len(decodes)
    assert predicted(budget, decodes, 0, chunk) <= STALL * decode_s < predicted(budget, decodes, 0, chunk + 1)
    assert STALL * decode_s < DEFAULT_TARGET_STEP_MS / 1e3  # here the streams' bound is the tighter one


def test_a_chunk_is_never_crumbs_but_the_floor_stretches_a_gap_at_most_gap_max_times():
    budget = learned(0.05, 2e-11)  # 50 ms a step whatever its size: FLOOR x that is 150 ms of prompt
    decodes = [decoding(f"s{i}", 300) for i in range(4)]
    decode_s = predicted(budget, decodes, 0, 0)  # about 69 ms: STALL would allow 82 ms of prompt
    chunk = budget.tokens(decodes, [Request("long", [1] * 4000)], threads=2) - len(decodes)
    prompt_s = predicted(budget, decodes, 0, chunk) - decode_s
    assert (STALL - 1) * decode_s < prompt_s <= (GAP_MAX - 1) * decode_s  # the floor won, up to GAP_MAX
    slow = learned(0.5, 1e-11)  # a machine where every step is over the target already
    chunk = slow.tokens([], [Request("long", [1] * 4000)], threads=2)
    fixed, per_flop = slow.costs.fit(2)
    assert per_flop * chunk_flops(SMOL, 0, chunk) <= FLOOR * fixed < per_flop * chunk_flops(SMOL, 0, chunk + 1)


def test_a_turn_after_a_long_cached_history_is_priced_at_its_positions():
    budget = learned(0.01, 2e-11)
    fresh = budget.budget(candidates_of(Request("new", [1] * 4000)), threads=2).tokens
    turn = Request("turn", [1] * 4000)
    later = budget.budget([Candidate(turn, False, 3900, 3900, 100)], threads=2).tokens
    assert later < fresh  # its tokens attend to the 3,900 cached before them


def candidates_of(*requests):
    return [Candidate(r, False, 0, 0, len(r.token_ids)) for r in requests]


@pytest.mark.parametrize("fixed_s", [0.005, 0.3])  # 69 ms a step: the floor wins; 364 ms: FAIR_STALL does
def test_a_tenant_far_ahead_shares_little_beside_others_decodes(fixed_s):
    budget = learned(fixed_s, 5e-12)
    decodes = [decoding(f"s{i}", 300) for i in range(60)]
    honest = [Candidate(r, True, 0, 300, 1, lead=0) for r in decodes]
    heavy = Candidate(Request("heavy", [1] * 4000), False, 0, 0, 4000, lead=FAIR_SLACK + 1)
    plain = budget.budget(honest + [Candidate(heavy.request, False, 0, 0, 4000, lead=0)], threads=2)
    fair = budget.budget(honest + [heavy], threads=2)
    decode_s = predicted(budget, decodes, 0, 0)
    cap = fair.chunks["heavy"]
    assert not plain.chunks and cap < plain.tokens - len(decodes)
    # The most that keeps the step within FAIR_STALL times theirs, or MIN_CHUNK if that is more.
    assert predicted(budget, decodes, 0, cap + 1) > FAIR_STALL * decode_s
    assert cap == MIN_CHUNK or predicted(budget, decodes, 0, cap) <= FAIR_STALL * decode_s
    assert (cap == MIN_CHUNK) == (fixed_s == 0.005)
    assert fair.tokens == len(decodes) + cap


def test_a_tenant_far_ahead_still_moves_min_chunk_tokens_a_step():
    """Beside one stream on a machine whose fixed cost is small, FAIR_STALL leaves a tenant far
    ahead less than a token a step: it still gets MIN_CHUNK, so its prompt ends in bounded
    time (2,206 tokens in at most 138 steps), where it crawled at 3 tokens a step."""
    budget = learned(0.002, 5e-11)
    stream = [Candidate(decoding("s", 300), True, 0, 300, 1, lead=0)]
    computed, steps = 0, 0
    while computed < 2206:
        heavy = Candidate(Request("heavy", [1] * 2206), True, 0, computed, 2206 - computed, lead=FAIR_SLACK + 1)
        cap = budget.budget(stream + [heavy], threads=2).chunks["heavy"]
        assert cap >= min(MIN_CHUNK, 2206 - computed)
        computed, steps = computed + cap, steps + 1
    assert steps <= -(-2206 // MIN_CHUNK)


def test_beside_decodes_a_step_stays_within_the_target_when_that_is_tighter():
    budget = learned(0.05, 2e-11)
    decodes = [decoding(f"s{i}", 300) for i in range(30)]  # about 190 ms
    decode_s = predicted(budget, decodes, 0, 0)
    assert decode_s < DEFAULT_TARGET_STEP_MS / 1e3 / 2 and STALL * decode_s > DEFAULT_TARGET_STEP_MS / 1e3
    chunk = budget.tokens(decodes, [Request("long", [1] * 4000)], threads=2) - len(decodes)
    target = DEFAULT_TARGET_STEP_MS / 1e3
    assert predicted(budget, decodes, 0, chunk) <= target < predicted(budget, decodes, 0, chunk + 1)


def test_late_in_a_long_prompt_chunks_are_smaller():
    budget = learned(0.05, 5e-12)
    early = budget.tokens([], [Request("long", [1] * 4000)], threads=2)
    half_done = Request("long", [1] * 4000)
    half_done.num_computed_tokens = 3000  # running, 1,000 tokens of its prompt left
    assert budget.tokens([half_done], [], threads=2) < early


def test_when_the_decodes_take_most_of_the_target_the_prompt_still_gets_as_long():
    budget = learned(0.05, 2e-11)  # 20 ms a GFLOP: about a 2-core laptop's
    decodes = [decoding(f"s{i}", 1000) for i in range(64)]
    decode_s = predicted(budget, decodes, 0, 0)
    assert decode_s > DEFAULT_TARGET_STEP_MS / 1e3 / 2
    chunk = budget.tokens(decodes, [Request("long", [1] * 4000)], threads=2) - len(decodes)
    prompt_s = predicted(budget, decodes, 0, chunk) - decode_s
    assert prompt_s <= decode_s < predicted(budget, decodes, 0, chunk + 1) - decode_s


def test_the_budget_never_passes_the_cap_and_always_moves_a_prompt():
    fast = learned(0.001, 1e-15)  # a GPU-like machine: everything fits in the target
    assert fast.tokens([], [Request("long", [1] * 4000)], threads=2) == DEFAULT_MAX_NUM_BATCHED_TOKENS
    slow = learned(0.5, 1e-9)  # every step is over the target already
    assert slow.tokens([], [Request("long", [1] * 4000)], threads=2) == MIN_CHUNK


def test_a_plan_is_the_same_given_the_same_budget():
    def plan(budget):
        scheduler = Scheduler(PrefixCachingAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
        for i in range(3):
            scheduler.add(Request(f"r{i}", list(range(100 * i, 100 * i + 30))))  # nothing shared
        return [(s.request.request_id, s.start, s.end) for s in scheduler.schedule(budget).scheduled]

    assert plan(40) == plan(40) == [("r0", 0, 30), ("r1", 0, 10)]
    assert plan(None) == plan(64) and plan(1000) == plan(64)  # a budget above the cap is the cap


# --- the engine, with budgets chosen step by step ----------------------------------------------


class Scripted:
    """A StepBudget stand-in that hands out the budgets of a script, one per step."""

    def __init__(self, budgets):
        self.budgets, self.steps, self.handed = list(budgets), 0, []

    def budget(self, candidates, threads):
        budget = self.budgets[self.steps % len(self.budgets)]
        self.steps += 1
        self.handed.append(budget)
        return Budget(budget)

    def record(self, threads, plan, seconds):
        assert plan.num_tokens <= self.handed[-1]


SHARED = list(range(100, 140))
PROMPTS = [SHARED + [7, 8, 9], SHARED[:20] + list(range(300, 330)), SHARED + list(range(400, 410)), [5, 6, 7]]
_expected = {}


def expected(model, prompt):
    key = tuple(prompt)
    if key not in _expected:
        _expected[key] = greedy_reference(model, prompt, 6)
    return _expected[key]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budgets=st.lists(st.integers(1, 64), min_size=1, max_size=6), cascade=st.booleans())
@example(budgets=[64], cascade=True)
def test_replies_are_exact_whatever_budget_each_step_gets(tiny_model, tokenizer, monkeypatch, budgets, cascade):
    """Chunks of every size, with the decodes' groups sharing their prefix or not: the thresholds
    are lowered so that the tiny prompts' 40 shared tokens make a family (engine/batch_attention.py)."""
    monkeypatch.setattr(batch_attention, "CASCADE_MIN_TOKENS", 8)
    monkeypatch.setattr(batch_attention, "CASCADE_MIN_REQUESTS", 2)
    monkeypatch.setattr(batch_attention, "CASCADE_GROUP_SLOTS", 0)
    monkeypatch.setattr(batch_attention, "CASCADE_OWN_COST", 1.0)
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=64)
    script = Scripted(budgets)
    runner = BatchRunner(engine.parts, cascade_attention=cascade, choose_threads=False, step_budget=script,
                         max_num_seqs=4, max_num_batched_tokens=64)
    requests = [runner.add(f"r{i}", p, SamplingParams(max_tokens=6), None) for i, p in enumerate(PROMPTS)]
    shared = []
    real_build_step = batch_attention.build_step

    def build_step(*args, **kwargs):
        inputs = real_build_step(*args, **kwargs)
        shared.extend(group.prefix_blocks is not None for group in inputs.groups)
        return inputs

    monkeypatch.setattr(model_runner, "build_step", build_step)
    replies = runner.run(requests)
    assert [r.token_ids for r in replies] == [expected(tiny_model, p) for p in PROMPTS]
    assert not engine.allocator.block_tables
    assert cascade or not any(shared)
    if cascade and budgets == [64]:  # all four admitted in two steps, then decoding side by side
        assert any(shared)  # the shared-prefix path ran


def test_the_engine_is_calibrated_when_made_then_learns_and_keeps_within_the_cap(make_engine):
    engine = make_engine(num_blocks=256, target_step_ms=DEFAULT_TARGET_STEP_MS)  # its costs learned, as Engine()'s
    assert engine.scheduler_options["max_num_batched_tokens"] == 2048
    costs = engine.step_budget.costs

    def kept() -> int:
        return sum(costs.num_steps(threads) for threads in costs.buckets)

    assert kept() == len(CALIBRATION_TOKENS)  # the passes timed when it was made: its first step is not FIRST_CHUNK's
    prompts = [list(range(1, 300)), list(range(1, 20)) + [5] * 30]
    replies = engine.generate_batch(prompts, max_tokens=5)
    assert [r.token_ids for r in replies] == [greedy_reference(engine.model, p, 5) for p in prompts]
    assert kept() > len(CALIBRATION_TOKENS)  # the steps were timed too
    assert FIRST_CHUNK <= engine.step_budget.last <= 2048


def test_a_fixed_budget_or_a_target_not_both(make_engine):
    assert make_engine(max_num_batched_tokens=64).step_budget is None
    assert make_engine(target_step_ms=100).step_budget.target_ms == 100
    assert make_engine(max_num_batched_tokens=None).step_budget.target_ms == DEFAULT_TARGET_STEP_MS
    with pytest.raises(ValueError, match="not both"):
        make_engine(max_num_batched_tokens=64, target_step_ms=100)
    for bad in (-1, 0, float("nan"), float("inf"), True, "400"):
        with pytest.raises(ValueError, match="target_step_ms"):
            make_engine(target_step_ms=bad)


def test_health_shows_the_target_and_what_a_step_costs(tiny_model, tokenizer):
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=64)
    with serve(create_app(engine, cache_page_every_s=0)) as url:
        status, reply = call(url, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3})
        assert status == 200
        health = call(url, "/health")[1]
    engine.loop.stop()
    assert health["target_step_ms"] == DEFAULT_TARGET_STEP_MS and health["max_num_batched_tokens"] == 2048
    assert set(health["step_costs"]) <= {"1 thread", "2 threads", f"{torch.get_num_threads()} threads"}
    for costs in health["step_costs"].values():  # one fit per thread count a step ran with
        assert costs["steps"] >= 1 and costs["ms_per_prompt_token"] > 0
    assert health["last_step"]["budget"] >= 1


def test_a_step_is_learned_from_under_the_lock_snapshot_reads_it_under(make_engine):
    """The loop publishes the learned costs (in engine.snapshot, for /health) under
    allocator_lock: each step is recorded under it too, never while a publish iterates."""
    engine = make_engine(target_step_ms=400)
    held, record = [], engine.step_budget.record

    def recording(*args):
        def try_lock():
            taken = engine.allocator_lock.acquire(blocking=False)
            if taken:
                engine.allocator_lock.release()
            held.append(not taken)

        other = threading.Thread(target=try_lock)
        other.start()
        other.join()
        record(*args)

    engine.step_budget.record = recording
    engine.generate([1, 2, 3, 4, 5], max_tokens=3)
    assert held and all(held)


def test_a_new_requests_first_step_runs_without_the_prompts_already_prefilling():
    budget = learned(0.005, 5e-12)
    long = Request("long", [1] * 4000)
    long.num_computed_tokens, long.admitted = 500, True  # running, part-way through its prompt
    question = Request("question", [2] * 30)
    alone = budget.budget([Candidate(long, True, 0, 500, 3500)], threads=2)
    assert not alone.chunks and not budget.yielded
    beside = budget.budget([Candidate(long, True, 0, 500, 3500), Candidate(question, False, 0, 0, 30)], threads=2)
    assert beside.chunks == {"long": 0} and beside.tokens >= 30  # the long prompt yields the question's first step
    budget.record(2, StepPlan([ScheduledRequest(question, 0, 30)], []), 0.010)
    assert budget.yielded_s == 0.010
    follower = Candidate(Request("next", [3] * 30), False, 0, 0, 30)
    again = budget.budget([Candidate(long, True, 0, 500, 3500), follower], threads=2)
    assert again.chunks == {"long": 0}  # 10 ms yielded in a row so far: under FLOOR fixed costs (15 ms)


def test_a_flood_of_arrivals_leaves_the_prompts_half_the_time():
    budget = learned(0.005, 5e-12)
    fixed, _ = budget.costs.fit(2)
    long = Request("long", [1] * 4000)
    long.num_computed_tokens, long.admitted = 500, True
    moved = []
    for step in range(12):  # a newcomer before every step
        newcomer = Request(f"q{step}", [2] * 30)
        given = budget.budget([Candidate(long, True, 0, 500, 3500), Candidate(newcomer, False, 0, 0, 30)], threads=2)
        moved.append(given.chunks.get("long") != 0)
        budget.record(2, StepPlan([ScheduledRequest(newcomer, 0, 30)], []), FLOOR * fixed)  # a yielded step: a floor's worth
    assert moved == [False, True] * 6  # FLOOR fixed costs yielded in a row, then the prompt moves


def slow_runner(engine: Engine, num_blocks: int | None = None) -> BatchRunner:
    """A runner of the engine's default policy on a held calibration of 20 ms a token: the tiny
    model's prompts come in chunks of about 20 tokens, as a long one does on a laptop."""
    budget = engine.step_budget
    budget.costs = HeldCosts(fixed_s=0.001, per_flop=0.02 / (2 * budget.shape.body_params))
    budget.attention = budget.shape.attention
    return BatchRunner(engine.parts, choose_threads=False, step_budget=budget, max_num_seqs=4,
                       max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS)


def test_an_engines_long_prompt_yields_a_newcomers_first_step_and_every_reply_is_exact(tiny_model, tokenizer):
    """The default policy on a held calibration, through the runner the engine loop steps: a
    long prompt is part-way in when a question arrives; the next step is the question's alone,
    then the long prompt goes on beside its decode."""
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=128)
    runner = slow_runner(engine)
    long_ids, question_ids = list(range(1, 201)), [7, 8, 9, 10, 11, 12]
    long = runner.add("long", long_ids, SamplingParams(max_tokens=3), None)
    runner.step()
    first = {s.request.request_id: (s.start, s.end) for s in runner.last_plan.scheduled}
    assert list(first) == ["long"] and first["long"][1] < len(long_ids)  # part-way in
    question = runner.add("question", question_ids, SamplingParams(max_tokens=3), None)
    runner.step()
    assert [(s.request.request_id, s.start, s.end) for s in runner.last_plan.scheduled] == [("question", 0, 6)]
    runner.step()
    assert {s.request.request_id for s in runner.last_plan.scheduled} == {"long", "question"}
    replies = runner.run([long, question])
    assert [r.token_ids for r in replies] == [greedy_reference(tiny_model, ids, 3) for ids in (long_ids, question_ids)]
    assert not engine.allocator.block_tables


def test_no_yield_to_newcomers_that_wait_for_the_prompts_blocks_and_no_step_runs_empty(tiny_model, tokenizer):
    """Newcomers whose next block the long prompt is about to write wait for it (Scheduler's
    _hit_coming): yielding to them would run steps that compute nothing, forever
    (tests/engine/test_scheduler.py has the step that cannot admit a newcomer for want of room)."""
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=128)
    runner = slow_runner(engine)
    prefix = list(range(1, 101))
    prompts = [prefix + [200 + i] * 3 for i in range(3)]
    requests = [runner.add("r0", prompts[0], SamplingParams(max_tokens=3), None)]
    runner.step()
    requests += [runner.add(f"r{i}", prompts[i], SamplingParams(max_tokens=3), None) for i in (1, 2)]
    runner.step()
    assert [s.request.request_id for s in runner.last_plan.scheduled] == ["r0"]  # no yield: they wait for its blocks
    for _ in range(200):
        if all(r.status == FINISHED for r in requests):
            break
        runner.step()
        assert runner.last_plan.scheduled
    assert [r.output_ids for r in requests] == [greedy_reference(tiny_model, p, 3) for p in prompts]
