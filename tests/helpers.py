"""Helpers the test files share: the oracle (plain Hugging Face generate), a token counter,
the rule every engine test ends with (the pool whole), and a real server on a real port with
the curl-style calls the HTTP tests make. Fixtures are in the conftest.py files.

The analyzer's tests import the HTTP helpers without a model, so torch, openai and the server
are imported by the functions that need them, not here. The waits below guard against a hang,
not a slow machine: each is tens of times what it takes on a quiet one, and stretched by the
load (machine.py); a wait that runs out says the load it met."""

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler

import machine

MODEL = "tiny-llama"
SYSTEM = "You are a patient teacher. Answer every question in one short sentence. "
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a KV cache?"}]


# --- what an engine leaves behind -------------------------------------------------


class EmbeddingCounter:
    """Counts the tokens the model embeds: the tokens it actually computes."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.get_input_embeddings().register_forward_hook(self.hook)

    def hook(self, module, args, output):
        self.count += args[0].numel()


def assert_pool_whole(engine) -> None:
    """No request holds a block: every block free, every ref count 0, the allocator consistent."""
    alloc = engine.allocator
    assert alloc.block_tables == {}, f"requests still hold blocks: {alloc.block_tables}"
    assert alloc.num_free_blocks == alloc.num_blocks
    assert all(alloc.ref_count(b) == 0 for b in range(alloc.num_blocks))
    alloc.check_invariants()


# The default step budget on a held calibration (step_budget.HeldCosts): a fast machine's
# fixed cost a step and cost per flop, and attention as counted, so an engine of the tiny model
# plans with the policy users get, and the same on every machine. tests/engine/test_step_budget.py
# tests the learning and the timing.
TEST_COSTS = {"fixed_s": 1e-3, "per_flop": 1e-12}


def calibrated(engine):
    """`engine` with its step budget's costs held at TEST_COSTS and its attention counted (an
    engine given a fixed max_num_batched_tokens has no step budget: it is returned as it is)."""
    from engine.step_budget import HeldCosts

    if engine.step_budget is not None:
        engine.step_budget.costs = HeldCosts(**TEST_COSTS)
        engine.step_budget.attention = engine.step_budget.shape.attention
    return engine


def wait_until_idle(engine, timeout: float = 30.0) -> None:
    """Every request finished or cancelled, every block back. A client that left is noticed
    by its server thread, and its request freed by the engine loop before its next step,
    moments later."""
    deadline = time.monotonic() + machine.scaled(timeout)
    while (engine.allocator.block_tables or engine.loop.live) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.loop.live == {}
    assert_pool_whole(engine)


# --- a real server, and what a client sends it ------------------------------------------------------


@contextlib.contextmanager
def serve(app, **limits):
    """Run `app` on a free port of 127.0.0.1 in a thread; yields its base URL. limits: the
    connection limits of server.ClassServer."""
    from server import serve_in_background

    url, server = serve_in_background(app, **limits)
    try:
        yield url
    finally:
        server.shutdown()


def call(url: str, path: str, body=None, *, method=None, headers=None, timeout=60) -> tuple[int, dict]:
    """What `curl -s url/path -H 'Content-Type: application/json' -d body` does: (status, parsed
    JSON reply). body: dict or bytes; a body is sent as JSON unless headers say otherwise."""
    status, reply, _ = call_with_headers(url, path, body, method=method, headers=headers, timeout=timeout)
    return status, reply


def call_with_headers(url: str, path: str, body=None, *, method=None, headers=None,
                      timeout=60) -> tuple[int, dict, dict]:
    """call(), and the reply's headers too."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = ({"Content-Type": "application/json"} if data is not None else {}) | (headers or {})
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def ask(url: str, method: str = "GET", body=None, key: str | None = None, headers: dict | None = None):
    """(status, body text, headers) of one request; a refusal is an answer too."""
    data = None if body is None else json.dumps(body).encode()
    sent = {"Content-Type": "application/json"} if data is not None else {}
    sent |= ({"Authorization": f"Bearer {key}"} if key else {}) | (headers or {})
    request = urllib.request.Request(url, data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), err.headers


