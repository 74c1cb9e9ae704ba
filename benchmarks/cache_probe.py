"""Does a server's prefix cache work, and does it leak? Cold and warm time to first token, and
the timing side channel of stage 9, measured through the OpenAI API on any server.

    python prefix_caching.py --bench cache_probe                      # a server of this course, started here
    python prefix_caching.py --bench cache_probe --url http://HOST:8000 --api-key KEY   # any server
    python prefix_caching.py --bench cache_probe --compare-generate   # this course's server: OpenAI vs /generate

1. cold / warm: a shared prefix of --prefix-words words (about as many tokens) and a short
   question, max_tokens 1, streamed, timed at the client. Cold: the prefix opened by a fresh
   first line, so nothing of it is cached anywhere and nothing needs resetting (vLLM has
   POST /reset_prefix_cache only in dev mode). Warm: the same prompt again. For each kind,
   over --repeats requests: the cached tokens the server reports (or that it reports none),
   how many requests found some cached (hits) and how many none (misses), and the spread of
   cached tokens and TTFT (p50, p90, p99, min, max).
2. the side channel: tenant A sends a letter with her name in it; tenant B sends the same
   letter with each name he suspects and times the replies. First with no salt, then with a
   cache_salt per tenant in the body (vLLM and this course's server take it): the right
   guess should then wait like the wrong ones. A verdict on the salt follows from the cached
   tokens: it works, the server ignores it (tenants still hit each other's blocks), or it
   cannot be told (no cached tokens reported, or no side channel to close without a salt).

--compare-generate (a server of this course): the same cold/warm prompts through its own
route, /generate, as well; the cached tokens must be equal and the client's times close
(within COMPARE_TOLERANCE). With --url every request goes to that server, wherever it is.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
import urllib.request

from rich.console import Console
from rich.table import Table

from analyzer.request_logs import Writer
from benchmarks import save_json
from benchmarks.openai_api import (NOT_REPORTED, OpenAIServer, Reply, add_server_arguments, fresh_line, hits_and_misses,
                                   open_server, SPREAD_COLUMN, spread_json, spread_text)
from commands.flags import positive_int

COMPARE_TOLERANCE = 0.25  # OpenAI's streamed route and /generate: medians within 25 % of each other
NAMES = ["Sam Ortega", "Priya Natarajan", "Dana Whitfield", "Lena Brandt"]
VICTIM = "Dana Whitfield"


def request_class(replies: list[Reply]) -> dict:
    """The figures of one kind of request, per request: prompt and cached tokens, hits and
    misses, TTFT (None where the server reports nothing)."""
    hits = hits_and_misses(replies)
    return {"requests": len(replies), "prompt_tokens": spread_json([r.prompt_tokens for r in replies]),
            "cached_tokens": spread_json([r.cached_tokens for r in replies]),
            "hits": None if hits is None else hits[0], "misses": None if hits is None else hits[1],
            "ttft_ms": spread_json([r.ttft_ms for r in replies])}


def salt_verdict(probes: dict[bool, dict[str, Reply]]) -> tuple[str, str]:
    """What the side channel says of cache_salt on this server: ("works", "ignored",
    "untested" or "unknown", a sentence). Where the salt is ignored, tenant B's right guess
    finds tenant A's whole letter cached; it is set against his wrong guesses after his
    first, which find what that first guess cached under his own salt."""
    found = {}
    for salted, replies in probes.items():
        right = replies[VICTIM].cached_tokens
        wrong = [replies[name].cached_tokens for name in NAMES[1:] if name != VICTIM]
        if right is None or None in wrong:
            return "unknown", "cache_salt: cannot tell, this server reports no cached tokens (the times above may)"
        found[salted] = (right, max(wrong))
    (open_right, open_wrong), (salted_right, salted_wrong) = found[False], found[True]
    if open_right <= open_wrong:
        return "untested", (f"cache_salt: untested, for without a salt the right guess found no more cached than the "
                            f"wrong ones ({open_right} against {open_wrong} tokens): is prefix caching on?")
    if salted_right > salted_wrong:
        return "ignored", (f"[bold red]salt ignored by this server[/]: with a cache_salt per tenant, tenant B's right "
                           f"guess still found {salted_right} tokens of tenant A's letter cached (his wrong guesses "
                           f"{salted_wrong} at most): its tenants share one cache")
    return "works", (f"cache_salt works on this server: with a salt per tenant the right guess found no more cached "
                     f"than the wrong ones ({salted_right} against {salted_wrong} tokens); without one, "
                     f"{open_right} against {open_wrong}")


def cold_warm(server: OpenAIServer, prefix: str, repeats: int, rng: random.Random) -> dict[str, list[Reply]]:
    """`repeats` pairs: a prompt with a fresh first line (cold), then the same again (warm)."""
    runs: dict[str, list[Reply]] = {"cold": [], "warm": []}
    for i in range(repeats):
        messages = [{"role": "system", "content": f"{fresh_line(rng)}\n{prefix}"},
                    {"role": "user", "content": f"Question {i}: what is a block hash?"}]
        runs["cold"].append(server.chat(messages, max_tokens=1))
        runs["warm"].append(server.chat(messages, max_tokens=1))
    return runs


def side_channel(server: OpenAIServer, letter: str, salted: bool, rng: random.Random) -> dict[str, Reply]:
    """Tenant A's letter, then tenant B's guesses at the name in it: {name: B's reply}."""
    first = fresh_line(rng)  # this experiment's letters start alike, and like no earlier one

    def send(name: str, tenant: str) -> Reply:
        salt = {"cache_salt": tenant} if salted else {}
        return server.complete(f"{first}\nFrom: {name}\n{letter}", max_tokens=1, **salt)

    send(VICTIM, "tenant-a")
    return {name: send(name, "tenant-b") for name in NAMES}


def generate_route(url: str, messages: list[dict]) -> tuple[int, float]:
    """This course's own route, /generate, max_tokens 1: (cached tokens, ms at the client)."""
    body = json.dumps({"messages": messages, "max_tokens": 1}).encode()
    request = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.load(response)
    return reply["cached_tokens"], (time.perf_counter() - start) * 1e3


def compare_generate(server: OpenAIServer, prefix: str, repeats: int, rng: random.Random) -> dict:
    """The same cold/warm pairs through the OpenAI route and through /generate."""
    # A first request, not counted, leaves the chat template's opening in the cache, so the
    # first cold request of either route finds the same there.
    server.chat([{"role": "system", "content": fresh_line(rng)}, {"role": "user", "content": "Hi"}], max_tokens=1)
    rows = []
    for i in range(repeats):
        for route in ("openai", "generate"):
            messages = [{"role": "system", "content": f"{fresh_line(rng)}\n{prefix}"},
                        {"role": "user", "content": f"Question {i}: what is a ref count?"}]
            for kind in ("cold", "warm"):
                if route == "openai":
                    reply = server.chat(messages, max_tokens=1)
                    rows.append((route, kind, reply.cached_tokens, reply.ttft_ms))
                else:
                    rows.append((route, kind, *generate_route(server.url, messages)))
    result = {}
    for kind in ("cold", "warm"):
        for route in ("openai", "generate"):
            picked = [r for r in rows if r[0] == route and r[1] == kind]
            result[f"{kind}_{route}_cached"] = sorted({r[2] for r in picked})
            result[f"{kind}_{route}_ms"] = round(statistics.median(r[3] for r in picked), 1)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench cache_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-words", type=positive_int, default=400,
                        help="words of the shared prefix (default 400)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="cold/warm pairs (default 5)")
    parser.add_argument("--compare-generate", action="store_true", help="also through /generate (this course's server)")
    parser.add_argument("--seed", type=int, default=None, help="the fresh first lines (default: new every run)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    console = Console()
    if args.url is None:
        console.print("starting a server of this course (prefix caching on)…")
    server, server_thread = open_server(parser, args, {})
    rng = random.Random(args.seed)
    w = Writer(0)
    prefix, letter = w.words(args.prefix_words), "Please make this letter warm but firm.\n" + w.words(120)
    console.print(f"[bold]cache probe[/] of {server.url}, model {server.model}, from {platform.node()} "
                  f"({platform.machine()}); times at the client")

    runs = cold_warm(server, prefix, args.repeats, rng)
    classes = {kind: request_class(replies) for kind, replies in runs.items()}
    table = Table("prompt", "requests", "prompt tokens", "hits / misses", "cached tokens", "TTFT ms",
                  title="cold (a fresh first line) vs warm, per request",
                  caption=f"prompt tokens, cached tokens and TTFT: {SPREAD_COLUMN} over each kind's requests")
    for kind, figures in classes.items():
        table.add_row(kind, str(figures["requests"]), spread_text(figures["prompt_tokens"]),
                      "not reported" if figures["hits"] is None else f"{figures['hits']} / {figures['misses']}",
                      spread_text(figures["cached_tokens"]), spread_text(figures["ttft_ms"]))
    console.print(table)
    cold_ms, warm_ms = (statistics.median(r.ttft_ms for r in runs[k]) for k in ("cold", "warm"))
    if None in {r.cached_tokens for r in runs["warm"]}:
        console.print(f"{NOT_REPORTED} Only the times can tell.")
    console.print(f"warm / cold: {warm_ms / cold_ms:.2f} ({cold_ms / warm_ms:.1f}x sooner warm)")
    results = {"url": server.url, "model": server.model, "cold": [r.__dict__ for r in runs["cold"]],
               "warm": [r.__dict__ for r in runs["warm"]], "classes": classes}

    table = Table("tenant B's guess", "no salt: cached", "TTFT", "a salt per tenant: cached", "TTFT",
                  title=f"the side channel: tenant A sent the letter from {VICTIM}")
    probes = {salted: side_channel(server, letter, salted, rng) for salted in (False, True)}
    for name in NAMES:
        row = [name]
        for salted in (False, True):
            reply = probes[salted][name]
            row += ["not reported" if reply.cached_tokens is None else str(reply.cached_tokens),
                    f"{reply.ttft_ms:,.0f} ms"]
        table.add_row(*row, style="bold red" if name == VICTIM else None)
    console.print(table)
    for salted, label in ((False, "no salt"), (True, "a salt per tenant")):
        right = probes[salted][VICTIM]
        wrong = statistics.median(r.ttft_ms for n, r in probes[salted].items() if n != VICTIM)
        console.print(f"{label}: the right guess took {right.ttft_ms:,.0f} ms, "
                      f"the wrong ones {wrong:,.0f} ms (median): "
                      f"{right.ttft_ms / wrong:.2f} of their time")
    results["side_channel"] = {("salted" if salted else "open"): {name: r.__dict__ for name, r in replies.items()}
                               for salted, replies in probes.items()}
    results["salt"], sentence = salt_verdict(probes)
    console.print(sentence)

    if args.compare_generate:
        comparison = compare_generate(server, prefix, args.repeats, rng)
        results["compare_generate"] = comparison
        for kind in ("cold", "warm"):
            openai_ms, generate_ms = comparison[f"{kind}_openai_ms"], comparison[f"{kind}_generate_ms"]
            close = abs(openai_ms - generate_ms) <= COMPARE_TOLERANCE * max(openai_ms, generate_ms)
            console.print(f"{kind}: cached {comparison[f'{kind}_openai_cached']} through OpenAI's route, "
                          f"{comparison[f'{kind}_generate_cached']} through /generate; {openai_ms:,.0f} ms against "
                          f"{generate_ms:,.0f} ms: {'within' if close else 'NOT within'} {COMPARE_TOLERANCE:.0%}")
    if server_thread is not None:
        server_thread.shutdown()
    save_json(args.json, results, console)
    return results
