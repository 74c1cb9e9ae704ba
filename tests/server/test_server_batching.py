"""The server on the batching engine (python server.py's default): clients share forward
passes, a busy pool makes them wait instead of answering 503, /health and /cache show the
scheduler, and a client that leaves frees its request. Real servers on 127.0.0.1 around an
Engine() over conftest's tiny random model, as in test_server.py.

No sleeps decide anything here. A forward hook that waits on an event holds the engine loop
inside a step where a test needs it: requests sent meanwhile pile up in the waiting queue, and
the step after takes them all at once.
"""

import concurrent.futures
import http.client
import json
import logging
import os
import re
import threading
import time

import pytest

from engine import Engine
from engine.engine_loop import EngineLoop
from helpers import (
    MODEL, SYSTEM, calibrated, call, client, held_in_step, queued_together, raw_request, serve, wait_for_log,
    wait_until_idle,
)
from server import create_app

ALICE, BOB = {"Authorization": "Bearer alice-key"}, {"Authorization": "Bearer bob-key"}


def batching_engine(tiny_model, tokenizer, **kwargs) -> Engine:
    """The default policy on a held calibration unless a budget is given: the step counts these
    tests compare are the same on every machine."""
    return calibrated(Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, **kwargs))


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    """Room for 16 short chats at once: 256 blocks of 4 tokens."""
    return batching_engine(tiny_model, tokenizer, num_blocks=256)


@pytest.fixture(scope="module")
def url(engine):
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL)) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def alone(tiny_model, tokenizer):
    """The one-request-at-a-time engine on the same model: what a request gets alone."""
    one = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=256)
    return lambda prompt, max_tokens: one.generate(prompt, max_tokens=max_tokens)


def health_when(url: str, ready, headers=None, timeout: float = 30.0) -> dict:
    """/health, polled until ready(health) holds: a request reaches the queue a moment after
    its client sent it."""
    deadline = time.monotonic() + timeout
    while True:
        health = call(url, "/health", headers=headers, timeout=10)[1]
        if ready(health):
            return health
        assert time.monotonic() < deadline, f"/health never got there: {health}"
        time.sleep(0.02)


# --- many clients, one forward pass per step --------------------------------------------------------


def test_concurrent_clients_get_the_answers_they_get_alone_in_shared_steps(engine, url, alone):
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(16)]
    expected = {q: alone(SYSTEM + q, 10) for q in questions}

    def ask(i: int) -> tuple[str, str]:
        question = questions[i]
        if i % 2:  # half of them stream through the openai client
            stream = client(url).completions.create(model=MODEL, prompt=SYSTEM + question, max_tokens=10,
                                                     temperature=0, stream=True)
            return question, "".join(chunk.choices[0].text for chunk in stream)
        status, reply = call(url, "/generate", {"prompt": SYSTEM + question, "max_tokens": 10})
        assert status == 200
        return question, reply["text"]

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        with queued_together(engine):
            replies = [pool.submit(ask, i) for i in range(16)]
            before = health_when(url, lambda h: h["waiting_requests"] == 16)
        together = dict(r.result() for r in replies)
    assert together == {q: reply.text for q, reply in expected.items()}
    after = call(url, "/health")[1]
    longest = max(len(reply.token_ids) for reply in expected.values())
    assert after["steps"] - before["steps"] == longest  # one step per token for all 16 at once, not 16 x 10
    assert after["preemptions"] == before["preemptions"] and after["waiting_requests"] == 0
    assert after["hit_tokens"] > 0  # they shared the system prompt's blocks


