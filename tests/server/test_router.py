"""The class server as a worker behind SGLang's real router (sglang-router, pinned in
requirements.txt; benchmarks/router.py starts it as its CLI does). Over real HTTP on
127.0.0.1: two replicas of the server over conftest's tiny model, each with its own engine and
pool, in this process (a replica in a process of its own takes half a minute to import torch
on a busy machine; the app and its server are the same), and the router's own process.

    1. what the router needs from a worker (/health, /server_info, /model_info) and the routes it forwards:
       a chat goes through, streamed and not, and so does a completion
    2. the body the router forwards is taken: SGLang's own fields, at their defaults
    3. what it passes on: Authorization (keys hold), but no X-Forwarded-For; a chat's cache_salt
       is dropped, and so is the prompt of this server's own /generate
    4. replayed one after another: round robin splits a shared prefix's requests between the
       replicas, cache_aware keeps them on one, and every request is traced to its replica
    5. the benchmark, its replicas in processes of their own and keyed as a class's fleet

What the router's guards close is test_router_safety.py's.
"""

import json
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer

import pytest

from analyzer.fleet import ROUTER_VERSION
from analyzer.request_logs import LoggedRequest
from benchmarks.router import Fleet, replay_through_router, router
from engine import Engine
from helpers import MODEL, StubWorker, calibrated, serve, wait_until_idle
from server import create_app
from serving.requests import CHAT, COMPLETIONS, Settings, parse_generation_request

pytestmark = [pytest.mark.router, pytest.mark.server]


def make_engine(tiny_model, tokenizer) -> Engine:
    return calibrated(Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=128))


@pytest.fixture(scope="module")
def replica_urls(tiny_model, tokenizer):
    engines = [make_engine(tiny_model, tokenizer) for _ in range(2)]
    with serve(create_app(engines[0], model_name=MODEL)) as a, serve(create_app(engines[1], model_name=MODEL)) as b:
        yield (a, b)
    for engine in engines:
        wait_until_idle(engine)  # every block free again, every ref count 0
        engine.close()


@pytest.fixture
def fresh_replicas(replica_urls):
    """Both replicas' caches empty: each test sees what its own requests cached."""
    for url in replica_urls:
        post(url + "/reset_prefix_cache", {})
    return replica_urls


def post(url: str, body: dict, headers: dict | None = None):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    return urllib.request.urlopen(request, timeout=60)


def chat(question: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 3, **fields}


# --- 1. through the router ---------------------------------------------------------------------------


def test_a_replica_describes_itself_in_sglangs_fields(replica_urls):
    with urllib.request.urlopen(replica_urls[0] + "/server_info", timeout=10) as response:
        assert json.load(response) == {"served_model_name": MODEL}
    with urllib.request.urlopen(replica_urls[0] + "/model_info", timeout=10) as response:
        info = json.load(response)
    assert info["model_type"] == "llama" and info["is_generation"] is True and isinstance(info["architectures"], list)


