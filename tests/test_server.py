"""The server's spec. Every test talks to a real server on a real port (werkzeug's, on
127.0.0.1, port picked by the OS) around a real Engine over conftest's tiny random model:
curl-style requests, the official openai client, bad input, concurrent clients, tenants.
Every test ends with the pool whole: no request holds a block, every ref count is 0.
"""

import concurrent.futures
import contextlib
import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import assert_pool_whole
from prefix_caching import Engine
from server import create_app, serve_in_background

MODEL = "tiny-llama"
SYSTEM = "You are a patient teacher. Answer every question in one short sentence. "
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a KV cache?"}]


@contextlib.contextmanager
def serve(app):
    """Run `app` on a free port of 127.0.0.1 in a daemon thread; yields its base URL."""
    url, server = serve_in_background(app)
    try:
        yield url
    finally:
        server.shutdown()


def call(url: str, path: str, body=None, *, method=None, headers=None) -> tuple[int, dict]:
    """What `curl -s url/path -d body` does: (status, parsed JSON reply). body: dict or bytes."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def wait_until_idle(engine: Engine, timeout: float = 20.0) -> None:
    """A stream the client abandoned is freed by the server thread moments later."""
    deadline = time.monotonic() + timeout
    while engine.allocator.block_tables and time.monotonic() < deadline:
        time.sleep(0.02)
    assert_pool_whole(engine)


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    """One engine for the module: block size 4 so blocks fill fast, 64 blocks (256 tokens)."""
    return Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=64)


@pytest.fixture(scope="module")
def url(engine):
    with serve(create_app(engine, model_name=MODEL, max_tokens_limit=300)) as base_url:
        yield base_url


@pytest.fixture(autouse=True)
def fresh_pool(request):
    """Each test starts with an empty cache and must leave every block free."""
    if "engine" not in request.fixturenames:
        yield
        return
    engine = request.getfixturevalue("engine")
    assert engine.allocator.reset_prefix_cache()
    yield
    wait_until_idle(engine)


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)


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
    assert (health["requests"], health["queried_tokens"], health["hit_tokens"]) == (
        2, stats.queried_tokens, stats.hit_tokens)
    assert health["hit_rate"] == round(stats.hit_rate, 4) > 0
    assert health["evictions"] == 0


def test_cache_shows_a_running_request_and_reset_waits_for_it(engine, url):
    call(url, "/generate", {"prompt": SYSTEM, "max_tokens": 2})
    held = engine.stream(SYSTEM + "Go on.", max_tokens=8, request_id="held-by-the-test")
    next(held)  # prefilled: it holds its blocks until it is closed
    status, snap = call(url, "/cache")
    assert status == 200
    table = snap["block_tables"]["held-by-the-test"]
    assert snap["running_requests"] == 1 and table == engine.allocator.block_tables["held-by-the-test"]
    assert all(snap["blocks"][b]["ref_cnt"] == 1 for b in table)
    assert snap["blocks"][table[0]]["block_hash"] is not None  # a hit on the first request's blocks
    assert len(snap["free_queue"]) == snap["num_free_blocks"] == 64 - len(table)
    status, refused = call(url, "/reset_prefix_cache", method="POST")
    assert status == 409 and "1 running requests" in refused["error"]["message"]
    held.close()

    wait_until_idle(engine)
    status, snap = call(url, "/cache")
    cached = [b for b in snap["blocks"] if b["block_hash"]]
    assert snap["block_tables"] == {} and sorted(snap["free_queue"]) == list(range(64))
    assert len(cached) == snap["num_cached_blocks"] > 0
    first_block = engine.allocator.blocks[cached[0]["block_id"]]
    assert cached[0]["text"] == engine.tokenizer.decode(first_block.token_ids)
    assert cached[0]["block_hash"] == first_block.block_hash.hex()[:8]


def test_reset_prefix_cache_forgets_every_block(engine, url):
    call(url, "/generate", {"prompt": SYSTEM, "max_tokens": 2})
    status, health = call(url, "/reset_prefix_cache", method="POST")
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
    assert warm.choices[0].message.content == cold.choices[0].message.content == engine.generate(CHAT, 8).text

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
    assert plain.object == "text_completion" and plain.choices[0].text == engine.generate(prompt, 6).text
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
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2])
    assert json.loads(events[-3].removeprefix("data: "))["usage"]["completion_tokens"] == 3


# --- bad input: a 4xx JSON error that says what was wrong, never a crash, never a leak ---------------

LONG_PROMPT = "block " * 270  # more tokens than the pool's 256 slots, fewer than the model's 512

BAD_REQUESTS = [
    # (route, body, status, words the message must contain)
    ("/generate", b"{not json", 400, "not valid JSON"),
    ("/generate", b"", 400, "body is empty"),
    ("/generate", b"[1, 2]", 400, "JSON object"),
    ("/generate", b'{"prompt": "Hi", "temperature": NaN}', 400, "NaN"),
    ("/generate", b"\xff\xfe{", 400, "not valid JSON"),
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
    ("/generate", {"prompt": "Hi", "top_p": 2}, 400, "top_p"),
    ("/generate", {"prompt": "Hi", "seed": "x"}, 400, "seed must be None or an int"),
    ("/generate", {"prompt": "Hi", "seed": 1.5}, 400, "seed must be None or an int"),
    ("/generate", {"prompt": "Hi", "seed": 2**70}, 400, "seed must be None or an int in [0, 2**63)"),
    ("/generate", b'{"prompt": "Hi", "temperature": 1e400}', 400, "temperature must be a finite number"),
    ("/generate", {"prompt": "Hi", "cache_salt": 7}, 400, "cache_salt must be a non-empty string"),
    ("/generate", {"prompt": "Hi", "stream": True}, 400, "does not stream"),
    ("/generate", {"prompt": LONG_PROMPT, "max_tokens": 4}, 400, "whole KV pool has 256"),
    ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, 400, "stream must be true or false"),
    ("/v1/completions", {"prompt": "Hi", "stream": True, "stream_options": 1}, 400, "stream_options"),
    ("/v1/completions", {"messages": CHAT}, 400, 'takes prompt, not "messages"'),
    ("/v1/chat/completions", {"prompt": "Hi"}, 400, 'takes messages, not "prompt"'),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4o"}, 404, "not served here"),
]


@pytest.mark.parametrize("route, body, status, words", BAD_REQUESTS, ids=[f"{r[0]} {r[3]}" for r in BAD_REQUESTS])
def test_bad_input_gets_a_4xx_json_error_that_says_why(engine, url, route, body, status, words):
    got, reply = call(url, route, body)
    assert got == status
    assert reply["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert words in reply["error"]["message"]


def test_oversized_body_is_413(url):
    got, reply = call(url, "/generate", json.dumps({"prompt": "x" * (1 << 20)}).encode())
    assert got == 413 and "limit of 1,048,576 bytes" in reply["error"]["message"]


def test_unknown_route_is_404_and_wrong_method_is_405(url):
    got, reply = call(url, "/generat", {"prompt": "Hi"})
    assert got == 404 and "no route /generat" in reply["error"]["message"]
    got, reply = call(url, "/generate")
    assert got == 405 and "use POST" in reply["error"]["message"]
    got, reply = call(url, "/health", method="DELETE")
    assert got == 405 and reply["error"]["message"].startswith("/health does not take DELETE")


def test_a_full_pool_is_503_before_and_during_a_reply(tiny_model, tokenizer):
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=8)
    with serve(create_app(engine, model_name=MODEL)) as url:
        held = engine.stream(list(range(100, 124)), max_tokens=4)  # 24 tokens: 6 of the 8 blocks
        next(held)
        got, reply = call(url, "/generate", {"prompt": list(range(200, 212)), "max_tokens": 2})  # needs 3
        assert got == 503 and "KV pool is full" in reply["error"]["message"]
        assert reply["error"]["type"] == "service_unavailable_error"

        # 4 prompt tokens fit in 1 block and the reply gets the last free block, then finds none.
        body = {"prompt": list(range(300, 304)), "max_tokens": 12, "temperature": 0}
        got, reply = call(url, "/generate", body)
        assert got == 503 and "filled up during the reply" in reply["error"]["message"]
        with pytest.raises(openai.APIError, match="filled up during the reply"):
            list(client(url).completions.create(model=MODEL, stream=True, **body))
        held.close()
        wait_until_idle(engine)
        got, reply = call(url, "/generate", body)
        assert got == 200 and reply["completion_tokens"] == 12


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
        deadline = time.monotonic() + 20
        while call(url, "/health")[1]["blocks_in_use"] and time.monotonic() < deadline:
            time.sleep(0.05)
    assert call(url, "/health")[1]["blocks_in_use"] == 0
    assert any("the client left after" in r.getMessage() for r in caplog.records)


# --- many clients at once ------------------------------------------------------------------------


def test_concurrent_clients_get_the_answers_they_get_alone(engine, url):
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(16)]
    alone = {q: engine.generate(SYSTEM + q, max_tokens=10).text for q in questions}
    assert engine.allocator.reset_prefix_cache()

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


# --- tenants: cache_salt, and a salt derived from the API key --------------------------------------


def test_cache_salt_keeps_tenants_apart(engine, url):
    def cached(salt):
        body = {"prompt": SYSTEM, "max_tokens": 2} | ({"cache_salt": salt} if salt else {})
        return call(url, "/generate", body)[1]["cached_tokens"]

    full_hit = (len(engine.tokenize(SYSTEM)) - 1) // 4 * 4
    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same prompt, other salt: a miss
    assert cached(None) == 0  # no salt is a tenant of its own
    assert cached("tenant-a") == full_hit


def test_salt_by_api_key_isolates_keys_and_refuses_client_salts(engine):
    with serve(create_app(engine, model_name=MODEL, salt_by_api_key=True)) as url:
        model = MODEL

        def cached_tokens(api_key: str) -> int:
            reply = client(url, api_key).chat.completions.create(model=model, messages=CHAT, max_tokens=2)
            return reply.usage.prompt_tokens_details.cached_tokens

        full_hit = (len(engine.tokenize(CHAT)) - 1) // 4 * 4
        assert cached_tokens("alice-key") == 0
        assert cached_tokens("bob-key") == 0  # bob cannot time alice's prompt: it is never a hit for him
        assert cached_tokens("alice-key") == full_hit

        with pytest.raises(openai.BadRequestError, match="derives cache_salt from your API key"):
            client(url, "bob-key").chat.completions.create(model=model, messages=CHAT,
                                                           extra_body={"cache_salt": "alice"})
        got, reply = call(url, "/generate", {"prompt": "Hi"})  # no Authorization header
        assert got == 401 and reply["error"]["type"] == "authentication_error"
        snap = call(url, "/cache")[1]
        assert snap["num_cached_blocks"] > 0 and all(b["text"] is None for b in snap["blocks"])


# --- the real thing: python server.py with the default model --------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_python_server_py_serves_the_default_model():
    port = free_port()
    command = [sys.executable, "server.py", "--port", str(port), "--num-blocks", "64"]
    root = Path(__file__).resolve().parent.parent
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
        status, reply = call(url, "/generate", {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4})
        assert status == 200 and reply["completion_tokens"] >= 1 and reply["text"]
        status, health = call(url, "/health")
        assert health["blocks_in_use"] == 0 and health["requests"] == 1
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0]
    assert f"serving SmolLM2-135M-Instruct on {url}" in output
    assert f"/generate: prompt {reply['prompt_tokens']} tokens, cached 0" in output


@pytest.mark.parametrize("flags, words", [
    (["--max-tokens-limit", "0"], "--max-tokens-limit must be at least 1"),
    (["--num-blocks", "10", "--kv-memory-gb", "1"], "not allowed with argument"),
])
def test_python_server_py_refuses_bad_flags_before_loading_anything(flags, words, capsys):
    import server

    with pytest.raises(SystemExit) as exit_info:
        server.main(flags)
    assert exit_info.value.code == 2 and words in capsys.readouterr().err
