"""Does the server stay fast for a class when some clients misbehave?

    python prefix_caching.py --bench server_abuse                 # 16 honest clients, alone, then beside 16 abusive ones
    python prefix_caching.py --bench server_abuse --honest 8 --abusive 32 --json out.json

It starts the server in this process on a free port of 127.0.0.1 (the default model and pool
unless --model / --num-blocks say otherwise), batching, with its default limits. Honest clients
stream chats that share a system prompt (max_tokens --max-tokens, greedy), one after another,
and time the gap between two tokens. Abusive clients each do one thing once a second, in turn
by kind:

    hang-up    send a chat with a 12 KiB prompt and close the connection at once
    half-body  send the headers and half the body, then nothing (until the read timeout)
    poll       GET /cache, as a class with the live page open

Two runs of --seconds each, in one process on one server: the honest clients alone, then the
same honest clients beside the abusive ones. The figure is the ratio of the two medians of
the per-token latency (the server's goal: within 2x).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import os
import platform
import socket
import statistics
import threading
import time

from benchmarks import save_json
from benchmarks.openai_api import start_server
from engine import add_model_arguments, positive_int

SYSTEM_PROMPT = (
    "You are a patient teaching assistant in a course about large language model serving. "
    "Answer every question in one short sentence, in plain words, without code."
)
QUESTIONS = ["What is a KV cache?", "What is a block hash?", "What is the free queue for?", "What is a ref count?"]
KINDS = ("hang-up", "half-body", "poll")


def honest(host: str, port: int, i: int, max_tokens: int, until: float, gaps: list[float], sent: list) -> None:
    """Stream chats until `until`; append the gap between every two tokens, in ms."""
    for n in itertools.count():
        if time.monotonic() >= until:
            return
        sent.append(1)
        body = {"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                             {"role": "user", "content": f"{QUESTIONS[(i + n) % len(QUESTIONS)]} (student {i})"}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True}
        conn = http.client.HTTPConnection(host, port, timeout=120)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        last = None
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1e3)
            last = now
        conn.close()


def abusive(host: str, port: int, kind: str, until: float, counts: dict) -> None:
    """Do `kind` once a second until `until`."""
    long_prompt = "Please summarise this. " + "All work and no play makes a dull model. " * 300  # ~12 KiB
    body = json.dumps({"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 64}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    left_open = []
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            if kind == "poll":
                conn = http.client.HTTPConnection(host, port, timeout=30)
                conn.request("GET", "/cache")
                conn.getresponse().read()
                conn.close()
            else:
                sock = socket.create_connection((host, port), timeout=30)
                if kind == "hang-up":
                    sock.sendall(head + body)
                    sock.close()
                else:
                    sock.sendall(head + body[: len(body) // 2])
                    left_open.append(sock)  # the server's read timeout closes it
            counts[kind] += 1
        except OSError:
            counts["refused"] += 1  # the server said no (a full queue, the connection cap): its right
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    for sock in left_open:
        sock.close()


def run(engine, host: str, port: int, honest_clients: int, abusive_clients: int, max_tokens: int,
        seconds: float) -> dict:
    until = time.monotonic() + seconds
    gaps: list[float] = []
    sent: list[int] = []
    counts = dict.fromkeys((*KINDS, "refused"), 0)
    admitted_before = engine.allocator.stats.requests
    threads = [threading.Thread(target=honest, args=(host, port, i, max_tokens, until, gaps, sent))
               for i in range(honest_clients)]
    threads += [threading.Thread(target=abusive, args=(host, port, KINDS[i % len(KINDS)], until, counts))
                for i in range(abusive_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Every request the engine admitted took blocks once at least; the honest ones are known.
    admitted_abusive = engine.allocator.stats.requests - admitted_before - len(sent)
    return {"honest": honest_clients, "abusive": abusive_clients, "honest_requests": len(sent),
            "abusive_requests_admitted": admitted_abusive, "gaps": len(gaps),
            "per_token_ms_median": round(statistics.median(gaps), 1) if gaps else None,
            "per_token_ms_p90": round(statistics.quantiles(gaps, n=10)[-1], 1) if len(gaps) > 1 else None,
            "abuse": counts}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench server_abuse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--honest", type=positive_int, default=16, help="honest clients (default: 16)")
    parser.add_argument("--abusive", type=positive_int, default=16, help="abusive clients beside them (default: 16)")
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each of the two runs lasts")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    from rich.console import Console

    console = Console()
    console.print("starting the server…")
    url, server, engine = start_server(args, batching=True)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    logging.getLogger("server").setLevel(logging.ERROR)  # one warning per abusive request otherwise
    host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    console.print(f"[bold]server under abuse[/] on {platform.machine()}, {os.cpu_count()} CPU cores, "
                  f"{engine.device.type}, {args.honest} honest clients streaming {args.max_tokens} tokens, "
                  f"{args.seconds:g} s a run")
    alone = run(engine, host, port, args.honest, 0, args.max_tokens, args.seconds)
    console.print(f"  alone:            median {alone['per_token_ms_median']} ms a token "
                  f"(p90 {alone['per_token_ms_p90']}), {alone['gaps']} gaps")
    beside = run(engine, host, port, args.honest, args.abusive, args.max_tokens, args.seconds)
    console.print(f"  beside {args.abusive} abusive: median {beside['per_token_ms_median']} ms a token "
                  f"(p90 {beside['per_token_ms_p90']}), {beside['gaps']} gaps; abuse sent: {beside['abuse']}; "
                  f"abusive requests the engine admitted: {beside['abusive_requests_admitted']}")
    server.shutdown()
    ratio = round(beside["per_token_ms_median"] / alone["per_token_ms_median"], 2)
    console.print(f"per-token latency, beside the abusive clients / alone: [bold]{ratio}x[/] (goal: within 2x)")
    results = {"machine": platform.platform(), "cpu_cores": os.cpu_count(), "device": engine.device.type,
               "alone": alone, "beside": beside, "ratio": ratio}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
