"""Speed on a busy machine: the demo, one request, the batch engine, and transformers', beside
other programs.

    python prefix_caching.py --bench busy [--programs 2] [--requests 16] [--json out.json]

A student's laptop runs a browser and Jupyter beside the course. This runs each of these
first on a quiet machine and then beside --programs busy programs that it starts itself (each
a Python process spinning on one core) and stops when it is done, even if it fails:

    demo     `python prefix_caching.py --demo`, the whole command, in a process of its own,
             --demo-runs times: its seconds, and each HIT's TTFT against the MISS's (the
             lesson: beside busy programs every HIT still comes at least 4x sooner)
    one      one request of --one-tokens new tokens on stage 7's path, the demo's (cold pool,
             the median of three)
    (c)      --bench throughput's (c): --requests requests batched with caching
    (d)      --bench throughput's (d): transformers' own continuous batching

Each way runs with no other way's forward passes alive beside it (an engine of its own,
closed before the next; (d) and stage 7's path on a thread that ends with them): engine/cpu_threads.py
says why a second thread's OpenMP pool would slow it. The same requests, greedy, both times. Reported: each one's seconds quiet and busy, busy over
quiet (the target: at most 2.5x for the demo and the one request), and (c) against (d) in
each. (d) runs at transformers' own thread count: the engine sets torch's thread count for
each of its forward passes only (cpu_threads.one_pass) and puts it back after.
--fixed-threads adds the engine with torch's thread count kept for every pass
(Engine(choose_threads=False)) beside the busy programs: what the choice saves.
"""

from __future__ import annotations

import argparse
import json
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.table import Table

from benchmarks import save_json
from benchmarks.engines import open_engine, stage_7
from benchmarks.throughput import questions, run_ours, run_transformers, summary
from commands.flags import positive_int
from commands.model_flags import add_model_arguments
from engine.cpu_threads import in_own_thread
from engine.llm_engine import Engine
from engine.model_loader import DEFAULT_MODEL

SPIN = "while True: pass"  # one core kept busy, as a browser tab running a script would


@contextlib.contextmanager
def busy_programs(n: int):
    """n processes that keep a core busy each, until the block ends (whatever happens in it)."""
    programs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        yield programs
    finally:
        for program in programs:
            program.kill()
            program.wait()


