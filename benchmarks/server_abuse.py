"""Does the server stay fast for a class when one student attacks it, or leans on it?

    python prefix_caching.py --bench server_abuse                          # every scene, 15 s each
    python prefix_caching.py --bench server_abuse --scenes attacks         # the attacks only
    python prefix_caching.py --bench server_abuse --scenes long-prompt,long-alone --repeat 5
    python prefix_caching.py --bench server_abuse --scenes long-alone --fixed-budget   # the default's cap, fixed
    python prefix_caching.py --bench server_abuse --scenes class --json out.json       # the eight class scenes

It starts `python server.py` in a process of its own on a free port of 127.0.0.1, as a class
meets it: at its defaults (batching, the default step budget, every limit) with
--salt-by-api-key, the model and pool flags given here, and whatever --server-args adds
(--fixed-budget N adds --max-num-batched-tokens N). Its own process, because the clients'
threads here would otherwise take the interpreter's lock from its engine loop and count their
own Python as the server's. It also gets an --admin-key, only so that this benchmark can read
/health across tenants: the budget it runs, and whether it is idle before each scene.

The class: --honest students on 127.0.0.1, each with a key of its own, stream short chats
(max_tokens --max-tokens, greedy) one after another. Every request is timed at the client:
its time to first token (TTFT), its request time (until its last byte), and the gaps between
its tokens. The students run alone for --seconds (after a few seconds of warming up, while the
server learns what a step costs), then beside each scene in turn. The attacks come from
127.0.0.2 (on Linux every 127.x.y.z is this machine), --abusive attackers each once a second:

    drip          130 connections, each a request line and then one header byte every 9 s,
                  opened again as soon as the server cuts or refuses one (one attacker)
    padding       a chat of ~2,000 tokens, then 512 KiB of junk, then a close
    big-body      a ~1 MiB body (37,000 tiny messages, or CJK text) over --max-prompt-tokens
    half-close    a chat, then shutdown(SHUT_WR) (as `nc -N` does), and its reply read
    hang-up       a chat with a 12 KiB prompt, and a close at once
    half-body     the headers and half the body, then nothing
    made-up-keys  GET /cache with a new made-up API key each time

The class scenes are what students do to each other without meaning harm:

    heavy-student  one student (from 127.0.0.3, a key of its own) runs --heavy-loops loops
                   of ~--heavy-tokens-token chats back to back, max_tokens 4
    made-up-tenant heavy-student's loops, each chat under a key nobody listed, new every time
                   (where any key is taken, a key is no tenant: it counts as its address)
    many-streams   one student (from 127.0.0.3) keeps --streams streams of --stream-tokens
                   tokens going, each started again when it ends
    keyed-streams  --keyed-streams streams from 127.0.0.3 (16), each under a key of its own
    long-context   two streams of one student, each sending the ~--heavy-tokens-token chat
                   again (cached after the first) for --stream-tokens tokens: decodes that
                   attend to thousands of keys
    nat-class      --nat-students students (no other class beside them) and --nat-pages live
                   pages, each polling GET /health and GET /cache once a second, all from
                   127.0.0.1, as a class behind one NAT: what was served, what refused
    long-prompt    a ~--long-tokens-token chat (max_tokens 1) is sent; 1 s later a stream (a
                   short chat of 8 tokens) and an 8-token POST /generate: the stream's TTFT
                   and the /generate's request time against the same two sent alone just
                   before, and the long chat's request time (for one token, its TTFT)
    long-alone     the long chat alone: its request time, under the budget the server runs

The long chats are the course's demo system prompt and a pasted page of its words
(stalls.long_chat), each sent opened by a fresh line, so nothing of it is ever cached; the
long-prompt scene's requests each have a fresh key, so the two sent alone warm nothing for
the two sent beside. Reported for the honest students of each scene: how many were served,
their request time and TTFT (median and p90) and, beside an attack, their per-token
latency, against alone (the goal: at least 90 % served, within 1.5x), and beside
each of the five scenes of one student the fraction of their requests within 1.5x of alone's median
request time. With --repeat N every scene (alone too) runs N times and each figure shown is
the median of the N runs' figures. The load average at the start and the end says how busy
the machine was besides.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import http.client
import itertools
import json
import os
import platform
import secrets
import shlex
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import save_json
from benchmarks.openai_api import fresh_line
from benchmarks.served_clients import Server, Timed, budget_of, health, send, serving, wait_until_idle
from commands.flags import positive_float, positive_int
from commands.model_flags import add_model_arguments
from engine.llm_engine import DEFAULT_MAX_NUM_BATCHED_TOKENS

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PROMPT = (
    "You are a patient teaching assistant in a course about large language model serving. "
    "Answer every question in one short sentence, in plain words, without code."
)
QUESTIONS = ["What is a KV cache?", "What is a block hash?", "What is the free queue for?", "What is a ref count?"]
ATTACKER, OTHER_STUDENT = "127.0.0.2", "127.0.0.3"  # where each connects from (the class: CLASS)
CHAT = "/v1/chat/completions"
DRIP_CONNECTIONS = 130  # more than the old --max-connections (128), from one address: its share (32) holds
DRIP_EVERY_S = 9.0
SHORT_TOKENS = 8  # the long-prompt scene's stream and /generate
HEAVY_MAX_TOKENS = 4  # the heavy student wants the prefill, not the reply

ATTACKS = ("drip", "padding", "big-body", "half-close", "hang-up", "half-body", "made-up-keys")
BESIDE = ("heavy-student", "made-up-tenant", "many-streams", "keyed-streams", "long-context")  # one against the class
CLASS_SCENES = ("long-prompt", "long-alone", *BESIDE, "nat-class")
GROUPS = {"attacks": ATTACKS, "class": CLASS_SCENES, "all": ATTACKS + CLASS_SCENES}
BESIDE_THE_CLASS = (*ATTACKS, *BESIDE)  # the scenes measured against alone


def question(n: int, who: str, max_tokens: int, stream: bool = True) -> dict:
    """A student's short chat: the system prompt and question n (of four), greedy."""
    return {"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": f"{QUESTIONS[n % len(QUESTIONS)]} ({who})"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def fresh(messages: list[dict], max_tokens: int) -> dict:
    """A streamed chat of `messages` whose first message opens with a fresh line: under any
    key, nothing of it is cached."""
    first = {**messages[0], "content": f"{fresh_line()}\n{messages[0]['content']}"}
    return {"messages": [first, *messages[1:]], "max_tokens": max_tokens, "temperature": 0, "stream": True}


FRESH_KEYS = 2_000  # --listed-keys: keys a run may take as fresh (three a long-prompt run, one a long-alone)
_fresh = itertools.count()


def fresh_key() -> str:
    """A key no request used before: under --salt-by-api-key, a cache of its own, empty (one
    of the file's with --listed-keys)."""
    return f"fresh-{next(_fresh)}"


def listed_keys(args) -> list[str]:
    """Every key the benchmark's students send, for --listed-keys' --api-keys file."""
    return ([f"student-{i}" for i in range(args.honest)] + [f"nat-{i}" for i in range(args.nat_students)]
            + ["heavy-student", "many-streams", "long-context"] + [f"streamer-{i}" for i in range(args.keyed_streams)]
            + [f"fresh-{i}" for i in range(FRESH_KEYS)])


# -----------------------------------------------------------------------------
# The class, and the other student beside it


def honest(server: Server, key: str, max_tokens: int, until: float, replies: list[Timed]) -> None:
    """A student: short chats, streamed, one after another until `until`. After a failure a
    second's pause, as a student tries again a moment later."""
    for n in itertools.count():
        if time.monotonic() >= until:
            return
        reply = send(server, "POST", CHAT, question(n, key, max_tokens), key=key)
        replies.append(reply)
        if not reply.ok:
            time.sleep(1.0)


def other_student(server: Server, key: str | Callable[[int], str], body: Callable[[int], dict], until: float,
                  replies: list[Timed]) -> None:
    """One loop of the student on 127.0.0.3: request body(n) after body(n - 1) under `key` (or
    key(n)), each cut at `until`; after a refusal, a second's pause."""
    for n in itertools.count():
        if time.monotonic() >= until:
            return
        reply = send(server, "POST", CHAT, body(n), key=key(n) if callable(key) else key, source=OTHER_STUDENT,
                     until=until)
        replies.append(reply)
        if not reply.ok and time.monotonic() < until:
            time.sleep(1.0)


def page(server: Server, key: str, until: float, replies: dict[str, list[Timed]]) -> None:
    """A student's browser tab on the live page: GET /health and GET /cache with its key, once
    a second, until `until`."""
    while time.monotonic() < until:
        started = time.monotonic()
        for path in replies:
            replies[path].append(send(server, "GET", path, key=key))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))


