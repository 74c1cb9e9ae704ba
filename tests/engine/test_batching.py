"""Many requests in one forward pass: every request's greedy tokens equal plain Hugging Face
generate on that prompt alone, whatever shares its batch (tiny random model, float32)."""

import gc
import threading
import time
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator import PrefixCachingAllocator
from engine import batch_attention
from engine import cpu_threads
from engine import one_request
from engine import Engine
from engine.batch_attention import MAX_GROUPS, Row, group_rows
from engine.batch_engine import BatchRunner
from engine.kv_pool import PagedKVPool
from engine.one_request import EngineParts, greedy_reference, run_request
from engine.request import SamplingParams
from helpers import EmbeddingCounter, assert_pool_whole

SHARED = list(range(300, 330))  # 30 tokens: 7 full blocks of 4 and a partial one
MIXED = [SHARED + [40], SHARED + [41, 42, 43, 44, 45], [7], list(range(500, 523)), SHARED[:9], [8, 9]]


def test_a_mixed_batch_equals_generate_on_each_prompt_alone(make_engine):
    engine = make_engine()
    replies = engine.generate_batch(MIXED, max_tokens=8)
    for prompt, reply in zip(MIXED, replies):
        assert reply.token_ids == greedy_reference(engine.model, prompt, 8), f"prompt of {len(prompt)} tokens"
        assert reply.finish_reason == "length" and reply.prompt_tokens == len(prompt)


def test_both_engines_run_on_their_parts_alone_with_no_engine_anywhere(tiny_model, tokenizer):
    """BatchRunner and run_request take EngineParts, nothing else of an Engine: parts made by
    hand here serve both, and the second request hits the blocks the first left cached."""
    shape = PagedKVPool.shape_from_config(tiny_model.config)
    parts = EngineParts(
        tiny_model, tokenizer, frozenset({tiny_model.generation_config.eos_token_id}),
        allocator=PrefixCachingAllocator(num_blocks=16, block_size=4),
        kv=PagedKVPool(**shape, num_blocks=16, block_size=4, dtype=tiny_model.dtype, device=tiny_model.device),
        device=tiny_model.device, lock=threading.RLock(), allocator_lock=threading.RLock(),
    )
    prompt, params = SHARED[:10], SamplingParams(max_tokens=6)
    runner = BatchRunner(parts, choose_threads=False, max_num_seqs=4, max_num_batched_tokens=64)
    (batched,) = runner.run([runner.add("a", prompt, params, None)])
    *_, last = run_request(parts, "b", prompt, params, None, time.perf_counter())
    assert batched.token_ids == last.generation.token_ids == greedy_reference(tiny_model, prompt, 6)
    assert last.generation.cached_tokens == 8  # the prompt's 2 full blocks, from the runner's request
    assert not parts.allocator.block_tables
    parts.allocator.check_invariants()


def test_requests_admitted_together_hit_the_blocks_the_first_computes_in_that_step(make_engine):
    engine = make_engine()
    counter = EmbeddingCounter(engine.model)
    prompts = [SHARED + [40 + i] for i in range(4)]
    replies = engine.generate_batch(prompts, max_tokens=1)
    counter.handle.remove()
    assert [r.cached_tokens for r in replies] == [0, 28, 28, 28]
    assert counter.count == 31 + 3 * 3  # the shared prefix was computed once, in one step
    assert [r.token_ids for r in replies] == [greedy_reference(engine.model, p, 1) for p in prompts]


