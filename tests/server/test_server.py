"""The server's spec. Every test talks to a real server on a real port (werkzeug's, on
127.0.0.1, port picked by the OS) around a real Engine over conftest's tiny random model:
curl-style requests, the official openai client, bad input, clients that leave, concurrent
clients, on the server's engine (conftest's engine and url fixtures). What only batching
shows (the queue, preemption, shared steps) is in test_server_batching.py; tenants, keys and
the network rules in test_server_security.py; how a request body is read, without HTTP, in
test_server_requests.py.
Every test ends with the pool whole: no request holds a block, every ref count is 0.
"""

import concurrent.futures
import http.client
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from benchmarks.served_clients import free_port
from helpers import (CHAT, MODEL, SYSTEM, EmbeddingCounter, call, client, queued_together, raw_request, until,
                     wait_for_log, wait_until_idle)
from server import create_app, serve_in_background


def test_shutdown_waits_for_the_serving_thread(engine):
    # The serving thread drops the last reference to the app (and the engine's tensors) as it
    # ends; if that happened while the interpreter shut down, the process would abort.
    before = set(threading.enumerate())
    url, server = serve_in_background(create_app(engine, cache_page_every_s=0))
    serving = [t for t in threading.enumerate() if t not in before and t.name.endswith("(serve_forever)")]
    assert len(serving) == 1 and call(url, "/health")[0] == 200
    server.shutdown()
    assert not serving[0].is_alive()


# --- /generate, /health, /cache, /reset_prefix_cache: what the lessons curl ---------------------


def test_generate_answers_and_a_shared_prefix_hits(engine, url):
    first_prompt, second_prompt = SYSTEM + "What is a block?", SYSTEM + "What is a hash?"
    status, first = call(url, "/generate", {"prompt": first_prompt, "max_tokens": 8})
    assert status == 200
    assert list(first) == ["text", "prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason",
                           "ttft_ms", "total_ms"]
    assert first["prompt_tokens"] == len(engine.tokenize(first_prompt))
    assert first["cached_tokens"] == 0
    assert first["completion_tokens"] == 8 and first["finish_reason"] == "length"

    expected_hit = engine.allocator.peek(engine.tokenize(second_prompt))
    assert expected_hit >= 12  # the shared system prompt spans several blocks of 4
    status, second = call(url, "/generate", {"prompt": second_prompt, "max_tokens": 8})
    assert second["cached_tokens"] == expected_hit
    assert second["text"] == engine.generate(second_prompt, max_tokens=8).text  # the same greedy reply


def test_generate_takes_chat_messages(engine, url):
    status, reply = call(url, "/generate", {"messages": CHAT, "max_tokens": 4})
    assert status == 200
    assert reply["prompt_tokens"] == len(engine.tokenize(CHAT))


def test_health_reports_the_cache_figures(engine, url):
    call(url, "/generate", {"prompt": SYSTEM, "max_tokens": 2})
    call(url, "/generate", {"prompt": SYSTEM, "max_tokens": 2})
    status, health = call(url, "/health")
    assert status == 200
    stats = engine.allocator.stats
    assert health["status"] == "ok" and health["model"] == MODEL
    assert health["num_blocks"] == 64 and health["block_size"] == 4
    assert health["num_free_blocks"] == 64 and health["blocks_in_use"] == 0 and health["running_requests"] == 0
    assert health["num_cached_blocks"] == engine.allocator.num_cached_blocks > 0
    assert health["counted"] == "all requests"  # no keys: the allocator's own counters
    assert (health["requests"], health["queried_tokens"], health["hit_tokens"]) == (
        2, stats.queried_tokens, stats.hit_tokens)
    assert health["hit_rate"] == round(stats.hit_rate, 4) > 0
    assert health["evictions"] == 0
    assert health["cuda_graphs"] is None  # a CPU runs no graph


