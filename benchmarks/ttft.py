"""Time to first token (TTFT), cold vs warm, on a real model. One command:

    python prefix_caching.py --bench ttft [--json out.json] [--quick] [--model ... --device ...]

1. Cold vs warm. Each request is a shared prefix of P tokens and a 32-token suffix of its
   own. Cold: nobody has seen the prefix. Warm: the request just before computed it, so
   only the suffix runs. Beside each measured warm/cold ratio is the ideal one,
   suffix / (prefix + suffix): what it would be if time were proportional to the tokens
   computed. (The warm suffix costs a little more than that: it attends over the prefix.)
2. Where the warm time goes: lookup (hashing, allocation), gather (K/V out of the pool),
   forward (the suffix), write (its K/V into the pool), sample.
3. The overhead of caching when nothing is shared: the same never-repeating prompts on an
   engine with caching on and on one with caching off, in pairs that take turns so that a
   change in machine speed hits both alike.

Every request runs stage 7's path (benchmarks/engines.py's stage_7: one_request.generate over
the engine's parts), whose phases its Generation times. Cold and warm figures are medians of
--repeats runs. Prompts are random token ids: prefill costs
the same whatever the tokens say. The first forward pass of a process is slow (allocation,
kernel choice), so a warm-up pass runs before anything is timed.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from benchmarks import save_json
from benchmarks.engines import captured, device_name, stage_7
from commands.model_flags import add_model_arguments, pool_arguments
from engine.cpu_threads import synchronize
from engine.llm_engine import Engine

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SUFFIX_LEN = 32  # each request's own tokens after the shared prefix


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """n ordinary token ids (the first 1,000 ids, where special tokens live, are skipped)."""
    return [rng.randrange(1000, vocab_size) for _ in range(n)]


def cold_vs_warm(engine: Engine, prefix_len: int, suffix_len: int, repeats: int, rng: random.Random) -> dict:
    """Median TTFT of a request whose prefix is new, and of the next one sharing it. Where
    stage 7's passes run as CUDA graphs (a GPU), every pass of a request this long is
    captured before the clock; captures_while_timed counts any that were not."""
    vocab_size = engine.model.get_input_embeddings().num_embeddings
    if engine.parts.fixed is not None:
        engine.parts.fixed.capture_at_start(up_to=prefix_len + suffix_len)
    captures = captured(engine)
    cold, warm, parts = [], [], []
    for _ in range(repeats):  # a fresh prefix each time, so the cold request is truly cold
        prefix = random_tokens(rng, prefix_len, vocab_size)
        synchronize(engine.device)
        first = stage_7(engine, prefix + random_tokens(rng, suffix_len, vocab_size), max_tokens=1)
        synchronize(engine.device)
        second = stage_7(engine, prefix + random_tokens(rng, suffix_len, vocab_size), max_tokens=1)
        hit = prefix_len // engine.allocator.block_size * engine.allocator.block_size  # whole blocks only
        assert first.cached_tokens == 0 and second.cached_tokens == hit, "the benchmark must measure a miss, then a hit"
        cold.append(first.ttft_ms)
        warm.append(second.ttft_ms)
        parts.append(second.prefill)
    cold_ms, warm_ms = statistics.median(cold), statistics.median(warm)
    breakdown = {
        name: statistics.median(getattr(p, name) for p in parts)
        for name in ("lookup_ms", "gather_ms", "forward_ms", "write_ms", "sample_ms")
    }
    return {
        "prefix_tokens": prefix_len,
        "suffix_tokens": suffix_len,
        "cold_ms": cold_ms,
        "warm_ms": warm_ms,
        "ratio": warm_ms / cold_ms,
        "ideal_ratio": suffix_len / (prefix_len + suffix_len),
        "speedup": cold_ms / warm_ms,
        "warm_breakdown_ms": breakdown,
        "captures_while_timed": captured(engine) - captures,
    }


def no_sharing_overhead(on: Engine, off: Engine, prompt_len: int, repeats: int, rng: random.Random) -> dict:
    """TTFT of never-repeating prompts with caching on and off, in pairs that take turns.

    Each pair runs back to back, so the ratio within a pair is barely touched by the machine
    getting faster or slower; the overhead is the median of those ratios. Its standard error
    says how much of it is noise. The work caching itself adds, hashing the prompt's blocks
    and looking them up, is timed on its own as well.
    """
    vocab_size = on.model.get_input_embeddings().num_embeddings
    times: dict[str, list[float]] = {"on": [], "off": []}
    lookups: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(repeats):
        order = [("on", on), ("off", off)] if i % 2 == 0 else [("off", off), ("on", on)]
        for name, engine in order:
            reply = stage_7(engine, random_tokens(rng, prompt_len, vocab_size), max_tokens=1)
            assert reply.cached_tokens == 0
            times[name].append(reply.ttft_ms)
            lookups[name].append(reply.prefill.lookup_ms)
    ratios = [t_on / t_off - 1 for t_on, t_off in zip(times["on"], times["off"])]
    off_ms = statistics.median(times["off"])
    caching_work_ms = statistics.median(lookups["on"]) - statistics.median(lookups["off"])
    return {
        "prompt_tokens": prompt_len,
        "pairs": repeats,
        "caching_on_ms": statistics.median(times["on"]),
        "caching_off_ms": off_ms,
        "overhead": statistics.median(ratios),
        "overhead_standard_error": statistics.stdev(ratios) / len(ratios) ** 0.5,
        "caching_work_ms": caching_work_ms,
        "caching_work_fraction": caching_work_ms / off_ms,
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    prefixes = [r["prefix_tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    left.plot(prefixes, [r["cold_ms"] for r in rows], "o-", color="tab:red", label="cold (prefix computed)")
    left.plot(prefixes, [r["warm_ms"] for r in rows], "o-", color="tab:green", label="warm (prefix from the pool)")
    left.set(xscale="log", yscale="log", xlabel="shared prefix (tokens)", ylabel="TTFT (ms)", title="time to first token")
    right.plot(prefixes, [r["ratio"] for r in rows], "o-", color="tab:green", label="measured warm / cold")
    right.plot(prefixes, [r["ideal_ratio"] for r in rows], "--", color="gray", label="ideal: suffix / all tokens")
    right.set(xscale="log", yscale="log", xlabel="shared prefix (tokens)", title="warm / cold")
    for ax in (left, right):
        ax.set_xticks(prefixes, [str(p) for p in prefixes])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # ticks at 1, 2, 5 x 10^k, plainly written
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench ttft", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--suffix-len", type=int, default=SUFFIX_LEN)
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement; medians are reported")
    parser.add_argument("--overhead-prompt-len", type=int, default=512)
    parser.add_argument("--overhead-pairs", type=int, default=15)
    parser.add_argument("--plot", type=Path, default=ASSETS / "ttft.png", help="where to save the figure")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="two short prefixes, one run each (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.prefix_lens, args.repeats, args.overhead_prompt_len, args.overhead_pairs = [64, 128], 1, 64, 2

    import torch
    from rich.console import Console
    from rich.table import Table

    console = Console()
    on = Engine(args.model, device=args.device, dtype=args.dtype, **pool_arguments(args))
    off = Engine(model=on.model, tokenizer=on.tokenizer, block_size=args.block_size,
                 num_blocks=on.allocator.num_blocks, enable_caching=False)
    device = device_name(on.device)
    machine = f"{device}, {torch.get_num_threads()} threads, {str(on.dtype).removeprefix('torch.')}"
    model = args.model or "SmolLM2-135M-Instruct"
    console.print(f"[bold]TTFT benchmark[/]: {model} on {on.device} ({machine}); block size {args.block_size}")
    on.warm_up()
    off.warm_up()

    rng = random.Random(0)
    rows = [cold_vs_warm(on, p, args.suffix_len, args.repeats, rng) for p in args.prefix_lens]
    overhead = no_sharing_overhead(on, off, args.overhead_prompt_len, args.overhead_pairs, rng)

    table = Table(title=f"TTFT, shared prefix + {args.suffix_len}-token suffix (median of {args.repeats})")
    for column in ("prefix", "cold ms", "warm ms", "warm / cold", "ideal", "speed-up"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            f"{r['prefix_tokens']:,}", f"{r['cold_ms']:,.0f}", f"{r['warm_ms']:,.1f}",
            f"{r['ratio']:.3f}", f"{r['ideal_ratio']:.3f}", f"{r['speedup']:.1f}x",
        )
    console.print(table)

    parts = Table(title="where the warm TTFT goes (ms, median)")
    parts.add_column("prefix", justify="right")
    for name in ("lookup", "gather", "forward", "write", "sample", "TTFT"):
        parts.add_column(name, justify="right")
    for r in rows:
        b = r["warm_breakdown_ms"]
        parts.add_row(f"{r['prefix_tokens']:,}", *(f"{b[f'{n}_ms']:.1f}" for n in ("lookup", "gather", "forward", "write", "sample")),
                      f"{r['warm_ms']:.1f}")
    console.print(parts)

    console.print(
        f"[bold]No shared prefix[/] ({overhead['prompt_tokens']} new tokens, {overhead['pairs']} pairs): "
        f"TTFT caching on {overhead['caching_on_ms']:,.1f} ms, off {overhead['caching_off_ms']:,.1f} ms (medians); "
        f"overhead [bold]{overhead['overhead']:+.1%}[/] ± {overhead['overhead_standard_error']:.1%} "
        f"(median of paired ratios ± standard error). The work caching adds, hashing + lookup: "
        f"{overhead['caching_work_ms']:.2f} ms = {overhead['caching_work_fraction']:.2%} of TTFT."
    )
    console.print(f"CUDA graphs captured while timed: {sum(r['captures_while_timed'] for r in rows)}.")
    plot(rows, args.plot, f"{model}, {machine}")
    console.print(f"saved {args.plot}")

    results = {"model": model, "device": str(on.device), "machine": machine, "cold_vs_warm": rows, "no_sharing": overhead}
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
