"""The class server when a class leans on it: clients that hang up while they wait or while
their prompt comes in, a full queue, long prompts, silent connections, too many connections,
an engine loop that fails, tenants who look at each other, and Ctrl+C with requests running.
Real servers on 127.0.0.1 around a batching Engine over conftest's tiny random model.

No sleeps decide anything: a forward hook holds the engine loop inside a step where a test
needs it, and the tests poll for what they wait for, with a deadline.
"""

import concurrent.futures
import http.client
import json
import re
import socket
import threading

import pytest

from engine import Engine
from engine.engine_loop import EngineLoop, EngineStoppedError
from helpers import (
    MODEL, SYSTEM, EmbeddingCounter, calibrated, call, call_with_headers, held_in_step, queued_together, raw_request,
    serve, until, wait_until_idle,
)
from server import create_app, drain, serve_in_background
from serving.views import ServerState

ALICE, BOB, ADMIN = ({"Authorization": f"Bearer {key}"} for key in ("alice-key", "bob-key", "s3cret"))


def batching_engine(tiny_model, tokenizer, **kwargs) -> Engine:
    # the default policy on a held calibration: the same steps on every machine
    return calibrated(Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=128, **kwargs))


def post_head(path: str, body: bytes) -> list[str]:
    return [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json", f"Content-Length: {len(body)}"]


def read_reply(sock: socket.socket) -> tuple[int, dict, bytes]:
    """(status, headers, body) of the one HTTP reply on `sock` (the server closes after it)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def health_reply(url: str) -> tuple[int, dict, bytes] | None:
    """A raw GET /health's reply once the server refuses it with a 503; None before."""
    try:
        reply = read_reply(raw_request(url, ["GET /health HTTP/1.1", "Host: 127.0.0.1"]))
    except ConnectionError:
        return None
    return reply if reply[0] == 503 else None


# --- 1. a client that leaves is noticed before anything is spent on it ---------------------------


def test_clients_that_hang_up_while_they_wait_are_dropped_before_their_prefill(tiny_model, tokenizer):
    engine = batching_engine(tiny_model, tokenizer)
    counter = EmbeddingCounter(engine.model)
    with serve(create_app(engine, model_name=MODEL)) as url:
        with queued_together(engine):
            for i in range(6):  # each sends a long prompt and hangs up at once
                body = json.dumps({"prompt": SYSTEM * 4 + f"Question {i}?", "max_tokens": 64}).encode()
                raw_request(url, post_head("/generate", body), body).close()
            until(lambda: len(engine.snapshot().waiting) == 6, what="six requests in the queue")
        wait_until_idle(engine)
    counter.handle.remove()
    assert counter.count == 3  # the opener's prompt, and nothing of the six
    assert engine.allocator.stats.requests == 1  # none of them took a block
    assert engine.snapshot().num_steps == 1


@pytest.mark.parametrize("after_body", [b"", b"x"], ids=["closed", "one-byte-then-closed"])
def test_a_client_that_leaves_during_a_chunked_prefill_stops_it_between_chunks(tiny_model, tokenizer, after_body):
    # A byte after the body cannot be a next request (every reply closes its connection): it
    # is read and thrown away, and the close behind it is seen.
    engine = batching_engine(tiny_model, tokenizer, max_num_seqs=4, max_num_batched_tokens=16)
    counter = EmbeddingCounter(engine.model)
    body = json.dumps({"prompt": list(range(100, 200)), "max_tokens": 4}).encode()  # 100 tokens: 7 chunks
    with serve(create_app(engine, model_name=MODEL)) as url:
        with held_in_step(engine, step=2) as (inside, release):  # the second chunk's forward pass
            sock = raw_request(url, post_head("/generate", body), body + after_body)
            assert inside.wait(30)
            sock.close()
            release.set()
            wait_until_idle(engine)
    counter.handle.remove()
    assert counter.count == 32 and engine.snapshot().num_steps == 2  # two chunks of 16, then dropped


# --- 2. limits a teacher sets -------------------------------------------------------------------


def test_a_full_queue_answers_503_with_retry_after(tiny_model, tokenizer):
    engine = batching_engine(tiny_model, tokenizer, max_num_seqs=1, max_num_batched_tokens=64)
    with serve(create_app(engine, model_name=MODEL, max_waiting=2)) as url:
        with concurrent.futures.ThreadPoolExecutor(2) as pool, queued_together(engine):
            queued = [pool.submit(call, url, "/generate", {"prompt": f"Hi {i}", "max_tokens": 2}) for i in range(2)]
            until(lambda: len(engine.snapshot().waiting) == 2, what="two requests in the queue")
            status, reply, headers = call_with_headers(url, "/generate", {"prompt": "One more", "max_tokens": 2})
            assert status == 503 and headers["Retry-After"] == "2"
            assert "--max-waiting-requests" in reply["error"]["message"]
        assert [f.result()[0] for f in queued] == [200, 200]  # the queued ones were served
    wait_until_idle(engine)


def test_a_prompt_over_the_limit_is_refused_before_it_runs(engine):
    with serve(create_app(engine, model_name=MODEL, max_prompt_tokens=8)) as url:
        status, reply = call(url, "/generate", {"prompt": SYSTEM, "max_tokens": 2})
        steps = engine.snapshot().num_steps
        assert status == 400 and "--max-prompt-tokens" in reply["error"]["message"]
        assert f"is {len(engine.tokenize(SYSTEM))} tokens, over this server's limit of 8" in reply["error"]["message"]
        assert call(url, "/generate", {"prompt": "Hi", "max_tokens": 2})[0] == 200
        assert engine.snapshot().num_steps > steps


def test_a_half_sent_body_times_out_and_a_silent_connection_is_closed(engine):
    with serve(create_app(engine, model_name=MODEL), read_timeout=0.5, idle_timeout=0.5) as url:
        body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
        requests_before = engine.allocator.stats.requests
        sock = raw_request(url, post_head("/generate", body), body[:5])  # and the rest never comes
        status, headers, reply = read_reply(sock)
        assert status == 408 and "stopped arriving before its Content-Length" in json.loads(reply)["error"]["message"]
        assert engine.allocator.stats.requests == requests_before  # nothing reached the engine

        host, port = url.removeprefix("http://").split(":")
        silent = socket.create_connection((host, int(port)), timeout=30)  # connects, sends nothing
        assert silent.recv(1) == b""  # closed by the server after its idle timeout
        assert call(url, "/health")[0] == 200


def test_connections_over_the_cap_get_a_503_at_once_while_every_head_is_in(engine):
    with serve(create_app(engine, model_name=MODEL), max_connections=2, idle_timeout=30, head_timeout=30) as url:
        body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
        holding = [raw_request(url, post_head("/generate", body)) for _ in range(2)]  # heads in, bodies to come
        status, headers, reply = until(lambda: health_reply(url), what="both connections taken")
        assert status == 503 and headers["Retry-After"] == "2" and "--max-connections" in json.loads(reply)["error"]["message"]
        for connection in holding:
            connection.close()
        until(lambda: call(url, "/health")[0] == 200, what="a free connection slot")


def test_at_the_cap_a_new_connection_takes_the_place_of_the_oldest_head_still_coming_in(engine):
    with serve(create_app(engine, model_name=MODEL), max_connections=2, idle_timeout=30, head_timeout=30) as url:
        host, port = url.removeprefix("http://").split(":")
        oldest = socket.create_connection((host, int(port)), timeout=30)  # connects, sends nothing
        dripping = socket.create_connection((host, int(port)), timeout=30)
        dripping.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # its head never ends
        dripping.settimeout(0.2)
        # Both places taken by heads still coming in: once they are older than MAKE_ROOM_AFTER_S,
        # a request takes the oldest's place and is served, at once, with no 503.
        assert until(lambda: call(url, "/health")[0] == 200, what="a request served at the cap") is True
        assert oldest.recv(1) == b""  # the idle connection was cut to make room
        with pytest.raises(TimeoutError):
            dripping.recv(1)  # the younger one is still open
        oldest.close()
        dripping.close()


# --- 3. a supervised engine loop ----------------------------------------------------------------


def fail_once(monkeypatch, loop: EngineLoop, error: BaseException) -> None:
    """The loop's next admission (outside any step) raises `error`, once."""
    add = loop.scheduler.add
    raised = []

    def add_or_fail(request):
        if not raised:
            raised.append(1)
            raise error
        add(request)

    monkeypatch.setattr(loop.scheduler, "add", add_or_fail)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread that dies
@pytest.mark.parametrize("error, cause", [(RuntimeError("a bug outside the step"), "a bug outside the step"),
                                          (SystemExit(), "the engine loop's thread died")],
                         ids=["exception", "dead-thread"])
def test_a_failure_outside_a_step_kills_the_engine_once_and_every_caller_is_told_why(tiny_model, tokenizer,
                                                                                      monkeypatch, error, cause):
    engine = batching_engine(tiny_model, tokenizer)
    engine.generate("Hello", max_tokens=1)  # the loop's thread runs
    fail_once(monkeypatch, engine.loop, error)
    with serve(create_app(engine, model_name=MODEL)) as url:
        status, reply = call(url, "/generate", {"prompt": "Hi", "max_tokens": 2})
        assert status == 503 and "takes no more requests; close it and make a new one" in reply["error"]["message"]
        assert cause in reply["error"]["message"]
        status, health = call(url, "/health")
        assert status == 503 and health["status"] == "error" and cause in health["message"]
        status, reply, headers = call_with_headers(url, "/generate", {"prompt": "Hi", "max_tokens": 2}, timeout=5)
        assert status == 503 and headers["Retry-After"] == "2" and cause in reply["error"]["message"]
    with pytest.raises(EngineStoppedError, match=cause):  # in process too, until the engine is made again
        engine.generate("Hi", max_tokens=2)


def test_a_request_waits_no_longer_than_its_deadline(tiny_model, tokenizer):
    engine = batching_engine(tiny_model, tokenizer, max_num_seqs=1, max_num_batched_tokens=64)
    with serve(create_app(engine, model_name=MODEL, request_timeout=0.2)) as url:
        with queued_together(engine):  # the opener holds the only seat past the deadline
            status, reply, headers = call_with_headers(url, "/generate", {"prompt": "Hi", "max_tokens": 2})
        assert status == 503 and "did not finish within 0.2 s" in reply["error"]["message"]
        assert headers["Retry-After"] == "2"
    wait_until_idle(engine)


# --- 4. tenants see only their own ---------------------------------------------------------------


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# the class of 2026\nalice-key\n\nbob-key\n")
    return path


def test_with_a_key_list_an_unknown_key_gets_401_everywhere_and_probes_still_work(engine, keys_file):
    from serving.requests import read_api_keys

    app = create_app(engine, model_name=MODEL, salt_by_api_key=True, admin_key="s3cret",
                     api_keys=read_api_keys(str(keys_file)))
    stranger = {"Authorization": "Bearer made-up"}
    with serve(app) as url:
        for path, body in (("/generate", {"prompt": "Hi", "max_tokens": 1}), ("/cache", None), ("/health", None),
                           ("/v1/models", None), ("/v1/completions", {"prompt": "Hi", "max_tokens": 1})):
            status, reply = call(url, path, body, headers=stranger)
            assert status == 401 and "not on this server's list" in reply["error"]["message"], path
            assert call(url, path, body)[0] == (200 if path == "/health" else 401), path  # no key at all
        assert call(url, "/health") == (200, {"status": "ok"})  # liveness for a probe, nothing more
        assert call(url, "/generate", {"prompt": "Hi", "max_tokens": 1}, headers=ALICE)[0] == 200
        assert call(url, "/cache", headers=ADMIN)[0] == 200  # the admin key is always on the list


def test_a_tenant_sees_no_other_tenants_step_or_block_state_and_the_admin_sees_all(engine):
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL, salt_by_api_key=True,
                          admin_key="s3cret")) as url:
        call(url, "/generate", {"prompt": SYSTEM + "Bob asks.", "max_tokens": 1}, headers=BOB)
        alice, admin = call(url, "/health", headers=ALICE)[1], call(url, "/health", headers=ADMIN)[1]
        assert "last_step" not in alice and admin["last_step"]["prefill_tokens"] > 0
        assert alice["blocks_in_use"] == admin["blocks_in_use"]  # a count is everyone's
        assert admin["counted"] == "all requests" and admin["requests"] == engine.allocator.stats.requests

        seen_by_alice, seen_by_admin = call(url, "/cache", headers=ALICE)[1], call(url, "/cache", headers=ADMIN)[1]
        bobs = [b["block_id"] for b in seen_by_admin["blocks"] if b["text"] and "Bob" in b["text"]]
        assert bobs
        for block_id in bobs:  # neither its ref count nor its state, nor its place in the free queue
            assert seen_by_alice["blocks"][block_id] == {"block_id": block_id, "opaque": True, "block_hash": None,
                                                         "num_tokens": None, "text": None}
            assert block_id not in seen_by_alice["free_queue"] and block_id in seen_by_admin["free_queue"]
        assert "Bob" not in json.dumps(seen_by_alice)
    wait_until_idle(engine)