def test_health_answers_inside_a_step_and_shows_who_runs_and_who_waits(tiny_model, tokenizer, alone):
    """A pool of 16 blocks, six prompts of 5 blocks each: three fit, three wait."""
    engine = batching_engine(tiny_model, tokenizer, num_blocks=16)
    prompts = [list(range(100 * i, 100 * i + 20)) for i in range(1, 7)]
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL)) as url:
        health = call(url, "/health")[1]
        assert health["steps"] == 0 and health["last_step"] is None
        assert (health["max_num_seqs"], health["max_num_batched_tokens"]) == (64, 2048)
        with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
            with held_in_step(engine, step=2) as (inside, release):  # step 1 is the opener's
                with queued_together(engine):
                    replies = [pool.submit(call, url, "/generate", {"prompt": p, "max_tokens": 8}) for p in prompts]
                    health_when(url, lambda h: h["waiting_requests"] == 6)
                assert inside.wait(30)  # step 2 is in the model now, holding engine.lock
                health = call(url, "/health", timeout=10)[1]  # answered without waiting for it
                snap = call(url, "/cache", timeout=10)[1]
                release.set()
            results = [r.result() for r in replies]
        assert (health["running_requests"], health["waiting_requests"], health["steps"]) == (3, 3, 2)
        assert health["blocks_in_use"] == 15
        # The step that ended last, the opener's: the snapshot takes a step's figures when it ends.
        assert health["last_step"] == {"requests": 1, "tokens": 3, "prefill_tokens": 3, "budget": 2048}
        assert len(snap["block_tables"]) == 3 and len(snap["waiting_queue"]) == 3
        assert not set(snap["block_tables"]) & set(snap["waiting_queue"])  # without keys, every id is shown

        assert [status for status, _ in results] == [200] * 6  # they waited: not one 503
        assert [reply["text"] for _, reply in results] == [alone(p, 8).text for p in prompts]
        health = call(url, "/health")[1]
        assert health["preemptions"] > 0  # three replies of 7 blocks each outgrow 16 blocks
        assert health["running_requests"] == health["waiting_requests"] == 0
        assert health["last_step"]["prefill_tokens"] == 0  # the last step only decoded
    wait_until_idle(engine)


def test_health_and_the_page_show_a_request_part_way_through_its_prompt(page, tiny_model, tokenizer, alone):
    from playwright.sync_api import expect

    engine = batching_engine(tiny_model, tokenizer, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=8)
    prompt = list(range(100, 140))  # 40 tokens: five chunks of 8
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL)) as url:
        page.goto(url + "/")
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            with held_in_step(engine, step=3) as (inside, release):
                reply = pool.submit(call, url, "/generate", {"prompt": prompt, "max_tokens": 3})
                assert inside.wait(30)  # chunks 1 and 2 written (16 tokens), chunk 3 in the model
                health = call(url, "/health", timeout=10)[1]
                snap = call(url, "/cache", timeout=10)[1]
                (request_id,) = snap["prefilling"]
                assert snap["prefilling"][request_id] == {"computed_tokens": 16, "prompt_tokens": 40}
                expect(page.locator("#tables .request .prefilling")).to_have_text(" prefill 16/40")
                release.set()
            status, result = reply.result()
        assert (health["prefilling_requests"], health["enable_chunked_prefill"]) == (1, True)
        assert health["last_step"] == {"requests": 1, "tokens": 8, "prefill_tokens": 8}
        assert snap["blocks_in_use"] == 6  # slots for the 24 tokens scheduled so far: 6 blocks of 4, not 10
        assert status == 200 and result["text"] == alone(prompt, 3).text
        assert call(url, "/health")[1]["prefilling_requests"] == 0
    wait_until_idle(engine)


def test_a_request_that_could_never_fit_is_refused_at_once(tiny_model, tokenizer):
    engine = batching_engine(tiny_model, tokenizer, num_blocks=16)
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL)) as url:
        got, reply = call(url, "/generate", {"prompt": list(range(100, 170)), "max_tokens": 4})
        assert got == 400 and "whole KV pool has 64" in reply["error"]["message"]
        assert engine.snapshot().num_steps == 0 and engine.allocator.stats.requests == 0  # it never reached the queue
        assert engine.loop.live == {}


# --- clients that leave ------------------------------------------------------------------------


@pytest.fixture
def cancelled(monkeypatch) -> threading.Event:
    """Set once the server has cancelled a request in the engine loop (by closing its stream)."""
    event, cancel = threading.Event(), EngineLoop.cancel

    def cancel_and_tell(loop, request):
        cancel(loop, request)
        event.set()

    monkeypatch.setattr(EngineLoop, "cancel", cancel_and_tell)
    return event


