"""One engine core: every path (stage 7's one request at a time, the engine loop's generate,
generate_batch and stream, the server streamed or not) finishes a reply with the same code; an
engine has one scheduler, whoever calls; a step that fails ends every request in it and the
loop goes on. Tiny random model, float32; failures forced, never waited for.
"""

import concurrent.futures
import json
import threading
import time
import urllib.request
from dataclasses import replace

import pytest

from engine import batch_engine
from engine.one_request import generate, run_request
from engine.request import SamplingParams
from engine.scheduler import Scheduler
from helpers import MODEL, assert_pool_whole, call, queued_together, serve, wait_until_idle
from server import create_app

PROMPT = list(range(100, 118))  # 18 tokens
TEXT = "A ripe banana is"


# --- one finisher ------------------------------------------------------------------------------


def eos_inside_the_reply(engine, prompt):
    """A token of the tiny model's greedy reply made its stop token, so the reply ends there,
    on a character a stop string can start with; (reply text, stop string)."""
    tokens = engine.generate(prompt, max_tokens=12).token_ids
    for k in range(3, len(tokens)):
        text = engine.tokenizer.decode(tokens[: k + 1], skip_special_tokens=True)
        if tokens[k] not in tokens[:k] and text.strip() and not text.endswith("\ufffd"):
            engine.parts = replace(engine.parts, stop_token_ids=frozenset({tokens[k]}))
            return text, text[-1] + "\u2603"  # begins with the reply's last character, never completed
    raise AssertionError("no usable token in the reply")


def test_a_reply_that_ends_on_eos_with_stop_strings_set_keeps_its_text_on_every_path(make_engine):
    engine = make_engine()
    text, stop = eos_inside_the_reply(engine, TEXT)

    replies = {
        "stage 7": generate(engine.parts, "one", engine.tokenize(TEXT), SamplingParams(max_tokens=12, stop=stop)),
        "generate": engine.generate(TEXT, max_tokens=12, stop=stop),
        "generate_batch": engine.generate_batch([TEXT], max_tokens=12, stop=stop)[0],
    }
    streamed = "".join(event.text for event in engine.stream(TEXT, max_tokens=12, stop=stop))
    for path, reply in replies.items():
        assert (path, reply.text, reply.finish_reason) == (path, text, "stop")
    assert streamed == text

    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL)) as url:
        status, reply = call(url, "/generate", {"prompt": TEXT, "max_tokens": 12, "stop": stop})
        assert status == 200 and (reply["text"], reply["finish_reason"]) == (text, "stop")
        body = {"model": MODEL, "prompt": TEXT, "max_tokens": 12, "stop": stop, "stream": True, "temperature": 0}
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            events = [line.removeprefix("data: ") for line in response.read().decode().split("\n\n") if line]
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert "".join(c["text"] for c in chunks) == text and chunks[-1]["finish_reason"] == "stop"
        assert events[-1] == "[DONE]"


def test_text_held_back_for_a_stop_string_comes_out_when_max_tokens_ends_the_reply(make_engine):
    engine = make_engine()
    full = engine.generate(PROMPT, max_tokens=6).text
    stop = full[-1] + "\u2603"
    assert engine.generate(PROMPT, max_tokens=6, stop=stop).text == full
    assert engine.generate_batch([PROMPT], max_tokens=6, stop=stop)[0].text == full


# --- one scheduler per engine ------------------------------------------------------------------


