"""Chunked prefill: what a long prompt does to the requests around it, chunking on vs off.

    python prefix_caching.py --bench chunked_prefill [--budget 64] [--long-tokens 2000] [--json out.json]

A few clients are decoding when a long prompt arrives, and a few short requests arrive right
behind it. The same scene runs twice on one model, with the scheduler's
enable_chunked_prefill on (as vLLM v1's default) and off, stepping a BatchRunner directly so
both runs schedule exactly the same steps every time (the step counts do not depend on the
machine; the times do). Reported for each:

    clients   their longest gap between two tokens after the long prompt arrived, against
              their median gap, and the step at which they finish
    long      its time to first token (from its arrival) and the step it finishes at
    behind    how long the requests behind it waited to be admitted

With chunking off, a prompt longer than the budget left after the decodes waits for a step
of its own, which comes only when every running request has finished; nothing behind it may
overtake it. With chunking on it is split across steps beside the decodes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from rich.table import Table

from benchmarks import save_json
from benchmarks.engines import open_engine
from commands.flags import positive_int
from commands.model_flags import add_model_arguments
from engine.batch_engine import BatchRunner
from engine.llm_engine import Engine
from engine.model_loader import DEFAULT_MODEL
from engine.request import SamplingParams


def token_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """n token ids nobody has sent before: no prefix hit blurs what chunking does."""
    return [rng.randrange(100, vocab) for _ in range(n)]


def run_scene(engine: Engine, chunked: bool, args, vocab: int) -> dict:
    """One run of the scene; the times of every sampled token, and the step counts."""
    rng = random.Random(0)  # the same token ids for both runs
    runner = BatchRunner(engine.parts, max_num_seqs=args.clients + args.behind + 1,
                         max_num_batched_tokens=args.budget, enable_chunked_prefill=chunked)
    runner.model_runner.capture_at_start()  # on a GPU: a runner of its own, its graphs captured before the clock
    captures = runner.model_runner.captures
    warm = args.warm_tokens  # tokens each client decodes before the long prompt arrives
    clients = [runner.add(f"client-{i}", token_ids(rng, 20, vocab), SamplingParams(max_tokens=warm + args.client_tokens), None)
               for i in range(args.clients)]
    long_ids = token_ids(rng, args.long_tokens, vocab)
    behind_ids = [token_ids(rng, 20, vocab) for _ in range(args.behind)]
    times: dict[str, list[float]] = {}  # request id -> when each of its tokens was sampled
    steps: dict[str, int] = {}  # request id -> the step it finished in
    admitted: dict[str, float] = {}
    first_token_step: dict[str, int] = {}
    step = arrival = arrival_step = 0
    long = behind = None
    while runner.scheduler.has_work():
        if long is None and all(len(c.output_ids) >= warm for c in clients):
            arrival, arrival_step = time.perf_counter(), step
            long = runner.add("long", long_ids, SamplingParams(max_tokens=args.long_max_tokens), None)
            behind = [runner.add(f"behind-{i}", ids, SamplingParams(max_tokens=8), None) for i, ids in enumerate(behind_ids)]
        finished = runner.step()
        step += 1
        now = time.perf_counter()
        for s in runner.last_plan.scheduled:
            rid = s.request.request_id
            admitted.setdefault(rid, now)
            if s.samples:
                times.setdefault(rid, []).append(now)
                first_token_step.setdefault(rid, step)
        for request in finished:
            steps[request.request_id] = step
    gaps = [b - a for c in clients for a, b in zip(times[c.request_id], times[c.request_id][1:]) if a >= arrival]
    return {
        "chunked": chunked,
        "arrival_step": arrival_step,
        "client_gap_median_ms": statistics.median(gaps) * 1e3,
        "client_gap_longest_ms": max(gaps) * 1e3,
        "client_gap_ratio": max(gaps) / statistics.median(gaps),
        "clients_done_s": max(times[c.request_id][-1] for c in clients) - arrival,
        "clients_done_step": max(steps[c.request_id] for c in clients) - arrival_step,
        "long_ttft_s": times["long"][0] - arrival,
        "long_first_token_step": first_token_step["long"] - arrival_step,
        "long_done_s": times["long"][-1] - arrival,
        "long_done_step": steps["long"] - arrival_step,
        "behind_wait_max_s": max(admitted[r.request_id] for r in behind) - arrival,
        "behind_done_step": max(steps[r.request_id] for r in behind) - arrival_step,
        "long_tokens": [*long.output_ids],
        "captures_while_timed": runner.model_runner.captures - captures,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench chunked_prefill",
                                     description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--budget", type=positive_int, default=64,
                        help="max_num_batched_tokens: 64 makes a chunk cost about a few decodes on a 2-core CPU")
    parser.add_argument("--clients", type=positive_int, default=4, help="requests decoding when the long prompt arrives")
    parser.add_argument("--warm-tokens", type=positive_int, default=8, help="tokens each client decodes before it arrives")
    parser.add_argument("--client-tokens", type=positive_int, default=100, help="tokens each client has left to decode then")
    parser.add_argument("--long-tokens", type=positive_int, default=2000, help="the long prompt's length")
    parser.add_argument("--long-max-tokens", type=positive_int, default=16)
    parser.add_argument("--behind", type=int, default=4, help="short requests arriving right behind the long one")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="a small scene (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.budget, args.clients, args.warm_tokens, args.client_tokens = 8, 2, 2, 12
        args.long_tokens, args.long_max_tokens, args.behind = 40, 3, 2
    if args.budget < args.clients + args.behind + 1:
        parser.error(f"--budget must be at least the number of requests ({args.clients + args.behind + 1})")

    console, engine, device = open_engine(args)
    vocab = engine.model.get_input_embeddings().num_embeddings
    console.print(f"[bold]Chunked prefill[/]: {args.model or DEFAULT_MODEL} on {engine.device} ({device}, "
                  f"{torch.get_num_threads()} threads); budget {args.budget} tokens a step; {args.clients} clients "
                  f"with {args.client_tokens} tokens left to decode when a {args.long_tokens:,}-token prompt arrives, "
                  f"{args.behind} short requests right behind it")
    engine.warm_up()
    engine.generate_batch(["warm up"] * 2, max_tokens=2)  # the batched path's first pass, untimed
    runs = []
    for chunked in (True, False):
        engine.allocator.reset_prefix_cache()
        runs.append(run_scene(engine, chunked, args, vocab))
    on, off = runs

    table = Table(title="the same scene, chunked prefill on and off (steps counted from the long prompt's arrival)")
    table.add_column("", no_wrap=True)
    table.add_column("chunking on", justify="right")
    table.add_column("chunking off", justify="right")
    rows = [
        ("clients: median gap between tokens", lambda r: f"{r['client_gap_median_ms']:,.0f} ms"),
        ("clients: longest gap", lambda r: f"{r['client_gap_longest_ms']:,.0f} ms ({r['client_gap_ratio']:.1f}x median)"),
        ("clients: all done", lambda r: f"{r['clients_done_s']:.1f} s, step {r['clients_done_step']}"),
        ("long prompt: time to first token", lambda r: f"{r['long_ttft_s']:.1f} s, step {r['long_first_token_step']}"),
        ("long prompt: done", lambda r: f"{r['long_done_s']:.1f} s, step {r['long_done_step']}"),
        ("behind it: admitted within", lambda r: f"{r['behind_wait_max_s']:.1f} s"),
        ("behind it: all done", lambda r: f"step {r['behind_done_step']}"),
    ]
    for name, show in rows:
        table.add_row(name, show(on), show(off))
    console.print(table)
    console.print(f"same tokens for the long prompt both ways: {on['long_tokens'] == off['long_tokens']}. "
                  f"Measured in this run on {device}; the step counts do not depend on the machine. CUDA graphs "
                  f"captured while timed: {on['captures_while_timed'] + off['captures_while_timed']}.")
    results = {"machine": device, "threads": torch.get_num_threads(), "budget": args.budget, "runs": runs}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
