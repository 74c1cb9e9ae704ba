"""Stalls: what a long prompt does to the streams around it, at the settings a class runs.

    python prefix_caching.py --bench stalls [--long-tokens 4000] [--http] [--json out.json]

Four students are reading their replies as they stream when a fifth sends a ~4,000-token
chat prompt (a pasted document). The scene runs on this course's batching engine at its
defaults (each step's budget from a target step time, engine/step_budget.py) and, side by side in
the same run, with the fixed budget of 2,048 tokens a step (vLLM's default
max_num_batched_tokens, this engine's before the target). Reported for each:

    streams   their median gap between tokens before the prompt arrived, and their longest
              gap while it was prefilled (the target: at most 3x the median)
    prompt    its time to first token, against the same prompt sent alone to the same
              engine (the target: at most 2x)

In process by default (Engine(), what python server.py runs); --http runs the
same scene over HTTP against a server of this course started at its defaults in this
process (and one with --max-num-batched-tokens 2048), the streams read as a client reads them.
Each run's long prompt has a cache_salt of its own, so no run hits another's blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request

import torch
from rich.table import Table

from benchmarks import save_json
from benchmarks.engines import StepSeen, captured, open_engine, watch_steps
from benchmarks.openai_api import start_server
from benchmarks.throughput import TOPICS
from commands.demo import DEMO_SYSTEM_PROMPT
from commands.flags import positive_int
from commands.model_flags import add_model_arguments
from engine.llm_engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_TARGET_STEP_MS, Engine
from engine.model_loader import DEFAULT_MODEL

SYSTEM = {"role": "system", "content": DEMO_SYSTEM_PROMPT}


def long_chat(tokenize, n: int) -> list[dict]:
    """A chat of about n tokens: the course's system prompt, then a pasted document."""
    words = []
    while len(tokenize([SYSTEM, {"role": "user", "content": " ".join(words)}])) < n:
        words += (DEMO_SYSTEM_PROMPT + "\n").split(" ")[:60]
    return [SYSTEM, {"role": "user", "content": "Summarise this page:\n" + " ".join(words)}]


# -----------------------------------------------------------------------------
# Two ways to stream: from the engine in this process, or from a server over HTTP


def engine_stream(engine: Engine):
    def stream(messages, max_tokens, salt, stop: threading.Event, times: list[float]) -> None:
        for _ in engine.stream(messages, max_tokens=max_tokens, cache_salt=salt):
            times.append(time.perf_counter())
            if stop.is_set():
                return  # closing the stream cancels the request
    return stream


def http_stream(url: str):
    def stream(messages, max_tokens, salt, stop: threading.Event, times: list[float]) -> None:
        body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                if raw.startswith(b"data: {"):
                    times.append(time.perf_counter())
                    if stop.is_set():
                        return  # the server sees the hang-up
    return stream


# -----------------------------------------------------------------------------
# The scene


def while_prefilling(steps: list[StepSeen], arrival: float, first: float) -> dict:
    """The steps that ran while the long prompt was prefilled: how many, their prompt tokens and
    times, and the thread counts they ran with."""
    during = [s for s in steps if s.start >= arrival and s.end <= first]
    chunks = [s.prefill_tokens for s in during if s.prefill_tokens]
    times = [(s.end - s.start) * 1e3 for s in during]
    return {"steps": len(during), "chunk_min": min(chunks, default=0), "chunk_max": max(chunks, default=0),
            "step_median_ms": statistics.median(times) if times else 0.0, "step_max_ms": max(times, default=0.0),
            "threads": sorted({s.threads for s in during if s.threads is not None})}


def run_scene(stream, long_messages, args, salt: str) -> dict:
    """Clients stream; once each has args.warm_tokens, the long prompt arrives; stop once it
    has its first token and the clients have streamed a little past it."""
    stop = threading.Event()
    client_times: list[list[float]] = [[] for _ in range(args.clients)]
    threads = []
    for i, times in enumerate(client_times):
        question = [SYSTEM, {"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}, step by step."}]
        threads.append(threading.Thread(target=stream, args=(question, args.client_tokens, None, stop, times)))
    for thread in threads:
        thread.start()
    while min(len(t) for t in client_times) < args.warm_tokens:
        if not all(thread.is_alive() for thread in threads):  # a stream refused or ended early: say so
            stop.set()
            raise SystemExit(f"a stream ended before its first {args.warm_tokens} tokens (see above); "
                             f"--client-tokens must be within the server's --max-tokens-limit")
        time.sleep(0.01)
    arrival = time.perf_counter()
    long_times: list[float] = []
    long_thread = threading.Thread(target=stream, args=(long_messages, 2, salt, threading.Event(), long_times))
    long_thread.start()
    long_thread.join()
    first = long_times[0]
    time.sleep(3 * statistics.median(gaps_of(client_times, 0, arrival)))  # a few tokens after it, then stop
    stop.set()
    for thread in threads:
        thread.join()
    before = gaps_of(client_times, 0, arrival)
    during = [b - a for times in client_times for a, b in zip(times, times[1:]) if b > arrival and a < first]
    return {"gap_median_before_ms": statistics.median(before) * 1e3, "gap_longest_during_ms": max(during) * 1e3,
            "gap_ratio": max(during) / statistics.median(before), "ttft_s": first - arrival,
            "arrival": arrival, "first": first}


