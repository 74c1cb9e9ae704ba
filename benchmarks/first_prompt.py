"""A class's first long prompt: what a freshly started server does with it, at its defaults.

    python prefix_caching.py --bench first_prompt                 # 3 fresh servers each way, the default model
    python prefix_caching.py --bench first_prompt --runs 5 --long-tokens 4000 --json out.json

Each run starts `python server.py` in a process of its own (benchmarks/served_clients.py's
`serving`), once at its defaults and once with a fixed --max-num-batched-tokens (the default's
cap, DEFAULT_MAX_NUM_BATCHED_TOKENS), taking turns, and sends, as a class meets a server just
started:

    alone      a ~--long-tokens-token prompt (random token ids, max_tokens 1), the server's
               first request: its request time. At the defaults the step budget comes from a
               target step time and a calibration the engine timed when it started
               (engine/step_budget.py), so the first prompt is chunked by what this machine does.
    arrivals   a second such prompt; 1 s later a streamed 8-token completion and an 8-token
               POST /generate together: their time to first token against each such request
               sent by itself after it, the median of ALONE (the stream's TTFT at the client,
               /generate's as the server reports it).
               Each of the four is SHORT_TOKENS random token ids of its own, so none finds
               another's blocks cached: alone and beside the long prompt, they compute the same
               tokens.

The medians of the runs are printed side by side; the ratios are default over fixed
(alone) and beside the long prompt over alone (arrivals).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import threading
import time

from benchmarks import save_json
from benchmarks.served_clients import Server, serving
from commands.flags import positive_int
from engine.llm_engine import DEFAULT_MAX_NUM_BATCHED_TOKENS

SHORT_TOKENS = 32  # a student's question in the chat template: "What is a block?" is 35 tokens
ALONE = 3  # times each newcomer is timed alone, after the long prompts (the median is its time alone)
WAYS = {"default": [], "fixed": ["--max-num-batched-tokens", str(DEFAULT_MAX_NUM_BATCHED_TOKENS)]}


def post(server: Server, path: str, body: dict, stream: bool = False) -> tuple[dict | None, float, float]:
    """(the JSON reply or None for a stream, seconds to the first streamed line or to the reply, seconds in all)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
    start = time.perf_counter()
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                      "Authorization": f"Bearer {server.admin_key}"})
        response = conn.getresponse()
        if not stream:
            reply = json.loads(response.read())
            return reply, time.perf_counter() - start, time.perf_counter() - start
        first = None
        for line in response:
            if line.startswith(b"data:") and first is None:
                first = time.perf_counter() - start
        return None, first, time.perf_counter() - start
    finally:
        conn.close()


def random_ids(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(1000, 30_000) for _ in range(num_tokens)]


def stream_ttft(server: Server, model: str, rng: random.Random) -> float:
    """A streamed 8-token completion's time to first token, at the client."""
    return post(server, "/v1/completions", {"model": model, "prompt": random_ids(rng, SHORT_TOKENS), "max_tokens": 8,
                                            "stream": True}, stream=True)[1]


def generate_ttft(server: Server, rng: random.Random) -> float:
    """An 8-token POST /generate's time to first token, as the server reports it."""
    return post(server, "/generate", {"prompt": random_ids(rng, SHORT_TOKENS), "max_tokens": 8})[0]["ttft_ms"] / 1e3


def ttfts(server: Server, model: str, rng: random.Random) -> tuple[float, float]:
    """(stream_ttft, generate_ttft) of the two sent together."""
    got = {}
    stream = threading.Thread(target=lambda: got.update(stream=stream_ttft(server, model, rng)))
    stream.start()
    generate = generate_ttft(server, rng)
    stream.join()
    return got["stream"], generate


def one_run(server_args: list[str], long_tokens: int, rng: random.Random) -> dict:
    with serving(server_args) as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        conn.close()

        def long_prompt() -> list[int]:
            return random_ids(rng, long_tokens)

        alone = post(server, "/generate", {"prompt": long_prompt(), "max_tokens": 1})[2]
        beside = {}
        long = threading.Thread(target=lambda: beside.update(long=post(
            server, "/generate", {"prompt": long_prompt(), "max_tokens": 1})[2]))
        long.start()
        time.sleep(1.0)
        stream, generate = ttfts(server, model, rng)
        long.join()
        # Alone: each by itself (sent together, the second would wait for the first's step), median of ALONE
        stream_alone = statistics.median(stream_ttft(server, model, rng) for _ in range(ALONE))
        generate_alone = statistics.median(generate_ttft(server, rng) for _ in range(ALONE))
    return {"alone_s": alone, "long_beside_arrivals_s": beside["long"], "stream_ttft_s": stream,
            "stream_alone_s": stream_alone, "generate_ttft_s": generate, "generate_alone_s": generate_alone}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python prefix_caching.py --bench first_prompt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=positive_int, default=3, help="fresh servers each way (default 3)")
    parser.add_argument("--long-tokens", type=positive_int, default=2000, help="the long prompt's tokens")
    parser.add_argument("--server-args", default="", help='more flags for python server.py, in one word: '
                                                          '--server-args="--model PATH"')
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console, rng, extra = Console(), random.Random(0), args.server_args.split()
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for i in range(args.runs):
        for way, flags in WAYS.items():
            runs[way].append(one_run([*flags, *extra], args.long_tokens, rng))
            console.print(f"run {i + 1}, {way}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[way][-1].items()))

    def median(way: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[way])

    def ratio(way: str, key: str, alone: str) -> float:
        return statistics.median(run[key] / run[alone] for run in runs[way])

    table = Table(title=f"a fresh server's first {args.long_tokens:,}-token prompt, medians of {args.runs} runs",
                  caption=f"fixed: --max-num-batched-tokens {DEFAULT_MAX_NUM_BATCHED_TOKENS}; "
                          "the others at the defaults")
    for column in ("", "default", "fixed"):
        table.add_column(column, justify="right")
    table.add_row("the long prompt alone, first request", *(f"{median(w, 'alone_s'):.2f} s" for w in WAYS))
    table.add_row("  default / fixed", f"{median('default', 'alone_s') / median('fixed', 'alone_s'):.2f}x", "")
    table.add_row("a stream sent 1 s after a long prompt: TTFT / alone",
                  *(f"{ratio(w, 'stream_ttft_s', 'stream_alone_s'):.1f}x" for w in WAYS))
    table.add_row("an 8-token /generate sent with it: TTFT / alone",
                  *(f"{ratio(w, 'generate_ttft_s', 'generate_alone_s'):.1f}x" for w in WAYS))
    table.add_row("the long prompt beside them", *(f"{median(w, 'long_beside_arrivals_s'):.2f} s" for w in WAYS))
    console.print(table)
    results = {"long_tokens": args.long_tokens, "runs": runs,
               "alone_ratio": median("default", "alone_s") / median("fixed", "alone_s")}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
