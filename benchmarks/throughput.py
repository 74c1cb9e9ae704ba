"""Throughput with many requests at once: what continuous batching and prefix caching buy.

    python prefix_caching.py --bench throughput [--requests 16 32] [--json out.json] [--quick]

The demo's system prompt in front of N different questions, 32 new tokens each, greedy,
run four ways on the same model and token ids, one after another in one process. Each way
runs its passes on a thread that ends with it (an engine's loop, closed before the next way;
(d) and the floor in_own_thread): engine/cpu_threads.py says why a thread's OpenMP pool left beside
another's would slow both.

    (a) sequential   this engine, one request after another (Engine.generate)
    (b) batched      this engine's scheduler, every request in the same steps, caching off
    (c) batched+APC  the same with prefix caching on: the system prompt is computed once
    (d) transformers model.generate_batch, its own continuous batching with block sharing
                     on (ContinuousBatchingConfig(allow_block_sharing=True)), its cache sized
                     like ours: pages of our block size, as many, the same step budget

For each: requests/s, output tokens/s, TTFT p50/p95 (every request arrives at time 0, so a
TTFT includes the wait for admission), the tokens the model embedded (every token a forward
pass computed, prompts and decodes: the same on every machine; for ours counted from the steps
the engine's loop ran, as its scheduler planned them, since a decode step replayed as a CUDA
graph calls no hook on the model; for transformers' by a hook on its embedding), and whether
its tokens equal (a)'s. Then (c)'s floor:
the same forward passes, of the same numbers of tokens, each with the logits of as many tokens
as sampled in it, run plainly with nothing in a pool to attend to: the time no attention or
bookkeeping could beat, and (c)'s time over it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import NamedTuple

import torch
from rich.table import Table
from transformers import ContinuousBatchingConfig, GenerationConfig

from benchmarks import save_json
from benchmarks.engines import StepSeen, open_engine, unwatch_steps, watch_steps
from benchmarks.measure import TokenCounter
from commands.demo import DEMO_SYSTEM_PROMPT
from commands.model_flags import add_model_arguments
from engine.cpu_threads import in_own_thread, one_pass, synchronize
from engine.llm_engine import Engine
from engine.model_loader import DEFAULT_MODEL

ASSETS = Path(__file__).resolve().parent.parent / "assets"

TOPICS = ["a CPU", "RAM", "a hard disk", "an SSD", "a GPU", "an operating system", "a compiler", "a file",
          "a folder", "a network", "Wi-Fi", "a router", "an IP address", "DNS", "a web browser", "a cookie",
          "a password manager", "encryption", "a virus", "a backup", "the cloud", "a database", "a spreadsheet",
          "a pixel", "a font", "a keyboard shortcut", "a USB port", "Bluetooth", "a battery", "a byte",
          "binary numbers", "an algorithm"]


def questions(n: int) -> list[list[dict]]:
    """n chats: the shared system prompt, then a question of its own."""
    system = {"role": "system", "content": DEMO_SYSTEM_PROMPT}
    return [[system, {"role": "user", "content": f"What is {TOPICS[i % len(TOPICS)]}, in two sentences?"}]
            for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linearly interpolated (q=50: the median).

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 95)
    (2.5, 3.85)
    """
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low, high = int(k), min(int(k) + 1, len(ordered) - 1)
    return round(ordered[low] + (ordered[high] - ordered[low]) * (k - low), 6)


def summary(name: str, seconds: float, outputs: list[list[int]], ttfts_ms: list[float], reference) -> dict:
    tokens = sum(len(o) for o in outputs)
    same = None if reference is None else sum(o == r for o, r in zip(outputs, reference))
    return {"name": name, "seconds": round(seconds, 3), "requests_per_s": round(len(outputs) / seconds, 3),
            "output_tokens_per_s": round(tokens / seconds, 1), "ttft_p50_ms": round(percentile(ttfts_ms, 50), 1),
            "ttft_p95_ms": round(percentile(ttfts_ms, 95), 1), "same_tokens_as_a": same, "requests": len(outputs)}


class Run(NamedTuple):
    """One way of ours, timed: its time, each reply's tokens and TTFT, and what its engine's
    loop ran, counted by the runner's plans (benchmarks/engines.watch_steps), not by a hook on
    the model, which a replayed CUDA graph never calls."""

    seconds: float
    outputs: list[list[int]]
    ttfts_ms: list[float]
    steps: list[StepSeen]  # each step the loop ran with requests in it
    steps_run: int  # the runner's own count of them (BatchRunner.num_steps)
    captures: int  # CUDA graphs captured inside the timed run (0 on a CPU)
    computed: int  # the tokens the replies say were computed: uncached prompt tokens, and each reply's but the last