def run_threads(targets: list[Callable[[], None]]) -> None:
    """Each target in a thread of its own, all at once; return when all have."""
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def with_class(server: Server, args, seconds: float, others: list[Callable[[float], None]]) -> list[Timed]:
    """The honest students for `seconds`, each of `others` called with the same deadline in a
    thread of its own beside them: the students' replies."""
    until = time.monotonic() + seconds
    replies: list[Timed] = []
    students = [functools.partial(honest, server, f"student-{i}", args.max_tokens, until, replies)
                for i in range(args.honest)]
    run_threads(students + [functools.partial(other, until) for other in others])
    return replies


# -----------------------------------------------------------------------------
# The attacks


def connect(server: Server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=30, source_address=(ATTACKER, 0))


def post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def chat(text: str, max_tokens: int = 64) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}).encode()


LONG = "Please summarise this. " + "All work and no play makes a dull model. " * 300  # ~12 KiB, ~2,700 tokens
PADDED = "Please summarise this. " + "All work and no play makes a dull model. " * 220  # ~2,000 tokens
MESSAGES = json.dumps({"messages": [{"role": "user", "content": "a"}] * 37_000}).encode()
CJK = json.dumps({"messages": [{"role": "user", "content": "缓存" * 170_000}]}, ensure_ascii=False).encode()


