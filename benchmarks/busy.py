"""Throughput on a busy machine: the batch engine, and transformers', beside other programs.

    python prefix_caching.py --bench busy [--programs 2] [--requests 16] [--json out.json]

A student's laptop runs a browser and Jupyter beside the course. This runs --bench
throughput's ways (c), this engine batched with caching, and (d), transformers' own
continuous batching, first on a quiet machine and then beside --programs busy programs that
it starts itself (each a Python process spinning on one core) and stops when it is done,
even if it fails. The same requests, greedy, both times.

Reported: each way's seconds quiet and busy, busy over quiet, and (c) against (d) in each.
(d) runs at transformers' own thread count: the batch engine sets torch's thread count for
each of its forward passes only (cpu_threads.ThreadChooser) and puts it back after.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys

import torch
from rich.table import Table

from benchmarks import save_json
from benchmarks.engines import open_engine
from benchmarks.throughput import questions, run_ours, run_transformers, summary
from engine import Engine, add_model_arguments, positive_int
from model_loader import DEFAULT_MODEL

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


def run_ways(engine: Engine, hf_model, prompts, max_tokens: int) -> tuple[dict, list]:
    """(c) and (d) once each: their summaries, and the tokens of each."""
    c = run_ours(engine, prompts, max_tokens, batched=True)
    d = run_transformers(hf_model, prompts, max_tokens, engine.stop_token_ids, engine)
    return {"c": summary("(c)", *c, None), "d": summary("(d)", *d, None)}, [c[1], d[1]]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench busy", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--programs", type=int, default=2, help="busy programs to start beside the runs (default 2)")
    parser.add_argument("--requests", type=positive_int, default=16)
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--fixed-threads", action="store_true",
                        help="also run (c) beside the programs with torch's thread count kept for every step "
                             "(Engine(choose_threads=False)): what the engine's choice saves")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="4 requests of 4 tokens, 1 busy program (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.programs = 4, 4, 1

    console, engine, device = open_engine(args)
    hf_model = type(engine.model).from_pretrained(engine.model.name_or_path, dtype=engine.dtype).to(engine.device)
    console.print(f"[bold]Throughput on a busy machine[/]: {args.model or DEFAULT_MODEL} on {engine.device} ({device}, "
                  f"torch's {torch.get_num_threads()} threads); {args.requests} requests behind one system prompt, "
                  f"{args.max_tokens} new tokens each; quiet, then beside {args.programs} busy programs")
    engine.warm_up()
    engine.generate_batch(["warm up"] * 2, max_tokens=2)  # the batched path's first pass, untimed
    prompts = [engine.tokenize(q) for q in questions(args.requests)]
    quiet, quiet_tokens = run_ways(engine, hf_model, prompts, args.max_tokens)
    with busy_programs(args.programs):
        busy, busy_tokens = run_ways(engine, hf_model, prompts, args.max_tokens)
        if args.fixed_threads:  # the same engine keeping torch's count for every step
            fixed = Engine(model=engine.model, tokenizer=engine.tokenizer, block_size=args.block_size,
                           num_blocks=engine.allocator.num_blocks, choose_threads=False)
            busy["c fixed"] = summary("(c)", *run_ours(fixed, prompts, args.max_tokens, batched=True), None)
    same = quiet_tokens == busy_tokens and quiet_tokens[0] == quiet_tokens[1]

    table = Table(title=f"{args.requests} requests: quiet, and beside {args.programs} busy programs")
    for column in ("way", "quiet", "busy", "busy / quiet"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for key, name in (("c", "(c) this engine, batched with caching"), ("d", "(d) transformers generate_batch")):
        table.add_row(name, f"{quiet[key]['seconds']:.2f} s", f"{busy[key]['seconds']:.2f} s",
                      f"{busy[key]['seconds'] / quiet[key]['seconds']:.1f}x")
    if "c fixed" in busy:
        table.add_row("(c) with torch's thread count kept", "", f"{busy['c fixed']['seconds']:.2f} s",
                      f"{busy['c fixed']['seconds'] / quiet['c']['seconds']:.1f}x")
    console.print(table)
    ratio_quiet = quiet["d"]["seconds"] / quiet["c"]["seconds"]
    ratio_busy = busy["d"]["seconds"] / busy["c"]["seconds"]
    console.print(f"(c) against (d): {ratio_quiet:.1f}x quiet, {ratio_busy:.1f}x busy. The thread count the engine "
                  f"ended with: {engine.threads.threads} (torch's own: {torch.get_num_threads()}). Measured in this "
                  f"run on {device}. Every request got the same tokens both ways, quiet and busy: {same}.")
    results = {"machine": device, "threads": torch.get_num_threads(), "programs": args.programs,
               "quiet": quiet, "busy": busy, "c_over_d_quiet": ratio_quiet, "c_over_d_busy": ratio_busy}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
