"""Replicas of this course's server behind SGLang's router: what a cache-aware router buys over
round robin, measured on one machine.

    python prefix_caching.py --bench router                 # the multi-turn log, 2 and 3 replicas, both policies
    python prefix_caching.py --bench router --serve --replicas 2 --policy cache_aware   # a fleet until Ctrl+C
    python prefix_caching.py --bench router --log my_log.jsonl --replicas 2 4 --json out.json

The router is SGLang's own (`sglang-router` on PyPI, pinned to ROUTER_VERSION in
requirements.txt: Rust with Python bindings), started as its CLI starts it,
`python -m sglang_router.launch_router --worker-urls URL ... --policy POLICY`. Each replica is
`python server.py --port PORT` in a process of its own, with its own engine and KV pool.

The interface, for code that drives a fleet (a test, the analyzer's check of its prediction):

    with fleet(2, "cache_aware", server_args=["--num-blocks", "256"]) as f:
        f.url               # the router's URL: send OpenAI requests there
        f.replica_urls      # each replica's URL, in order; f.ports their ports
        routed = replay_through_router(f, read_log("lessons/data/multi_turn.jsonl.xz"))
    routed[0].replica, routed[0].prompt_tokens, routed[0].cached_tokens, routed[0].ttft_ms

    fleet(n, policy, server_args=(), router_args=())   n replicas of server.py on free ports of
        127.0.0.1 (server_args: any flags of server.py but --host and --port) and the router in
        front of them (policy: one of POLICIES; router_args: any other flags of the router, such as
        ["--cache-threshold", "0.5"]); yields a Fleet once the router lists every replica healthy
        under the model's name; stops them all at the end (a failure to start raises
        FleetError with the tail of the process's log).
    replicas(n, server_args) and router(replica_urls, policy, router_args): the two halves, each
        a context manager of its own (the benchmark starts the replicas once and a router per
        policy in front of them, resetting their caches between runs: reset_caches(urls)).
    replay_through_router(fleet, requests, max_tokens=1) -> list[Routed]: the requests (the
        analyzer's LoggedRequest, as analyzer.request_logs.read_log reads a log: chat messages go
        to /v1/chat/completions, a text or token ids to /v1/completions, with the request's
        cache_salt if it has one) sent through the router one after another, each streamed with
        its usage, greedy. Per request, in order: Routed(replica, prompt_tokens, cached_tokens,
        ttft_ms), where replica is the index in fleet.replica_urls of the replica that served it.

Which replica served a request: the router passes back no header that names its worker, so
each replica's /health is read before and after every request; its "requests" counter (the
allocator's, one per request it allocated) went up on exactly one of them, else FleetError.
That is why the replay is one request after another, and why a replica started with keys
(--api-keys, --salt-by-api-key), whose /health shows no figures without one, cannot be replayed.

What the router does to a request on its way (sglang-router 0.3.2, checked against this server):
it forwards Authorization (so --api-keys, --salt-by-api-key and the per-key limits hold) and
sends no X-Forwarded-For (every request reaches a replica from the router's address); it reads
the body into its own request type and writes it out again, adding SGLang's fields at their
defaults (no_stop_trim, skip_special_tokens, ...; server_requests.py takes them), leaving out a
chat's cache_salt and user, and filling a chat's missing model with "unknown" (send "model":
the replay takes it from the router's /v1/models).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from analyzer.request_logs import LoggedRequest
from benchmarks.openai_api import OpenAIServer

ROUTER_VERSION = "0.3.2"  # the sglang-router requirements.txt pins: the flags and behaviour above are its
POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")
ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300.0  # the default model's first load converts its GGUF file; a busy machine is slower
STOP_TIMEOUT_S = 20.0  # after Ctrl+C (replicas) or SIGTERM (router), then killed
UNKNOWN_MODEL = "unknown"  # the router's name for a worker whose /server_info it could not read


class FleetError(RuntimeError):
    """A replica or the router did not start, or a request could not be traced to a replica."""


@dataclass(frozen=True)
class Fleet:
    url: str  # the router's
    replica_urls: tuple[str, ...]
    policy: str

    @property
    def ports(self) -> tuple[int, ...]:
        return tuple(int(url.rsplit(":", 1)[1]) for url in self.replica_urls)


@dataclass(frozen=True)
class Routed:
    """One request replayed through the router: who served it and what that replica's usage said."""

    replica: int  # index in Fleet.replica_urls
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float  # at the client, through the router


# -----------------------------------------------------------------------------
# Starting and stopping the processes


def free_port() -> int:
    """A port of 127.0.0.1 free right now (the process that takes it binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(text[-lines:]) or "(no output)"


def wait_until(ready, process: subprocess.Popen, log: Path, what: str, timeout: float) -> None:
    """Poll ready() until it is true; FleetError if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise FleetError(f"{what} exited with status {process.returncode}:\n{log_tail(log)}")
        try:
            if ready():
                return
        except (OSError, ValueError):  # not listening yet, or not answering JSON yet
            pass
        time.sleep(0.2)
    raise FleetError(f"{what} was not ready after {timeout:g} s:\n{log_tail(log)}")