def test_a_pool_too_small_for_everyone_at_once_finishes_all_exactly(make_engine):
    engine = make_engine(num_blocks=24)  # 96 slots; the batch needs about 150 at once
    replies = engine.generate_batch(MIXED, max_tokens=20)
    assert sum(r.num_preemptions for r in replies) > 0, "the test should exercise preemption"
    for prompt, reply in zip(MIXED, replies):
        assert reply.token_ids == greedy_reference(engine.model, prompt, 20)
    assert_pool_whole(engine)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_every_step_reads_the_blocks_where_they_lie_exactly(tiny_model, tokenizer, block_size):
    """Attention reads each context block by block through its table (whole blocks, the last
    one part-filled and masked): every logit a step samples from equals a full forward pass
    over that request's tokens, at every block size, with prompts and decodes of many lengths
    in one step, a shared prefix hit, and preemption (a pool too small for everyone)."""
    prompts = MIXED + [list(range(600, 617)), SHARED[:16]]
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=block_size, num_blocks=112 // block_size)
    runner = BatchRunner(engine.parts, choose_threads=False, max_num_seqs=8, max_num_batched_tokens=40)
    requests = [runner.add(f"r{i}", p, SamplingParams(max_tokens=12), None) for i, p in enumerate(prompts)]
    seen = []
    hook = tiny_model.register_forward_hook(lambda module, args, output: seen.append(output.logits[0].clone()))
    checked = 0
    try:
        while any(r.status != "finished" for r in requests):
            runner.step()
            plan = runner.last_plan
            if not plan.scheduled:
                continue
            logits = seen.pop()
            with torch.inference_mode():
                for row, s in enumerate([s for s in plan.scheduled if s.samples]):
                    full = tiny_model(input_ids=torch.tensor([s.request.token_ids[: s.end]])).logits[0, -1]
                    assert torch.allclose(logits[row], full, rtol=1e-5, atol=1e-5), (block_size, s.request.request_id)
                    checked += 1
    finally:
        hook.remove()
    assert runner.scheduler.num_preemptions > 0, "the test should exercise preemption"
    assert checked >= 12 * len(prompts)
    for prompt, request in zip(prompts, requests):
        assert request.reply.token_ids == greedy_reference(tiny_model, prompt, 12)
    assert_pool_whole(engine)


def test_a_preempted_request_resumes_mostly_from_the_cache(make_engine):
    engine = make_engine(num_blocks=8)  # room for both prompts (6 blocks), not both replies
    runner = BatchRunner(engine.parts)
    params = SamplingParams(max_tokens=12)
    requests = [runner.add(f"r{i}", SHARED[:16] + [60 + i], params, None) for i in range(2)]
    counter = EmbeddingCounter(engine.model)
    replies = runner.run(requests)
    counter.handle.remove()
    assert runner.scheduler.num_preemptions >= 1
    recomputed = counter.count - (17 + 1 + 2 * 11)  # beyond one prefill, one hit prefill, the decodes
    assert 0 < recomputed < 17 + 12, "a resumed request recomputes only what was evicted"
    for i, reply in enumerate(replies):
        assert reply.token_ids == greedy_reference(engine.model, SHARED[:16] + [60 + i], 12)
    runner.scheduler.check_invariants()
    # The hit rate counts each request's prompt once; a resumed request's lookup is counted apart.
    stats = engine.allocator.stats
    assert (stats.requests, stats.queried_tokens) == (2, 2 * 17)
    assert stats.hit_tokens == sum(r.cached_tokens for r in replies)
    assert stats.preempted_requests == runner.scheduler.num_preemptions and stats.preempted_hit_tokens > 0


def test_the_hit_rate_counts_a_chunked_prompt_whole(make_engine):
    """Handed a prompt chunk by chunk, the allocator still counts the whole prompt as looked
    up: the hit rate is the share of the requests' prompt tokens that came from the pool."""
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=8)
    prompt = SHARED + [40, 41, 42]
    first, second = engine.generate(prompt, max_tokens=2), engine.generate(prompt[:-1] + [43], max_tokens=2)
    stats = engine.allocator.stats
    assert second.cached_tokens > 8  # more than one chunk's worth was found
    assert (stats.queried_tokens, stats.hit_tokens) == (2 * len(prompt), first.cached_tokens + second.cached_tokens)
    assert stats.hit_rate == second.cached_tokens / (2 * len(prompt))


def test_stop_strings_and_eos_end_batched_requests_like_single_ones(make_engine):
    engine = make_engine()
    prompt = SHARED + [40]
    full = engine.generate(prompt, max_tokens=10)
    engine.parts = replace(engine.parts, stop_token_ids=frozenset({full.token_ids[3]}))
    eos, alone = engine.generate_batch([prompt, [5, 6]], max_tokens=10)
    assert eos.token_ids == full.token_ids[:4] and eos.finish_reason == "stop"
    assert alone.token_ids == greedy_reference(engine.model, [5, 6], 10)[: len(alone.token_ids)]


@pytest.mark.parametrize("prompts, kwargs, match", [
    ([], {}, "non-empty list"),
    ("one string", {}, "non-empty list"),
    ([[1, 2], []], {}, "non-empty"),
    ([[1, 2]], {"max_tokens": 0}, "max_tokens"),
    ([[1, 2]], {"cache_salt": "a/b"}, "'/'"),
    ([list(range(300))], {"max_tokens": 10}, "num_blocks"),
])
def test_bad_batches_are_refused_before_anything_runs(make_engine, prompts, kwargs, match):
    engine = make_engine()
    with pytest.raises(ValueError, match=match):
        engine.generate_batch(prompts, **kwargs)
    assert engine.allocator.stats.requests == 0


