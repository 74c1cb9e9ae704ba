"""Does the server stay fast for a class when one student attacks it?

    python prefix_caching.py --bench server_abuse                 # 16 honest clients, alone, then beside each attack
    python prefix_caching.py --bench server_abuse --honest 8 --abusive 32 --seconds 10 --json out.json

It starts the server in this process on a free port of 127.0.0.1 (the default model and pool
unless --model / --num-blocks say otherwise), batching, with its default limits and
--salt-by-api-key (each honest client has a key of its own). Honest clients, on 127.0.0.1,
stream chats (max_tokens --max-tokens, greedy), one after another, and time the gap between
two tokens. The attackers connect from 127.0.0.2 (on Linux every 127.x.y.z is this machine),
one attack a run, each attack a server can meet under load:

    drip        130 connections, each a request line and then one header byte every 9 s,
                opened again as soon as the server cuts or refuses one
    padding     a chat of ~2,000 tokens, then 512 KiB of junk, then a close
    big-body    a ~1 MiB body (37,000 tiny messages, or CJK text) over --max-prompt-tokens
    half-close  a chat, then shutdown(SHUT_WR) (as `nc -N` does), and its reply read
    hang-up     a chat with a 12 KiB prompt, and a close at once
    half-body   the headers and half the body, then nothing
    made-up-keys  GET /cache with a new made-up API key each time
(--abusive attackers, each once a second; drip is one attacker of 130 connections.)

A run lasts --seconds: the honest clients alone (after a few seconds of warming up, while
the server learns what a step costs), then beside each attack in turn, in one process on one
server. For each: the honest requests that succeeded (a 200 and a whole
stream), and the median per-token latency against alone (the goal: at least 90 % served,
within 1.5x).
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
from engine import Engine
from flags import positive_int
from model_flags import add_model_arguments, pool_arguments

SYSTEM_PROMPT = (
    "You are a patient teaching assistant in a course about large language model serving. "
    "Answer every question in one short sentence, in plain words, without code."
)
QUESTIONS = ["What is a KV cache?", "What is a block hash?", "What is the free queue for?", "What is a ref count?"]
ATTACKER = "127.0.0.2"
DRIP_CONNECTIONS = 130  # the issue's: more than --max-connections (128)
DRIP_EVERY_S = 9.0


def honest(host: str, port: int, i: int, max_tokens: int, until: float, gaps: list[float], results: list) -> None:
    """Stream chats until `until`; append the gap between every two tokens, in ms, and for
    each request whether it succeeded."""
    for n in itertools.count():
        if time.monotonic() >= until:
            return
        body = {"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                             {"role": "user", "content": f"{QUESTIONS[(i + n) % len(QUESTIONS)]} (student {i})"}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True}
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer student-{i}"}
        ok, last, mine = False, None, []
        try:
            conn = http.client.HTTPConnection(host, port, timeout=60)
            conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
            response = conn.getresponse()
            for line in response:
                if line.startswith(b"data: [DONE]"):
                    ok = response.status == 200 and bool(mine)
                if not line.startswith(b"data: {") or b'"error"' in line:
                    continue
                now = time.perf_counter()
                if last is not None:
                    mine.append((now - last) * 1e3)
                last = now
            conn.close()
        except OSError:
            ok = False
        gaps.extend(mine)
        results.append(ok)
        if not ok:
            time.sleep(1.0)  # what a student does after an error: try again a moment later


def connect(host: str, port: int) -> socket.socket:
    return socket.create_connection((host, port), timeout=30, source_address=(ATTACKER, 0))


def post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def chat(text: str, max_tokens: int = 64) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}).encode()


LONG = "Please summarise this. " + "All work and no play makes a dull model. " * 300  # ~12 KiB, ~2,700 tokens
PADDED = "Please summarise this. " + "All work and no play makes a dull model. " * 220  # ~2,000 tokens
MESSAGES = json.dumps({"messages": [{"role": "user", "content": "a"}] * 37_000}).encode()
CJK = json.dumps({"messages": [{"role": "user", "content": "缓存" * 170_000}]}, ensure_ascii=False).encode()


def attack_once(kind: str, host: str, port: int, n: int) -> None:
    """One attack of `kind` (not drip); n counts them, to vary what is sent."""
    if kind == "made-up-keys":
        conn = http.client.HTTPConnection(host, port, timeout=30, source_address=(ATTACKER, 0))
        conn.request("GET", "/cache", headers={"Authorization": f"Bearer made-up-{os.getpid()}-{n}-{time.time()}"})
        conn.getresponse().read()
        conn.close()
        return
    sock = connect(host, port)
    try:
        if kind == "padding":
            sock.sendall(post("/v1/chat/completions", chat(PADDED)))
            sock.sendall(b"x" * (512 << 10))
        elif kind == "big-body":
            sock.sendall(post("/v1/chat/completions", MESSAGES if n % 2 else CJK))
            sock.recv(1 << 16)
        elif kind == "half-close":
            sock.sendall(post("/v1/chat/completions", chat(f"What is a cache? ({n})", max_tokens=16)))
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):
                pass
        elif kind == "hang-up":
            sock.sendall(post("/v1/chat/completions", chat(LONG)))
        elif kind == "half-body":
            body = chat(LONG)
            sock.sendall(post("/v1/chat/completions", body)[: -len(body) // 2])
            sock.recv(1 << 16)  # until the server's deadline answers (or cuts) it
    finally:
        sock.close()


def abusive(host: str, port: int, kind: str, until: float, counts: dict) -> None:
    """Do `kind` once a second until `until`."""
    for n in itertools.count():
        if time.monotonic() >= until:
            return
        started = time.monotonic()
        try:
            attack_once(kind, host, port, n)
            counts["sent"] += 1
        except OSError:
            counts["cut"] += 1  # the server refused or ended it: its right
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))


def drip(host: str, port: int, until: float, counts: dict) -> None:
    """DRIP_CONNECTIONS connections, each sending one header byte every DRIP_EVERY_S seconds;
    one that the server cuts or refuses is opened again at once."""
    open_: dict[socket.socket, float] = {}  # socket -> when it last sent
    while time.monotonic() < until:
        now = time.monotonic()
        while len(open_) < DRIP_CONNECTIONS and time.monotonic() < until:
            try:
                sock = connect(host, port)
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
                open_[sock] = now
                counts["sent"] += 1
            except OSError:
                counts["cut"] += 1
                break
        for sock, last in list(open_.items()):
            if now - last < DRIP_EVERY_S:
                continue
            try:
                sock.sendall(b"X")
                open_[sock] = now
            except OSError:
                counts["cut"] += 1
                sock.close()
                del open_[sock]
        time.sleep(0.2)
    for sock in open_:
        sock.close()


def run(host: str, port: int, honest_clients: int, attack: str | None, abusive_clients: int, max_tokens: int,
        seconds: float) -> dict:
    until = time.monotonic() + seconds
    gaps: list[float] = []
    results: list[bool] = []
    counts = {"sent": 0, "cut": 0}
    threads = [threading.Thread(target=honest, args=(host, port, i, max_tokens, until, gaps, results))
               for i in range(honest_clients)]
    if attack == "drip":
        threads.append(threading.Thread(target=drip, args=(host, port, until, counts)))
    elif attack is not None:
        threads += [threading.Thread(target=abusive, args=(host, port, attack, until, counts))
                    for _ in range(abusive_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"attack": attack, "honest_requests": len(results), "served": sum(results),
            "success_rate": round(sum(results) / len(results), 3) if results else None, "gaps": len(gaps),
            "per_token_ms_median": round(statistics.median(gaps), 1) if gaps else None,
            "per_token_ms_p90": round(statistics.quantiles(gaps, n=10)[-1], 1) if len(gaps) > 1 else None,
            "abuse": counts}


ATTACKS = ("drip", "padding", "big-body", "half-close", "hang-up", "half-body", "made-up-keys")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench server_abuse",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--honest", type=positive_int, default=16, help="honest clients (default: 16)")
    parser.add_argument("--abusive", type=positive_int, default=16,
                        help="attackers beside them, each once a second (default: 16; drip: 130 connections)")
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each run lasts (default: 20)")
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS), help="the attacks to run")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from server import create_app, serve_in_background

    console = Console()
    console.print("starting the server…")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    logging.getLogger("server").setLevel(logging.ERROR)  # one warning per abusive request otherwise
    engine = Engine(args.model, device=args.device, dtype=args.dtype, **pool_arguments(args), batching=True)
    engine.warm_up()
    url, server = serve_in_background(create_app(engine, salt_by_api_key=True))
    host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    console.print(f"[bold]server under attack[/] on {platform.machine()}, {os.cpu_count()} CPU cores, "
                  f"{engine.device.type}, {args.honest} honest clients streaming {args.max_tokens} tokens, "
                  f"{args.seconds:g} s a run, load average before: {os.getloadavg()[0]:.2f}")
    run(host, port, args.honest, None, 0, args.max_tokens, min(5.0, args.seconds))  # warm: the step costs learned
    alone = run(host, port, args.honest, None, 0, args.max_tokens, args.seconds)
    beside = {}
    for attack in args.attacks:
        beside[attack] = run(host, port, args.honest, attack, args.abusive, args.max_tokens, args.seconds)
        beside[attack]["ratio"] = (round(beside[attack]["per_token_ms_median"] / alone["per_token_ms_median"], 2)
                                   if beside[attack]["per_token_ms_median"] and alone["per_token_ms_median"] else None)
    server.shutdown()
    table = Table(title="honest clients, alone and beside each attack (goal: 90 % served, within 1.5x)")
    for column in ("run", "served", "per-token median", "p90", "vs alone", "attacks sent / cut"):
        table.add_column(column, justify="left" if column == "run" else "right")
    table.add_row("alone", f"{alone['served']}/{alone['honest_requests']}", f"{alone['per_token_ms_median']} ms",
                  f"{alone['per_token_ms_p90']} ms", "1.00x", "")
    for attack, r in beside.items():
        table.add_row(attack, f"{r['served']}/{r['honest_requests']} ({r['success_rate']:.0%})",
                      f"{r['per_token_ms_median']} ms", f"{r['per_token_ms_p90']} ms", f"{r['ratio']}x",
                      f"{r['abuse']['sent']} / {r['abuse']['cut']}")
    console.print(table)
    console.print(f"load average after: {os.getloadavg()[0]:.2f}")
    results = {"machine": platform.platform(), "cpu_cores": os.cpu_count(), "device": engine.device.type,
               "alone": alone, "beside": beside}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