def run_ours(engine: Engine, prompts: list[list[int]], max_tokens: int, batched: bool) -> Run:
    engine.allocator.reset_prefix_cache()  # every way starts from a cold pool
    runner = engine.loop.runner
    num_steps, captures = runner.num_steps, runner.model_runner.captures
    steps = watch_steps(engine)
    try:
        synchronize(engine.device)
        start = time.perf_counter()
        if batched:
            replies = engine.generate_batch(prompts, max_tokens=max_tokens)
            ttfts = [r.ttft_ms for r in replies]
        else:
            replies, ttfts = [], []
            for prompt in prompts:  # all arrive at time 0: the k-th waits for the k-1 before it
                replies.append(engine.generate(prompt, max_tokens=max_tokens))
                ttfts.append((time.perf_counter() - start) * 1e3 - replies[-1].total_ms + replies[-1].ttft_ms)
        seconds = time.perf_counter() - start
    finally:
        unwatch_steps(engine)
    computed = sum(r.prompt_tokens - r.cached_tokens + len(r.token_ids) - 1 for r in replies)
    return Run(seconds, [r.token_ids for r in replies], ttfts, steps, runner.num_steps - num_steps,
               runner.model_runner.captures - captures, computed)


def counted(run: Run) -> dict:
    """A run's counts for its row: the tokens its passes computed (from the steps it ran), the
    steps counted both ways, and the graphs captured while it was timed."""
    return {"tokens_embedded": sum(s.tokens for s in run.steps), "tokens_replies_computed": run.computed,
            "steps_watched": len(run.steps), "steps_run": run.steps_run, "captures_while_timed": run.captures}


