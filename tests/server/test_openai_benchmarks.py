"""The benchmarks that measure a server through the OpenAI API only (server_load, cache_probe):
over real HTTP against this course's server, where their cached tokens must equal what its own
route reports, and against stub servers: one that leaves the prefix cache out of its usage,
and one with a prefix cache of its own that honours cache_salt or ignores it."""

import json
import threading

import pytest
from flask import Flask, Response, request
from werkzeug.serving import make_server

from benchmarks import cache_probe, server_load
from benchmarks.openai_api import OpenAIServer, Spread
from engine import Engine

pytestmark = [pytest.mark.server]


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    """The server's engine, batching, with room for the side channel's five letters at once
    (the conftest one holds 256 tokens: later guesses would evict the victim's letter)."""
    return Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=512)


STUB_BLOCK = 4  # words per block of the stub's cache


def cached_words(words: list[str], earlier: list[list[str]]) -> int:
    """The stub's prefix cache: the whole blocks of `words` that an earlier prompt began with
    (the last word always computed, as a server must to sample).

    >>> cached_words("a b c d e f".split(), ["a b c d x".split()])
    4
    """
    longest = 0
    for other in earlier:
        same = 0
        while same < min(len(words) - 1, len(other)) and words[same] == other[same]:
            same += 1
        longest = max(longest, same)
    return longest // STUB_BLOCK * STUB_BLOCK


def stub_app(received: list[dict], cache: str | None = None) -> Flask:
    """An OpenAI-compatible server that answers "ok". cache=None: its usage has no
    prompt_tokens_details, and it has no /reset_prefix_cache (as vLLM outside dev mode).
    cache="salted" or "ignores salt": a prefix cache of whole blocks of words that reports
    cached tokens and has /reset_prefix_cache, kept per cache_salt or shared by all tenants."""
    app = Flask("stub")
    seen: dict[str | None, list[list[str]]] = {}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    def stream():
        body = request.get_json()
        received.append(body)
        chat = "messages" in body
        entry = {"index": 0, "delta": {"content": "ok"}} if chat else {"index": 0, "text": "ok"}
        words = ("\n".join(m["content"] for m in body["messages"]) if chat else body["prompt"]).split()
        usage = {"prompt_tokens": len(words), "completion_tokens": 1, "total_tokens": len(words) + 1}
        if cache is not None:
            earlier = seen.setdefault(body.get("cache_salt") if cache == "salted" else None, [])
            usage["prompt_tokens_details"] = {"cached_tokens": cached_words(words, earlier)}
            earlier.append(words)
        events = [{"choices": [entry]}, {"choices": [], "usage": usage}]
        return Response("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n",
                        mimetype="text/event-stream")

    app.post("/v1/chat/completions")(stream)
    app.post("/v1/completions", endpoint="completions")(stream)
    if cache is not None:
        @app.post("/reset_prefix_cache")
        def reset():
            received.append({"reset": True})
            seen.clear()
            return {}
    return app


@pytest.fixture
def serve_stub():
    """Start a stub server: (its URL, the bodies it received)."""
    servers = []

    def serve(cache: str | None = None) -> tuple[str, list[dict]]:
        received: list[dict] = []
        server = make_server("127.0.0.1", 0, stub_app(received, cache), threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.port}", received

    yield serve
    for server in servers:
        server.shutdown()


@pytest.fixture
def stub(serve_stub):
    return serve_stub()


def test_the_probe_counts_through_openai_what_generate_counts_and_sees_the_side_channel(url, engine):
    results = cache_probe.main(["--url", url, "--prefix-words", "40", "--repeats", "2", "--compare-generate",
                                "--seed", "0"])
    cold = [r["cached_tokens"] for r in results["cold"]]
    warm = [r["cached_tokens"] for r in results["warm"]]
    assert max(cold) < min(warm)  # a fresh first line leaves little more than the chat template to hit
    compared = results["compare_generate"]
    assert compared["cold_openai_cached"] == compared["cold_generate_cached"]
    assert compared["warm_openai_cached"] == compared["warm_generate_cached"]
    assert compared["warm_openai_cached"] > compared["cold_openai_cached"]
    open_, salted = results["side_channel"]["open"], results["side_channel"]["salted"]
    wrong = [name for name in cache_probe.NAMES if name != cache_probe.VICTIM]
    assert open_[cache_probe.VICTIM]["cached_tokens"] > max(open_[n]["cached_tokens"] for n in wrong)
    # With a salt per tenant the right guess finds no more than the wrong guesses after the
    # first: tenant B's own fresh first line, never tenant A's letter.
    assert salted[cache_probe.VICTIM]["cached_tokens"] <= min(salted[n]["cached_tokens"] for n in wrong[1:])
    assert results["salt"] == "works"
    classes = results["classes"]
    assert classes["warm"]["hits"] == 2
    assert classes["warm"]["cached_tokens"]["min"] > classes["cold"]["cached_tokens"]["max"]