def test_cache_shows_a_running_request_and_reset_waits_for_it(engine, url):
    call(url, "/generate", {"prompt": SYSTEM, "max_tokens": 2})
    held = engine.stream(SYSTEM + "Go on.", max_tokens=150, request_id="held-by-the-test")
    next(held)  # prefilled: it holds its blocks until it is closed (the engine loop goes on decoding it)
    status, snap = call(url, "/cache")
    assert status == 200
    table = snap["block_tables"]["held-by-the-test"]
    live = engine.allocator.block_tables["held-by-the-test"]
    assert snap["running_requests"] == 1 and table == live[: len(table)]  # it may have grown since
    assert all(snap["blocks"][b]["ref_cnt"] == 1 and snap["blocks"][b]["state"] == "in_use" for b in table)
    assert snap["blocks"][table[0]]["block_hash"] is not None  # a hit on the first request's blocks
    assert len(snap["free_queue"]) == snap["num_free_blocks"] == 64 - len(table)
    status, refused = call(url, "/reset_prefix_cache", {})
    assert status == 409 and "1 running requests" in refused["error"]["message"]
    held.close()

    wait_until_idle(engine)
    status, snap = call(url, "/cache")
    cached = [b for b in snap["blocks"] if b["state"] == "cached"]
    assert snap["block_tables"] == {} and sorted(snap["free_queue"]) == list(range(64))
    assert len(cached) == snap["num_cached_blocks"] > 0 and not any(b["opaque"] for b in snap["blocks"])
    first_block = engine.allocator.blocks[cached[0]["block_id"]]
    assert cached[0]["text"] == engine.tokenizer.decode(first_block.token_ids)
    assert cached[0]["block_hash"] == first_block.block_hash.hex()[:8]


def test_reset_prefix_cache_forgets_every_block(engine, url):
    call(url, "/generate", {"prompt": SYSTEM, "max_tokens": 2})
    status, health = call(url, "/reset_prefix_cache", {})
    assert status == 200 and health["num_cached_blocks"] == 0
    status, again = call(url, "/generate", {"prompt": SYSTEM, "max_tokens": 2})
    assert again["cached_tokens"] == 0


def test_one_log_line_per_request(engine, url, caplog):
    with caplog.at_level(logging.INFO, logger="server"):
        status, reply = call(url, "/generate", {"prompt": SYSTEM, "max_tokens": 3})
    line = f"/generate: prompt {reply['prompt_tokens']} tokens, cached 0, completion 3, TTFT "
    assert [r.getMessage() for r in caplog.records if line in r.getMessage()]


# --- the OpenAI-compatible routes, through the official client ------------------------------------


def test_openai_client_lists_the_model(engine, url):
    assert [m.id for m in client(url).models.list()] == [MODEL]


def test_openai_chat_plain_and_streaming(engine, url):
    oa, model = client(url), MODEL
    cold = oa.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    warm = oa.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=8, temperature=0)
    prompt_tokens = len(engine.tokenize(CHAT))
    assert cold.object == "chat.completion" and cold.choices[0].finish_reason == "length"
    assert cold.choices[0].message.role == "assistant"
    assert cold.usage.prompt_tokens == prompt_tokens and cold.usage.completion_tokens == 8
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 4 * 4
    assert warm.choices[0].message.content == cold.choices[0].message.content == engine.generate(CHAT, max_tokens=8).text

    chunks = list(oa.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == cold.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 4 * 4


def test_openai_completions_plain_and_streaming(engine, url):
    oa, model, prompt = client(url), MODEL, SYSTEM + "Why?"
    plain = oa.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert plain.object == "text_completion" and plain.choices[0].text == engine.generate(prompt, max_tokens=6).text
    chunks = list(oa.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None  # no include_usage


def test_openai_client_sees_our_errors(engine, url):
    oa = client(url)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        oa.chat.completions.create(model="gpt-4o", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="limit of 300"):
        oa.completions.create(model=MODEL, prompt="Hi", max_tokens=301)


def test_the_raw_stream_is_server_sent_events(url):
    body = {"prompt": SYSTEM, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2])
    assert json.loads(events[-3].removeprefix("data: "))["usage"]["completion_tokens"] == 3


# --- stop strings, and OpenAI fields this server does not implement ---------------------------------


def test_stop_ends_the_reply_before_the_stop_string(engine, url):
    prompt = SYSTEM + "Why?"
    full = engine.generate(prompt, max_tokens=12).text
    stop = full[len(full) // 2 :][:3]  # three characters from the second half of the greedy reply
    expected = full[: full.find(stop)]
    status, reply = call(url, "/generate", {"prompt": prompt, "max_tokens": 12, "stop": stop})
    assert status == 200 and reply["finish_reason"] == "stop"
    assert reply["text"] == expected and reply["completion_tokens"] < 12

    oa = client(url)
    plain = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=["\x00x", stop])
    assert plain.choices[0].text == expected and plain.choices[0].finish_reason == "stop"
    chunks = list(oa.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                        stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected  # the stop text is never sent, not even in part
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_fields_this_server_does_not_implement_are_refused_by_name(engine, url):
    oa = client(url)
    with pytest.raises(openai.BadRequestError, match="does not implement 'n'"):
        oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="does not implement 'logprobs'"):
        oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True)
    with pytest.raises(openai.BadRequestError, match="does not take the field 'temprature'"):
        oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={"temprature": 0})
    reply = oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=1, logprobs=False, user="s7")
    assert reply.usage.completion_tokens == 2  # at their no-op values they are welcome
    status, reply = call(url, "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": None, "max_tokens": 3})
    assert status == 200 and reply["usage"]["completion_tokens"] == 3  # a null does not hide the other


