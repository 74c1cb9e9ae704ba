"""Replicas of this course's server behind SGLang's router: what a cache-aware router buys over
round robin, measured on one machine, and a fleet a class can be given.

    python prefix_caching.py --bench router                 # the multi-turn log: 1 replica, then 2 and 3 under both policies
    python prefix_caching.py --bench router --serve --replicas 2 --policy cache_aware   # a fleet for a class, until Ctrl+C
    python prefix_caching.py --bench router --log my_log.jsonl --replicas 2 4 --json out.json

The router is SGLang's own (`sglang-router` on PyPI, pinned to ROUTER_VERSION in
requirements.txt: Rust with Python bindings), started as its CLI starts it,
`python -m sglang_router.launch_router --worker-urls URL ... --policy POLICY`, with the guards of
guard_flags. Each replica is `python server.py --port PORT` in a process of its own, with its own
engine and KV pool, on 127.0.0.1: only the router, and the teacher's own machine, reach it. On a
keyed fleet the router too is on 127.0.0.1, and the class reaches it through the door
(router_front.py: the class server's connection rules, its keys, the OpenAI routes only).

The interface, for code that drives a fleet (a test, the analyzer's check of its prediction):

    with fleet(2, "cache_aware", Keys.generate(30), server_args=["--num-blocks", "256"]) as f:
        f.url               # the door's URL: send OpenAI requests there, a student's key in each
        f.router_url        # the router's own, on 127.0.0.1: its /workers with the teacher's key
        f.replica_urls      # each replica's URL, in order; f.ports their ports
        routed = replay_through_router(f, read_log("lessons/data/multi_turn.jsonl.xz"))
    routed[0].replica, routed[0].prompt_tokens, routed[0].cached_tokens, routed[0].ttft_ms

    fleet(n, policy, keys, server_args=(), router_args=(), host=, port=, max_body_bytes=)   n
        replicas of server.py on free ports of 127.0.0.1 (server_args: any flags of server.py but
        --host, --port and the keys' flags), each a class server for `keys` (a Keys: every student's
        key a tenant, --salt-by-api-key, the teacher's key its --admin-key), the router on a free
        port of 127.0.0.1 in front of them (policy: one of POLICIES; router_args: any other flags
        of the router, such as ["--cache-threshold", "0.5"]; its control plane takes the teacher's
        key), and the door (front) on host:port (default a free port of 127.0.0.1); without keys,
        the router on host:port and no door. Yields a Fleet once the router lists every replica
        healthy under the model's name; stops them all at the end (a failure to start raises
        FleetError with the tail of the process's log).
    replicas(n, server_args, keys=None), router(replica_urls, policy, router_args,
        control_key=None, max_body_bytes=) and front(router_url, keys, max_body_bytes, host=,
        port=, open_files=): the parts, each a context manager of its own
        (the benchmark starts the replicas once and a router per policy in front of them,
        resetting their caches between runs: reset_caches(urls, admin_key)). Replicas without
        keys serve anyone, and router() without control_key closes its control plane with a
        key only it holds.
    replay_through_router(fleet, requests, max_tokens=1) -> list[Routed]: the requests (the
        analyzer's LoggedRequest, as analyzer.request_logs.read_log reads a log: chat messages go
        to /v1/chat/completions, a text or token ids to /v1/completions) sent through the router
        one after another, each streamed with its usage, greedy. A request's cache_salt is its
        tenant: on a keyed fleet each tenant of the log is a student with a key of its own
        (tenant_keys), on a fleet without keys the salt goes in the body. Per request, in order:
        Routed(replica, prompt_tokens, cached_tokens, ttft_ms), where replica is the index in
        fleet.replica_urls of the replica that served it.

Which replica served a request: neither the router nor this server adds a header that names the
replica (the router passes a worker's own headers back), so each replica's /health is read
before and after every request (with the teacher's key on a keyed fleet: a keyless /health
shows no figures there); its "requests" counter (the allocator's, one per request it
allocated) went up on exactly one of them, else FleetError. That is why the replay is one
request after another.

What the router does to a request on its way (sglang-router 0.3.2, checked against this server
by tests/server/test_router.py): it forwards Authorization (so --api-keys, --salt-by-api-key and the
per-key limits hold) and sends no X-Forwarded-For, so every request reaches a replica from the
router's address and --forwarded-allow-ips has nothing to read. A replica's per-address cap
(--max-connections-per-client) would then cap the whole class's requests to it:
replicas() starts each with --max-connections-per-client 0 unless server_args names it; the
keys tell the students apart instead. The router reads a body into its own
request type and writes it out again: SGLang's fields added at their defaults (no_stop_trim,
skip_special_tokens, ...; serving/requests.py takes them), a chat's cache_salt and user left
out (a salt for chats behind it comes from the key), a chat's missing model filled with
"unknown" (send "model": the replay takes it from the router's /v1/models), and /generate's
body, which is this course's own, emptied of its prompt: through the router, use the OpenAI routes.

What guard_flags closes, and what 0.3.2 leaves open (tests/server/test_router_safety.py,
docs/fleet.md): without the teacher's key the router refuses
(401) /workers and /workers/{id} (every method), /get_loads, /flush_cache, /v1/tokenizers,
/wasm and /parse/*; it answers anyone on its public routes: /v1/models (the model's name),
/get_server_info (how many replicas), /readiness (how many are healthy), /health,
/health_generate, /liveness, /get_model_info (passed to a replica, which asks for a class's
key), /engine_metrics (a 500: no replica serves /metrics), /v1/tokenize and /v1/detokenize (a
400: no tokenizer is loaded, and loading one takes the teacher's key), and /ha/* (a 503: its
command line starts no mesh).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

from analyzer.fleet import ROUTER_VERSION
from analyzer.kv_memory import KNOWN_MODELS
from analyzer.log_replay import hit_rate_curve, tokenize_log
from analyzer.request_logs import Log, LoggedRequest, interleave
from benchmarks import save_json
from benchmarks.openai_api import SPREAD_COLUMN, OpenAIServer, spread_json, spread_text
from benchmarks.served_clients import free_ports
from commands.flags import positive_int
from commands.model_flags import add_model_arguments
from engine.model_files import load_tokenizer
from serving.requests import DEFAULT_MAX_PROMPT_TOKENS, SMOLLM2_TOKEN_BYTES, PromptBounds, read_api_keys
from serving.routes import tokenizer_token_bytes

POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")
ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300.0  # the default model's first load converts its GGUF file; a busy machine is slower
STOP_TIMEOUT_S = 20.0  # after Ctrl+C (replicas) or SIGTERM (router), then killed
PORT_ATTEMPTS = 3  # a replica whose port another program took first is started again on another, this many times in all
UNKNOWN_MODEL = "unknown"  # the router's name for a worker whose /server_info it could not read
# The largest body a replica of the default model reads at its default --max-prompt-tokens
# (serving.requests.PromptBounds): the router's own limit unless told the replicas' (body_limit).
DEFAULT_BODY_BYTES = PromptBounds.of(DEFAULT_MAX_PROMPT_TOKENS, SMOLLM2_TOKEN_BYTES).max_body_bytes
# With its breaker off, the router's probe of each replica's /health is what takes a dead one
# out of the rotation: after 3 failed probes in a row (--health-failure-threshold), 30 s.
HEALTH_CHECK_INTERVAL_S = 10  # the router's default: 60
DEFAULT_STUDENTS = 30  # keys --serve makes when it is given none


class FleetError(RuntimeError):
    """A replica or the router did not start, or a request could not be traced to a replica."""


@dataclass(frozen=True)
class Keys:
    """A class's keys on a fleet. Each student's key is a tenant of every replica (--api-keys
    lists them, --salt-by-api-key gives each its own cache, fair share serves each its share);
    the teacher's is each replica's --admin-key (every figure of /health, every block of the
    page, the reset) and the only key of the router's control plane."""

    teacher: str
    students: tuple[str, ...]

    def __post_init__(self):
        if not self.students:
            raise ValueError("a class needs at least one student's key")
        if self.teacher in self.students:
            raise ValueError("the teacher's key is also a student's: that student could do what the teacher does; "
                             "give the teacher another key")

    @classmethod
    def generate(cls, students: int) -> Keys:
        """Fresh random keys, numbered so the teacher can hand them out: student-01-..., ..."""
        return cls(f"teacher-{secrets.token_urlsafe(18)}",
                   tuple(f"student-{i:02d}-{secrets.token_urlsafe(9)}" for i in range(1, students + 1)))