def test_a_chat_goes_through_the_router_streamed_and_not(fresh_replicas):
    with router(fresh_replicas, "round_robin") as url:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
            assert [m["id"] for m in json.load(response)["data"]] == [MODEL]  # from the replicas' /server_info
        with post(url + "/v1/chat/completions", chat("What is a KV cache?")) as response:
            reply = json.load(response)
        assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 3
        body = chat("What is a block?", stream=True, stream_options={"include_usage": True})
        with post(url + "/v1/chat/completions", body) as response:
            events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing cached yet
        with post(url + "/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 2}) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 2
        with pytest.raises(urllib.error.HTTPError) as refused:  # the router names a chat without one "unknown"
            post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
        assert refused.value.code == 404 and "this server serves 'tiny-llama'" in refused.value.read().decode()
        with pytest.raises(urllib.error.HTTPError) as refused:  # and a completion without one never leaves it
            post(url + "/v1/completions", {"prompt": "Once upon"})
        assert refused.value.code == 422


def test_keys_hold_behind_the_router(tiny_model, tokenizer):
    """A replica with --api-keys: the router registers it without a key (/server_info answers
    anyone), and each student's key reaches it: a listed one is served, another one refused."""
    engine = make_engine(tiny_model, tokenizer)
    with serve(create_app(engine, model_name=MODEL, api_keys=frozenset({"student-01"}))) as replica:
        with router([replica], "round_robin") as url:
            with post(url + "/v1/chat/completions", chat("Hi"), {"Authorization": "Bearer student-01"}) as response:
                assert response.status == 200
            with pytest.raises(urllib.error.HTTPError) as refused:
                post(url + "/v1/chat/completions", chat("Hi"), {"Authorization": "Bearer student-99"})
            assert refused.value.code == 401
    wait_until_idle(engine)
    engine.close()


# --- 2. the body it forwards -------------------------------------------------------------------------

# What sglang-router 0.3.2 forwarded for {"messages": [...], "max_tokens": 8} (recorded from it):
# its own request type written out again, with SGLang's fields at their defaults.
ROUTER_CHAT_BODY = {
    "messages": [{"role": "user", "content": "Hi"}], "model": MODEL, "logprobs": False,
    "max_completion_tokens": 8, "stream": False, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False,
}
ROUTER_COMPLETION_BODY = {
    "model": MODEL, "prompt": "Hi", "max_tokens": 8, "temperature": 0.0, "top_p": 0.9, "stream": True,
    "stream_options": {"include_usage": True}, "echo": False, "stop": ["x"], "user": "me", "seed": 3,
    "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False,
    "cache_salt": "s",
}


def test_the_bodies_the_router_writes_are_taken():
    assert parse_generation_request(ROUTER_CHAT_BODY, CHAT, Settings(MODEL), headers={}).max_tokens == 8
    assert parse_generation_request(ROUTER_COMPLETION_BODY, COMPLETIONS, Settings(MODEL), headers={}).cache_salt == "s"


@pytest.mark.parametrize("field, value", [("ignore_eos", True), ("no_stop_trim", True), ("skip_special_tokens", False)])
def test_sglang_fields_that_would_change_the_reply_are_refused(field, value):
    from serving.requests import APIError

    with pytest.raises(APIError, match=f"does not implement '{field}'"):
        parse_generation_request({**ROUTER_CHAT_BODY, field: value}, CHAT, Settings(MODEL), headers={})


# --- 3. what it passes on: recorded by a worker that keeps every request ----------------------------


class Recorder(StubWorker):
    """A worker that keeps what it was sent."""

    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        self.reply({"id": "x", "object": "chat.completion", "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def test_the_router_forwards_authorization_not_x_forwarded_for_and_drops_a_chats_salt():
    worker = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    try:
        with router([f"http://127.0.0.1:{worker.server_port}"], "round_robin") as url:
            headers = {"Authorization": "Bearer student-07", "X-Forwarded-For": "203.0.113.9"}
            post(url + "/v1/chat/completions", chat("Hi", cache_salt="class-a", user="s7"), headers).close()
            post(url + "/v1/completions", {"model": MODEL, "prompt": "Hi", "cache_salt": "class-a"}, headers).close()
            post(url + "/generate", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}).close()
    finally:
        worker.shutdown()
    (chat_path, chat_headers, chat_body), (_, completion_headers, completion_body), (_, _, generate_body) = Recorder.seen
    assert chat_path == "/v1/chat/completions"
    assert chat_headers["authorization"] == completion_headers["authorization"] == "Bearer student-07"
    assert "x-forwarded-for" not in chat_headers and "x-forwarded-for" not in completion_headers
    assert "cache_salt" not in chat_body and "user" not in chat_body  # dropped on the way
    assert completion_body["cache_salt"] == "class-a"
    assert "messages" not in generate_body and "max_tokens" not in generate_body  # /generate's own body is lost


# --- 4. replayed through the router ----------------------------------------------------------------

SHARED = "You are a patient teacher. Answer every question in one short sentence. " * 3
REQUESTS = [LoggedRequest([{"role": "system", "content": SHARED}, {"role": "user", "content": q}], None, f"line {i + 1}")
            for i, q in enumerate(["What is a KV cache?", "What is a block?", "What is a hash?", "Why evict?"])]


def test_round_robin_splits_a_shared_prefix_between_the_replicas(fresh_replicas):
    with router(fresh_replicas, "round_robin") as url:
        routed = replay_through_router(Fleet(url, fresh_replicas, "round_robin"), REQUESTS)
    replicas = [r.replica for r in routed]
    assert replicas[0] != replicas[1] and replicas[2:] == replicas[:2]  # taking turns
    assert [r.cached_tokens > 0 for r in routed] == [False, False, True, True]  # each replica computes it once
    assert all(r.prompt_tokens > r.cached_tokens for r in routed)


def test_cache_aware_keeps_a_shared_prefix_on_one_replica(fresh_replicas):
    with router(fresh_replicas, "cache_aware") as url:
        routed = replay_through_router(Fleet(url, fresh_replicas, "cache_aware"), REQUESTS)
    assert len({r.replica for r in routed}) == 1
    assert [r.cached_tokens > 0 for r in routed] == [False, True, True, True]


# --- 5. the benchmark: replicas in processes of their own ------------------------------------------


def test_a_replica_whose_port_was_taken_starts_again_on_another(tiny_model_dir, monkeypatch):
    """Between a port's pick and the replica's bind another program may take it: the replica
    exits with "Address already in use", and the fleet starts it again on another port."""
    import socket

    from benchmarks import router as bench

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        real, picks = bench.free_ports, []

        def pick(n):  # the fleet's first pick: the port taken; every later one as it comes
            picks.append(n)
            return [port] * n if len(picks) == 1 else real(n)

        monkeypatch.setattr(bench, "free_ports", pick)
        with bench.replicas(1, ["--model", str(tiny_model_dir), "--num-blocks", "64"]) as (url,):
            assert not url.endswith(f":{port}") and len(picks) == 2
            with urllib.request.urlopen(url + "/health", timeout=30) as response:
                assert json.loads(response.read())["status"] == "ok"


def test_the_router_benchmark_starts_a_fleet_and_reports_each_run(tiny_model_dir, tmp_path):
    """`--bench router` as docs/fleet.md runs it, on the tiny model: two replicas of python
    server.py, each the class server a fleet gets (keys, a cache per key, the teacher's admin
    key), a router per policy, every request traced to a replica by its /health read with the
    teacher's key, the figure written."""
    from benchmarks import router as bench

    out, figure = tmp_path / "router.json", tmp_path / "router.png"
    results = bench.main(["--model", str(tiny_model_dir), "--replicas", "2", "--requests", "3", "--max-tokens", "1",
                          "--log", str(bench.ROOT / "lessons" / "data" / "chatbot.jsonl.xz"),
                          "--figure", str(figure), "--json", str(out)])
    assert [(run["replicas"], run["policy"]) for run in results["runs"]] == [(2, "round_robin"), (2, "cache_aware")]
    for run in results["runs"]:
        assert sum(run["requests_per_replica"]) == 3 == len(run["routed"])
        assert run["cached_tokens"] == sum(r["cached_tokens"] for r in run["routed"])
    assert results["runs"][0]["requests_per_replica"] == [2, 1] or results["runs"][0]["requests_per_replica"] == [1, 2]
    assert json.loads(out.read_text())["router"] == ROUTER_VERSION and figure.stat().st_size > 0
    assert "--no-fair-share" not in results["server_flags"]  # fair share on, as a class gets it