def run_one(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """One request on stage 7's path from a cold pool, three times: the median seconds,
    and its tokens."""
    seconds, tokens = [], None
    for _ in range(3):
        engine.allocator.reset_prefix_cache()
        start = time.perf_counter()
        reply = stage_7(engine, prompt, max_tokens)
        seconds.append(time.perf_counter() - start)
        tokens = reply.token_ids
    return statistics.median(seconds), tokens


def run_demo(args) -> tuple[float, list[dict]]:
    """`python prefix_caching.py --demo` with this benchmark's model flags: its seconds, start
    to end, and its requests (cached tokens, TTFT) as its --json wrote them."""
    command = [sys.executable, str(Path(__file__).resolve().parents[1] / "prefix_caching.py"), "--demo"]
    for flag in ("model", "device", "dtype", "num_blocks", "kv_memory_gb"):
        if getattr(args, flag) is not None:
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    command += ["--block-size", str(args.block_size)]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "demo.json"
        start = time.perf_counter()
        subprocess.run(command + ["--json", str(out)], check=True, capture_output=True)
        seconds = time.perf_counter() - start
        return seconds, json.loads(out.read_text())


def demo_runs(args, runs: int) -> dict:
    """The demo `runs` times: the median seconds of the whole command, and each HIT's speed-up
    over the MISS (request 1's TTFT over its own), the median over the runs: the demo's lesson
    holds when the slowest of those is well above 1."""
    seconds, speedups = [], []
    for _ in range(runs):
        took, requests = run_demo(args)
        seconds.append(took)
        speedups.append([requests[0]["ttft_ms"] / r["ttft_ms"] for r in requests[1:]])
    per_hit = [statistics.median(run[i] for run in speedups) for i in range(len(speedups[0]))]
    return {"seconds": round(statistics.median(seconds), 3), "hit_speedups": [round(x, 2) for x in per_hit],
            "slowest_hit_speedup": round(min(per_hit), 2)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench busy", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--programs", type=int, default=2, help="busy programs to start beside the runs (default 2)")
    parser.add_argument("--requests", type=positive_int, default=16)
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--one-tokens", type=positive_int, default=16,
                        help="new tokens of the one request (default 16)")
    parser.add_argument("--fixed-threads", action="store_true",
                        help="also run the one request and (c) beside the programs with torch's thread count kept for "
                             "every pass (Engine(choose_threads=False)): what the engine's choice saves")
    parser.add_argument("--demo-runs", type=positive_int, default=3,
                        help="runs of the demo, quiet and busy: its seconds and HIT speed-ups are their medians (default 3)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="4 requests of 4 tokens, 1 busy program (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.one_tokens, args.programs, args.demo_runs = 4, 4, 4, 1, 1

    console, first, device = open_engine(args)
    model, tokenizer, num_blocks, eos = first.model, first.tokenizer, first.allocator.num_blocks, first.stop_token_ids
    budget = first.scheduler_options["max_num_batched_tokens"]
    prompts = [first.tokenize(q) for q in questions(args.requests)]
    first.close()
    hf_model = type(model).from_pretrained(model.name_or_path, dtype=model.dtype).to(model.device)
    console.print(f"[bold]Speed on a busy machine[/]: {args.model or DEFAULT_MODEL} on {model.device} ({device}, "
                  f"torch's {torch.get_num_threads()} threads); the demo, one request of {args.one_tokens} new tokens, "
                  f"and {args.requests} requests behind one system prompt, {args.max_tokens} new tokens each; quiet, "
                  f"then beside {args.programs} busy programs")

    def fresh(**options) -> Engine:
        engine = Engine(model=model, tokenizer=tokenizer, block_size=args.block_size, num_blocks=num_blocks, **options)
        engine.warm_up()
        return engine

    ended = {}  # busy or not: the thread count (c)'s engine ended with

    def measure(busy_now: bool) -> tuple[dict, list]:
        """Each way with no other way's passes alive beside it: an engine of its own, closed
        before the next, and (d) and stage 7's path in_own_thread (engine/cpu_threads.py says why)."""
        ways, tokens = {}, []
        kinds = [("", {})] + ([(" fixed", {"choose_threads": False})] if busy_now and args.fixed_threads else [])
        for suffix, options in kinds:  # " fixed": the engine keeping torch's count for every pass
            with fresh(**options) as engine:
                engine.generate_batch(["warm up"] * 2, max_tokens=2)  # the batched path's first pass, untimed
                c = run_ours(engine, prompts, args.max_tokens, batched=True)
                ended[busy_now] = ended.get(busy_now) or engine.threads.threads  # the chosen count, not " fixed"
            with fresh(**options) as engine:  # stage 7's path: this engine's loop never starts
                seconds, one_tokens = in_own_thread(run_one, engine, prompts[0], args.one_tokens)
            ways["c" + suffix] = summary("(c)", c.seconds, c.outputs, c.ttfts_ms, None)
            ways["one" + suffix] = {"seconds": round(seconds, 3)}
            tokens = tokens or [c.outputs, None, one_tokens]
        d = in_own_thread(run_transformers, hf_model, prompts, args.max_tokens, eos, args.block_size, num_blocks, budget)
        ways["d"], tokens[1] = summary("(d)", *d, None), d[1]
        ways["demo"] = demo_runs(args, args.demo_runs)
        return ways, tokens

    quiet, quiet_tokens = measure(False)
    with busy_programs(args.programs):
        busy, busy_tokens = measure(True)
    same = quiet_tokens == busy_tokens and quiet_tokens[0] == quiet_tokens[1]

    table = Table(title=f"quiet, and beside {args.programs} busy programs")
    for column in ("way", "quiet", "busy", "busy / quiet"):
        table.add_column(column, justify="left" if column == "way" else "right")
    rows = [("demo", f"python prefix_caching.py --demo (median of {args.demo_runs})", "demo"),
            ("one", f"one request, {args.one_tokens} new tokens (stage 7's path)", "one"),
            ("one fixed", "  the same with torch's thread count kept", "one"),
            ("c", f"(c) {args.requests} requests, this engine batched with caching", "c"),
            ("c fixed", "  the same with torch's thread count kept", "c"),
            ("d", f"(d) {args.requests} requests, transformers generate_batch", "d")]
    for key, name, base in rows:
        if key in busy:
            quiet_s = f"{quiet[key]['seconds']:.2f} s" if key in quiet else ""
            table.add_row(name, quiet_s, f"{busy[key]['seconds']:.2f} s",
                          f"{busy[key]['seconds'] / quiet[base]['seconds']:.1f}x")
    console.print(table)
    for name, ways in (("quiet", quiet), ("busy", busy)):
        hits = ", ".join(f"{x:.1f}x" for x in ways["demo"]["hit_speedups"])
        console.print(f"The demo's HITs against its MISS, {name} (TTFT, the median of {args.demo_runs} runs each): {hits}.")
    ratio_quiet = quiet["d"]["seconds"] / quiet["c"]["seconds"]
    ratio_busy = busy["d"]["seconds"] / busy["c"]["seconds"]
    console.print(f"(c) against (d): {ratio_quiet:.1f}x quiet, {ratio_busy:.1f}x busy. The thread count (c)'s engine "
                  f"ended with, busy: {ended[True]} (torch's own: {torch.get_num_threads()}). Measured in this "
                  f"run on {device}. Every request got the same tokens quiet and busy, and (c) the same as (d): "
                  f"{same}.")
    results = {"machine": device, "threads": torch.get_num_threads(), "programs": args.programs,
               "quiet": quiet, "busy": busy, "c_over_d_quiet": ratio_quiet, "c_over_d_busy": ratio_busy,
               "same_tokens": same}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