@dataclass(frozen=True)
class Fleet:
    url: str  # where the class sends its requests: the door (router_front.py) on a keyed fleet, else the router
    replica_urls: tuple[str, ...]
    policy: str
    keys: Keys | None = None  # None: replicas that serve anyone, one cache for all
    router_url: str = ""  # the router's own, on 127.0.0.1 (its control plane); "" : url

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


def bearer(key: str | None) -> dict:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def get_json(url: str, key: str | None = None, timeout: float = 5.0):
    with urllib.request.urlopen(urllib.request.Request(url, headers=bearer(key)), timeout=timeout) as response:
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


def default_sigint() -> None:
    """In a child, before it runs: Ctrl+C's signal handled as Python does by default. A process
    started in the background (`command &`) inherits SIGINT ignored, and a server.py started
    from it would then never see its Ctrl+C (stop sends it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop(processes: list[subprocess.Popen], how: int) -> None:
    """Signal every process at once, then wait for each (killed after STOP_TIMEOUT_S)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(how)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def replicas(n: int, server_args: Sequence[str] = (), timeout: float = STARTUP_TIMEOUT_S,
             keys: Keys | None = None) -> Iterator[tuple[str, ...]]:
    """n processes of `python server.py` on free ports of 127.0.0.1, started at once; yields
    their URLs when every one answers /health. keys: each a class server, the students' keys
    its --api-keys, --salt-by-api-key, the teacher's key its --admin-key. Stopped with Ctrl+C's
    signal (running requests drain) at the end."""
    if n < 1:
        raise ValueError(f"a fleet needs at least 1 replica, got {n}")
    if {"--host", "--port"} & set(server_args):
        raise ValueError("server_args: the fleet chooses --host and --port itself")
    if keys is not None and {"--api-keys", "--salt-by-api-key", "--admin-key"} & set(server_args):
        raise ValueError("server_args: the fleet passes --api-keys, --salt-by-api-key and --admin-key from its keys")
    if "--max-connections-per-client" not in server_args:  # one client: the router (the module's docstring)
        server_args = [*server_args, "--max-connections-per-client", "0"]
    with tempfile.TemporaryDirectory(prefix="replicas-") as logs, contextlib.ExitStack() as stack:
        if keys is not None:
            key_file = Path(logs) / "class-keys.txt"
            key_file.write_text("\n".join(keys.students) + "\n")
            server_args = [*server_args, "--api-keys", str(key_file), "--salt-by-api-key", "--admin-key", keys.teacher]
        started = []
        stack.callback(lambda: stop([process for _, process, _ in started], signal.SIGINT))

        def start(i: int, port: int, attempt: int = 0) -> tuple[str, subprocess.Popen, Path]:
            log = Path(logs) / f"replica{i}-{attempt}.log"
            out = stack.enter_context(open(log, "w"))
            # A session of its own: a Ctrl+C in the terminal reaches this process, which stops them all.
            process = subprocess.Popen([sys.executable, "server.py", "--port", str(port), *server_args],
                                       cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       preexec_fn=default_sigint, start_new_session=True)
            return f"http://127.0.0.1:{port}", process, log

        started.extend(start(i, port) for i, port in enumerate(free_ports(n)))
        for i in range(n):
            for attempt in itertools.count(1):
                url, process, log = started[i]
                try:
                    wait_until(lambda: get_json(url + "/health").get("status") == "ok", process, log,
                               f"replica {i} (python server.py on {url})", timeout)
                    break
                except FleetError:
                    # Another program took the port between its pick and the replica's bind: another port.
                    if attempt == PORT_ATTEMPTS or "Address already in use" not in log_tail(log):
                        raise
                    started[i] = start(i, free_ports(1)[0], attempt)
        yield tuple(url for url, _, _ in started)