def stop(process: subprocess.Popen, how: int) -> None:
    if process.poll() is None:
        process.send_signal(how)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def replicas(n: int, server_args: Sequence[str] = (), timeout: float = STARTUP_TIMEOUT_S) -> Iterator[tuple[str, ...]]:
    """n processes of `python server.py` on free ports of 127.0.0.1, started at once; yields
    their URLs when every one answers /health. Stopped with Ctrl+C's signal (running requests
    drain) at the end."""
    if n < 1:
        raise ValueError(f"a fleet needs at least 1 replica, got {n}")
    if {"--host", "--port"} & set(server_args):
        raise ValueError("server_args: the fleet chooses --host and --port itself")
    with tempfile.TemporaryDirectory(prefix="replicas-") as logs, contextlib.ExitStack() as stack:
        started = []
        for i in range(n):
            port = free_port()
            log = Path(logs) / f"replica{i}.log"
            out = stack.enter_context(open(log, "w"))
            process = subprocess.Popen([sys.executable, "server.py", "--port", str(port), *server_args],
                                       cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            stack.callback(stop, process, signal.SIGINT)
            started.append((f"http://127.0.0.1:{port}", process, log))
        for i, (url, process, log) in enumerate(started):
            wait_until(lambda: get_json(url + "/health").get("status") == "ok", process, log,
                       f"replica {i} (python server.py on {url})", timeout)
        yield tuple(url for url, _, _ in started)


@contextlib.contextmanager
def router(replica_urls: Sequence[str], policy: str = "cache_aware", router_args: Sequence[str] = (),
           timeout: float = 60.0) -> Iterator[str]:
    """SGLang's router on a free port of 127.0.0.1 in front of replica_urls; yields its URL
    once it lists every replica healthy under a model's name. Stopped with SIGTERM."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: choose one of {', '.join(POLICIES)}")
    port = free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *replica_urls, "--policy", policy, "--log-level", "warn",
               # its metrics server would take 0.0.0.0:29000, once per machine
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *router_args]
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        workers = get_json(url + "/workers")["workers"]
        return (len(workers) == len(replica_urls)
                and all(w["is_healthy"] and w["model_id"] != UNKNOWN_MODEL for w in workers))

    with tempfile.TemporaryDirectory(prefix="router-") as logs:
        log = Path(logs) / "router.log"
        with open(log, "w") as out:
            process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env={**os.environ, "NO_COLOR": "1"})
            try:
                wait_until(ready, process, log, f"the router ({policy}, on {url})", timeout)
                yield url
            finally:
                stop(process, signal.SIGTERM)


@contextlib.contextmanager
def fleet(n: int, policy: str = "cache_aware", server_args: Sequence[str] = (), router_args: Sequence[str] = (),
          timeout: float = STARTUP_TIMEOUT_S) -> Iterator[Fleet]:
    """n replicas of server.py and SGLang's router in front of them (see the module's docstring)."""
    with replicas(n, server_args, timeout) as urls, router(urls, policy, router_args) as url:
        yield Fleet(url, urls, policy)


def reset_caches(replica_urls: Sequence[str]) -> None:
    """Forget every replica's cached blocks (POST /reset_prefix_cache: a server without keys
    lets anyone on this machine do it), so that the next run starts cold."""
    for url in replica_urls:
        request = urllib.request.Request(url + "/reset_prefix_cache", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).close()


# -----------------------------------------------------------------------------
# Replaying a log through the router


def request_counts(replica_urls: Sequence[str]) -> list[int]:
    """Each replica's count of requests (its /health's "requests")."""
    counts = []
    for url in replica_urls:
        figures = get_json(url + "/health")
        if "requests" not in figures:
            raise FleetError(f"{url}/health shows no figures without a key (a replica with --api-keys or "
                             f"--salt-by-api-key): the replay cannot tell which replica served a request")
        counts.append(figures["requests"])
    return counts


def send(server: OpenAIServer, request: LoggedRequest, max_tokens: int):
    """One logged request as the OpenAI API takes it: a chat, or a completion of a text or token ids."""
    salt = {} if request.cache_salt is None else {"cache_salt": request.cache_salt}
    if isinstance(request.prompt, list) and request.prompt and isinstance(request.prompt[0], dict):
        return server.chat(request.prompt, max_tokens, **salt)
    return server.complete(request.prompt, max_tokens, **salt)


def replay_through_router(f: Fleet, requests: Sequence[LoggedRequest], max_tokens: int = 1) -> list[Routed]:
    """Each request sent through the router after the one before it has finished; who served
    it and what it found cached (see the module's docstring)."""
    server = OpenAIServer(f.url)  # the model's name from the router's /v1/models
    counts = request_counts(f.replica_urls)
    routed = []
    for i, request in enumerate(requests):
        reply = send(server, request, max_tokens)
        after = request_counts(f.replica_urls)
        served = [r for r, (a, b) in enumerate(zip(counts, after)) if b != a]
        if len(served) != 1 or after[served[0]] != counts[served[0]] + 1:
            raise FleetError(f"request {i} ({request.where}): the replicas' request counts went from {counts} to "
                             f"{after}; exactly one should have gone up by one (did the router retry it?)")
        if reply.prompt_tokens is None or reply.cached_tokens is None:
            raise FleetError(f"request {i} ({request.where}): the reply carried no usage with cached tokens")
        routed.append(Routed(served[0], reply.prompt_tokens, reply.cached_tokens, reply.ttft_ms))
        counts = after
    return routed
