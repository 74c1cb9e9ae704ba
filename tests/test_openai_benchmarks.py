"""The benchmarks that measure a server through the OpenAI API only (server_load, cache_probe):
over real HTTP against this course's server, where their cached tokens must equal what its own
route reports, and against a stub server that leaves the prefix cache out of its usage."""

import json
import threading

import pytest
from flask import Flask, Response, request
from werkzeug.serving import make_server

from benchmarks import cache_probe, server_load
from benchmarks.openai_api import OpenAIServer
from engine import Engine


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    """The server's engine, batching, with room for the side channel's five letters at once
    (the conftest one holds 256 tokens: later guesses would evict the victim's letter)."""
    return Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=512, batching=True)


def stub_app(received: list[dict]) -> Flask:
    """An OpenAI-compatible server that answers "ok" and reports usage without
    prompt_tokens_details, and has no /reset_prefix_cache (as vLLM outside dev mode)."""
    app = Flask("stub")

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    def stream():
        body = request.get_json()
        received.append(body)
        chat = "messages" in body
        entry = {"index": 0, "delta": {"content": "ok"}} if chat else {"index": 0, "text": "ok"}
        usage = {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}
        events = [{"choices": [entry]}, {"choices": [], "usage": usage}]
        return Response("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n",
                        mimetype="text/event-stream")

    app.post("/v1/chat/completions")(stream)
    app.post("/v1/completions", endpoint="completions")(stream)
    return app


@pytest.fixture
def stub():
    received: list[dict] = []
    server = make_server("127.0.0.1", 0, stub_app(received), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.port}", received
    server.shutdown()


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


def test_the_load_benchmark_speaks_openai_to_a_running_server(url, engine):
    results = server_load.main(["--url", url, "--quick"])
    assert results["model"] == "tiny-llama" and [run["clients"] for run in results["runs"]] == [1, 4]
    assert all(run["requests"] == 8 and run["cached_tokens"] > 0 for run in results["runs"])
    assert results["batching"] is None  # a server it did not start: it cannot know


def test_a_server_that_reports_no_cached_tokens_is_said_so(stub, capsys):
    stub_url, received = stub
    probe = cache_probe.main(["--url", stub_url, "--prefix-words", "10", "--repeats", "1"])
    load = server_load.main(["--url", stub_url, "--quick"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("This server does not report cached tokens") == 2 and "not reported" in out
    assert probe["cold"][0]["cached_tokens"] is None and probe["model"] == "stub-model"
    assert all(run["cached_tokens"] is None for run in load["runs"])
    # No reset there: each load run's system prompt opened with a fresh first line instead.
    systems = {body["messages"][0]["content"].split("\n")[0] for body in received if "messages" in body
               and "teaching assistant" in body["messages"][0]["content"]}
    assert len(systems) == 3 and all(line.startswith("Request ") for line in systems)  # 2 load runs + the class
    assert all(body["stream"] and body["stream_options"] == {"include_usage": True} for body in received)


def test_a_stream_is_timed_to_its_first_text_and_its_usage_read_at_the_end(stub):
    stub_url, _ = stub
    reply = OpenAIServer(stub_url).complete("Hi", max_tokens=1)
    assert (reply.text, reply.prompt_tokens, reply.cached_tokens, reply.completion_tokens) == ("ok", 12, None, 1)
    assert 0 < reply.ttft_ms <= reply.total_ms


@pytest.mark.parametrize("bench", [server_load, cache_probe])
def test_a_flag_of_the_server_it_starts_is_refused_with_url(bench, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--url", "http://192.0.2.1:8000", "--model", "gpt2"])
    assert exit_.value.code == 2 and "--served-model" in capsys.readouterr().err