def guard_flags(url: str, control_key: str, max_body_bytes: int) -> list[str]:
    """The router's flags that make it safe to hand to a class (sglang-router 0.3.2; the
    module's docstring says what they close and what stays open), for a router on `url`."""
    return [
        # /workers (register, list, remove a replica), /get_loads, /flush_cache, /v1/tokenizers
        # and /wasm: the teacher's key only (id:name:role:key). Default: anyone.
        "--control-plane-api-keys", f"teacher:teacher:admin:{control_key}",
        "--prometheus-host", "127.0.0.1",  # its metrics: this machine only (default: 0.0.0.0, even under --host 127.0.0.1)
        # No page of another site may call it from a student's browser (default: every origin).
        "--cors-allowed-origins", url,
        # A body no replica would read is refused on its Content-Length (default: 512 MiB, read whole).
        "--max-payload-size", str(max_body_bytes),
        # The breaker counts a replica's 4xx as its failures: 10 bad requests from a student
        # would close a replica for 60 s. Off; the health checks take a dead replica out instead.
        "--disable-circuit-breaker", "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S),
        # A replica's 503 (its queue is full) and 429 (a key over its share) both mean "later":
        # retried, each would reach the replicas 5 times. One try; the client gets the answer.
        "--disable-retries",
    ]