def floor_seconds(model, threads, sizes: list[tuple[int, int]]) -> float:
    """Plain forward passes of these (tokens, tokens that sample) one after another: no pool,
    no cache; the logits of as many tokens as sampled in each of (c)'s passes, since a token
    is picked from its own row of logits (the model's last layer, a tenth of its weights or
    more, runs for each)."""
    synchronize(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        for n, keep in sizes:  # threads: the engine's policy, so its passes get its thread count (one_pass)
            with one_pass(threads, model.device, ("floor", n > 1, n.bit_length()), may_probe=n == 1):
                model(input_ids=torch.zeros(1, n, dtype=torch.long, device=model.device), logits_to_keep=max(keep, 1))
    synchronize(model.device)
    return time.perf_counter() - start


def run_transformers(model, prompts: list[list[int]], max_tokens: int, eos: set[int], block_size: int, num_blocks: int,
                     max_batch_tokens: int) -> tuple[float, list, list]:
    """transformers' continuous batching on a cache sized like ours: the same pages of
    block_size tokens, as many of them, the same token budget per step. (Left to size itself
    on a CPU, it takes most of the RAM for its cache and runs 2-4x slower than this.)"""
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=sorted(eos),
                              pad_token_id=model.generation_config.pad_token_id)
    cb_config = ContinuousBatchingConfig(allow_block_sharing=True, page_size=block_size, num_blocks=num_blocks,
                                         max_batch_tokens=max_batch_tokens)
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=config, record_timestamps=True,
                                   continuous_batching_config=cb_config)
    seconds = time.perf_counter() - start
    ordered = sorted(outputs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    ttfts = [((o.timestamps[0] if o.timestamps else o.lifespan[1]) - start) * 1e3 for o in ordered]
    return seconds, [list(o.generated_tokens) for o in ordered], ttfts


def plot(results: dict, path: Path, title: str) -> None:
    """Requests per second of each way, one group of bars per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    names = [row["name"] for row in runs[0]["rows"]]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        values = [next(r["requests_per_s"] for r in run["rows"] if r["name"] == name) for run in runs]
        bars = ax.bar([i + k * width for i in range(len(runs))], values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(runs))],
                  [f"{run['requests']} requests" for run in runs])
    ax.set_ylabel("requests / s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench throughput", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 32], help="batch sizes to run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--skip-transformers", action="store_true", help="leave out (d)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--plot", type=Path, default=ASSETS / "throughput.png", help="where to save the figure")
    parser.add_argument("--quick", action="store_true", help="4 requests of 4 tokens (for tests)")
    parser.add_argument("--padded-decode", action="store_true",
                        help="run decode steps padded to fixed shapes, as a GPU runs them (there as CUDA graphs; "
                        "on a CPU eagerly, to check that the counts see them)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens = [4], 4

    console, first, device = open_engine(args)
    model, tokenizer, num_blocks, eos = first.model, first.tokenizer, first.allocator.num_blocks, first.stop_token_ids
    budget = first.scheduler_options["max_num_batched_tokens"]
    prompt_sets = {n: [first.tokenize(q) for q in questions(n)] for n in args.requests}
    first.close()  # each way below makes its own engine, and closes it before the next way runs

    def fresh_engine(**options) -> Engine:
        if args.padded_decode:
            options["static_decode"] = True
        engine = Engine(model=model, tokenizer=tokenizer, block_size=args.block_size, num_blocks=num_blocks, **options)
        engine.warm_up()
        engine.generate_batch(["warm up"] * 2, max_tokens=2)  # the batched path's first pass, untimed
        return engine

    console.print(f"[bold]Throughput benchmark[/]: {args.model or DEFAULT_MODEL} on {model.device} ({device}, "
                  f"{torch.get_num_threads()} threads, {str(model.dtype).removeprefix('torch.')}); "
                  f"{num_blocks} blocks of {args.block_size}; {args.max_tokens} new tokens each")
    results = {"machine": device, "threads": torch.get_num_threads(), "runs": []}

    for n in args.requests:
        prompts = prompt_sets[n]
        shared = min(len(p) for p in prompts)
        with fresh_engine(enable_caching=False) as off:
            run_b = run_ours(off, prompts, args.max_tokens, batched=True)
        with fresh_engine() as engine:
            run_a = run_ours(engine, prompts, args.max_tokens, batched=False)
            run_c = run_ours(engine, prompts, args.max_tokens, batched=True)
            threads = engine.threads
        sizes = [(s.tokens, s.samples) for s in run_c.steps]  # (c)'s passes as planned, replays and padded steps too
        floor = in_own_thread(floor_seconds, model, threads, sizes)  # after the engine's loop has ended
        reference = run_a.outputs
        rows = [summary(name, run.seconds, run.outputs, run.ttfts_ms, reference) | counted(run)
                for name, run in [("(a) sequential", run_a), ("(b) batched, caching off", run_b),
                                  ("(c) batched, caching on", run_c)]]
        if not args.skip_transformers:
            hf_model = type(model).from_pretrained(model.name_or_path, dtype=model.dtype).to(model.device)
            with TokenCounter(hf_model.get_input_embeddings()) as embedded:  # its passes, like ours, off this thread
                run = in_own_thread(run_transformers, hf_model, prompts, args.max_tokens, eos, args.block_size,
                                    num_blocks, budget)
            rows.append(summary("(d) transformers generate_batch", *run, reference)
                        | {"tokens_embedded": embedded.tokens})  # its own passes, eager: a hook sees each
            del hf_model
        results["runs"].append({"requests": n, "prompt_tokens_min": shared, "rows": rows,
                                "floor_seconds": round(floor, 3), "forward_passes": len(sizes)})

        table = Table(title=f"{n} requests behind one system prompt (prompts of {shared}+ tokens)")
        table.add_column("way", no_wrap=True)
        for column in ("seconds", "requests/s", "tokens/s", "TTFT p50 ms", "TTFT p95 ms", "tokens embedded",
                       "same tokens as (a)"):
            table.add_column(column, justify="right")
        for r in rows:
            table.add_row(r["name"], f"{r['seconds']:.2f}", f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                          f"{r['ttft_p50_ms']:,.0f}", f"{r['ttft_p95_ms']:,.0f}", f"{r['tokens_embedded']:,}",
                          f"{r['same_tokens_as_a']} of {n}")
        console.print(table)
        by_name = {r["name"][:3]: r for r in rows}
        ratios = [f"(c)/(a) {by_name['(c)']['requests_per_s'] / by_name['(a)']['requests_per_s']:.1f}x",
                  f"(c)/(b) {by_name['(c)']['requests_per_s'] / by_name['(b)']['requests_per_s']:.1f}x"]
        if "(d)" in by_name:
            ratios.append(f"(c)/(d) {by_name['(c)']['requests_per_s'] / by_name['(d)']['requests_per_s']:.1f}x")
        console.print("requests/s, measured in this run: " + ", ".join(ratios))
        console.print(f"(c)'s floor: its {len(sizes)} forward passes ({sum(n for n, _ in sizes):,} tokens, the logits "
                      f"of the {sum(k for _, k in sizes):,} that sampled) run plainly, with no pool to attend to, took "
                      f"{floor:.2f} s; (c) took {by_name['(c)']['seconds'] / floor:.2f}x that.")
        if model.device.type == "cuda" or args.padded_decode:
            captured = {r["name"][:3]: r["captures_while_timed"] for r in rows[:3]}
            console.print("CUDA graphs captured inside the timed runs: "
                          + ", ".join(f"{name} {count}" for name, count in captured.items())
                          + " (each engine was warmed first; a capture inside a run is part of its time)")
    plot(results, args.plot, f"{args.model or DEFAULT_MODEL}, {args.max_tokens} new tokens each, on {device}")
    console.print(f"figure: {args.plot}")
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
