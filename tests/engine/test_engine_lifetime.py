"""An Engine's lifetime and its one way to fail.

A closed or dropped batching Engine gives back its pool, its model and its loop's thread
(nothing else keeps them alive: no atexit reference, no frozen cycle), so a notebook cell run
again does not grow the process. A failure in one request's bookkeeping (its reply builder,
its caller's hang-up check) ends that request only; the others in its step finish exactly.
Tiny random model, float32.
"""

import gc
import os
import threading
import weakref

import pytest
import torch

from engine import llm_engine as engine_module
from engine import Engine, EngineClosedError
from engine.cpu_threads import in_own_thread
from engine.engine_loop import EngineStoppedError
from engine.one_request import generate, greedy_reference
from engine.outputs import ReplyBuilder
from engine.request import SamplingParams
from helpers import assert_pool_whole
from lessons.models import tiny_llama

PROMPTS = [list(range(10, 30)), list(range(40, 57)), list(range(70, 95))]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def used_engine(tokenizer, **options) -> Engine:
    """A batching engine over a model of its own, that has served requests (its loop runs)."""
    engine = Engine(model=tiny_llama(tokenizer), tokenizer=tokenizer, block_size=4,
                    max_num_batched_tokens=256, **options)
    engine.generate_batch(PROMPTS, max_tokens=4)
    return engine


def parts_of(engine: Engine) -> list[weakref.ref]:
    return [weakref.ref(engine.kv), weakref.ref(engine.model), weakref.ref(engine.loop._thread),
            weakref.ref(engine.loop)]


@pytest.mark.parametrize("how", ["del", "close", "with"])
def test_a_dropped_or_closed_engine_frees_its_pool_model_and_thread(tokenizer, how):
    if how == "with":
        with used_engine(tokenizer, num_blocks=64) as engine:
            refs = parts_of(engine)
            thread = engine.loop._thread
    else:
        engine = used_engine(tokenizer, num_blocks=64)
        refs, thread = parts_of(engine), engine.loop._thread
        if how == "close":
            engine.close()
            engine.close()  # twice is fine
            with pytest.raises(EngineClosedError, match="closed"):
                engine.generate([1, 2, 3], max_tokens=1)
        del engine
    thread.join(timeout=30)
    assert not thread.is_alive(), "the loop's thread should have stopped"
    del thread
    gc.collect()
    alive = [name for name, ref in zip(["pool", "model", "thread", "loop"], refs) if ref() is not None]
    assert not alive, f"still alive after the engine went: {alive}"


def test_closing_an_engine_ends_its_requests_in_flight_with_a_clear_error(make_engine):
    engine = make_engine()
    stream = engine.stream(list(range(100, 120)), max_tokens=200)
    next(stream)
    engine.close()
    with pytest.raises(EngineStoppedError, match="its engine was closed"):
        for _ in stream:  # the events the loop sent before it stopped, then the error
            pass
    with pytest.raises(EngineClosedError):
        engine.generate("Hi", max_tokens=2)


def test_a_closed_engines_pool_goes_at_close_with_no_collection(tokenizer):
    """The pool is freed by its reference count when the engine closes: closing the last
    loop leaves its objects to the collector's own schedule (engine_loop.thaw_startup_heap)
    without holding the memory that matters until then."""
    engine = used_engine(tokenizer, num_blocks=64)
    pool = weakref.ref(engine.kv.data)
    gc.disable()
    try:
        engine.close()
        assert pool() is None, "the closed engine's pool waits for a garbage collection"
    finally:
        gc.enable()


def test_three_engines_made_and_dropped_do_not_grow_the_process(tokenizer):
    pool_bytes = 96 * 2**20  # each engine's KV pool: far more than the tiny model itself
    gc.collect()
    sizes = []
    for _ in range(4):
        engine = used_engine(tokenizer, kv_memory_gb=pool_bytes / 2**30)
        assert engine.kv.data.numel() * engine.kv.data.element_size() > pool_bytes * 0.9
        del engine
        gc.collect()
        sizes.append(rss_bytes())
    grown = sizes[-1] - sizes[0]  # after the first cycle: what a re-run cell adds
    assert grown < pool_bytes, f"three more engines grew the process by {grown / 2**20:.0f} MiB"


def failing_builder(monkeypatch, request_id: str):
    """ReplyBuilder.add raises for one request's reply, on its second token."""
    real = ReplyBuilder.add

    def add(self, token):
        if self.reply.request_id == request_id and len(self.reply.token_ids) == 1:
            raise RuntimeError(f"the reply builder of {request_id} broke")
        return real(self, token)

    monkeypatch.setattr(ReplyBuilder, "add", add)