def body_limit(tokenizer, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> int:
    """The largest body a replica serving this tokenizer's model reads (serving.routes.create_app's
    bounds): the router's --max-payload-size, so that the router refuses what no replica would take."""
    return PromptBounds.of(max_prompt_tokens, tokenizer_token_bytes(tokenizer)).max_body_bytes


@contextlib.contextmanager
def router(replica_urls: Sequence[str], policy: str = "cache_aware", router_args: Sequence[str] = (),
           timeout: float = 60.0, host: str = "127.0.0.1", port: int | None = None, control_key: str | None = None,
           max_body_bytes: int = DEFAULT_BODY_BYTES) -> Iterator[str]:
    """SGLang's router in front of replica_urls, on `port` of `host` (default: a free port of
    127.0.0.1), with guard_flags: its control plane takes control_key only (None: a random key
    that only this function holds), and max_body_bytes is the replicas' body limit (body_limit);
    router_args come after them and win. Yields its URL once it lists every replica healthy
    under a model's name. Stopped with SIGTERM."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: choose one of {', '.join(POLICIES)}")
    free = free_ports(2)  # the router's port, if none is given, and its metrics' port: never the same
    port = port or free[0]
    control_key = control_key or secrets.token_urlsafe(24)
    url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
               "--worker-urls", *replica_urls, "--policy", policy, "--log-level", "warn",
               "--prometheus-port", str(free[1] if free[1] != port else free[0]),  # its default, 29000: one per machine
               *guard_flags(url, control_key, max_body_bytes), *router_args]

    def ready() -> bool:
        workers = get_json(url + "/workers", control_key)["workers"]
        return (len(workers) == len(replica_urls)
                and all(w["is_healthy"] and w["model_id"] != UNKNOWN_MODEL for w in workers))

    with tempfile.TemporaryDirectory(prefix="router-") as logs:
        log = Path(logs) / "router.log"
        with open(log, "w") as out:
            process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                       stdin=subprocess.DEVNULL, env={**os.environ, "NO_COLOR": "1"})
            try:
                wait_until(ready, process, log, f"the router ({policy}, on {url})", timeout)
                yield url
            finally:
                stop([process], signal.SIGTERM)


@contextlib.contextmanager
def fleet(n: int, policy: str = "cache_aware", keys: Keys | None = None, server_args: Sequence[str] = (),
          router_args: Sequence[str] = (), timeout: float = STARTUP_TIMEOUT_S, host: str = "127.0.0.1",
          port: int | None = None, max_body_bytes: int = DEFAULT_BODY_BYTES) -> Iterator[Fleet]:
    """n replicas of server.py and SGLang's router in front of them (see the module's docstring)."""
    control_key = None if keys is None else keys.teacher
    if keys is None:
        with (replicas(n, server_args, timeout, keys) as urls,
              router(urls, policy, router_args, host=host, port=port, control_key=control_key,
                     max_body_bytes=max_body_bytes) as url):
            yield Fleet(url, urls, policy, keys, url)
        return
    with (replicas(n, server_args, timeout, keys) as urls,
          router(urls, policy, router_args, control_key=control_key, max_body_bytes=max_body_bytes) as url,
          front(url, keys, max_body_bytes, host=host, port=port) as door):
        yield Fleet(door, urls, policy, keys, url)


@contextlib.contextmanager
def front(router_url: str, keys: Keys, max_body_bytes: int = DEFAULT_BODY_BYTES, host: str = "127.0.0.1",
          port: int | None = None, timeout: float = 60.0, front_args: Sequence[str] = (),
          open_files: int | None = None) -> Iterator[str]:
    """The class's door (router_front.py) in front of the router at router_url, on `port` of
    `host` (default: a free port of 127.0.0.1), taking the keys of `keys`; front_args: its other
    flags. open_files: its process's open-file limit (ulimit -n), else this one's. Yields its URL
    once it answers. Stopped with SIGTERM."""
    port = port or free_ports(1)[0]
    url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"

    def limit_files() -> None:
        default_sigint()
        if open_files is not None:
            import resource  # POSIX only, as is this limit

            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    with tempfile.TemporaryDirectory(prefix="front-") as logs:
        key_file = Path(logs) / "class-keys.txt"
        key_file.write_text("\n".join(keys.students) + "\n")
        log = Path(logs) / "front.log"
        command = [sys.executable, "-m", "benchmarks.router_front", "--router", router_url, "--host", host,
                   "--port", str(port), "--api-keys", str(key_file), "--admin-key", keys.teacher,
                   "--max-body-bytes", str(max_body_bytes), *front_args]
        with open(log, "w") as out:
            process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                       stdin=subprocess.DEVNULL, preexec_fn=limit_files)
            try:
                wait_until(lambda: answers(url), process, log, f"the door (on {url})", timeout)
                yield url
            finally:
                stop([process], signal.SIGTERM)


def answers(url: str) -> bool:
    """Whether a server answers at url at all (any status)."""
    try:
        urllib.request.urlopen(url + "/v1/models", timeout=2).close()
    except urllib.error.HTTPError:  # a 401 without a key: it answers
        pass
    return True


def reset_caches(replica_urls: Sequence[str], admin_key: str | None = None) -> None:
    """Forget every replica's cached blocks (POST /reset_prefix_cache: with the admin key where
    the replicas have one; a server without keys lets anyone on this machine do it), so that the
    next run starts cold."""
    for url in replica_urls:
        request = urllib.request.Request(url + "/reset_prefix_cache", data=b"{}",
                                         headers={"Content-Type": "application/json", **bearer(admin_key)})
        urllib.request.urlopen(request, timeout=30).close()


# -----------------------------------------------------------------------------
# Replaying a log through the router


def request_counts(replica_urls: Sequence[str], admin_key: str | None = None) -> list[int]:
    """Each replica's count of requests (its /health's "requests"), read with the admin key
    where the replicas have one."""
    counts = []
    for url in replica_urls:
        figures = get_json(url + "/health", admin_key)
        if "requests" not in figures:
            raise FleetError(f"{url}/health shows this caller no figures (a replica with --api-keys or "
                             f"--salt-by-api-key answers them to its --admin-key): the replay cannot tell which "
                             f"replica served a request; give the Fleet its Keys")
        counts.append(figures["requests"])
    return counts


def tenant_keys(salts: Sequence[str | None], keys: Keys) -> dict[str | None, str]:
    """A student's key for each tenant of a log (a cache_salt; None: the requests without one),
    in the order they first appear: on a keyed fleet the key is the salt (--salt-by-api-key).

    >>> tenant_keys([None, "a", None, "b"], Keys("t", ("k1", "k2", "k3")))
    {None: 'k1', 'a': 'k2', 'b': 'k3'}
    """
    tenants = list(dict.fromkeys(salts))
    if len(tenants) > len(keys.students):
        raise FleetError(f"the log has {len(tenants)} tenants (its cache_salts, and the requests without one), "
                         f"more than the fleet's {len(keys.students)} students' keys")
    return dict(zip(tenants, keys.students))


def clients(f: Fleet, requests: Sequence[LoggedRequest]) -> list[OpenAIServer]:
    """Who sends each request: on a fleet without keys one client for all, the salt in the body;
    on a keyed fleet the student whose key stands for the request's salt (tenant_keys)."""
    model = OpenAIServer(f.url, api_key=f.keys and f.keys.teacher).model  # the model's name from /v1/models
    if f.keys is None:
        return [OpenAIServer(f.url, model)] * len(requests)
    keys = tenant_keys([r.cache_salt for r in requests], f.keys)
    students = {key: OpenAIServer(f.url, model, api_key=key) for key in keys.values()}
    return [students[keys[r.cache_salt]] for r in requests]