def test_stage_7_runs_on_the_pool_the_engine_loop_filled(make_engine):
    engine = make_engine()
    engine.generate_batch([SHARED], max_tokens=2)
    prompt = SHARED + [99]
    reply = one_request.generate(engine.parts, "stage 7", prompt, SamplingParams(max_tokens=6))
    assert reply.cached_tokens == len(SHARED) // 4 * 4 and reply.token_ids == greedy_reference(engine.model, prompt, 6)


# --- the engine loop: calls from many threads share forward passes --------------------------


def wait_until_idle(engine, timeout: float = 10.0) -> None:
    """A cancelled request is freed by the engine loop before its next step: moments later."""
    deadline = time.monotonic() + timeout
    while (engine.loop.live or engine.allocator.block_tables) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.loop.live == {}


def run_in_threads(engine, prompts, **kwargs):
    replies = [None] * len(prompts)

    def client(i):
        replies[i] = engine.generate(prompts[i], **kwargs)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return replies


def test_calls_from_many_threads_run_in_shared_steps_and_get_their_answers_alone(make_engine):
    engine = make_engine()
    steps = []
    engine.model.register_forward_pre_hook(lambda module, args, kwargs: steps.append(1), with_kwargs=True)
    prompts = [SHARED + [40 + i] for i in range(8)]
    try:
        replies = run_in_threads(engine, prompts, max_tokens=6)
    finally:
        engine.model._forward_pre_hooks.clear()
    assert [r.token_ids for r in replies] == [greedy_reference(engine.model, p, 6) for p in prompts]
    assert len(steps) < 8 * 6, "the requests should have shared forward passes"
    assert sum(r.cached_tokens for r in replies) >= 7 * 28


def test_a_busy_pool_makes_threads_wait_instead_of_refusing_them(make_engine):
    engine = make_engine(num_blocks=16)
    prompts = [list(range(100 * i, 100 * i + 20)) for i in range(1, 7)]  # 6 x 5 blocks: never all at once
    replies = run_in_threads(engine, prompts, max_tokens=8)
    assert [r.token_ids for r in replies] == [greedy_reference(engine.model, p, 8) for p in prompts]
    assert max(r.wait_ms for r in replies) > 0


def test_a_stream_closed_mid_batch_frees_its_blocks_and_the_others_go_on(make_engine):
    engine = make_engine()
    other = threading.Thread(target=lambda: engine.generate(SHARED + [1], max_tokens=20))
    other.start()
    stream = engine.stream(SHARED + [2], max_tokens=40)
    next(stream), next(stream)
    stream.close()  # a client that disconnects
    other.join(timeout=60)
    wait_until_idle(engine)
    assert_pool_whole(engine)


def test_a_request_id_waiting_or_running_in_the_loop_is_refused(make_engine):
    engine = make_engine()
    stream = engine.stream(SHARED, max_tokens=30, request_id="lesson")
    next(stream)
    with pytest.raises(ValueError, match="already running"):
        engine.stream([1, 2], request_id="lesson")
    stream.close()
    wait_until_idle(engine)


def test_the_engine_loop_stops_between_steps_and_takes_nothing_after(make_engine):
    # At exit the loop must not be killed inside a forward pass (the process would abort):
    # stop() lets the running step finish and ends the thread; atexit calls it.
    engine = make_engine()
    before = engine.generate(SHARED, max_tokens=3)
    engine.loop.stop()
    assert not engine.loop._thread.is_alive()
    with pytest.raises(RuntimeError, match="stopped"):
        engine.generate(SHARED, max_tokens=3)
    assert before.finish_reason == "length"
    assert_pool_whole(engine)


# --- what a step's attention reads -------------------------------------------------------------


def test_one_long_context_does_not_pad_the_short_ones(make_engine):
    engine = make_engine(num_blocks=256)
    runner = BatchRunner(engine.parts, max_num_seqs=8, max_num_batched_tokens=512)
    prompts = [list(range(100 + i, 110 + i)) for i in range(7)] + [list(range(600, 900))]
    requests = [runner.add(f"r{i}", p, SamplingParams(max_tokens=6), None) for i, p in enumerate(prompts)]
    runner.step()  # the prompts
    runner.step()  # eight decodes: seven of ~11 tokens of context, one of 301
    figures = runner.last_step
    assert figures.num_slots_needed == 7 * 11 + 301
    assert figures.num_slots_read <= 1.25 * figures.num_slots_needed  # not 8 x 301
    replies = runner.run(requests)
    assert [r.token_ids for r in replies] == [greedy_reference(engine.model, p, 6) for p in prompts]