def test_a_client_that_hangs_up_during_its_reply_stops_its_request(engine, url, caplog, cancelled):
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 240}).encode()
    head = ["POST /generate HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(body)}"]
    steps_before = call(url, "/health")[1]["steps"]
    with caplog.at_level(logging.INFO, logger="server"):
        with held_in_step(engine, step=2) as (inside, release), held_in_step(engine, step=3) as (_, release_third):
            sock = raw_request(url, head, body)
            assert inside.wait(30)  # its first token came; the second step is held
            sock.close()  # a script killed by Ctrl+C, a closed notebook
            release.set()
            assert cancelled.wait(30)  # noticed between two tokens; a third step, if any, waits till then
            release_third.set()
        wait_until_idle(engine)
        line = wait_for_log(caplog, "the client hung up after")
    # After the first token, or the second: the server thread looks between any two.
    assert re.fullmatch(r"/generate: the client hung up after [12] tokens; stopped its request and freed its blocks", line)
    assert call(url, "/health")[1]["steps"] - steps_before in (2, 3)  # not 240


def test_a_client_that_leaves_mid_stream_frees_its_request(engine, url, caplog, cancelled):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"prompt": "Tell me a long story.", "max_tokens": 240, "stream": True}
    steps_before = call(url, "/health")[1]["steps"]
    # The server notices at one of its next writes, which fail; the loop cannot pass step 40 before.
    with held_in_step(engine, step=40) as (_, release), caplog.at_level(logging.INFO, logger="server"):
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: {")
        response.close()  # hang up after the first event
        conn.close()
        assert cancelled.wait(30)
        release.set()
    wait_until_idle(engine)
    assert wait_for_log(caplog, "the client left after")
    assert call(url, "/health")[1]["steps"] - steps_before <= 40  # it never got past the held step, let alone 240


# --- tenants ------------------------------------------------------------------------------------


@pytest.fixture
def keyed_url(engine):
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL, salt_by_api_key=True, admin_key="s3cret")) as base_url:
        yield base_url


def test_under_keys_the_queue_shows_a_tenant_its_own_request_ids_only(engine, keyed_url):
    def send(headers, question):
        return call(keyed_url, "/generate", {"prompt": SYSTEM + question, "max_tokens": 2}, headers=headers)

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        with queued_together(engine):
            replies = [pool.submit(send, ALICE, "Alice asks."),
                       pool.submit(send, BOB, "Bob asks."), pool.submit(send, BOB, "Bob asks again.")]
            health_when(keyed_url, lambda h: len(engine.snapshot().waiting) == 3, headers=ALICE)
            seen_by_alice = call(keyed_url, "/cache", headers=ALICE)[1]
            seen_by_bob = call(keyed_url, "/cache", headers=BOB)[1]
        assert [r.result()[0] for r in replies] == [200] * 3
    alice_ids, bob_ids = seen_by_alice["waiting_queue"], seen_by_bob["waiting_queue"]
    assert len(alice_ids) == 1 and len(bob_ids) == 2 and not set(alice_ids) & set(bob_ids)
    # Each sees its own requests and counts them, and nothing of the others' (not even how many).
    assert None not in alice_ids + bob_ids
    assert (seen_by_alice["waiting_requests"], seen_by_bob["waiting_requests"]) == (1, 2)

    # Alice asks again: her counters see her hit, counted when her request was admitted.
    status, again = send(ALICE, "Alice asks.")
    assert status == 200 and again["cached_tokens"] > 0
    alice = call(keyed_url, "/health", headers=ALICE)[1]
    assert (alice["requests"], alice["hit_tokens"]) == (2, again["cached_tokens"])


# --- the live page --------------------------------------------------------------------------------


@pytest.fixture
def page():
    """A page in headless Chromium, as test_server_browser.py opens it (skipped without Playwright)."""
    browser_test = pytest.importorskip("test_server_browser")
    if not browser_test.shutil.which(browser_test.CHROMIUM):
        pytest.skip("no chromium here: `bash setup.sh` as root installs it")
    with browser_test.sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_test.CHROMIUM, headless=True,
                                             args=browser_test.FLAGS)
        yield browser.new_page(viewport={"width": 1280, "height": 1000})
        browser.close()