def test_generate_batch_takes_the_engines_settings_or_none(make_engine):
    engine = make_engine(max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs=8: this engine batches every caller's requests"):
        engine.generate_batch([PROMPT], max_tokens=2, max_num_seqs=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens=64"):
        engine.generate_batch([PROMPT], max_tokens=2, max_num_batched_tokens=64)
    assert engine.snapshot().num_steps == 0 and engine.allocator.stats.requests == 0  # refused before any work
    replies = engine.generate_batch([PROMPT, PROMPT[:9]], max_tokens=2, max_num_seqs=4)  # its own value is fine
    assert [len(r.token_ids) for r in replies] == [2, 2]


def test_generate_batch_beside_other_callers_joins_their_queue_in_arrival_order(make_engine):
    # 24 blocks of 4: three callers' traffic keeps the pool nearly full the whole time.
    engine = make_engine(num_blocks=24)
    scheduler = engine.loop.scheduler
    added, admitted, empty_steps = [], [], []
    real_add, real_schedule = scheduler.add, scheduler.schedule

    def add(request):
        added.append(request.request_id)
        real_add(request)

    def schedule(budget=None):
        waiting = {r.request_id for r in scheduler.waiting if not r.admitted}
        plan = real_schedule(budget)
        admitted.extend(s.request.request_id for s in plan.scheduled if s.request.request_id in waiting)
        if not plan.scheduled and not plan.preempted:
            empty_steps.append(1)
        return plan

    scheduler.add, scheduler.schedule = add, schedule
    stop, traffic_done = threading.Event(), []

    def traffic(n):
        i = 0
        while not stop.is_set():
            engine.generate(list(range(200 + 40 * n, 218 + 40 * n)) + [i % 7], max_tokens=8)
            i += 1
        traffic_done.append(i)

    callers = [threading.Thread(target=traffic, args=(n,)) for n in range(3)]
    for thread in callers:
        thread.start()
    batch = [list(range(600, 612)), list(range(700, 710)), list(range(800, 814)), list(range(600, 608))]
    expected = [make_engine().generate(p, max_tokens=6).token_ids for p in batch]
    try:
        while len(admitted) < 3:
            time.sleep(0.01)  # the traffic is flowing
        result = {}
        runner = threading.Thread(target=lambda: result.update(replies=engine.generate_batch(batch, max_tokens=6)))
        runner.start()
        runner.join(timeout=120)
        assert not runner.is_alive(), "generate_batch did not finish beside the traffic"
        assert not traffic_done, "the traffic stopped before the batch finished"
    finally:
        stop.set()
        for thread in callers:
            thread.join(timeout=120)
    assert [r.token_ids for r in result["replies"]] == expected
    assert admitted == [rid for rid in added if rid in admitted]  # first admissions in arrival order
    batch_ids = [rid for rid in added if rid.startswith("batch-")]
    assert len(batch_ids) == 4 and all(rid in admitted for rid in batch_ids)
    assert not empty_steps, "the loop stepped with nothing to run"
    assert all(thread.is_alive() is False for thread in callers) and min(traffic_done) >= 1


def test_a_runner_of_its_own_refuses_a_pool_held_by_a_stage_7_request(make_engine):
    # Stage 8's lesson steps runners of its own over an engine's parts: one whose scheduler
    # cannot see the requests holding the pool says so instead of waiting for blocks forever.
    engine = make_engine(num_blocks=8)
    held = run_request(engine.parts, "held", list(range(100, 124)), SamplingParams(max_tokens=4), None, 0.0)
    next(held)  # 6 of the 8 blocks, held between tokens
    runner = batch_engine.BatchRunner(engine.parts)
    steps = []
    real_step = runner.step
    runner.step = lambda: steps.append(1) or real_step()
    request = runner.add("r", list(range(300, 312)), SamplingParams(max_tokens=2), None)  # needs 3 blocks
    try:
        with pytest.raises(batch_engine.OutOfBlocksError, match="held by other requests of this engine"):
            runner.run([request])
    finally:
        with engine.allocator_lock:
            runner.scheduler.finish(request)
        held.close()
    assert len(steps) == 1  # refused after the one step that could run nothing, no spinning
    assert_pool_whole(engine)


# --- failures reach everyone -------------------------------------------------------------------


def submit_together(engine, prompts, max_tokens):
    """Requests queued in one go, so the loop's next step takes them all."""
    requests = [engine.loop.new_request(f"r{i}", p, batch_engine.SamplingParams(max_tokens=max_tokens), None)
                for i, p in enumerate(prompts)]
    engine.loop.submit(requests)
    return requests


def outcome(engine, request):
    try:
        return [event.text for event in engine.loop.events(request)][-1:]
    except RuntimeError as err:
        return str(err)


def test_a_failed_sampling_fails_every_request_of_the_step_and_the_loop_goes_on(make_engine, monkeypatch):
    engine = make_engine()
    real_sample, calls = batch_engine.sample_batch, []

    def sample_batch(logits, params, generators):
        calls.append(1)
        if len(calls) == 1:  # the first step, both requests in it; each would end in it
            raise RuntimeError("sampling fell over")
        return real_sample(logits, params, generators)

    monkeypatch.setattr(batch_engine, "sample_batch", sample_batch)
    first, second = submit_together(engine, [PROMPT, list(range(300, 310))], max_tokens=1)
    assert outcome(engine, first) == outcome(engine, second) == "sampling fell over"
    wait_until_idle(engine)
    assert engine.generate(PROMPT, max_tokens=4).token_ids == make_engine().generate(PROMPT, max_tokens=4).token_ids


def test_a_failure_after_a_request_finished_in_the_step_still_reaches_it(make_engine, monkeypatch):
    # The request that finished first had its blocks freed; the step then failed on the next.
    engine = make_engine()
    real_finish, failed = Scheduler.finish, []

    def finish(self, request):
        if request.request_id == "r1" and not failed:
            failed.append(request)
            raise RuntimeError("finishing fell over")
        real_finish(self, request)

    monkeypatch.setattr(Scheduler, "finish", finish)
    first, second = submit_together(engine, [PROMPT, list(range(300, 310))], max_tokens=1)
    assert outcome(engine, first) == outcome(engine, second) == "finishing fell over"  # neither waits forever
    wait_until_idle(engine)
    assert engine.loop.live == {}
    assert engine.generate(PROMPT, max_tokens=2, request_id="r0").finish_reason == "length"  # its id is free again


def test_a_failed_step_spares_the_requests_that_were_not_in_it(make_engine, monkeypatch):
    engine = make_engine(num_blocks=8)  # room for one of the two at a time
    real_sample, calls = batch_engine.sample_batch, []

    def sample_batch(logits, params, generators):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("sampling fell over")
        return real_sample(logits, params, generators)

    monkeypatch.setattr(batch_engine, "sample_batch", sample_batch)
    first, second = submit_together(engine, [list(range(100, 124)), list(range(300, 320))], max_tokens=2)
    assert outcome(engine, first) == "sampling fell over"
    assert outcome(engine, second) != "sampling fell over"  # it waited for the pool, then ran
    wait_until_idle(engine)


def test_a_refused_submit_leaves_no_trace(make_engine):
    engine = make_engine()
    one, two = submit_together(engine, [PROMPT], 2)[0], None
    with pytest.raises(ValueError, match="'r0' is already running"):
        submit_together(engine, [list(range(300, 310)), PROMPT], 2)  # r0 taken: neither is queued
    list(engine.loop.events(one))
    wait_until_idle(engine)
    engine.loop.stop()
    with pytest.raises(RuntimeError, match="the engine loop has stopped"):
        engine.generate(PROMPT, max_tokens=2, request_id="late")
    assert engine.loop.live == {} and two is None
    assert engine.allocator.stats.requests == 1


def test_the_server_sends_a_failed_steps_error_then_done_and_serves_on(make_engine, monkeypatch):
    engine = make_engine()
    real_sample, calls = batch_engine.sample_batch, []

    def sample_batch(logits, params, generators):
        calls.append(1)
        if len(calls) == 3:  # mid-reply: the stream's status line and first events are out
            raise RuntimeError("sampling fell over")
        return real_sample(logits, params, generators)

    monkeypatch.setattr(batch_engine, "sample_batch", sample_batch)
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL)) as url:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True, "temperature": 0}
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            events = response.read().decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        assert "sampling fell over" in json.loads(events[-3].removeprefix("data: "))["error"]["message"]
        status, reply = call(url, "/generate", {"prompt": PROMPT, "max_tokens": 4})
        assert status == 200 and reply["completion_tokens"] == 4
    wait_until_idle(engine)


