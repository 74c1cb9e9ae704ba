"""Replicas of this course's server behind SGLang's router: what a cache-aware router buys over
round robin, measured on one machine.

    python prefix_caching.py --bench router                 # the multi-turn log: 1 replica, then 2 and 3 under both policies
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

    fleet(n, policy, server_args=(), router_args=(), host=, port=)   n replicas of server.py on
        free ports of 127.0.0.1 (server_args: any flags of server.py but --host and --port) and
        the router (on host:port, default a free port of 127.0.0.1) in
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

Which replica served a request: neither the router nor this server adds a header that names the
replica (the router passes a worker's own headers back), so each replica's /health is read
before and after every request; its "requests" counter (the
allocator's, one per request it allocated) went up on exactly one of them, else FleetError.
That is why the replay is one request after another, and why a replica started with keys
(--api-keys, --salt-by-api-key), whose /health shows no figures without one, cannot be replayed.

What the router does to a request on its way (sglang-router 0.3.2, checked against this server
by tests/server/test_router.py): it forwards Authorization (so --api-keys, --salt-by-api-key and the
per-key limits hold) and sends no X-Forwarded-For, so every request reaches a replica from the
router's address and --forwarded-allow-ips has nothing to read. A replica's per-address cap
(--max-connections-per-client) would then cap the whole class's unkeyed requests to it:
replicas() starts each with --max-connections-per-client 0 unless server_args names it (they
listen on 127.0.0.1, where only the router reaches them). The router reads a body into its own
request type and writes it out again: SGLang's fields added at their defaults (no_stop_trim,
skip_special_tokens, ...; server_requests.py takes them), a chat's cache_salt and user left
out, a chat's missing model filled with "unknown" (send "model": the replay takes it from the
router's /v1/models), and /generate's body, which is this course's own, emptied of its prompt:
through the router, use the OpenAI routes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
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
from analyzer.request_logs import Log, LoggedRequest, interleave
from analyzer.log_replay import hit_rate_curve, tokenize_log
from benchmarks import save_json
from benchmarks.openai_api import SPREAD_COLUMN, OpenAIServer, spread_json, spread_text
from flags import positive_int
from model_files import load_tokenizer
from model_flags import add_model_arguments

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
def replicas(n: int, server_args: Sequence[str] = (), timeout: float = STARTUP_TIMEOUT_S) -> Iterator[tuple[str, ...]]:
    """n processes of `python server.py` on free ports of 127.0.0.1, started at once; yields
    their URLs when every one answers /health. Stopped with Ctrl+C's signal (running requests
    drain) at the end."""
    if n < 1:
        raise ValueError(f"a fleet needs at least 1 replica, got {n}")
    if {"--host", "--port"} & set(server_args):
        raise ValueError("server_args: the fleet chooses --host and --port itself")
    if "--max-connections-per-client" not in server_args:  # one client: the router (the module's docstring)
        server_args = [*server_args, "--max-connections-per-client", "0"]
    with tempfile.TemporaryDirectory(prefix="replicas-") as logs, contextlib.ExitStack() as stack:
        started = []
        stack.callback(lambda: stop([process for _, process, _ in started], signal.SIGINT))
        for i in range(n):
            port = free_port()
            log = Path(logs) / f"replica{i}.log"
            out = stack.enter_context(open(log, "w"))
            # A session of its own: a Ctrl+C in the terminal reaches this process, which stops them all.
            process = subprocess.Popen([sys.executable, "server.py", "--port", str(port), *server_args],
                                       cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       preexec_fn=default_sigint, start_new_session=True)
            started.append((f"http://127.0.0.1:{port}", process, log))
        for i, (url, process, log) in enumerate(started):
            wait_until(lambda: get_json(url + "/health").get("status") == "ok", process, log,
                       f"replica {i} (python server.py on {url})", timeout)
        yield tuple(url for url, _, _ in started)


@contextlib.contextmanager
def router(replica_urls: Sequence[str], policy: str = "cache_aware", router_args: Sequence[str] = (),
           timeout: float = 60.0, host: str = "127.0.0.1", port: int | None = None) -> Iterator[str]:
    """SGLang's router in front of replica_urls, on `port` of `host` (default: a free port of
    127.0.0.1); yields its URL once it lists every replica healthy under a model's name.
    Stopped with SIGTERM."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: choose one of {', '.join(POLICIES)}")
    port = port or free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
               "--worker-urls", *replica_urls, "--policy", policy, "--log-level", "warn",
               # its metrics server would take 0.0.0.0:29000, once per machine
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *router_args]
    url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"

    def ready() -> bool:
        workers = get_json(url + "/workers")["workers"]
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
def fleet(n: int, policy: str = "cache_aware", server_args: Sequence[str] = (), router_args: Sequence[str] = (),
          timeout: float = STARTUP_TIMEOUT_S, host: str = "127.0.0.1", port: int | None = None) -> Iterator[Fleet]:
    """n replicas of server.py and SGLang's router in front of them (see the module's docstring)."""
    with replicas(n, server_args, timeout) as urls, router(urls, policy, router_args, host=host, port=port) as url:
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
    flags = ["--block-size", str(args.block_size), "--no-fair-share"]  # one tenant (the router): arrival order
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


def serve_fleet(args, console) -> None:
    """--serve: a fleet until Ctrl+C, for a class or a terminal to send requests to."""
    with fleet(max(args.replicas), args.policy, server_flags(args), host=args.host, port=args.port) as f:
        console.print(f"[bold green]the router ({f.policy}) on {f.url}[/], in front of {', '.join(f.replica_urls)}")
        model = OpenAIServer(f.url).model
        console.print(f"  try:  curl -s {f.url}/v1/chat/completions -H 'Content-Type: application/json' -d "
                      f"'{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}], "
                      f"\"max_tokens\": 16}}'", soft_wrap=True, markup=False)
        console.print("  each replica's cache: open its URL in a browser   (Ctrl+C stops them all)")
        try:
            while True:
                time.sleep(3600)
        except (KeyboardInterrupt, SystemExit):
            console.print("stopping the router and the replicas…")


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
    parser.add_argument("--serve", action="store_true", help="start the largest of --replicas replicas and the "
                        "router with --policy, print the router's URL and serve until Ctrl+C")
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware", help="the router's policy for --serve")
    parser.add_argument("--host", default="127.0.0.1", help="where the router listens with --serve (0.0.0.0: a "
                        "class on other machines; the replicas stay on 127.0.0.1)")
    parser.add_argument("--port", type=positive_int, default=None, help="the router's port with --serve "
                        "(default: a free one)")
    add_model_arguments(parser)  # passed to every replica
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the replicas and the router on the way out
    if args.serve:
        serve_fleet(args, console)
        return None
    requests = interleave(Log.read(args.log).requests, args.conversations_at_once)[: args.requests]
    prompts, salts = tokenize_log(requests, load_tokenizer(args.model)), [r.cache_salt for r in requests]
    most = max(args.replicas)
    console.print(f"starting {most} replicas of server.py ({' '.join(server_flags(args))}) and, for each run, SGLang's "
                  f"router {ROUTER_VERSION}; {len(requests)} requests of {args.log.name}, one after another")
    runs = []
    load_before = os.getloadavg()
    with replicas(most, server_flags(args)) as urls:
        for n in sorted(set(args.replicas)):
            for policy in args.policies if n > 1 else args.policies[:1]:
                reset_caches(urls)
                with router(urls[:n], policy) as url:
                    routed = replay_through_router(Fleet(url, urls[:n], policy), requests, args.max_tokens)
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