def attack_once(kind: str, server: Server, n: int) -> None:
    """One attack of `kind` (not drip); n counts them, to vary what is sent."""
    if kind == "made-up-keys":
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30, source_address=(ATTACKER, 0))
        conn.request("GET", "/cache", headers={"Authorization": f"Bearer made-up-{os.getpid()}-{n}-{time.time()}"})
        conn.getresponse().read()
        conn.close()
        return
    sock = connect(server)
    try:
        if kind == "padding":
            sock.sendall(post(CHAT, chat(PADDED)))
            sock.sendall(b"x" * (512 << 10))
        elif kind == "big-body":
            sock.sendall(post(CHAT, MESSAGES if n % 2 else CJK))
            sock.recv(1 << 16)
        elif kind == "half-close":
            sock.sendall(post(CHAT, chat(f"What is a cache? ({n})", max_tokens=16)))
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):
                pass
        elif kind == "hang-up":
            sock.sendall(post(CHAT, chat(LONG)))
        elif kind == "half-body":
            body = chat(LONG)
            sock.sendall(post(CHAT, body)[: -len(body) // 2])
            sock.recv(1 << 16)  # until the server's deadline answers (or cuts) it
    finally:
        sock.close()


def abusive(server: Server, kind: str, counts: dict, until: float) -> None:
    """Do `kind` once a second until `until`."""
    for n in itertools.count():
        if time.monotonic() >= until:
            return
        started = time.monotonic()
        try:
            attack_once(kind, server, n)
            counts["sent"] += 1
        except (OSError, http.client.HTTPException):
            counts["cut"] += 1  # the server refused or ended it: its right
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))


def drip(server: Server, counts: dict, until: float) -> None:
    """DRIP_CONNECTIONS connections, each sending one header byte every DRIP_EVERY_S seconds;
    one that the server cuts or refuses is opened again at once."""
    open_: dict[socket.socket, float] = {}  # socket -> when it last sent
    while time.monotonic() < until:
        now = time.monotonic()
        while len(open_) < DRIP_CONNECTIONS and time.monotonic() < until:
            try:
                sock = connect(server)
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


def attack(server: Server, args, kind: str, alone: dict) -> dict:
    """The class beside one attack: its figures, and the attacks sent and cut."""
    counts = {"sent": 0, "cut": 0}
    if kind == "drip":
        others = [functools.partial(drip, server, counts)]
    else:
        others = [functools.partial(abusive, server, kind, counts) for _ in range(args.abusive)]
    return class_figures(with_class(server, args, args.seconds, others), alone) | {"abuse": counts}


# -----------------------------------------------------------------------------
# The class scenes


@dataclass(frozen=True)
class Prompts:
    """The long chats of the class scenes (stalls.long_chat: real words), and their lengths in
    tokens as the server's tokenizer counts them (before the fresh line each is sent with)."""

    long: list[dict]
    long_tokens: int
    heavy: list[dict]
    heavy_tokens: int