# --- bad input: a 4xx JSON error that says what was wrong, never a crash, never a leak ---------------

LONG_PROMPT = "block " * 270  # more tokens than the pool's 256 slots, fewer than the model's 512

BAD_REQUESTS = [
    # (route, body, status, words the message must contain)
    ("/generate", b"{not json", 400, "not valid JSON"),
    ("/generate", b"", 400, "body is empty"),
    ("/generate", b"[1, 2]", 400, "JSON object"),
    ("/generate", b'{"prompt": "Hi", "temperature": NaN}', 400, "NaN"),
    ("/generate", b"\xff\xfe{", 400, "not valid JSON"),
    ("/generate", b"[" * 100_000 + b"]" * 100_000, 400, "nests arrays or objects too deeply"),
    ("/generate", b'{"prompt": "Hi \\ud800"}', 400, "prompt holds '\\ud800', a lone surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages[0].content"),
    ("/generate", {}, 400, "no prompt"),
    ("/generate", {"prompt": ""}, 400, "prompt is empty"),
    ("/generate", {"prompt": 42}, 400, "prompt must be"),
    ("/generate", {"prompt": ["a", "b"]}, 400, "token ids"),
    ("/generate", {"prompt": "Hi", "messages": CHAT}, 400, "not both"),
    ("/generate", {"messages": "Hi"}, 400, "messages must be a non-empty list"),
    ("/generate", {"messages": []}, 400, "messages must be a non-empty list"),
    ("/generate", {"messages": [{"role": "user"}]}, 400, '"content": str'),
    ("/generate", {"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens must be an int"),
    ("/generate", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens must be an int >= 1"),
    ("/generate", {"prompt": "Hi", "max_tokens": 2.5}, 400, "max_tokens must be an int"),
    ("/generate", {"prompt": "Hi", "max_tokens": 301}, 400, "limit of 300"),
    ("/generate", {"prompt": "Hi", "temperature": -1}, 400, "temperature must be a finite number >= 0"),
    ("/generate", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    ("/generate", {"prompt": "Hi", "temperature": 10**400}, 400, "temperature"),  # no float holds it
    ("/generate", {"prompt": "Hi", "top_p": 2}, 400, "top_p"),
    ("/generate", {"prompt": "Hi", "seed": "x"}, 400, "seed must be None or an int"),
    ("/generate", {"prompt": "Hi", "seed": 1.5}, 400, "seed must be None or an int"),
    ("/generate", {"prompt": "Hi", "seed": 2**70}, 400, "seed must be None or an int in [0, 2**63)"),
    ("/generate", b'{"prompt": "Hi", "temperature": 1e400}', 400, "temperature must be a finite number"),
    ("/generate", {"prompt": "Hi", "cache_salt": 7}, 400, "cache_salt must be a str"),
    ("/generate", {"prompt": "Hi", "cache_salt": "a/b"}, 400, "cache_salt must not contain '/'"),
    ("/generate", {"prompt": "Hi", "stop": 123}, 400, "stop must be a non-empty string or a list"),
    ("/generate", {"prompt": "Hi", "max_token": 5}, 400, "does not take the field 'max_token'"),
    ("/generate", {"prompt": "Hi", "stream": True}, 400, "does not stream"),
    ("/generate", {"prompt": LONG_PROMPT, "max_tokens": 4}, 400, "whole KV pool has 256"),
    ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, 400, "stream must be true or false"),
    ("/v1/completions", {"prompt": "Hi", "stream": True, "stream_options": 1}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "Hi", "echo": True}, 400, "does not implement 'echo'"),
    ("/v1/completions", {"messages": CHAT}, 400, 'takes prompt, not "messages"'),
    ("/v1/chat/completions", {"prompt": "Hi"}, 400, 'takes messages, not "prompt"'),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5, "max_tokens": 600}, 400, "disagree"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4o"}, 404, "not served here"),
]


