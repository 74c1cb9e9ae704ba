"""A course server in a process of its own, and its requests timed as a client sees them: what
the server benchmarks (server_abuse.py, first_prompt.py) share.

    with serving(["--model", "tiny"]) as server:     # python server.py --salt-by-api-key ...
        reply = send(server, "POST", "/v1/chat/completions", body, key="student-1")
    reply.ok, reply.ttft_ms, reply.total_ms, reply.gaps_ms

The server gets an --admin-key, only so that a benchmark can read /health across tenants
(health, wait_until_idle, budget_of).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from serving.requests import DEFAULT_REQUEST_TIMEOUT

ROOT = Path(__file__).resolve().parents[1]
CLASS = "127.0.0.1"  # where the server listens, and the class connects from


# -----------------------------------------------------------------------------
# The server, in a process of its own


@dataclass(frozen=True)
class Server:
    """Where a server started by `serving` listens, and the admin key it was given."""

    host: str
    port: int
    admin_key: str


def free_ports(n: int) -> list[int]:
    """n different ports of 127.0.0.1, free right now (the processes that take them bind them a
    moment later). Held open together while they are picked: two picked one after the other can
    be the same port, since the first is free again when the second is asked for, and then two
    replicas race for it and one exits with "Address already in use"."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind((CLASS, 0))
        return [sock.getsockname()[1] for sock in socks]


def free_port() -> int:
    """A port of 127.0.0.1 free right now."""
    return free_ports(1)[0]


@contextlib.contextmanager
def serving(server_args: list[str]) -> Iterator[Server]:
    """`python server.py --salt-by-api-key` and server_args, until the block ends. Its log
    goes to a temporary file, shown if it exits before it answers."""
    server = Server(CLASS, free_port(), secrets.token_hex(16))
    command = [sys.executable, "server.py", "--host", CLASS, "--port", str(server.port), "--salt-by-api-key",
               "--admin-key", server.admin_key, *server_args]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_up(server, process, log)
            yield server
        finally:
            process.terminate()  # nothing of a benchmark's server is worth a graceful drain
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_until_up(server: Server, process: subprocess.Popen, log, timeout: float = 600) -> None:
    """Poll /health until the server answers (a first load of the default model converts it:
    tens of seconds); a server that exits first ends the benchmark with its last lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the server exited ({process.returncode}):\n" + "".join(log.readlines()[-20:]))
        try:
            health(server)
            return
        except (OSError, http.client.HTTPException):
            time.sleep(0.25)
    raise SystemExit(f"the server did not answer within {timeout:g} s")


def health(server: Server) -> dict:
    """GET /health as the admin sees it: every tenant's requests, and the scheduler's options."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request("GET", "/health", headers={"Authorization": f"Bearer {server.admin_key}"})
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise OSError(f"/health answered {response.status}")
    return json.loads(body)


def wait_until_idle(server: Server, timeout: float = 120) -> None:
    """Until no request runs or waits (or `timeout` s): what a scene cut short (a prefill, a
    stream) is gone before the next scene starts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        figures = health(server)
        if not figures["running_requests"] and not figures.get("waiting_requests"):
            return
        time.sleep(0.2)


def budget_of(figures: dict) -> str:
    """The step budget /health reports, in words: a target step time (the default, unless
    --server-args changes it) or a fixed number of tokens (--fixed-budget)."""
    if figures.get("target_step_ms"):
        return (f"a target step of {figures['target_step_ms']:g} ms (as many tokens as fit in it, at most "
                f"{figures['max_num_batched_tokens']:,})")
    return f"fixed: {figures['max_num_batched_tokens']:,} tokens a step"


# -----------------------------------------------------------------------------
# One request, timed as its client sees it


@dataclass
class Timed:
    """One request as its client saw it, in ms from just before its connection opened."""

    status: int | None  # None: no answer (refused at the door, or cut before a status line)
    ok: bool  # a 200 and the whole reply: for a stream, its [DONE] and no error event
    total_ms: float  # the request time
    ttft_ms: float | None = None  # a stream's first text; None for a reply in one piece
    gaps_ms: list[float] = field(default_factory=list)  # between a stream's texts


def event_text(line: bytes) -> str:
    """The text one line of a stream carries: a chat delta's content or a completion's text;
    '' for the rest (the role, the finish reason, the usage, a blank line).

    >>> event_text(b'data: {"choices": [{"delta": {"content": "Hi"}}]}'), event_text(b'data: [DONE]')
    ('Hi', '')
    """
    if not line.startswith(b"data: {"):
        return ""
    choice = (json.loads(line[6:]).get("choices") or [{}])[0]
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def read_stream(response, texts: list[float], until: float | None) -> bool:
    """Read a stream to its end, noting when each text came: whether it ended with [DONE] and
    no error event. `until` (time.monotonic) stops reading there."""
    done = False
    for line in response:
        if line.startswith(b'data: {"error"'):
            return False
        done = done or line.startswith(b"data: [DONE]")
        if event_text(line):
            texts.append(time.perf_counter())
        if until is not None and time.monotonic() >= until:
            return False
    return done


def send(server: Server, method: str, path: str, body: dict | None = None, key: str | None = None,
         source: str = CLASS, until: float | None = None) -> Timed:
    """One request from address `source` with bearer `key`. A stream (body["stream"]) is read
    as it comes; `until` (time.monotonic) cuts it there, as a student who closes the tab (the
    server sees the hang-up). Nothing raises: a refusal or a cut is a Timed that is not ok."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None if body is None else json.dumps(body)
    if data is not None:
        headers["Content-Type"] = "application/json"
    wait = DEFAULT_REQUEST_TIMEOUT if until is None else max(0.1, until - time.monotonic())
    status, done, texts = None, False, []
    start = time.perf_counter()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=wait, source_address=(source, 0))
    try:
        conn.request(method, path, data, headers)
        response = conn.getresponse()
        status = response.status
        if body and body.get("stream"):
            done = read_stream(response, texts, until)
        else:
            response.read()
            done = True
    except (OSError, http.client.HTTPException):
        done = False
    finally:
        conn.close()
    end = time.perf_counter()
    return Timed(status, status == 200 and done, (end - start) * 1e3, (texts[0] - start) * 1e3 if texts else None,
                 [(b - a) * 1e3 for a, b in zip(texts, texts[1:])])