def build_prompts(args) -> Prompts:
    """The long chats, measured with the model's own tokenizer (its chat template included)."""
    from benchmarks.stalls import long_chat
    from engine.model_files import load_tokenizer
    from engine.prompts import tokenize_prompts

    tokenizer = load_tokenizer(args.model)

    def tokenize(messages: list[dict]) -> list[int]:
        return tokenize_prompts(tokenizer, [messages])[0]

    long, heavy = long_chat(tokenize, args.long_tokens), long_chat(tokenize, args.heavy_tokens)
    return Prompts(long, len(tokenize(long)), heavy, len(tokenize(heavy)))


def long_prompt(server: Server, prompts: Prompts) -> dict:
    """A stream and a /generate, alone; then the long chat, and 1 s later the same two again
    (fresh keys: nothing of any of them cached)."""
    def stream() -> Timed:
        return send(server, "POST", CHAT, question(0, "stream", SHORT_TOKENS), key=fresh_key())

    def generate() -> Timed:
        return send(server, "POST", "/generate", question(1, "generate", SHORT_TOKENS, stream=False), key=fresh_key())

    stream_alone, generate_alone = stream(), generate()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        long = pool.submit(send, server, "POST", CHAT, fresh(prompts.long, 1), fresh_key())
        time.sleep(1.0)
        beside = pool.submit(stream), pool.submit(generate)
        stream_beside, generate_beside = (future.result() for future in beside)
        long_reply = long.result()
    replies = [stream_alone, generate_alone, long_reply, stream_beside, generate_beside]
    return {"requests": len(replies), "served": sum(r.ok for r in replies),
            "stream_ttft_alone_ms": stream_alone.ttft_ms, "stream_ttft_beside_ms": stream_beside.ttft_ms,
            "generate_alone_ms": generate_alone.total_ms, "generate_beside_ms": generate_beside.total_ms,
            "long_ms": long_reply.total_ms}


def long_alone(server: Server, prompts: Prompts) -> dict:
    """The long chat alone: its request time, for one token its time to first token."""
    reply = send(server, "POST", CHAT, fresh(prompts.long, 1), key=fresh_key())
    return {"requests": 1, "served": int(reply.ok), "long_ms": reply.total_ms}


def heavy_student(server: Server, args, prompts: Prompts, alone: dict) -> dict:
    """The class beside --heavy-loops loops of one student's long chats, each fresh."""
    replies: list[Timed] = []
    loop = functools.partial(other_student, server, "heavy-student", lambda n: fresh(prompts.heavy, HEAVY_MAX_TOKENS),
                             replies=replies)
    figures = class_figures(with_class(server, args, args.seconds, [loop] * args.heavy_loops), alone)
    return figures | {"other_student": tally(replies)}


def made_up_tenant(server: Server, args, prompts: Prompts, alone: dict) -> dict:
    """heavy-student's loops, each chat under a key nobody listed, new every time: where any key
    is taken (no --listed-keys) each would be a new tenant, served first, if a made-up key
    counted as one; with --listed-keys each is a 401."""
    replies: list[Timed] = []
    loop = functools.partial(other_student, server, lambda n: f"made-up-{secrets.token_hex(8)}",
                             lambda n: fresh(prompts.heavy, HEAVY_MAX_TOKENS), replies=replies)
    figures = class_figures(with_class(server, args, args.seconds, [loop] * args.heavy_loops), alone)
    return figures | {"other_student": tally(replies)}


def keyed_streams(server: Server, args, alone: dict) -> dict:
    """The class beside --keyed-streams streams from 127.0.0.3, each under a key of its own: one
    student with many keys, or as many classmates streaming long replies."""
    replies: list[Timed] = []
    loops = [functools.partial(other_student, server, f"streamer-{i}",
                               lambda n, i=i: question(n, f"streamer-{i}", args.stream_tokens), replies=replies)
             for i in range(args.keyed_streams)]
    figures = class_figures(with_class(server, args, args.seconds, loops), alone)
    return figures | {"other_student": tally(replies)}


def long_context(server: Server, args, prompts: Prompts, alone: dict) -> dict:
    """The class beside two streams of one student that send the heavy chat again and again (its
    blocks cached after the first) and stream --stream-tokens tokens over its ~--heavy-tokens
    tokens: decodes whose attention reads thousands of keys a token."""
    replies: list[Timed] = []
    body = {"messages": prompts.heavy, "max_tokens": args.stream_tokens, "temperature": 0, "stream": True}
    loop = functools.partial(other_student, server, "long-context", lambda n: body, replies=replies)
    figures = class_figures(with_class(server, args, args.seconds, [loop] * 2), alone)
    return figures | {"other_student": tally(replies)}