def send(server: OpenAIServer, request: LoggedRequest, max_tokens: int, **fields):
    """One logged request as the OpenAI API takes it: a chat, or a completion of a text or token
    ids; its cache_salt in the body unless a key stands for it (a keyed replica refuses a salt)."""
    salt = {} if request.cache_salt is None or server.api_key else {"cache_salt": request.cache_salt}
    if isinstance(request.prompt, list) and request.prompt and isinstance(request.prompt[0], dict):
        return server.chat(request.prompt, max_tokens, **salt, **fields)
    return server.complete(request.prompt, max_tokens, **salt, **fields)


def replay_through_router(f: Fleet, requests: Sequence[LoggedRequest], max_tokens: int = 1) -> list[Routed]:
    """Each request sent through the router after the one before it has finished; who served
    it and what it found cached (see the module's docstring)."""
    teacher = None if f.keys is None else f.keys.teacher
    counts = request_counts(f.replica_urls, teacher)
    routed = []
    for i, (request, client) in enumerate(zip(requests, clients(f, requests))):
        reply = send(client, request, max_tokens)
        after = request_counts(f.replica_urls, teacher)
        served = [r for r, (a, b) in enumerate(zip(counts, after)) if b != a]
        if len(served) != 1 or after[served[0]] != counts[served[0]] + 1:
            raise FleetError(f"request {i} ({request.where}): the replicas' request counts went from {counts} to "
                             f"{after}; exactly one should have gone up by one (did the router retry it?)")
        if reply.prompt_tokens is None or reply.cached_tokens is None:
            raise FleetError(f"request {i} ({request.where}): the reply carried no usage with cached tokens")
        routed.append(Routed(served[0], reply.prompt_tokens, reply.cached_tokens, reply.ttft_ms))
        counts = after
    return routed