def test_a_reply_cut_in_the_middle_of_a_character_drops_its_half(tokenizer):
    from engine.outputs import Generation, ReplyBuilder

    ok, smile = tokenizer.encode(" ok 🙂")[0], tokenizer.encode("🙂")  # " ok", then 🙂 in two tokens
    cut = ReplyBuilder(Generation("r", 3), tokenizer, set(), max_tokens=2)
    assert cut.add(ok) == (" ok", None)
    assert cut.add(smile[0]) == ("", "length") and cut.reply.text == " ok"  # not " ok\ufffd"
    whole = ReplyBuilder(Generation("r", 3), tokenizer, set(), max_tokens=3)
    assert [whole.add(t) for t in (ok, *smile)] == [(" ok", None), ("", None), ("🙂", "length")]


def test_an_automatic_request_id_skips_one_a_caller_took(make_engine):
    engine = make_engine()
    held = engine.stream(PROMPT, max_tokens=200, request_id="request-0")  # the id the counter gives next
    next(held)
    try:
        reply = engine.generate(list(range(300, 310)), max_tokens=2)
    finally:
        held.close()
    assert reply.request_id == "request-1" and reply.finish_reason == "length"


# --- the snapshot the loop publishes -----------------------------------------------------------


def test_health_reads_a_snapshot_while_another_thread_holds_the_loops_locks(make_engine):
    """The loop publishes a snapshot of itself; engine.snapshot() and /health read it without a
    lock, so they answer while another thread holds allocator_lock and the loop's condition (a
    long bookkeeping, a submit)."""
    engine = make_engine()
    engine.generate(PROMPT, max_tokens=2)
    holding, release = threading.Event(), threading.Event()

    def hold():
        with engine.allocator_lock, engine.loop._wake:
            holding.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL)) as url:
        with concurrent.futures.ThreadPoolExecutor(1) as reader:
            holder.start()
            try:
                assert holding.wait(30)
                snapshot = reader.submit(engine.snapshot).result(timeout=30)  # a lock taken would hang here
                status, health = call(url, "/health", timeout=30)
            finally:
                release.set()
                holder.join()
    assert status == 200 and health["running_requests"] == health["waiting_requests"] == 0
    assert health["num_free_blocks"] == snapshot.num_free_blocks == engine.allocator.num_blocks
    assert health["num_cached_blocks"] == snapshot.num_cached_blocks > 0 and health["requests"] == 1