def many_streams(server: Server, args, alone: dict) -> dict:
    """The class beside --streams streams of one student, each started again when it ends."""
    replies: list[Timed] = []
    loop = functools.partial(other_student, server, "many-streams",
                             lambda n: question(n, "many-streams", args.stream_tokens), replies=replies)
    figures = class_figures(with_class(server, args, args.seconds, [loop] * args.streams), alone)
    return figures | {"other_student": tally(replies)}


def nat_class(server: Server, args) -> dict:
    """--nat-students students and --nat-pages live pages (each one of the students'), all
    from 127.0.0.1 for --seconds: the students' figures, and every kind's counts."""
    until = time.monotonic() + args.seconds
    chats: list[Timed] = []
    polls: dict[str, list[Timed]] = {"/health": [], "/cache": []}
    targets = [functools.partial(honest, server, f"nat-{i}", args.max_tokens, until, chats)
               for i in range(args.nat_students)]
    targets += [functools.partial(page, server, f"nat-{i}", until, polls) for i in range(args.nat_pages)]
    run_threads(targets)
    kinds = {"POST " + CHAT: tally(chats)} | {f"GET {path}": tally(replies) for path, replies in polls.items()}
    return class_figures(chats) | {"kinds": kinds}


def run_scene(name: str, server: Server, args, prompts: Prompts | None, alone: dict | None) -> dict:
    """One run of the scene `name`: its figures."""
    if name in ATTACKS:
        return attack(server, args, name, alone)
    if name == "long-prompt":
        return long_prompt(server, prompts)
    if name == "long-alone":
        return long_alone(server, prompts)
    if name == "heavy-student":
        return heavy_student(server, args, prompts, alone)
    if name == "made-up-tenant":
        return made_up_tenant(server, args, prompts, alone)
    if name == "many-streams":
        return many_streams(server, args, alone)
    if name == "keyed-streams":
        return keyed_streams(server, args, alone)
    if name == "long-context":
        return long_context(server, args, prompts, alone)
    return nat_class(server, args)


# -----------------------------------------------------------------------------
# Figures


def median_p90(values: list[float]) -> tuple[float | None, float | None]:
    """The median and the 90th percentile, to 0.1; None for no values.

    >>> median_p90([10.0, 20.0, 30.0, 40.0, 1000.0])
    (30.0, 1000.0)
    """
    if not values:
        return None, None
    p90 = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
    return round(statistics.median(values), 1), round(min(p90, max(values)), 1)


def class_figures(replies: list[Timed], alone: dict | None = None) -> dict:
    """The honest students' figures in one run: requests served, and the median and p90 of
    their per-token gaps, request times and TTFTs. Given alone's figures, also the fraction of
    all requests served within 1.5x of alone's median request time."""
    served = [r for r in replies if r.ok]
    figures = {"honest_requests": len(replies), "served": len(served),
               "success_rate": round(len(served) / len(replies), 3) if replies else None,
               "gaps": sum(len(r.gaps_ms) for r in served)}
    ttfts = [r.ttft_ms for r in served if r.ttft_ms is not None]  # None: a reply of no text
    for name, values in (("per_token_ms", [g for r in served for g in r.gaps_ms]),
                         ("request_ms", [r.total_ms for r in served]), ("ttft_ms", ttfts)):
        figures[f"{name}_median"], figures[f"{name}_p90"] = median_p90(values)
    if alone and alone["request_ms_median"] and replies:
        within = sum(r.total_ms <= 1.5 * alone["request_ms_median"] for r in served)
        figures["within_1_5x"] = round(within / len(replies), 3)
    return figures


def tally(replies: list[Timed]) -> dict:
    """How many were sent, served, refused with a 503 (a limit: the queue, the connections of
    one address), and failed otherwise (no answer, another status, cut at the scene's end)."""
    served = sum(r.ok for r in replies)
    refused = sum(r.status == 503 for r in replies)
    return {"sent": len(replies), "served": served, "refused": refused, "failed": len(replies) - served - refused}