@pytest.mark.parametrize("route, body, status, words", BAD_REQUESTS, ids=[f"{r[0]} {r[3]}" for r in BAD_REQUESTS])
def test_bad_input_gets_a_4xx_json_error_that_says_why(engine, url, route, body, status, words):
    got, reply = call(url, route, body)
    assert got == status
    assert reply["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert words in reply["error"]["message"]
    assert engine.allocator.stats.requests == 0  # refused before any block was taken or any prefill ran


def test_a_huge_integer_temperature_is_a_number_not_a_500(engine, url):
    status, reply = call(url, "/generate", {"prompt": "Hi", "temperature": 2**64, "max_tokens": 2})
    assert status == 200 and reply["completion_tokens"] == 2  # a float of 1.8e19: sampling all but uniform


def test_oversized_body_is_413_with_or_without_a_length(url):
    # The limit is what --max-prompt-tokens (4,096) could ever accept: 81 bytes of text a token
    # (SmolLM2's tokenizer), 6 bytes of JSON a byte of text, 48 a message, 64 KiB for the rest.
    got, reply = call(url, "/generate", json.dumps({"prompt": "x" * (3 << 20)}).encode())
    assert got == 413 and "over this server's limit of 2,252,800 (what --max-prompt-tokens" in reply["error"]["message"]

    def chunked(body: bytes) -> bytes:
        """POST /generate with Transfer-Encoding: chunked (no length: the server must count);
        the reply's head. (A body refused part-read is discarded until the request's deadline,
        --read-timeout after it connected, so the connection's end would come 10 s later.)"""
        head = ["POST /generate HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
                "Transfer-Encoding: chunked", "Connection: close"]
        with raw_request(url, head, b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)) as sock:
            reply = b""
            while b"\r\n\r\n" not in reply and (data := sock.recv(65536)):
                reply += data
            return reply

    over = json.dumps({"prompt": "x" * (3 << 20), "max_tokens": 2}).encode()
    assert chunked(over).startswith(b"HTTP/1.1 413")  # not cut at the limit and served
    assert chunked(json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()).startswith(b"HTTP/1.1 200")


def test_unknown_route_is_404_and_wrong_method_is_405(url):
    got, reply = call(url, "/generat", {"prompt": "Hi"})
    assert got == 404 and "no route /generat" in reply["error"]["message"]
    got, reply = call(url, "/generate")
    assert got == 405 and "use POST" in reply["error"]["message"]
    got, reply = call(url, "/health", method="DELETE")
    assert got == 405 and reply["error"]["message"].startswith("/health does not take DELETE")


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(engine, url, caplog):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"prompt": "Tell me a long story.", "max_tokens": 240, "stream": True}
    with caplog.at_level(logging.INFO, logger="server"):
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: {")
        response.close()  # hang up after the first event, ~240 tokens before the end
        conn.close()
        wait_for_log(caplog, "the client left after")
    wait_until_idle(engine)


def test_a_client_that_hangs_up_before_its_reply_costs_nothing(engine, url, caplog):
    """The request waits in the queue (the loop held inside an opener's step) while its client
    hangs up, so the loop's check before its prefill always comes after the hang-up."""
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 240}).encode()
    head = ["POST /generate HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(body)}"]
    counter = EmbeddingCounter(engine.model)  # the opener's 3 tokens, and nothing else
    try:
        with caplog.at_level(logging.INFO, logger="server"):
            with queued_together(engine):
                sock = raw_request(url, head, body)
                until(lambda: len(engine.snapshot().waiting) == 1, what="the request in the queue")
                sock.close()  # a script killed by Ctrl+C, a closed notebook
            line = wait_for_log(caplog, "POST /generate -> 400")
    finally:
        counter.handle.remove()
    wait_until_idle(engine)
    assert counter.count == 3  # the opener's prompt: the engine loop saw the hang-up before the prefill
    assert "the connection's end of stream came before the reply" in line


def test_health_and_cache_answer_while_a_prefill_runs(engine, url):
    inside, release = threading.Event(), threading.Event()

    def pause(module, args):  # the model's forward pass waits here, holding engine.lock
        inside.set()
        release.wait(60)

    hook = engine.model.register_forward_pre_hook(pause)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(call, url, "/generate", {"prompt": SYSTEM, "max_tokens": 2})
            assert inside.wait(30)
            hook.remove()  # the paused pass stays paused; later ones run freely
            status, health = call(url, "/health", timeout=10)  # would wait for the whole forward pass
            assert status == 200 and health["running_requests"] == 1 and health["blocks_in_use"] > 0
            status, snap = call(url, "/cache", timeout=10)
            assert status == 200 and len(snap["block_tables"]) == 1
            release.set()
            assert reply.result()[0] == 200
    finally:
        release.set()
        hook.remove()