def test_a_caller_given_its_reply_reads_its_request_gone_and_its_blocks_back(make_engine):
    """The step publishes before its events go out: the snapshot read after the last one
    already shows the request finished and the pool as the allocator has it."""
    engine = make_engine()
    for _ in range(3):
        engine.generate(PROMPT, max_tokens=4)
        snapshot, alloc = engine.snapshot(), engine.allocator
        assert snapshot.running == snapshot.waiting == [] and not snapshot.prefilling
        assert (snapshot.num_free_blocks, snapshot.num_cached_blocks, snapshot.blocks_in_use,
                snapshot.running_requests) == (alloc.num_free_blocks, alloc.num_cached_blocks, 0, 0)
        assert snapshot.cache_stats == alloc.stats.as_dict()
        assert snapshot.last_step.num_tokens == 1  # the last step ended: one token decoded


def test_a_request_submitted_while_a_step_runs_shows_waiting_at_once(make_engine):
    """submit and cancel publish too: while the loop is held inside a step, the snapshot shows a
    new request waiting at once, and a cancelled one gone."""
    engine = make_engine()
    with queued_together(engine):  # the loop is inside an opener's step until the block ends
        first, second = submit_together(engine, [PROMPT, list(range(300, 310))], max_tokens=2)
        assert engine.snapshot().waiting == [("r0", None), ("r1", None)]
        engine.loop.cancel(second)
        assert engine.snapshot().waiting == [("r0", None)]
    assert [event.finish_reason for event in engine.loop.events(first)][-1] == "length"
    wait_until_idle(engine)