def median_of(runs: list[dict]) -> dict:
    """Several runs' figures as one: each figure the median of the runs' (None where no run
    has it), figure by figure inside nested dicts.

    >>> median_of([{"a": 1, "b": {"c": 4}}, {"a": 3, "b": {"c": None}}, {"a": 2, "b": {"c": 6}}])
    {'a': 2, 'b': {'c': 5.0}}
    """
    merged = {}
    for key, first in runs[0].items():
        values = [run.get(key) for run in runs]
        if isinstance(first, dict):
            merged[key] = median_of(values)
        else:
            numbers = [value for value in values if value is not None]
            merged[key] = statistics.median(numbers) if numbers else None
    return merged


def add_ratios(scene: dict, alone: dict) -> None:
    """Beside the class: each of its medians against alone's, as `<figure>_ratio`."""
    for figure in ("per_token_ms_median", "request_ms_median", "ttft_ms_median"):
        if scene.get(figure) and alone.get(figure):
            scene[figure.replace("_median", "_ratio")] = round(scene[figure] / alone[figure], 2)


# -----------------------------------------------------------------------------
# Tables


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def attacks_table(alone: dict, scenes: dict):
    from rich.table import Table

    table = Table(title="honest students, alone and beside each attack (goal: 90 % served, within 1.5x)")
    for column in ("run", "served", "per-token median", "p90", "vs alone", "attacks sent / cut"):
        table.add_column(column, justify="left" if column == "run" else "right")
    table.add_row("alone", f"{alone['served']:g}/{alone['honest_requests']:g}", ms(alone["per_token_ms_median"]),
                  ms(alone["per_token_ms_p90"]), "1.00x", "")
    for name, r in scenes.items():
        table.add_row(name, f"{r['served']:g}/{r['honest_requests']:g} ({r['success_rate'] or 0:.0%})",
                      ms(r["per_token_ms_median"]), ms(r["per_token_ms_p90"]), times(r.get("per_token_ms_ratio")),
                      f"{r['abuse']['sent']:g} / {r['abuse']['cut']:g}")
    return table