def gaps_of(client_times, start: float, end: float) -> list[float]:
    return [b - a for times in client_times for a, b in zip(times, times[1:]) if a >= start and b <= end]


def alone(stream, long_messages, salt: str) -> float:
    times: list[float] = []
    start = time.perf_counter()
    stream(long_messages, 2, salt, threading.Event(), times)
    return times[0] - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench stalls", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--clients", type=positive_int, default=4, help="students streaming when the prompt arrives")
    parser.add_argument("--warm-tokens", type=positive_int, default=12, help="tokens each streams before it arrives")
    parser.add_argument("--client-tokens", type=positive_int, default=500,
                        help="max_tokens of each stream (default 500: within the server's --max-tokens-limit)")
    parser.add_argument("--long-tokens", type=positive_int, default=4000, help="the long chat prompt's length")
    parser.add_argument("--http", action="store_true",
                        help="over HTTP, against servers of this course at their defaults")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="a small scene (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.warm_tokens, args.client_tokens, args.long_tokens = 2, 3, 200, 300

    console, engine, device = open_engine(args)  # its model serves both engines (or both servers)
    long_messages = long_chat(engine.tokenize, args.long_tokens)
    num_tokens = len(engine.tokenize(long_messages))
    ways = {"target": {}, "fixed": {"max_num_batched_tokens": DEFAULT_MAX_NUM_BATCHED_TOKENS}}
    names = {"target": f"default: {DEFAULT_TARGET_STEP_MS:g} ms target step",
             "fixed": f"fixed {DEFAULT_MAX_NUM_BATCHED_TOKENS} tokens a step (vLLM's default)"}
    console.print(f"[bold]Stalls[/]: {args.model or DEFAULT_MODEL} on {engine.device} ({device}, "
                  f"{torch.get_num_threads()} threads), {'over HTTP' if args.http else 'in process'}; {args.clients} "
                  f"streams when a {num_tokens:,}-token chat prompt arrives")
    results = {"machine": device, "http": args.http, "long_tokens": num_tokens, "ways": {}}
    for way, options in ways.items():  # each engine closed before the next starts (cpu_threads.in_own_thread)
        server = None
        if args.http:
            url, server, serving = start_server(args, **options)
            stream = http_stream(url)
        else:
            serving = Engine(model=engine.model, tokenizer=engine.tokenizer, block_size=args.block_size,
                             num_blocks=engine.allocator.num_blocks, **options)
            serving.warm_up(stage_7=False)  # as server.py warms its engine
            stream = engine_stream(serving)
        steps = watch_steps(serving)
        stream([SYSTEM, {"role": "user", "content": "Hi"}], 4, None, threading.Event(), [])  # first steps: untimed
        captures = captured(serving)  # CUDA graphs (none on a CPU)
        scene = run_scene(stream, long_messages, args, salt=f"{way}-with-streams")
        scene["prefill"] = while_prefilling(steps, scene.pop("arrival"), scene.pop("first"))
        scene["ttft_alone_s"] = alone(stream, long_messages, salt=f"{way}-alone")
        scene["ttft_ratio"] = scene["ttft_s"] / scene["ttft_alone_s"]
        scene["captures_while_timed"] = captured(serving) - captures
        results["ways"][way] = scene
        if server is not None:
            server.shutdown()
        serving.close()

    table = Table(title=f"{args.clients} streams, then a {num_tokens:,}-token prompt arrives")
    table.add_column("", no_wrap=True)
    for way in ways:
        table.add_column(names[way], justify="right")
    rows = [("streams: median gap before it", lambda r: f"{r['gap_median_before_ms']:,.0f} ms"),
            ("streams: longest gap while it prefills",
             lambda r: f"{r['gap_longest_during_ms']:,.0f} ms ({r['gap_ratio']:.1f}x; target 3x)"),
            ("the prompt: first token", lambda r: f"{r['ttft_s']:.1f} s"),
            ("steps while it prefills", lambda r: f"{r['prefill']['steps']}: chunks of {r['prefill']['chunk_min']:,}-"
                                                  f"{r['prefill']['chunk_max']:,} tokens"),
            ("  those steps: median, longest", lambda r: f"{r['prefill']['step_median_ms']:,.0f} ms, "
                                                         f"{r['prefill']['step_max_ms']:,.0f} ms"),
            ("  threads they ran with", lambda r: ", ".join(map(str, r["prefill"]["threads"])) or "-"),
            ("the prompt alone: first token",
             lambda r: f"{r['ttft_alone_s']:.1f} s ({r['ttft_ratio']:.1f}x; target 2x)"),
            ("CUDA graphs captured while timed", lambda r: str(r["captures_while_timed"]))]
    for name, show in rows:
        table.add_row(name, *(show(results["ways"][way]) for way in ways))
    console.print(table)
    console.print(f"Measured in this run on {device}.")
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