@settings(max_examples=200, deadline=None)
@given(contexts=st.lists(st.integers(1, 3000), min_size=1, max_size=64), queries=st.lists(st.integers(1, 64), max_size=64))
def test_groups_cover_every_request_once_in_a_bounded_number_of_calls(contexts, queries):
    rows = [Row(0, max(0, n - (queries[i] if i < len(queries) else 1)), n, None) for i, n in enumerate(contexts)]
    groups = group_rows(rows)
    assert 1 <= len(groups) <= MAX_GROUPS
    assert sorted(map(id, (r for g in groups for r in g))) == sorted(map(id, rows))
    one_group = len(rows) * max(r.end for r in rows) * max(r.num_queries for r in rows)
    padded = sum(len(g) * max(r.end for r in g) * max(r.num_queries for r in g) for g in groups)
    work = sum(r.end * r.num_queries for r in rows)
    assert padded <= one_group and (padded <= 1.25 * work or len(groups) == MAX_GROUPS)


# --- shared prefixes read once (cascade attention) ----------------------------------------------
#
# A prefix is shared only where that pays (batch_attention.decode_groups: at least
# CASCADE_MIN_REQUESTS decodes sharing CASCADE_MIN_TOKENS tokens, then counted work);
# tests/engine/test_shared_prefix.py pins that decision. Here: the whole model, with and without.

SYSTEM = list(range(1000, 1260))  # 260 tokens: a system prompt long enough to share


def step_logits(engine, prompts, cascade, max_tokens=5, block_size=4):
    """Every decode step's logits, and the replies, of a batch run with cascade on or off. With
    torch's own thread count for every step: a count chosen for a busy machine would sum in
    another order, and the two runs would differ by more than attention's own rounding."""
    runner = BatchRunner(engine.parts, cascade_attention=cascade, choose_threads=False, max_num_seqs=16,
                         max_num_batched_tokens=512)
    requests = [runner.add(f"r{i}", p, SamplingParams(max_tokens=max_tokens), None) for i, p in enumerate(prompts)]
    seen = []
    hook = engine.model.register_forward_hook(lambda module, args, output: seen.append(output.logits[0].clone()))
    try:
        replies = runner.run(requests)
    finally:
        hook.remove()
    return seen, replies, runner


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_shared_prefix_attention_gives_the_numbers_of_one_attention_over_each_context(tiny_model, tokenizer, block_size):
    prompts = [SYSTEM + [40 + i] * (i + 1) for i in range(5)] + [SYSTEM[:20] + [7, 8], list(range(500, 540))]
    calls = []
    real = batch_attention.shared_prefix_attention

    def counting(*args):
        calls.append(1)
        return real(*args)

    batch_attention.shared_prefix_attention = counting
    try:
        runs = [step_logits(Engine(model=tiny_model, tokenizer=tokenizer, block_size=block_size, num_blocks=2048 // block_size),
                            prompts, cascade) for cascade in (True, False)]
    finally:
        batch_attention.shared_prefix_attention = real
    (on, on_replies, _), (off, off_replies, _) = runs
    assert calls, "the five decodes sharing SYSTEM's blocks should attend over them once"
    # Merging two partial softmaxes rounds differently from one: ~1e-5 apart on logits of ~3.
    assert len(on) == len(off) and all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(on, off))
    for prompt, reply in zip(prompts, on_replies):
        assert reply.token_ids == greedy_reference(tiny_model, prompt, 5)


def test_sixteen_requests_behind_one_prefix_read_it_once(make_engine):
    engine = make_engine(num_blocks=512)
    prompts = [SYSTEM + [60 + i, 61 + i] for i in range(16)]  # 262 tokens: 65 full shared blocks of 4, then their own
    for cascade, expected in ((True, 260 + 16 * (262 + 1 - 260)), (False, 16 * 263)):
        runner = BatchRunner(engine.parts, cascade_attention=cascade, max_num_seqs=16, max_num_batched_tokens=512)
        requests = [runner.add(f"{cascade}-{i}", p, SamplingParams(max_tokens=3), None) for i, p in enumerate(prompts)]
        runner.step()  # the prompts (and the same-step hits)
        runner.step()  # sixteen decodes, each with a context of 263
        assert runner.last_step.num_slots_needed == 16 * 263
        assert runner.last_step.num_slots_read == expected  # the 260 shared slots once, or sixteen times
        runner.run(requests)