def class_table(alone: dict | None, scenes: dict):
    from rich.table import Table

    table = Table(title="honest students' short chats: request time and TTFT, median / p90")
    for column in ("run", "served", "request time", "vs alone", "TTFT", "vs alone", "within 1.5x",
                   "other student: served / 503 / cut or failed"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, r in (({"alone": alone} if alone else {}) | scenes).items():
        other = r.get("other_student")
        table.add_row(name, f"{r['served']:g}/{r['honest_requests']:g}",
                      f"{ms(r['request_ms_median'])} / {ms(r['request_ms_p90'])}", times(r.get("request_ms_ratio")),
                      f"{ms(r['ttft_ms_median'])} / {ms(r['ttft_ms_p90'])}", times(r.get("ttft_ms_ratio")),
                      "-" if r.get("within_1_5x") is None else f"{r['within_1_5x']:.0%}",
                      f"{other['served']:g} / {other['refused']:g} / {other['failed']:g}" if other else "")
    return table


def long_table(scenes: dict, prompts: Prompts):
    from rich.table import Table

    two = ", and two short requests 1 s after it" if "long-prompt" in scenes else ""
    table = Table(title=f"a {prompts.long_tokens:,}-token chat (max_tokens 1){two}")
    for column in ("request", "alone", f"beside the {prompts.long_tokens:,}-token chat", "vs alone"):
        table.add_column(column, justify="left" if column == "request" else "right")
    if "long-prompt" in scenes:
        r = scenes["long-prompt"]
        for name, before, after in ((f"stream of {SHORT_TOKENS} tokens: TTFT", "stream_ttft_alone_ms",
                                     "stream_ttft_beside_ms"),
                                    (f"POST /generate of {SHORT_TOKENS} tokens: request time", "generate_alone_ms",
                                     "generate_beside_ms")):
            ratio = r[after] / r[before] if r[after] and r[before] else None
            table.add_row(name, ms(r[before]), ms(r[after]), times(ratio))
        table.add_row("the long chat (1 token): request time", "", ms(r["long_ms"]), "")
    if "long-alone" in scenes:
        table.add_row("the long chat alone (1 token): request time", ms(scenes["long-alone"]["long_ms"]), "", "")
    return table


def nat_table(scene: dict):
    from rich.table import Table

    table = Table(title="a class behind one address (127.0.0.1)")
    for column in ("request", "sent", "served", "refused (503)", "cut or failed otherwise"):
        table.add_column(column, justify="left" if column == "request" else "right")
    for kind, c in scene["kinds"].items():
        table.add_row(kind, *(f"{c[key]:g}" for key in ("sent", "served", "refused", "failed")))
    return table


# -----------------------------------------------------------------------------
# The command


def scene_list(text: str) -> list[str]:
    """--scenes: names and groups, comma-separated, in the order the benchmark runs them.

    >>> scene_list("nat-class,drip")
    ['drip', 'nat-class']
    """
    names = set()
    for name in filter(None, (part.strip() for part in text.split(","))):
        if name not in GROUPS and name not in GROUPS["all"]:
            raise argparse.ArgumentTypeError(f"no scene {name!r}: name some of {', '.join(GROUPS['all'])}, "
                                             f"or a group ({', '.join(GROUPS)})")
        names |= set(GROUPS.get(name, (name,)))
    if not names:
        raise argparse.ArgumentTypeError("name at least one scene")
    return [name for name in GROUPS["all"] if name in names]


def server_arguments(parser: argparse.ArgumentParser, args) -> list[str]:
    """The flags of the server to start: the model and pool flags, --server-args, and
    --fixed-budget's --max-num-batched-tokens; a flag the benchmark sets itself is refused."""
    extra = shlex.split(args.server_args)
    for flag in ("--host", "--port", "--model", "--salt-by-api-key", "--admin-key"):
        if any(word == flag or word.startswith(flag + "=") for word in extra):
            parser.error(f"--server-args: {flag} is the benchmark's to set (use the benchmark's --model)")
    if args.fixed_budget is not None:
        if any(word.startswith(("--max-num-batched-tokens", "--target-step-ms")) for word in extra):
            parser.error("--fixed-budget and a budget in --server-args: give one")
        extra += ["--max-num-batched-tokens", str(args.fixed_budget)]
    model = {"--model": args.model, "--device": args.device, "--dtype": args.dtype, "--block-size": args.block_size,
             "--num-blocks": args.num_blocks, "--kv-memory-gb": args.kv_memory_gb}
    return [word for flag, value in model.items() if value is not None for word in (flag, str(value))] + extra


def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench server_abuse",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenes", type=scene_list, default=list(GROUPS["all"]), metavar="A,B,...",
                        help=f"the scenes to run: {', '.join(GROUPS['all'])}, or a group: {', '.join(GROUPS)} "
                             f"(default: all)")
    parser.add_argument("--repeat", type=positive_int, default=1, help="runs of each scene; figures are their medians")
    parser.add_argument("--seconds", type=positive_float, default=15.0,
                        help="how long alone and each scene with a class last (default: 15)")
    parser.add_argument("--honest", type=positive_int, default=16, help="honest students (default: 16)")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="tokens of each honest chat (default: 32)")
    parser.add_argument("--abusive", type=positive_int, default=16,
                        help="attackers beside them, each once a second (default: 16; drip: 130 connections)")
    parser.add_argument("--long-tokens", type=positive_int, default=2000, help="the long chat (default: 2000)")
    parser.add_argument("--heavy-tokens", type=positive_int, default=3800, help="each heavy chat (default: 3800)")
    parser.add_argument("--heavy-loops", type=positive_int, default=8, help="the heavy student's loops (default: 8)")
    parser.add_argument("--streams", type=positive_int, default=32, help="many-streams' streams (default: 32)")
    parser.add_argument("--stream-tokens", type=positive_int, default=512,
                        help="max_tokens of each stream of many-streams, keyed-streams, long-context (default: 512)")
    parser.add_argument("--keyed-streams", type=positive_int, default=16,
                        help="keyed-streams' streams, a key each (default: 16)")
    parser.add_argument("--nat-students", type=positive_int, default=30, help="nat-class's students (default: 30)")
    parser.add_argument("--nat-pages", type=positive_int, default=8, help="nat-class's live pages (default: 8)")
    parser.add_argument("--server-args", default="", metavar='"..."',
                        help='more flags for python server.py, in one word: --server-args="--max-num-seqs 16"')
    parser.add_argument("--fixed-budget", type=positive_int, nargs="?", const=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        metavar="N", help=f"start the server with --max-num-batched-tokens N, a fixed budget of N "
                                          f"tokens a step (N left out: {DEFAULT_MAX_NUM_BATCHED_TOKENS}, the "
                                          f"default budget's cap and vLLM's)")
    parser.add_argument("--listed-keys", action="store_true",
                        help="start the server with --api-keys listing every key the students send, as a class "
                             "behind one NAT needs (docs/server.md): each key's requests are then counted by key, "
                             "not by address; the made-up-keys attack is refused with a 401")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_model_arguments(parser)
    return parser, parser.parse_args(argv)


