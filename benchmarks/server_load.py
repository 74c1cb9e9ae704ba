"""How many requests per second does a server answer when a class hits it at once?

    python prefix_caching.py --bench server_load                  # 1 client, then 16, on the default model
    python prefix_caching.py --bench server_load --clients 1 4 16 --requests 64 --json out.json
    python prefix_caching.py --bench server_load --url http://HOST:8000 --api-key KEY   # any OpenAI-compatible server

Without --url it starts a server of this course in this process on a free port of 127.0.0.1
(the default model and pool unless --model / --num-blocks say otherwise), as python server.py
does. With --url every request goes to that server, wherever it runs: this course's,
vLLM, SGLang. It speaks only the OpenAI API: streamed /v1/chat/completions with
stream_options.include_usage, timed at the client. Every request is a chat with the same
system prompt and its own short question, max_tokens 16, greedy: the traffic of a class
trying the lesson's curl command. Every server gets the same prompts: each run's system prompt
opens with a fresh random line, so nothing of it is cached before the run and no server needs
a reset (vLLM has POST /reset_prefix_cache only in dev mode; a reset where a server has one
would leave it other prompts than one without). Two measurements:

    load    for each number of concurrent clients (--clients): one request primes the run's
            system prompt, then the clients send --requests requests between them, each as
            soon as its last answer came back: requests/s, and the ratio of the most clients to
            the fewest; per request, how many found some of their prompt cached (hits) and how
            many none (misses), and the spread of cached tokens and TTFT (p50, p90, p99, min, max)
    class   --class-size students send one question each at the same moment: how long until
            the last of them has its answer

Cached tokens come from usage.prompt_tokens_details.cached_tokens; a server that leaves it out
(vLLM without --enable-prompt-tokens-details) gets "not reported", never a zero. The engine
loop puts every running request in the same forward pass, so more clients mean more requests
per second until a step is as large as the machine computes in the time of a small one. Each
level stops after --time-limit s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import statistics
import threading
import time

from benchmarks import save_json
from benchmarks.openai_api import (NOT_REPORTED, OpenAIServer, Reply, add_server_arguments, fresh_line, hits_and_misses,
                                   open_server, SPREAD_COLUMN, spread_json, spread_text)
from commands.flags import positive_int

SYSTEM_PROMPT = (
    "You are a patient teaching assistant in a course about large language model serving. "
    "Answer every question in one short sentence, in plain words, without code. "
    "If a question is not about serving language models, say so politely."
)
PROMPT_RULE = "each run's system prompt opens with a fresh random line, on every server; nothing is reset"
QUESTIONS = [
    "What is a KV cache?", "Why are prompts split into blocks?", "What does a block hash name?",
    "Why chain a block's hash to its parent?", "What is the free queue for?", "What is a ref count?",
    "When is a cached block evicted?", "What does cache_salt protect against?",
]


def ask(server: OpenAIServer, system: str, i: int, max_tokens: int) -> Reply:
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (question {i})"}]
    return server.chat(messages, max_tokens)


def prime(server: OpenAIServer, max_tokens: int) -> str:
    """The run's system prompt, opened by a fresh first line (PROMPT_RULE), sent once, as the
    first student of the class would: the system prompt to use."""
    system = f"{fresh_line()}\n{SYSTEM_PROMPT}"
    ask(server, system, -1, max_tokens)
    return system


def load(server: OpenAIServer, clients: int, requests: int, max_tokens: int, time_limit: float) -> dict:
    """`requests` requests from `clients` threads at once; the figures of the replies."""
    system = prime(server, max_tokens)
    deadline = time.perf_counter() + time_limit
    numbers = iter(range(requests))
    lock = threading.Lock()
    replies: list[Reply] = []

    def client() -> None:
        while time.perf_counter() < deadline:
            with lock:
                i = next(numbers, None)
            if i is None:
                return
            reply = ask(server, system, i, max_tokens)
            with lock:
                replies.append(reply)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for done in [pool.submit(client) for _ in range(clients)]:
            done.result()
    seconds = time.perf_counter() - start
    hits = hits_and_misses(replies)
    return {
        "clients": clients,
        "requests": len(replies),
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(replies) / seconds, 2),
        "completion_tokens_per_s": round(sum(r.completion_tokens or 0 for r in replies) / seconds, 1),
        "prompt_tokens": spread_json([r.prompt_tokens for r in replies]),
        "cached_tokens": spread_json([r.cached_tokens for r in replies]),  # None: not reported
        "hits": None if hits is None else hits[0],  # requests that found some of their prompt cached
        "misses": None if hits is None else hits[1],  # and those that found none
        "ttft_ms": spread_json([r.ttft_ms for r in replies]),
        "latency_ms_median": round(statistics.median(r.total_ms for r in replies), 1),
    }


def one_class(server: OpenAIServer, students: int, max_tokens: int) -> dict:
    """`students` questions sent at the same moment, one each: when the first and the last
    answer came back, in ms from that moment."""
    system = prime(server, max_tokens)
    ready = threading.Barrier(students + 1)
    answered_at: list[float] = []

    def student(i: int) -> None:
        ready.wait()
        ask(server, system, i, max_tokens)
        answered_at.append(time.perf_counter())

    with concurrent.futures.ThreadPoolExecutor(students) as pool:
        done = [pool.submit(student, i) for i in range(students)]
        ready.wait()
        start = time.perf_counter()
        for future in done:
            future.result()
    return {"students": students, "first_answer_ms": round((min(answered_at) - start) * 1e3, 1),
            "last_answer_ms": round((max(answered_at) - start) * 1e3, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench server_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=positive_int, nargs="+", default=[1, 16],
                        help="concurrent clients, one run each")
    parser.add_argument("--requests", type=positive_int, default=32, help="requests per run")
    parser.add_argument("--class-size", type=positive_int, default=16, help="students who ask at the same moment")
    parser.add_argument("--max-tokens", type=positive_int, default=16)
    parser.add_argument("--time-limit", type=float, default=300, help="seconds per run at most")
    parser.add_argument("--no-caching", action="store_true", help="the same load with prefix caching off")
    parser.add_argument("--quick", action="store_true", help="1 and 4 clients, 8 requests of 4 tokens (for tests)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.requests, args.max_tokens, args.class_size = [1, 4], 8, 4, 4
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if args.url is None:
        console.print(f"starting the server, prefix caching {'off' if args.no_caching else 'on'}…")
    server, own = open_server(parser, args, {"--no-caching": args.no_caching}, enable_caching=not args.no_caching)
    console.print(f"[bold]server load[/] of {server.url} from {platform.machine()}, {os.cpu_count()} CPU cores, "
                  f"model {server.model}, max_tokens {args.max_tokens}; the same prompts for any server: {PROMPT_RULE}")

    runs = [load(server, n, args.requests, args.max_tokens, args.time_limit) for n in args.clients]
    burst = one_class(server, args.class_size, args.max_tokens)
    if own is not None:
        own.shutdown()

    table = Table(title="chat requests sharing a system prompt, greedy (per request, timed at the client)",
                  caption=f"cached tokens and TTFT: {SPREAD_COLUMN} over the run's requests")
    for column in ("clients", "requests", "req/s", "tokens/s", "prompt tokens (p50)", "hits / misses",
                   "cached tokens", "TTFT ms", "latency ms (p50)"):
        table.add_column(column, justify="right")
    for r in runs:
        table.add_row(*map(str, (r["clients"], r["requests"], r["requests_per_s"], r["completion_tokens_per_s"],
                                 "not reported" if r["prompt_tokens"] is None else f"{r['prompt_tokens']['p50']:,.0f}",
                                 "not reported" if r["hits"] is None else f"{r['hits']} / {r['misses']}",
                                 spread_text(r["cached_tokens"]), spread_text(r["ttft_ms"]),
                                 r["latency_ms_median"])))
    console.print(table)
    if runs[0]["cached_tokens"] is None:
        console.print(NOT_REPORTED)
    fewest, most = runs[0], runs[-1]
    ratio = round(most["requests_per_s"] / fewest["requests_per_s"], 2)
    console.print(f"requests/s, {most['clients']} clients / {fewest['clients']}: {ratio}x")
    console.print(f"a class of {burst['students']} asking at once: the first answer after "
                  f"{burst['first_answer_ms']:,.0f} ms, the last after {burst['last_answer_ms']:,.0f} ms")
    results = {"machine": platform.platform(), "cpu_cores": os.cpu_count(), "url": server.url, "model": server.model,
               "prompts": PROMPT_RULE,
               "caching": None if args.url else not args.no_caching,
               "runs": runs,
               "requests_per_s_ratio": ratio, "class": burst}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