def raw_request(url: str, head: list[str], body: bytes = b"") -> socket.socket:
    """Send a request byte for byte (the request line and headers in `head`), as no polite
    client would: a chunked body, a control character in the path, a hang-up. Returns the
    open socket."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + body)
    return sock


def wait_for_log(caplog, words: str, timeout: float = 20.0) -> str:
    """The first log message holding `words`; a server thread may write it a moment later."""
    limit = machine.scaled(timeout)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        found = [r.getMessage() for r in caplog.records if words in r.getMessage()]
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no log line with {words!r} in {limit:.0f} s ({machine.load_note()})")


def client(url: str, api_key: str = "unused"):
    """An OpenAI client of the server at `url`, which never retries."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)


@contextlib.contextmanager
def paused(engine, timeout: float = 30.0):
    """The batching engine's loop held inside its next forward pass until the block ends, so a
    running request's blocks stay as they are while a test reads them (the allocator is
    read under engine.allocator_lock, which a step never holds across the model)."""
    inside, release = threading.Event(), threading.Event()

    def wait(module, args):
        inside.set()
        release.wait(timeout)

    hook = engine.model.register_forward_pre_hook(wait)
    try:
        assert inside.wait(timeout), "the engine loop ran no step: is a request running?"
        yield
    finally:
        hook.remove()
        release.set()


@contextlib.contextmanager
def held_in_step(engine, step: int = 1):
    """The `step`-th forward pass from now waits inside the model until release.set() or the
    block ends; yields (inside, release): inside is set once it waits there."""
    inside, release, passes = threading.Event(), threading.Event(), []

    def pause(module, args):
        passes.append(1)
        if len(passes) == step:
            inside.set()
            release.wait(60)

    hook = engine.model.register_forward_pre_hook(pause)
    try:
        yield inside, release
    finally:
        release.set()
        hook.remove()


@contextlib.contextmanager
def queued_together(engine):
    """Requests sent inside the block wait in the queue, and the next step admits them all at
    once: until the block ends, the loop is held inside the step of an opener request (one
    token, so it is gone by then)."""
    opener = threading.Thread(target=engine.generate, args=([1, 2, 3],), kwargs={"max_tokens": 1})
    with held_in_step(engine) as (inside, _):
        opener.start()
        assert inside.wait(30)
        yield
    opener.join(60)


def connect_from(url: str, address: str, timeout: float = 30) -> socket.socket:
    """A connection to the server at `url` from the local `address` (on Linux every
    127.x.y.z is this machine: a second client address without a second machine)."""
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout, source_address=(address, 0))


def until(ready, timeout: float = 30.0, what: str = "the condition"):
    """Poll ready() until it returns something true; that value."""
    limit = machine.scaled(timeout)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"{what} did not hold within {limit:.0f} s ({machine.load_note()})")


class StubWorker(BaseHTTPRequestHandler):
    """A worker for SGLang's router without a model: it answers the router's probes (the
    model's name on /server_info, "ok" elsewhere); subclasses answer POSTs with reply()."""

    model_name = MODEL

    def log_message(self, *args):
        pass

    def reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({"served_model_name": self.model_name} if self.path == "/server_info" else {"status": "ok"})


def random_prompts(rng, count: tuple[int, int], own: int, shared: list[int]) -> list[list[int]]:
    """count[0] to count[1] prompts of 1 to `own` random token ids, about half of them behind
    the first 4 or more tokens of `shared` (the padded steps' tests: hits beside misses)."""
    prompts = []
    for _ in range(rng.randint(*count)):
        ids = [rng.randrange(100, 2000) for _ in range(rng.randint(1, own))]
        prompts.append(shared[: rng.randint(4, len(shared))] + ids if rng.random() < 0.5 else ids)
    return prompts