# --- many clients at once ------------------------------------------------------------------------


def test_concurrent_clients_get_the_answers_they_get_alone(engine, url):
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(16)]
    alone = {q: engine.generate(SYSTEM + q, max_tokens=10).text for q in questions}
    assert engine.reset_prefix_cache()

    def ask(i: int) -> tuple[str, str]:
        question = questions[i]
        if i % 2:  # half of them stream through the openai client
            stream = client(url).completions.create(model=MODEL, prompt=SYSTEM + question,
                                                     max_tokens=10, temperature=0, stream=True)
            return question, "".join(chunk.choices[0].text for chunk in stream)
        status, reply = call(url, "/generate", {"prompt": SYSTEM + question, "max_tokens": 10})
        assert status == 200
        return question, reply["text"]

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        together = dict(pool.map(ask, range(len(questions))))
    assert together == alone
    assert engine.allocator.stats.hit_tokens > 0  # they shared the system prompt's blocks


# --- the real thing: python server.py with the default model --------------------------------------


def test_a_taken_port_is_said_before_the_model_loads(capsys):
    """server.py's main (what `python server.py` runs) on a port another program listens on: a
    clear error and status 2 at once, before any model is looked for (the one named here does
    not exist, and nothing says "loading")."""
    import socket

    import server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            server.main(["--port", str(port), "--model", "/no/such/model"])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and "loading" not in out + err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "pick another --port" in err


@pytest.mark.server
@pytest.mark.real_model
@pytest.mark.subprocess
def test_python_server_py_serves_the_default_model():
    port = free_port()
    command = [sys.executable, "server.py", "--port", str(port), "--num-blocks", "64"]
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"})
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                status, health = call(url, "/health")
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up in 180 s"
                time.sleep(0.5)
        assert health["model"] == "SmolLM2-135M-Instruct" and health["num_blocks"] == 64
        assert health["waiting_requests"] == 0
        status, reply = call(url, "/generate", {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4})
        assert status == 200 and reply["completion_tokens"] >= 1 and reply["text"]
        status, health = call(url, "/health")
        assert health["blocks_in_use"] == 0 and health["requests"] == 1
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0]
    assert f"serving SmolLM2-135M-Instruct on {url}" in output
    assert "batching: up to 64 requests and as many tokens as fit in 400 ms (at most 2048) a step" in output
    assert f"curl -s {url}/generate -H 'Content-Type: application/json' -d '" in output  # the banner's example works
    assert f"/generate: prompt {reply['prompt_tokens']} tokens, cached 0" in output


@pytest.mark.parametrize("flags, words", [
    (["--max-tokens-limit", "0"], "argument --max-tokens-limit: must be at least 1"),
    (["--num-blocks", "10", "--kv-memory-gb", "1"], "not allowed with argument"),
    (["--port", "70000"], "--port must be in 1..65535, got 70000"),
    (["--port", "0"], "--port must be in 1..65535, got 0"),
    (["--block-size", "0"], "argument --block-size: must be at least 1, got 0"),
    (["--admin-key", " "], "--admin-key is empty"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be at least 1, got 0"),
    (["--no-batching"], "unrecognized arguments: --no-batching"),
    (["--max-num-batched-tokens", "32"], "--max-num-batched-tokens (32) must be at least --max-num-seqs (64)"),
    (["--target-step-ms", "0"], "argument --target-step-ms: must be a number above 0"),
    (["--target-step-ms", "100", "--max-num-batched-tokens", "512"], "not allowed with argument"),
    (["--max-requests-per-key", "0"], "argument --max-requests-per-key: must be at least 1, got 0"),
    (["--forwarded-allow-ips", "10.0.0.5,*"], "--forwarded-allow-ips: '*' would trust every client to name its own"),
    (["--forwarded-allow-ips", "proxy.local"], "--forwarded-allow-ips: 'proxy.local' is not an IP address or network"),
])
def test_python_server_py_refuses_bad_flags_before_loading_anything(flags, words, capsys):
    import server

    with pytest.raises(SystemExit) as exit_info:
        server.main(flags)
    assert exit_info.value.code == 2 and words in capsys.readouterr().err