# -----------------------------------------------------------------------------
# The benchmark: one log, each number of replicas, each policy, side by side


def working_sets(routed: list[Routed], n: int, prompts: list, salts: list, block_size: int) -> list[int]:
    """Each replica's working set in blocks: the analyzer's replay (vLLM's pool) of the requests
    the router sent it, in their order: the pool each replica needs to keep what it hits."""
    sets = []
    for i in range(n):
        mine = [k for k, r in enumerate(routed) if r.replica == i]
        sets.append(hit_rate_curve([prompts[k] for k in mine], [salts[k] for k in mine], block_size).working_set
                    if mine else 0)
    return sets


def summary(routed: list[Routed], n: int, working_set: list[int]) -> dict:
    """A run's figures: hit rate (cached / prompt tokens), requests per replica, TTFT, and the
    working set per replica with the KV memory it is for MEMORY_MODEL."""
    prompt = sum(r.prompt_tokens for r in routed)
    cached = sum(r.cached_tokens for r in routed)
    per_replica = [[r for r in routed if r.replica == i] for i in range(n)]
    return {
        "requests": len(routed), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "requests_per_replica": [len(rows) for rows in per_replica],
        "hit_rate_per_replica": [round(sum(r.cached_tokens for r in rows) / max(1, sum(r.prompt_tokens for r in rows)), 4)
                                 for rows in per_replica],
        "ttft_ms": spread_json([r.ttft_ms for r in routed]),
        "working_set_per_replica": working_set,  # blocks
        "routed": [asdict(r) for r in routed],  # per request, in order: what a prediction is compared with
    }