def test_a_raising_reply_builder_fails_only_its_request_in_the_loop(make_engine, tiny_model, monkeypatch):
    engine = make_engine()
    loop = engine.loop
    failing_builder(monkeypatch, "r1")
    requests = [loop.new_request(f"r{i}", p, SamplingParams(max_tokens=6), None) for i, p in enumerate(PROMPTS)]
    loop.submit(requests)  # one submit: the three share every step
    results = {}
    for request in requests:
        try:
            *_, last = loop.events(request)
            results[request.request_id] = last.generation.token_ids
        except RuntimeError as err:
            results[request.request_id] = err
    assert isinstance(results["r1"], RuntimeError) and "r1 broke" in str(results["r1"])
    for i in (0, 2):
        assert results[f"r{i}"] == greedy_reference(tiny_model, PROMPTS[i], 6)
    assert loop.failure is None
    assert engine.generate(PROMPTS[1], max_tokens=3).token_ids == greedy_reference(tiny_model, PROMPTS[1], 3)


def test_a_raising_reply_builder_fails_only_its_request_in_generate_batch(make_engine, tiny_model, monkeypatch):
    engine = make_engine()
    failing_builder(monkeypatch, "batch-1")
    with pytest.raises(RuntimeError, match="batch-1 broke"):
        engine.generate_batch(PROMPTS, max_tokens=6)  # the others ran to their end first
    assert_pool_whole(engine)
    monkeypatch.undo()
    assert [g.token_ids for g in engine.generate_batch(PROMPTS, max_tokens=6)] == [
        greedy_reference(tiny_model, p, 6) for p in PROMPTS]


