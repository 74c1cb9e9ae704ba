"""Where a decode step's time goes: the linear layers, attention on the pool, the rest of the
model, and the engine's own Python.

    python prefix_caching.py --bench step_profile [--requests 16 64] [--steps 5] [--json out.json]

N requests behind the demo's system prompt are prefilled, then a few of their decode steps
run under torch's profiler (torch.profiler, CPU time of each operator). Each operator is
counted in one part:

    linear     the weights: aten::linear, mm, addmm, matmul outside attention
    attention  everything inside batch_attention.pool_attention: writing the step's K/V into
               the pool, copying each group's context out, the softmax, the merge
    model      every other operator of the forward pass: norms, rotary embeddings, the
               activation, the embedding, residual adds (on a GPU, where a decode step is
               replayed as a CUDA graph, no operator runs on the CPU: its whole pass is here)
    engine     what the step does around the forward pass in Python: schedule, build_step,
               sampling, the finisher (BatchRunner.step's wall time minus the runner's pass)

On a GPU the decode steps' graphs are captured before the clock (ModelRunner.capture_at_start),
and the output says how many were captured while timed.

The parts are printed as a share of the step, from one run. The profiler's own bookkeeping
slows each operator a little, so the shares matter more than the milliseconds.

A second table times the engine's Python around the forward pass, without the profiler, on
the runner every request of the engine runs on (its loop's: the step budget at the defaults,
the snapshot /health reads published after each step), decode steps of N requests, medians:

    schedule     the step budget's budget, the scheduler's plan, the block tables it runs on
    sample       the next token of every request (sample_batch), after the pass has ended
    record       the step's cost, learned by the budget
    postprocess  the tokens into replies and events, finished requests freed, the snapshot
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.table import Table
from transformers import AttentionInterface

from benchmarks import save_json
from benchmarks.engines import open_engine
from benchmarks.throughput import questions
from commands.flags import positive_int
from commands.model_flags import add_model_arguments
from engine import batch_attention, batch_engine
from engine import model_runner as engine_model_runner
from engine.batch_engine import BatchRunner
from engine.cpu_threads import synchronize
from engine.model_loader import DEFAULT_MODEL
from engine.request import SamplingParams

LINEAR = {"aten::linear", "aten::mm", "aten::addmm", "aten::matmul"}
ATTENTION = "pool_attention"  # the record_function label the profile wraps batch_attention's function in
BUILD = "build_step"  # ... and batch_attention.build_step, as the runner calls it


def profiled_steps(engine, n: int, steps: int) -> dict:
    """Prefill n requests, then profile `steps` decode steps: milliseconds a step, each part."""
    runner = BatchRunner(engine.parts, max_num_seqs=n, max_num_batched_tokens=max(2048, n))
    prompts = [engine.tokenize(q) for q in questions(n)]
    for i, prompt in enumerate(prompts):
        runner.add(f"r{i}", prompt, SamplingParams(max_tokens=steps + 8), None)
    while any(not r.output_ids for r in [*runner.scheduler.running, *runner.scheduler.waiting]):
        runner.step()
    runner.step()  # one decode step untimed: the first of a shape sets up buffers
    model_runner = runner.model_runner
    model_runner.capture_at_start()  # on a GPU: the decode steps' graphs, before the clock
    captures = model_runner.captures

    forward_ms, step_ms = [], []

    def timed_run(*args, **kwargs):
        # Around the runner's pass, not the model's forward: a step replayed as a CUDA graph
        # calls no forward, and a wait inside a capture would break the capture.
        start = time.perf_counter()
        try:
            return real_run(*args, **kwargs)
        finally:
            synchronize(engine.device)
            forward_ms.append((time.perf_counter() - start) * 1e3)

    real_run, real_attention = model_runner.run, batch_attention.pool_attention
    model_runner.run = timed_run

    def labelled_attention(*args, **kwargs):
        with torch.profiler.record_function(ATTENTION):
            return real_attention(*args, **kwargs)

    AttentionInterface.register(batch_attention.POOL_ATTENTION, labelled_attention)
    real_build = engine_model_runner.build_step

    def labelled_build(*args, **kwargs):  # the packed step's inputs: the engine's Python, inside the runner's pass
        with torch.profiler.record_function(BUILD):
            return real_build(*args, **kwargs)

    engine_model_runner.build_step = labelled_build
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            for _ in range(steps):
                start = time.perf_counter()
                runner.step()
                step_ms.append((time.perf_counter() - start) * 1e3)
    finally:
        del model_runner.run
        engine_model_runner.build_step = real_build
        AttentionInterface.register(batch_attention.POOL_ATTENTION, real_attention)
        for request in list(runner.scheduler.running):
            runner.scheduler.finish(request)

    events = profile.key_averages()
    attention = sum(e.cpu_time_total for e in events if e.key == ATTENTION) / 1e3
    # Self times: a linear layer's aten::linear calls addmm, whose time is its own. Attention
    # multiplies with einsum and SDPA (bmm), none of these.
    linear = sum(e.self_cpu_time_total for e in events if e.key in LINEAR) / 1e3
    build = sum(e.cpu_time_total for e in events if e.key == BUILD) / 1e3
    forward = sum(forward_ms) - build
    total = sum(step_ms)
    parts = {"linear": linear, "attention": attention, "model": max(0.0, forward - linear - attention),
             "engine": max(0.0, total - forward)}
    return {"requests": n, "step_ms": statistics.median(step_ms),
            "shares": {name: ms / total for name, ms in parts.items()},
            "captures_while_timed": model_runner.captures - captures}


def engine_python(engine, n: int, steps: int) -> dict:
    """Milliseconds of each part of the engine's Python (the docstring's second table) in
    `steps` decode steps of n requests (less those whose reply stopped) on the engine loop's
    runner, and of the forward pass
    (ended on the device: a GPU's work is not left for the sampling to wait for). The parts are
    timed around the runner's own calls, which run as they always do."""
    runner = engine.loop.runner
    generator = torch.Generator().manual_seed(n)
    vocab = engine.model.config.get_text_config().vocab_size
    # 32 random tokens each, and room to decode long after the last one's prefill
    requests = [runner.add(f"engine-python-{n}-{i}", torch.randint(vocab, (32,), generator=generator).tolist(),
                           SamplingParams(max_tokens=steps + 64), None) for i in range(n)]
    times = {name: [] for name in ("schedule", "forward", "sample", "record", "postprocess")}
    sizes = []

    def timed(name, call, wait=False):
        def run(*args, **kwargs):
            start = time.perf_counter()
            result = call(*args, **kwargs)
            if wait:
                synchronize(engine.device)
            times[name].append((time.perf_counter() - start) * 1e3)
            return result
        return run

    model_runner, budget = runner.model_runner, runner.budget
    real = {"schedule": runner.schedule, "postprocess": runner.postprocess, "run": model_runner.run,
            "record": budget.record, "sample": batch_engine.sample_batch}
    runner.schedule, runner.postprocess = timed("schedule", real["schedule"]), timed("postprocess", real["postprocess"])
    model_runner.run, budget.record = timed("forward", real["run"], wait=True), timed("record", real["record"])
    batch_engine.sample_batch = timed("sample", real["sample"])
    try:
        while len(times["forward"]) < steps + 1 and (runner.scheduler.running or runner.scheduler.waiting):
            runner.step()
            plan = runner.last_plan
            if plan is None or plan.num_tokens != len(plan.scheduled) or runner.scheduler.waiting:
                for kept in times.values():
                    kept.clear()  # only decode steps after the last prompt's are counted
                sizes.clear()
            else:
                sizes.append(len(plan.scheduled))  # a random prompt's reply may stop early
    finally:
        del runner.schedule, runner.postprocess, model_runner.run, budget.record
        batch_engine.sample_batch = real["sample"]
        for request in requests:
            if request.status != "finished":
                runner.scheduler.finish(request)
    if len(times["forward"]) < 2:
        raise RuntimeError(f"the {n} requests never decoded together: the pool holds too few blocks for them")
    medians = {name: statistics.median(kept[1:]) for name, kept in times.items()}  # the first: a new shape
    return {"requests": n, "decodes": statistics.median(sizes[1:]), "steps": len(sizes) - 1, "ms": medians,
            "schedule_sample_record_ms": medians["schedule"] + medians["sample"] + medians["record"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench step_profile",
                                     description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--requests", type=positive_int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=positive_int, default=5, help="decode steps profiled (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    console, engine, device = open_engine(args)
    engine.warm_up()
    console.print(f"[bold]Where a decode step's time goes[/]: {args.model or DEFAULT_MODEL} on {engine.device} "
                  f"({device}, {torch.get_num_threads()} threads)")
    rows = [profiled_steps(engine, n, args.steps) for n in args.requests]
    table = Table("decodes", "step (median)", "linear layers", "attention", "rest of the model", "engine's Python",
                  title="a decode step behind one system prompt, under the profiler")
    for row in rows:
        shares = row["shares"]
        table.add_row(str(row["requests"]), f"{row['step_ms']:,.0f} ms",
                      *(f"{shares[name]:.1%}" for name in ("linear", "attention", "model", "engine")))
    console.print(table)
    console.print(f"One run on {device}; the profiler slows each operator a little, so read the shares. "
                  f"CUDA graphs captured while timed: {sum(row['captures_while_timed'] for row in rows)}.")
    python = [engine_python(engine, n, args.steps) for n in args.requests]
    table = Table("decodes", "forward pass", "schedule", "sample", "record", "schedule + sample + record",
                  "postprocess", title="the engine's Python around a decode step, its loop's runner, medians")
    for row in python:
        ms = row["ms"]
        table.add_row(f"{row['decodes']:g}", *(f"{ms[name]:.2f} ms" for name in ("forward", "schedule", "sample", "record")),
                      f"{row['schedule_sample_record_ms']:.2f} ms", f"{ms['postprocess']:.2f} ms")
    console.print(table)
    results = {"machine": device, "rows": rows, "engine_python": python}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