def server_flags(args) -> list[str]:
    """The flags of server.py this benchmark's own model flags stand for."""
    flags = ["--block-size", str(args.block_size)]
    for flag, value in (("--model", args.model), ("--device", args.device), ("--dtype", args.dtype),
                        ("--num-blocks", args.num_blocks), ("--kv-memory-gb", args.kv_memory_gb)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Hit rate of each run, and the requests each replica served."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{run['replicas']} × {run['policy']}" if run["replicas"] > 1 else "1 replica" for run in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3), dpi=100)
    bars = left.bar(range(len(runs)), [100 * run["hit_rate"] for run in runs],
                    color=[COLORS.get(run["policy"], "gray") for run in runs])
    left.bar_label(bars, fmt="%.0f%%", fontsize=7)
    left.set_ylabel("hit rate (cached / prompt tokens)", fontsize=8)
    for ax in (left, right):
        ax.set_xticks(range(len(runs)), labels, rotation=20, ha="right", fontsize=7)
    bottom = [0] * len(runs)
    for i in range(max(run["replicas"] for run in runs)):
        counts = [run["requests_per_replica"][i] if i < run["replicas"] else 0 for run in runs]
        right.bar(range(len(runs)), counts, bottom=bottom, label=f"replica {i}", edgecolor="white")
        bottom = [b + c for b, c in zip(bottom, counts)]
    right.set_ylabel("requests served", fontsize=8)
    right.legend(fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# Seven users chatting at once. With N conversations taking turns, round robin over R replicas
# sends each conversation's turns N requests apart: to the same replica every time when R
# divides N (8 users, 2 replicas), which real traffic does not do; 7 is divisible by neither.
CONVERSATIONS_AT_ONCE = 7
MEMORY_MODEL = KNOWN_MODELS["Llama-3.1-8B"]  # the working set per replica in GiB, as stage 10 sizes it
COLORS = {"round_robin": "tab:orange", "cache_aware": "tab:blue", "power_of_two": "tab:green", "random": "tab:red"}
DEFAULT_LOG = ROOT / "lessons" / "data" / "multi_turn.jsonl.xz"


def class_keys(args) -> Keys:
    """--serve's keys: the students' from --api-keys FILE, or --students fresh ones; the
    teacher's from --admin-key, or a fresh one."""
    fresh = Keys.generate(args.students)
    students = fresh.students if args.api_keys is None else tuple(sorted(read_api_keys(args.api_keys)))
    return Keys(args.admin_key or fresh.teacher, students)


def serve_fleet(args, keys: Keys, max_body_bytes: int, console) -> None:
    """--serve: a fleet until Ctrl+C, for a class to send requests to, each student with a key."""
    with fleet(max(args.replicas), args.policy, keys, server_flags(args), host=args.host, port=args.port,
               max_body_bytes=max_body_bytes) as f:
        console.print(f"[bold green]the class's door on {f.url}[/] (router_front.py: deadlines, caps, keys), in "
                      f"front of the router ({f.policy}) on {f.router_url} and {', '.join(f.replica_urls)} (this "
                      f"machine only)")
        if args.api_keys is None:
            console.print(f"  the class's keys, one for each student (--api-keys FILE keeps a class's keys from one "
                          f"fleet to the next):", markup=False)
            for key in keys.students:
                console.print(f"    {key}", markup=False, highlight=False)
        else:
            console.print(f"  the class's keys: the {len(keys.students)} of {args.api_keys}", markup=False)
        if args.admin_key is None:
            console.print(f"  the teacher's key (keep it): {keys.teacher}", markup=False, highlight=False)
        model = OpenAIServer(f.url, api_key=keys.teacher).model
        console.print(f"  try:  curl -s {f.url}/v1/chat/completions -H 'Content-Type: application/json' "
                      f"-H 'Authorization: Bearer {keys.students[0]}' -d '{{\"model\": \"{model}\", \"messages\": "
                      f"[{{\"role\": \"user\", \"content\": \"Hi\"}}], \"max_tokens\": 16}}'",
                      soft_wrap=True, markup=False, highlight=False)
        console.print("  the door passes /v1/chat/completions, /v1/completions and /v1/models (the router empties "
                      "/generate's body)", markup=False)
        console.print(f"  on this machine: the router's /workers and /get_loads at {f.router_url} (the teacher's key); "
                      f"each replica's cache at {f.replica_urls[0]}/#key=TEACHER'S-KEY, ...   (Ctrl+C stops them all)",
                      markup=False)
        try:
            while True:
                time.sleep(3600)
        except (KeyboardInterrupt, SystemExit):
            # The stop takes seconds (running requests drain, at most STOP_TIMEOUT_S, then killed): a second
            # Ctrl+C in the meantime would cut it short, with a traceback, and leave the processes running.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            console.print(f"stopping the door, the router and the replicas… (at most {STOP_TIMEOUT_S:g} s; a "
                          f"second Ctrl+C waits for it)", markup=False)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, default=DEFAULT_LOG, help=f"the request log to replay (default: "
                        f"{DEFAULT_LOG.relative_to(ROOT)}, 40 conversations)")
    parser.add_argument("--conversations-at-once", type=positive_int, default=CONVERSATIONS_AT_ONCE, metavar="N",
                        help=f"replay N conversations at a time, taking turns, as the analyzer does (default "
                             f"{CONVERSATIONS_AT_ONCE}: neither 2 nor 3 divides it, so round robin does not send a "
                             f"conversation's turns to one replica by chance)")
    parser.add_argument("--requests", type=positive_int, default=None, help="replay only the first N requests")
    parser.add_argument("--replicas", type=positive_int, nargs="+", default=[1, 2, 3],
                        help="numbers of replicas, one run each per policy (one replica: one run)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=["round_robin", "cache_aware"])
    parser.add_argument("--max-tokens", type=positive_int, default=1, help="tokens each reply generates")
    parser.add_argument("--figure", type=Path, default=ROOT / "assets" / "router.png", help="where to save the figure")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON, every request's replica too")
    serve = parser.add_argument_group("--serve: a fleet for a class")
    serve.add_argument("--serve", action="store_true", help="start the largest of --replicas replicas and the "
                       "router with --policy, print the router's URL and serve until Ctrl+C")
    serve.add_argument("--policy", choices=POLICIES, default="cache_aware", help="the router's policy for --serve")
    serve.add_argument("--host", default="127.0.0.1", help="where the router listens with --serve (0.0.0.0: a "
                       "class on other machines; the replicas stay on 127.0.0.1)")
    serve.add_argument("--port", type=positive_int, default=None, help="the router's port with --serve "
                       "(default: a free one)")
    serve.add_argument("--api-keys", metavar="FILE", help="the class's keys, one per line, as server.py reads them: "
                       "each student's requests carry theirs (default: --students fresh keys, printed)")
    serve.add_argument("--students", type=positive_int, default=DEFAULT_STUDENTS,
                       help=f"how many keys to make without --api-keys (default {DEFAULT_STUDENTS})")
    serve.add_argument("--admin-key", help="the teacher's key: the router's control plane, and each replica's "
                       "--admin-key (default: a fresh one, printed)")
    add_model_arguments(parser)  # passed to every replica
    args = parser.parse_args(argv)
    if args.admin_key is not None and not args.admin_key.strip():
        parser.error("--admin-key is empty: give a secret")
    from rich.console import Console
    from rich.table import Table

    console = Console()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the replicas and the router on the way out
    tokenizer = load_tokenizer(args.model)
    max_body_bytes = body_limit(tokenizer)
    if args.serve:
        try:
            keys = class_keys(args)
        except (OSError, UnicodeDecodeError, ValueError) as err:
            parser.error(f"--api-keys, --admin-key: {err}")
        serve_fleet(args, keys, max_body_bytes, console)
        return None
    requests = interleave(Log.read(args.log).requests, args.conversations_at_once)[: args.requests]
    prompts, salts = tokenize_log(requests, tokenizer), [r.cache_salt for r in requests]
    # The fleet a class gets (--serve's), measured: a student's key for each tenant of the log.
    keys = Keys.generate(len(set(salts)))
    most = max(args.replicas)
    console.print(f"starting {most} replicas of server.py ({' '.join(server_flags(args))}, each log tenant a key) and, "
                  f"for each run, SGLang's router {ROUTER_VERSION}; {len(requests)} requests of {args.log.name}, "
                  f"one after another")
    runs = []
    load_before = os.getloadavg()
    with replicas(most, server_flags(args), keys=keys) as urls:
        for n in sorted(set(args.replicas)):
            for policy in args.policies if n > 1 else args.policies[:1]:
                reset_caches(urls, keys.teacher)
                with router(urls[:n], policy, control_key=keys.teacher, max_body_bytes=max_body_bytes) as url:
                    routed = replay_through_router(Fleet(url, urls[:n], policy, keys), requests, args.max_tokens)
                sets = working_sets(routed, n, prompts, salts, args.block_size)
                runs.append({"replicas": n, "policy": policy if n > 1 else "-"} | summary(routed, n, sets))
                console.print(f"  {n} × {policy}: hit rate {runs[-1]['hit_rate']:.1%}")
    load_after = os.getloadavg()

    table = Table(title=f"{args.log.name} through SGLang's router {ROUTER_VERSION}: {len(requests)} requests, "
                        f"one after another, each replica's cached tokens from its usage",
                  caption=f"TTFT at the client, {SPREAD_COLUMN}: the replicas share this machine's "
                          f"{os.cpu_count()} cores, so it measures their contention as much as the policy")
    gib = MEMORY_MODEL.bytes_per_block(args.block_size) / 2**30
    for column in ("replicas", "policy", "hit rate", "requests per replica", "hit rate per replica",
                   "prompt tokens computed", "working set per replica", f"its KV for {MEMORY_MODEL.name}", "TTFT ms"):
        table.add_column(column, justify="right")
    for run in runs:
        table.add_row(str(run["replicas"]), run["policy"], f"{run['hit_rate']:.1%}",
                      " / ".join(map(str, run["requests_per_replica"])),
                      " / ".join(f"{h:.0%}" for h in run["hit_rate_per_replica"]),
                      f"{run['prompt_tokens'] - run['cached_tokens']:,}",
                      " / ".join(f"{w:,}" for w in run["working_set_per_replica"]) + " blocks",
                      " / ".join(f"{w * gib:.2f}" for w in run["working_set_per_replica"]) + " GiB",
                      spread_text(run["ttft_ms"]))
    console.print(table)
    console.print(f"working set: the analyzer's replay (vLLM's pool, blocks of {args.block_size}) of each replica's "
                  f"own requests; its KV: {MEMORY_MODEL.bytes_per_block(args.block_size) / 2**20:.0f} MiB a block for "
                  f"{MEMORY_MODEL.name} (analyzer/kv_memory.py), counted in this model's tokens")
    console.print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, args.figure, f"{args.log.name}, {len(requests)} requests: hit rate and requests per replica")
    console.print(f"wrote {args.figure}")
    results = {"machine": platform.platform(), "cpu_cores": os.cpu_count(), "router": ROUTER_VERSION,
               "log": args.log.name, "conversations_at_once": args.conversations_at_once,
               "server_flags": server_flags(args), "load_average": [load_before[0], load_after[0]], "runs": runs}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