def test_a_raising_hang_up_check_fails_only_its_request(make_engine, tiny_model):
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=8)  # prompts in chunks

    def broken():
        raise OSError("the hang-up check broke")

    streams = [engine.stream(p, max_tokens=5, gone=broken if i == 1 else (lambda: False))
               for i, p in enumerate(PROMPTS)]
    outcomes = []
    gate = threading.Barrier(len(streams))

    def run(stream):
        gate.wait()
        try:
            *_, last = stream
            outcomes.append(last.generation.token_ids)
        except OSError as err:
            outcomes.append(err)

    threads = [threading.Thread(target=run, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    errors = [o for o in outcomes if isinstance(o, OSError)]
    assert len(errors) == 1 and "check broke" in str(errors[0])
    assert sorted(o for o in outcomes if not isinstance(o, OSError)) == sorted(
        [greedy_reference(tiny_model, PROMPTS[0], 5), greedy_reference(tiny_model, PROMPTS[2], 5)])
    assert engine.loop.failure is None


def test_the_loop_is_not_kept_by_atexit(tokenizer):
    engine = used_engine(tokenizer, num_blocks=32)
    loop_ref = weakref.ref(engine.loop)
    engine.close()
    del engine
    gc.collect()
    assert loop_ref() is None


def test_closing_one_engine_keeps_the_heap_frozen_for_another_that_serves(tokenizer, tiny_model):
    serving = used_engine(tokenizer, num_blocks=32)
    closing = used_engine(tokenizer, num_blocks=32)
    closing.close()
    assert gc.get_freeze_count() > 0, "a full collection would walk the serving engine's heap inside its steps"
    assert serving.generate(PROMPTS[0], max_tokens=2).token_ids == greedy_reference(serving.model, PROMPTS[0], 2)
    serving.close()


# --- whose thread runs an engine's tensor work ---


def test_in_own_thread_returns_its_result_and_raises_its_error_in_the_caller():
    caller = threading.current_thread()
    ran_on = in_own_thread(threading.current_thread)
    assert ran_on is not caller and not ran_on.is_alive()  # it ended before in_own_thread returned
    assert in_own_thread(divmod, 7, 2) == (3, 1)
    with pytest.raises(ZeroDivisionError):
        in_own_thread(divmod, 1, 0)


def test_an_engine_runs_no_tensor_work_on_its_callers_thread(tokenizer, monkeypatch):
    """The pool's zeros, the budget's calibration and warm_up run on threads that end with
    them; every request's passes run on the loop's thread. The caller's thread runs none, so
    no OpenMP pool of its stays beside the loop's (cpu_threads.in_own_thread says why)."""
    model, pools, passes = tiny_llama(tokenizer), [], []

    class Pool(engine_module.PagedKVPool):
        def __init__(self, **shape):
            pools.append(threading.current_thread())
            super().__init__(**shape)

    monkeypatch.setattr(engine_module, "PagedKVPool", Pool)
    model.register_forward_pre_hook(lambda module, args: passes.append(threading.current_thread()))
    with Engine(model=model, tokenizer=tokenizer, block_size=4, num_blocks=64) as engine:  # the default: calibrates
        assert engine.step_budget is not None and passes  # calibrated, before any request
        engine.warm_up()
        before = list(passes)
        engine.generate(PROMPTS[0], max_tokens=3)
        engine.generate_batch(PROMPTS, max_tokens=2)
        loop_thread = engine.loop._thread
    caller = threading.current_thread()
    assert len(pools) == 1 and pools[0] is not caller and not pools[0].is_alive()
    assert all(t is not caller and not t.is_alive() for t in before)
    assert passes[len(before):] and all(t is loop_thread for t in passes[len(before):])


@pytest.mark.parametrize("static_decode", [False, True], ids=["packed", "padded"])
def test_warm_up_runs_every_kind_of_pass_and_leaves_the_pool_as_it_was(make_engine, tiny_model, static_decode):
    """Stage 7's passes (a prefill from nothing, a suffix over a gathered block, a decode) and
    the batched ones (a prompt's chunk, a decode, padded where the engine pads), all through
    the scratch block: afterwards the allocator's blocks hold what they held, nothing is cached,
    the loop's runner has run nothing, and the first request computes every token."""
    engine = make_engine(static_decode=static_decode)
    pool, seen = engine.kv, []

    def watch(module, args, kwargs):
        cache, step = kwargs.get("past_key_values"), kwargs.get("pool_step")
        kind = type(step).__name__ if step is not None else "one request"
        seen.append((kind, kwargs["input_ids"].shape[1], cache.get_seq_length() if cache is not None else None))

    before = pool.data.clone()
    hook = tiny_model.register_forward_pre_hook(watch, with_kwargs=True)
    try:
        engine.warm_up()
    finally:
        hook.remove()
    # block size 4: a block's prefill, a suffix of 2 after it, a decode after those 6 tokens; where
    # the engine pads, stage 7's passes run over its fixed buffers (engine/fixed_past.py)
    if static_decode:
        assert seen == [("RequestStep", 4, None), ("RequestStep", 2, None), ("RequestStep", 1, None),
                        ("ChunkStep", 2, None), ("StaticStep", 1, None)]
    else:
        assert seen == [("one request", 4, 0), ("one request", 2, 4), ("one request", 1, 6),
                        ("StepInputs", 2, None), ("StepInputs", 1, None)]
    assert torch.equal(pool.data, before) and not pool._memory[:, :, pool.scratch_block].eq(0).all()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks and engine.allocator.num_cached_blocks == 0
    runner = engine.loop.runner
    assert runner.num_steps == 0 and runner.last_step is None and runner.model_runner.graph_figures() is None
    reply = engine.generate(PROMPTS[0], max_tokens=3)
    assert reply.cached_tokens == 0 and reply.token_ids == greedy_reference(tiny_model, engine.tokenize(PROMPTS[0]), 3)
    assert_pool_whole(engine)


def test_a_server_warms_only_the_engine_loop_and_never_allocates_stage_7s_buffers(make_engine, tiny_model):
    """warm_up(stage_7=False), as server.py calls it: the batched passes only, and the fixed
    buffers of stage 7 (engine/fixed_past.py, where the engine pads) stay unallocated until a
    request of stage 7 comes."""
    engine = make_engine(static_decode=True)
    kinds = []
    hook = tiny_model.register_forward_pre_hook(
        lambda module, args, kwargs: kinds.append(type(kwargs.get("pool_step")).__name__), with_kwargs=True)
    try:
        engine.warm_up(stage_7=False)
    finally:
        hook.remove()
    assert kinds == ["ChunkStep", "StaticStep"] and engine.parts.fixed.kv is None
    assert engine.generate(PROMPTS[1], max_tokens=2).token_ids == greedy_reference(
        tiny_model, engine.tokenize(PROMPTS[1]), 2)
    assert engine.parts.fixed.kv is None  # the engine's own requests run in its loop
    generate(engine.parts, "stage-7", engine.tokenize(PROMPTS[2]), SamplingParams(max_tokens=2))
    assert engine.parts.fixed.kv is not None