def test_a_preempted_request_rejoins_the_shared_prefix_exactly(make_engine, monkeypatch):
    for name, value in {"CASCADE_MIN_REQUESTS": 2, "CASCADE_MIN_TOKENS": 16, "CASCADE_GROUP_SLOTS": 0}.items():
        monkeypatch.setattr(batch_attention, name, value)  # so that four short prompts share theirs
    engine = make_engine(num_blocks=16)  # the shared prompt's 4 blocks, and room for a few more
    prompts = [SHARED[:16] + [60 + i] for i in range(4)]
    runner = BatchRunner(engine.parts, max_num_seqs=4, max_num_batched_tokens=64)
    requests = [runner.add(f"r{i}", p, SamplingParams(max_tokens=14), None) for i, p in enumerate(prompts)]
    replies = runner.run(requests)
    assert runner.scheduler.num_preemptions > 0
    assert [r.token_ids for r in replies] == [greedy_reference(engine.model, p, 14) for p in prompts]


# --- the thread count the engine chooses ----------------------------------------------------------


@pytest.mark.parametrize("others", [0.0, 2.0])  # a quiet machine, or two other programs keeping cores busy
def test_batches_are_exact_with_the_thread_count_the_engine_chooses(make_engine, monkeypatch, others):
    monkeypatch.setattr(cpu_threads, "cores_used_by_others", lambda before, after: others)  # as /proc/stat tells it
    monkeypatch.setattr(cpu_threads.ThreadChooser, "SLOWER", float("inf"))  # not timings: they wander
    default = torch.get_num_threads()
    engine = make_engine()
    replies = engine.generate_batch(MIXED, max_tokens=8)
    assert engine.threads.threads == (1 if others and default > 1 else default)
    assert torch.get_num_threads() == default  # set for each forward pass only, and put back
    for prompt, reply in zip(MIXED, replies):
        assert reply.token_ids == greedy_reference(engine.model, prompt, 8)


@pytest.mark.parametrize("others", [0.0, 2.0])
def test_one_request_at_a_time_is_exact_with_the_thread_count_the_engine_chooses(make_engine, monkeypatch, others):
    """Stage 7's engine (the demo's) asks the same chooser for every prefill and decode pass."""
    monkeypatch.setattr(cpu_threads, "cores_used_by_others", lambda before, after: others)
    monkeypatch.setattr(cpu_threads.ThreadChooser, "SLOWER", float("inf"))
    default = torch.get_num_threads()
    engine = make_engine()
    calibration = sum(engine.threads.passes.values())  # the passes the step budget timed when the engine was made
    for i, prompt in enumerate(MIXED):
        reply = one_request.generate(engine.parts, f"r{i}", prompt, SamplingParams(max_tokens=8))
        assert reply.token_ids == greedy_reference(engine.model, prompt, 8)
    assert engine.threads.threads == (1 if others and default > 1 else default)
    assert sum(engine.threads.passes.values()) - calibration == 8 * len(MIXED)  # a prefill and 7 decodes each
    assert torch.get_num_threads() == default


def test_the_chooser_goes_back_to_all_the_cores_when_the_machine_is_quiet_again():
    chooser = cpu_threads.ThreadChooser()
    assert chooser.choose("decode", most=2) == 2
    chooser.record("decode", 2, 0.05, others=0.0)
    chooser.choose("decode", most=2)
    chooser.record("decode", 2, 0.30, others=1.9)  # two other programs started
    assert chooser.choose("decode", most=2) == 1
    chooser.record("decode", 1, 0.20, others=1.0)
    assert chooser.choose("decode", most=2) == 1  # still busy: no probe with both cores
    chooser.steps = chooser.next_probe  # ... many steps later, the others have stopped
    chooser.record("decode", 1, 0.08, others=0.0)
    assert chooser.choose("decode", most=2) == 2  # a probe with both cores
    chooser.record("decode", 2, 0.05, others=0.0)
    assert chooser.choose("decode", most=2) == 2 and chooser.choose("prefill", most=2, may_probe=False) == 2
    assert chooser.choose("decode", most=1) == 1  # torch's own setting is the most it ever uses


def test_the_engine_loop_freezes_the_startup_heap_once(make_engine):
    """A full garbage collection must not walk the model's objects inside a step (a stall every
    stream sees): the first engine loop of the process freezes what is alive, once."""
    engine = make_engine()
    engine.generate([1, 2, 3], max_tokens=2)
    frozen = gc.get_freeze_count()
    assert frozen > 0
    make_engine().generate([1, 2, 3], max_tokens=2)
    # Once: a second engine freezes nothing more. (The count may fall: a frozen object that
    # dies by its reference count leaves, as the loop's snapshot does when the next replaces it.)
    assert gc.get_freeze_count() <= frozen
