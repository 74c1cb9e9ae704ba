"""The padded steps against the packed ones, on the same steps: what padding costs, and what
reading each row's own blocks saves when one context is much longer than the rest.

    python prefix_caching.py --bench padded_decode [--repeats 7] [--quick] [--json out.json]

Each scene's requests are prefilled through a BatchRunner, then one step runs `--repeats`
times on two model runners over the same pool: the packed step of engine/batch_attention.py
(rows grouped by length, shapes their own) and the padded one (fixed shapes, each request's
own blocks; eagerly on a CPU, replayed as a CUDA graph on a GPU, its capture made before the
clock): engine/static_decode.py's for a step that only decodes, engine/static_chunk.py's for
one with a prompt's chunk. Running a step again writes the same K/V into the same slots, so
every repeat computes the same step. The table gives the median of the repeats after the
first two, the slots each step copied out of the pool (a layer), and the largest difference
between the two steps' logits.

    equal        16 requests of 200 tokens decoding: the rows read about the same, padding
                 costs little
    one long     one of 2,000 tokens among 15 of 60, decoding: each row reads its own blocks,
                 so the short rows do not pay for the long one's (a padded step that read the
                 longest row's blocks for every row copied 16 x 125 blocks)
    a chunk      15 requests of 200 tokens decoding beside a new prompt's first 497 tokens:
                 512 tokens, every one of them scoring every slot the step reads, masked to
                 its own request's (the packed step attends the chunk and the decodes apart)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.table import Table

from benchmarks import save_json
from benchmarks.engines import open_engine
from commands.flags import positive_int
from commands.model_flags import add_model_arguments
from engine.batch_engine import BatchRunner
from engine.cpu_threads import synchronize
from engine.model_loader import DEFAULT_MODEL
from engine.model_runner import ModelRunner
from engine.request import SamplingParams

# Each scene: the contexts of the requests decoding, and the tokens of a new prompt's chunk beside them
SCENES = {"equal": ([200] * 16, 0), "one long": ([2000] + [60] * 15, 0), "a chunk": ([200] * 15, 497)}
QUICK = {"equal": ([20] * 4, 0), "one long": ([120] + [6] * 3, 0), "a chunk": ([20] * 3, 29)}  # --quick: seconds
#                                                                                   on the tests' tiny model


def first_step(engine, lengths: list[int], chunk: int, seed: int):
    """A BatchRunner holding `lengths` random prompts, prefilled (one a step, the first ones
    decoding meanwhile), and its first plan that decodes every one of them; with chunk > 0, a
    new random prompt of `chunk` tokens added then, and the plan that decodes them all beside it."""
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.get_text_config().vocab_size
    prompt = lambda n: torch.randint(vocab, (n,), generator=generator).tolist()  # noqa: E731
    runner = BatchRunner(engine.parts, choose_threads=False, max_num_seqs=len(lengths) + 1,
                         max_num_batched_tokens=max(*lengths, len(lengths) + chunk), static_decode=False)
    requests = [runner.add(f"padded-{seed}-{i}", prompt(n), SamplingParams(max_tokens=4 * len(lengths)), None)
                for i, n in enumerate(lengths)]
    while True:
        plan = runner.schedule()
        if plan.num_tokens == len(plan.scheduled) == len(lengths):
            if not chunk:
                return runner, requests, plan
            requests.append(runner.add(f"padded-{seed}-chunk", prompt(chunk), SamplingParams(max_tokens=1), None))
            chunk = 0  # its plan comes next: the decodes, then the new prompt whole
        elif len(plan.scheduled) == len(lengths) + 1:
            return runner, requests, plan
        runner.postprocess(plan, runner.model_runner.run(plan, runner.block_tables).argmax(-1).tolist())


def timed(model_runner: ModelRunner, plan, tables, repeats: int, device) -> tuple[float, torch.Tensor]:
    """The median ms of the step's repeats after the first two, and its logits."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        logits = model_runner.run(plan, tables)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:]), logits.float()


def scene(engine, name: str, lengths: list[int], repeats: int, seed: int, chunk: int = 0) -> dict:
    runner, requests, plan = first_step(engine, lengths, chunk, seed)
    try:
        packed = ModelRunner(engine.parts, max_num_seqs=len(plan.scheduled), static_decode=False)
        padded = ModelRunner(engine.parts, max_num_seqs=len(plan.scheduled), static_decode=True)
        packed_ms, want = timed(packed, plan, runner.block_tables, repeats, engine.device)
        padded.run(plan, runner.block_tables)  # a GPU captures this shape's graph here, before the clock
        captures = padded.captures
        padded_ms, got = timed(padded, plan, runner.block_tables, repeats, engine.device)
        shape = padded.padded_rung(plan) or padded.chunk_rung(plan)
        graphs = padded.graphs if padded.padded_rung(plan) else padded.chunk_graphs
        return {"scene": name, "requests": len(plan.scheduled), "context_tokens": [s.end for s in plan.scheduled],
                "tokens": plan.num_tokens, "padded_to": shape,
                "packed_ms": packed_ms, "padded_ms": padded_ms,
                "packed_slots_copied": packed.last_step.num_slots_copied,
                "padded_slots_copied": padded.last_step.num_slots_copied,
                "graphed": graphs is not None and graphs.has(*shape),
                "captures_in_timed_region": padded.captures - captures,
                "max_logit_difference": (got - want).abs().max().item()}
    finally:
        for request in requests:
            runner.scheduler.finish(request)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench padded_decode",
                                     description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--repeats", type=positive_int, default=7, help="runs of each step (default 7; the first two are not counted)")
    parser.add_argument("--quick", action="store_true",
                        help="4 requests a scene, of 20 tokens, or one of 120 among 6, or a chunk of 29 beside 3")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3: the first two runs of a step are not counted")
    console, engine, device = open_engine(args)
    engine.warm_up()
    threads = f", {torch.get_num_threads()} threads" if engine.device.type == "cpu" else ""
    console.print(f"[bold]The padded steps against the packed ones[/]: {args.model or DEFAULT_MODEL} on {engine.device} "
                  f"({device}{threads}, {engine.kv.dtype})")
    rows = [scene(engine, name, lengths, args.repeats, seed, chunk)
            for seed, (name, (lengths, chunk)) in enumerate((QUICK if args.quick else SCENES).items())]
    padded_how = "replayed as a CUDA graph" if engine.device.type == "cuda" else "eagerly"
    table = Table("scene", "tokens, padded to", "packed step", f"padded step ({padded_how})", "padded / packed", "slots copied, packed",
                  "slots copied, padded", "largest logit difference", title="one step, median of the repeats")
    for row in rows:
        table.add_row(row["scene"], f"{row['tokens']}, {row['padded_to'][0]}", f"{row['packed_ms']:.1f} ms", f"{row['padded_ms']:.1f} ms",
                      f"{row['padded_ms'] / row['packed_ms']:.2f}x", f"{row['packed_slots_copied']:,}",
                      f"{row['padded_slots_copied']:,}", f"{row['max_logit_difference']:.1e}")
    console.print(table)
    console.print(f"One run on {device}; captures inside the timed region: "
                  f"{sum(row['captures_in_timed_region'] for row in rows)}.")
    results = {"machine": device, "device": str(engine.device), "dtype": str(engine.kv.dtype), "rows": rows}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