def test_response_ids_are_random_not_a_count_of_everyones_requests(url):
    host, port = url.removeprefix("http://").split(":")
    ids = []
    for _ in range(2):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}),
                     {"Content-Type": "application/json"})
        ids.append(json.loads(conn.getresponse().read())["id"])
        conn.close()
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1]


def test_cache_is_rendered_once_however_many_poll(engine, monkeypatch):
    renders = []
    snapshot = ServerState.snapshot
    monkeypatch.setattr(ServerState, "snapshot", lambda self, viewer: renders.append(1) or snapshot(self, viewer))
    with serve(create_app(engine, model_name=MODEL, cache_page_every_s=3600)) as url:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            pages = list(pool.map(lambda _: call(url, "/cache"), range(32)))
    assert len(renders) == 1 and all(page == pages[0] for page in pages)


# --- 5. a clean shutdown -------------------------------------------------------------------------


def test_shutdown_ends_streams_with_a_last_event_and_done_and_waiting_requests_with_503(tiny_model, tokenizer):
    engine = batching_engine(tiny_model, tokenizer, max_num_seqs=1, max_num_batched_tokens=64)
    url, server = serve_in_background(create_app(engine, model_name=MODEL))
    host, port = url.removeprefix("http://").split(":")
    with held_in_step(engine, step=3) as (inside, release):  # the stream's third step waits there
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Tell me a story", "max_tokens": 200, "stream": True}),
                     {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert inside.wait(30)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(call_with_headers, url, "/generate", {"prompt": "Hi", "max_tokens": 2})
            until(lambda: len(engine.snapshot().waiting) == 1, what="a request in the queue")
            stopping = threading.Thread(target=drain, args=(server, engine, 0.0))  # what Ctrl+C starts
            stopping.start()
            status, reply, headers = waiting.result(30)
            assert status == 503 and "shutting down" in reply["error"]["message"] and headers["Retry-After"] == "2"
            release.set()  # the held step ends; the stream is cut between two steps
            events = [line for line in stream.read().decode().split("\n\n") if line]
            stopping.join(30)
    assert not stopping.is_alive()
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert engine.allocator.block_tables == {} and engine.loop.live == {}


# --- the benchmark -------------------------------------------------------------------------------


def test_the_abuse_benchmark_times_honest_clients_alone_and_beside_each_attack(tiny_model_dir, tmp_path):
    from benchmarks import server_abuse

    out = server_abuse.main(["--model", str(tiny_model_dir), "--scenes", "attacks", "--honest", "2", "--abusive", "2",
                             "--seconds", "1", "--max-tokens", "4", "--json", str(tmp_path / "abuse.json"),
                             # the half-body attack waits for the server's deadline: 2 s, not 10
                             "--server-args", "--read-timeout 2 --head-timeout 1"])
    assert out["alone"]["gaps"] > 0 and out["alone"]["success_rate"] == 1.0
    assert list(out["scenes"]) == list(server_abuse.ATTACKS)
    for attack, run in out["scenes"].items():
        assert run["abuse"]["sent"] >= 1 and run["served"] >= 1 and run["per_token_ms_ratio"] > 0, attack
    assert json.loads((tmp_path / "abuse.json").read_text())["scenes"]["drip"]["abuse"]["sent"] >= 1


def test_the_abuse_benchmark_runs_each_class_scene_and_takes_the_median_of_its_runs(tiny_model_dir, tmp_path):
    """The class scenes at tiny sizes, twice each, on a server given a fixed budget and a flag
    of its own: every figure is there (what they are is the benchmark's to say, not a test's)."""
    from benchmarks import server_abuse

    out = server_abuse.main([
        "--model", str(tiny_model_dir), "--scenes", "class", "--repeat", "2", "--seconds", "1", "--honest", "2",
        "--max-tokens", "4", "--long-tokens", "500", "--heavy-tokens", "600", "--heavy-loops", "2", "--streams", "3",
        "--keyed-streams", "2", "--stream-tokens", "16", "--nat-students", "3", "--nat-pages", "2", "--fixed-budget", "128",
        "--server-args", "--max-tokens-limit 64", "--json", str(tmp_path / "class.json")])
    assert out["budget"] == "fixed: 128 tokens a step" and out["server_args"][-4:] == [
        "--max-tokens-limit", "64", "--max-num-batched-tokens", "128"]
    assert list(out["scenes"]) == list(server_abuse.CLASS_SCENES)
    assert {name: len(runs) for name, runs in out["runs"].items()} == {"alone": 2} | dict.fromkeys(out["scenes"], 2)
    assert len(out["load_average"]["start"]) == len(out["load_average"]["end"]) == 3
    assert out["prompt_tokens"]["long"] >= 500 and out["prompt_tokens"]["heavy"] >= 600
    long = out["scenes"]["long-prompt"]
    assert long["served"] == long["requests"] == 5
    assert all(long[figure] > 0 for figure in ("stream_ttft_alone_ms", "stream_ttft_beside_ms", "generate_alone_ms",
                                               "generate_beside_ms", "long_ms"))
    assert out["scenes"]["long-alone"]["served"] == 1 and out["scenes"]["long-alone"]["long_ms"] > 0
    for name in server_abuse.BESIDE:
        scene = out["scenes"][name]
        assert scene["served"] >= 1 and scene["request_ms_ratio"] > 0 and 0 <= scene["within_1_5x"] <= 1, name
        assert scene["other_student"]["sent"] >= 1, name
    kinds = out["scenes"]["nat-class"]["kinds"]
    assert list(kinds) == ["POST /v1/chat/completions", "GET /health", "GET /cache"]
    for kind, tally in kinds.items():
        assert tally["sent"] >= 1 and tally["sent"] == tally["served"] + tally["refused"] + tally["failed"], kind
    assert json.loads((tmp_path / "class.json").read_text())["scenes"]["nat-class"]["kinds"] == kinds


def test_the_first_prompt_benchmark_starts_fresh_servers_both_ways(tiny_model_dir, tmp_path):
    from benchmarks import first_prompt

    out = first_prompt.main(["--runs", "1", "--long-tokens", "300", "--server-args", f"--model {tiny_model_dir}",
                             "--json", str(tmp_path / "first.json")])
    assert list(out["runs"]) == ["default", "fixed"] and all(len(runs) == 1 for runs in out["runs"].values())
    for run in (out["runs"]["default"][0], out["runs"]["fixed"][0]):
        assert set(run) == {"alone_s", "long_beside_arrivals_s", "stream_ttft_s", "stream_alone_s", "generate_ttft_s",
                            "generate_alone_s"} and all(seconds > 0 for seconds in run.values())
    assert out["alone_ratio"] > 0 and json.loads((tmp_path / "first.json").read_text())["long_tokens"] == 300
