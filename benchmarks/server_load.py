"""How many requests per second does the server answer when a class hits it at once?

    python -m benchmarks.server_load                    # 1 client, then 8, on the default model
    python -m benchmarks.server_load --clients 8 --requests 64 --json out.json
    python -m benchmarks.server_load --url http://127.0.0.1:5000   # a server already running

Without --url it starts the server in this process on a free port of 127.0.0.1 (the default
model, the default pool). Every request is a chat with the same system prompt and its own
short question, max_tokens 16, greedy: the traffic of a class trying the lesson's curl
command. For each number of concurrent clients the cache is reset, one request primes the
system prompt, then the clients send `--requests` requests between them, as fast as answers
come back. Traffic stays on the loopback interface; each level stops after --time-limit s.

The engine runs one step (a prefill or one token) at a time and never batches, so more
clients do not mean more requests per second: they share the same steps, and each waits longer.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import platform
import statistics
import threading
import time
import urllib.request
from urllib.parse import urlparse

from benchmarks import save_json

SYSTEM_PROMPT = (
    "You are a patient teaching assistant in a course about large language model serving. "
    "Answer every question in one short sentence, in plain words, without code. "
    "If a question is not about serving language models, say so politely."
)
QUESTIONS = [
    "What is a KV cache?", "Why are prompts split into blocks?", "What does a block hash name?",
    "Why chain a block's hash to its parent?", "What is the free queue for?", "What is a ref count?",
    "When is a cached block evicted?", "What does cache_salt protect against?",
]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def ask(url: str, i: int, max_tokens: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (question {i})"}]
    return post(url + "/generate", {"messages": messages, "max_tokens": max_tokens})


def load(url: str, clients: int, requests: int, max_tokens: int, time_limit: float) -> dict:
    """`requests` requests from `clients` threads at once; the figures of the replies."""
    post(url + "/reset_prefix_cache", {})
    ask(url, -1, max_tokens)  # primes the system prompt, as the first student of the class would
    deadline = time.perf_counter() + time_limit
    numbers = iter(range(requests))
    lock = threading.Lock()
    replies: list[dict] = []

    def client() -> None:
        while time.perf_counter() < deadline:
            with lock:
                i = next(numbers, None)
            if i is None:
                return
            reply = ask(url, i, max_tokens)
            with lock:
                replies.append(reply)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for done in [pool.submit(client) for _ in range(clients)]:
            done.result()
    seconds = time.perf_counter() - start
    return {
        "clients": clients,
        "requests": len(replies),
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(replies) / seconds, 2),
        "completion_tokens_per_s": round(sum(r["completion_tokens"] for r in replies) / seconds, 1),
        "prompt_tokens": round(statistics.mean(r["prompt_tokens"] for r in replies), 1),
        "cached_tokens": round(statistics.mean(r["cached_tokens"] for r in replies), 1),
        "ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in replies), 1),
        "latency_ms_median": round(statistics.median(r["total_ms"] for r in replies), 1),
    }


def start_server(enable_caching: bool):
    """The default model served in a daemon thread on a free loopback port; (url, server)."""
    from prefix_caching import Engine
    from server import create_app, serve_in_background

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request on the screen
    engine = Engine(enable_caching=enable_caching)
    engine.warm_up()
    return serve_in_background(create_app(engine))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.server_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server on this machine (default: start one in this process)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="concurrent clients, one run each")
    parser.add_argument("--requests", type=int, default=32, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--time-limit", type=float, default=300, help="seconds per run at most")
    parser.add_argument("--no-caching", action="store_true", help="the same load with prefix caching off")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error(f"--url must be on this machine (127.0.0.1 or localhost), got {args.url}")
    if args.url and args.no_caching:
        parser.error("--no-caching starts its own server: leave out --url")
    from rich.console import Console
    from rich.table import Table

    console = Console()
    server = None
    url = args.url.rstrip("/") if args.url else None
    if url is None:
        console.print(f"starting the server on the default model, prefix caching {'off' if args.no_caching else 'on'}…")
        url, server = start_server(enable_caching=not args.no_caching)
    health = json.loads(urllib.request.urlopen(url + "/health", timeout=30).read())
    console.print(f"[bold]server load[/] on {platform.machine()}, {os.cpu_count()} CPU cores, "
                  f"model {health['model']}, {health['num_blocks']} blocks of {health['block_size']}, "
                  f"max_tokens {args.max_tokens}")

    results = [load(url, n, args.requests, args.max_tokens, args.time_limit) for n in args.clients]
    if server is not None:
        server.shutdown()

    table = Table(title="chat requests sharing a system prompt, greedy (medians of TTFT and latency)")
    for column in ("clients", "requests", "req/s", "tokens/s", "prompt", "cached", "TTFT ms", "latency ms"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(*map(str, (r["clients"], r["requests"], r["requests_per_s"], r["completion_tokens_per_s"],
                                 r["prompt_tokens"], r["cached_tokens"], r["ttft_ms_median"], r["latency_ms_median"])))
    console.print(table)
    save_json(args.json, {"machine": platform.platform(), "cpu_cores": os.cpu_count(), "model": health["model"],
                          "caching": not args.no_caching, "runs": results}, console)
    return results


if __name__ == "__main__":
    main()