def test_the_load_benchmark_speaks_openai_to_a_running_server(url, engine):
    results = server_load.main(["--url", url, "--quick"])
    assert results["model"] == "tiny-llama" and [run["clients"] for run in results["runs"]] == [1, 4]
    assert results["prompts"] == server_load.PROMPT_RULE
    for run in results["runs"]:  # every request behind the primed system prompt finds it cached
        assert run["requests"] == run["hits"] == 8 and run["misses"] == 0 and run["cached_tokens"]["min"] > 0
        assert run["ttft_ms"]["min"] <= run["ttft_ms"]["p50"] <= run["ttft_ms"]["p90"] <= run["ttft_ms"]["max"]


def test_a_server_that_reports_no_cached_tokens_is_said_so(stub, capsys):
    stub_url, received = stub
    probe = cache_probe.main(["--url", stub_url, "--prefix-words", "10", "--repeats", "1"])
    load = server_load.main(["--url", stub_url, "--quick"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("This server does not report cached tokens") == 2 and "not reported" in out
    assert probe["cold"][0]["cached_tokens"] is None and probe["model"] == "stub-model"
    assert all(run["cached_tokens"] is None and run["hits"] is None for run in load["runs"])
    assert probe["salt"] == "unknown" and probe["classes"]["warm"]["hits"] is None
    # No reset there: each load run's system prompt opened with a fresh first line instead.
    systems = {body["messages"][0]["content"].split("\n")[0] for body in received if "messages" in body
               and "teaching assistant" in body["messages"][0]["content"]}
    assert len(systems) == 3 and all(line.startswith("Request ") for line in systems)  # 2 load runs + the class
    assert all(body["stream"] and body["stream_options"] == {"include_usage": True} for body in received)


def test_a_stream_is_timed_to_its_first_text_and_its_usage_read_at_the_end(stub):
    stub_url, _ = stub
    reply = OpenAIServer(stub_url).complete("Hi there", max_tokens=1)
    assert (reply.text, reply.prompt_tokens, reply.cached_tokens, reply.completion_tokens) == ("ok", 2, None, 1)
    assert 0 < reply.ttft_ms <= reply.total_ms


@pytest.mark.parametrize("bench", [server_load, cache_probe])
def test_a_flag_of_the_server_it_starts_is_refused_with_url(bench, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--url", "http://192.0.2.1:8000", "--model", "gpt2"])
    assert exit_.value.code == 2 and "--served-model" in capsys.readouterr().err


def test_every_server_gets_the_same_prompts_reset_or_not(serve_stub):
    """A server with /reset_prefix_cache is sent what one without it is sent, and never reset."""
    bodies = {}
    for cache in (None, "salted"):
        url, received = serve_stub(cache)
        server_load.main(["--url", url, "--quick"])
        assert {"reset": True} not in received
        assert all(body["messages"][0]["content"].startswith("Request ") for body in received)  # a fresh line
        # The same system prompt after that line, the same questions (in the order threads sent them).
        bodies[cache] = sorted([m["content"].split("\n", 1)[-1] for m in body["messages"]] for body in received)
    assert bodies["salted"] == bodies[None]


def test_the_load_counts_hits_and_misses_per_request(serve_stub):
    url, _ = serve_stub("salted")
    results = server_load.main(["--url", url, "--quick"])
    for run in results["runs"]:  # the system prompt's whole blocks, then a question of its own
        assert (run["hits"], run["misses"]) == (8, 0)
        assert 0 < run["cached_tokens"]["min"] <= run["cached_tokens"]["p50"] < run["prompt_tokens"]["p50"]


@pytest.mark.parametrize("cache, verdict, said", [
    ("salted", "works", "cache_salt works on this server"),
    ("ignores salt", "ignored", "salt ignored by this server"),
])
def test_the_probe_says_whether_the_salt_keeps_tenants_apart(serve_stub, capsys, cache, verdict, said):
    url, _ = serve_stub(cache)
    results = cache_probe.main(["--url", url, "--prefix-words", "40", "--repeats", "3", "--seed", "0"])
    assert results["salt"] == verdict and said in " ".join(capsys.readouterr().out.split())
    cold, warm = results["classes"]["cold"], results["classes"]["warm"]
    assert (cold["hits"], cold["misses"], warm["hits"], warm["misses"]) == (0, 3, 3, 0)  # per request, not a set
    assert cold["cached_tokens"]["max"] == 0 and warm["cached_tokens"]["min"] > 0


def test_a_spread_is_the_median_beside_the_tail():
    spread = Spread.of([40, 32, 2031, 35, 36, 38, 41, 37, 39, 33])
    assert (spread.min, spread.p50, spread.p90, spread.p99, spread.max) == (32, 37, 41, 2031, 2031)
    assert Spread.of([12, None]) is None  # a server that reports nothing: not a zero