def test_the_page_shows_the_queue_the_shared_blocks_and_the_last_step(page, tiny_model, tokenizer, tmp_path):
    from playwright.sync_api import expect

    expect.set_options(timeout=15_000)
    errors = []
    page.on("pageerror", lambda error: errors.append(error))
    engine = batching_engine(tiny_model, tokenizer, num_blocks=48)
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL, salt_by_api_key=True)) as url:
        page.goto(url + "/")
        expect(page.locator("#status")).to_contain_text("send an API key")  # and how: /#key=YOUR-KEY
        page.goto(url + "/#key=alice-key")
        page.reload()  # a new fragment alone does not load the page again
        expect(page.locator("#status")).to_have_text("live, every 0.5 s")
        expect(page.locator("#steps")).to_have_text("–")  # null under keys: everyone's steps
        # Under keys the last step's token counts are left out: they tell other keys' prompt lengths.
        expect(page.locator("#last-step-label")).to_have_text("last step: not shown under API keys")
        expect(page.locator("#evictions")).to_have_text("–")  # everyone's history: not shown under keys

        def send(headers, question):
            return call(url, "/generate", {"prompt": SYSTEM + question, "max_tokens": 4}, headers=headers)

        with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
            with held_in_step(engine, step=2) as (inside, release):  # step 1 is the opener's
                with queued_together(engine):
                    replies = [pool.submit(send, ALICE, "What is a block?"), pool.submit(send, ALICE, "What is a hash?"),
                               pool.submit(send, BOB, "What is a block?")]
                    health_when(url, lambda h: len(engine.snapshot().waiting) == 3, headers=ALICE)
                    queue = call(url, "/cache", headers=ALICE)[1]["waiting_queue"]
                    assert len(queue) == 2  # Alice's own two: Bob's request is not shown, nor counted
                    expect(page.locator("#waiting")).to_have_text("2")
                    expect(page.locator("#waiting-queue .waiting")).to_have_text(
                        [rid or "another key's request" for rid in queue])
                # Step 2 admits all three; Alice's second request hits the blocks her first computes in it.
                assert inside.wait(30)
                snap = call(url, "/cache", headers=ALICE)[1]
                shared = [str(b["block_id"]) for b in snap["blocks"] if b.get("ref_cnt", 0) > 1]
                assert shared and "last_step" not in snap
                bobs = [str(b["block_id"]) for b in snap["blocks"] if b["opaque"]]
                assert bobs and all("ref_cnt" not in b for b in snap["blocks"] if b["opaque"])
                expect(page.locator("#pool .block.shared")).to_have_text(shared)
                expect(page.locator("#shared")).to_have_text(str(len(shared)))
                expect(page.locator("#running")).to_have_text("2")
                expect(page.locator("#waiting-queue")).to_have_text("empty: every request that came in runs")
                expect(page.locator("#pool .block.opaque")).to_have_text(bobs)  # Bob's, drawn as hidden
                expect(page.locator("#tables .request")).to_have_count(2)  # Alice's own two, not Bob's
                # PAGE_SCREENSHOT=assets/server_page_batching.png keeps the picture.
                page.screenshot(path=os.environ.get("PAGE_SCREENSHOT") or tmp_path / "queue.png", full_page=True)
                release.set()
            assert [r.result()[0] for r in replies] == [200] * 3
        expect(page.locator("#running")).to_have_text("0")
    wait_until_idle(engine)
    assert errors == []


# --- the benchmark ---------------------------------------------------------------------------------


def test_the_server_load_benchmark_reports_every_figure(tiny_model_dir, tmp_path):
    from benchmarks import server_load

    out = tmp_path / "load.json"
    results = server_load.main(["--model", str(tiny_model_dir), "--block-size", "4", "--num-blocks", "256",
                                "--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == results
    assert [run["clients"] for run in results["runs"]] == [1, 4]
    assert all(run["requests"] == run["hits"] == 8 and run["cached_tokens"]["min"] > 0 for run in results["runs"])
    assert results["requests_per_s_ratio"] > 0 and results["class"]["students"] == 4
    assert results["class"]["first_answer_ms"] <= results["class"]["last_answer_ms"]