def run_all(server: Server, args, prompts: Prompts | None, console) -> dict:
    """Every scene --repeat times, alone first in each round: {"alone", "scenes"}, each the
    median of its runs (the ratios against alone added), and "runs", each run's own."""
    needs_alone = any(name in BESIDE_THE_CLASS for name in args.scenes)
    runs: dict[str, list[dict]] = {"alone": []} | {name: [] for name in args.scenes}
    for round_ in range(args.repeat):
        alone = None
        if needs_alone:
            wait_until_idle(server)
            alone = class_figures(with_class(server, args, args.seconds, []))
            runs["alone"].append(alone)
        for name in args.scenes:
            console.print(f"  run {round_ + 1}/{args.repeat}: {name}…")
            wait_until_idle(server)
            runs[name].append(run_scene(name, server, args, prompts, alone))
    alone = median_of(runs["alone"]) if needs_alone else None
    scenes = {name: median_of(runs[name]) for name in args.scenes}
    for name in BESIDE_THE_CLASS:
        if name in scenes:
            add_ratios(scenes[name], alone)
    return {"alone": alone, "scenes": scenes, "runs": runs}


def measure(server: Server, args, prompts: Prompts | None, console, budget: str, load_before) -> dict:
    """Say what runs where, warm the server up, and run every scene (run_all)."""
    console.print(f"[bold]a class on the server[/] on {platform.machine()}, {os.cpu_count()} CPU cores; "
                  f"budget {budget}; {args.honest} honest students streaming {args.max_tokens} tokens, "
                  f"{args.seconds:g} s a scene, {args.repeat} run(s) each; load average at the start: "
                  f"{' '.join(f'{x:.2f}' for x in load_before)}")
    with_class(server, args, min(5.0, args.seconds), [])  # warm: the step costs learned
    return run_all(server, args, prompts, console)


def main(argv: list[str] | None = None) -> dict:
    parser, args = parse(argv)
    from rich.console import Console

    from engine.model_loader import resolve_device

    console = Console()
    device = resolve_device(args.device).type
    flags = server_arguments(parser, args)
    load_before = os.getloadavg()
    needs_prompts = any(name in ("long-prompt", "long-alone", "heavy-student", "made-up-tenant", "long-context")
                        for name in args.scenes)
    prompts = build_prompts(args) if needs_prompts else None
    key_file = None
    if args.listed_keys:
        key_file = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
        key_file.write("\n".join(listed_keys(args)) + "\n")
        key_file.close()
        flags += ["--api-keys", key_file.name]
    console.print(f"starting python server.py --salt-by-api-key {shlex.join(flags)}…")
    try:
        with serving(flags) as server:
            budget = budget_of(health(server))
            measured = measure(server, args, prompts, console, f"{budget}; {device}", load_before)
    finally:
        if key_file is not None:
            os.unlink(key_file.name)
    load_after = os.getloadavg()

    alone, scenes = measured["alone"], measured["scenes"]
    attacks = {name: scenes[name] for name in ATTACKS if name in scenes}
    if attacks:
        console.print(attacks_table(alone, attacks))
    heavy = {name: scenes[name] for name in (*BESIDE, "nat-class") if name in scenes}
    if heavy:
        console.print(class_table(alone, heavy))
    if "long-prompt" in scenes or "long-alone" in scenes:
        console.print(long_table(scenes, prompts))
    if "nat-class" in scenes:
        console.print(nat_table(scenes["nat-class"]))
    console.print(f"budget {budget}; load average at the end: {' '.join(f'{x:.2f}' for x in load_after)} "
                  f"({os.cpu_count()} CPU cores)")
    results = {"machine": platform.platform(), "cpu_cores": os.cpu_count(), "device": device, "budget": budget,
               "server_args": flags, "seconds": args.seconds, "repeat": args.repeat,
               "load_average": {"start": load_before, "end": load_after},
               "prompt_tokens": prompts and {"long": prompts.long_tokens, "heavy": prompts.heavy_tokens},
               **measured}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
