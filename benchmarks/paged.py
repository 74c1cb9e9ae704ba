"""The paged pool against a contiguous cache: a decode step of many requests, side by side.

    python prefix_caching.py --bench paged [--decodes 32 16] [--context 1024] [--steps 5] [--json out.json]

N requests with distinct contexts of --context tokens (no block shared: nothing to hit, no
shared-prefix attention), decoding together. Two ways to run the same step on the same model:

    paged        this engine's BatchRunner: every request's K/V in the block pool, read through
                 its block table in every layer (engine/batch_attention.py)
    contiguous   transformers' own batched decode: the same K/V in a DynamicCache, one
                 (requests, kv heads, tokens, dim) tensor per layer, as model.generate keeps it

The contexts are not computed one by one (a prefill of 32 x 1,024 tokens takes minutes on a
laptop CPU and says nothing about a decode step): one context is, and its K/V are copied into
every request's own blocks while their prompt step skips the model; the contiguous cache is
then copied out of the pool, so both attend over the very same numbers. The first step of
each is checked against the other (in fp32 their logits agree to ~1e-4 of the logits' size),
then --steps steps of each are timed in turn. Both run with torch's thread count (the
engine's thread choice is off here: one policy for both), and both eagerly, on a GPU too: the
bench compares where the K/V live, and a CUDA graph around one of them would compare launches
instead (python prefix_caching.py --bench padded_decode times the graphed step). Reported for
each N: the median step, the ratio (target: paged at most 1.2x contiguous), the time inside the attention
function (both call it: transformers' sdpa when no pool step is given), and the K/V a paged
layer copies out of the pool, in slots and bytes. The floor: the same N tokens through the
model with nothing to attend to.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from types import SimpleNamespace

import torch
from rich.table import Table
from transformers import DynamicCache

from benchmarks import save_json
from benchmarks.attention import floor_ms, timed_attention
from benchmarks.engines import open_engine
from commands.flags import positive_int
from commands.model_flags import add_model_arguments
from engine.batch_engine import BatchRunner
from engine.cpu_threads import synchronize
from engine.llm_engine import Engine
from engine.request import SamplingParams


@contextlib.contextmanager
def model_skipped(engine: Engine):
    """The engine's model answers without computing anything: zero logits for the tokens that
    sample, and no K/V written (the pool keeps what it holds)."""
    model = engine.model
    vocab = model.config.get_text_config().vocab_size

    def skipped(input_ids=None, logits_to_keep=None, **kwargs):
        return SimpleNamespace(logits=torch.zeros(1, len(logits_to_keep), vocab, device=input_ids.device))

    model.forward = skipped  # the instance's attribute hides the class's forward
    try:
        yield
    finally:
        del model.forward


def prefilled_runner(engine: Engine, n: int, context: int, steps: int, seed: int) -> BatchRunner:
    """A runner with n requests whose contexts of `context` tokens are in the pool (random K/V)
    and whose first tokens are sampled: every further step decodes all n."""
    rng = random.Random(seed)
    vocab = engine.model.config.get_text_config().vocab_size
    prompts = [[i] + [rng.randrange(vocab) for _ in range(context - 1)] for i in range(n + 1)]  # distinct
    # One context computed for real: its K/V are what every request's blocks get (random
    # numbers of the wrong size would make logits disagree for reasons no model has).
    runner = BatchRunner(engine.parts, cascade_attention=False, choose_threads=False, max_num_seqs=n,
                         max_num_batched_tokens=n * context, static_decode=False)  # every prompt in one step; eager
    real = runner.add("model", prompts[n], SamplingParams(max_tokens=2), None)
    runner.step()
    context_kv = engine.kv.data[:, :, engine.allocator.block_tables["model"]].clone()
    runner.scheduler.finish(real)
    for i in range(n):
        runner.add(f"r{i}", prompts[i], SamplingParams(max_tokens=steps + 8), None)
    with model_skipped(engine):
        runner.step()
    for request in runner.scheduler.running:
        engine.kv.data[:, :, engine.allocator.block_tables[request.request_id]] = context_kv
    return runner


def contiguous_cache(engine: Engine, runner: BatchRunner) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """The running requests' contexts copied out of the pool into one DynamicCache, with the
    next step's input ids and positions: what transformers' batched decode would hold."""
    requests = list(runner.scheduler.running)
    computed = requests[0].num_computed_tokens
    assert all(r.num_computed_tokens == computed for r in requests), "contexts of one length: no padding"
    tables = engine.allocator.block_tables
    per_request = [engine.kv.tokens_of(tables[r.request_id])[..., :computed, :] for r in requests]
    kv = torch.cat(per_request, dim=2)  # (layers, 2, requests, kv heads, tokens, dim)
    cache = DynamicCache([(kv[layer, 0].clone(), kv[layer, 1].clone()) for layer in range(engine.kv.num_layers)],
                         config=engine.model.config)
    ids = torch.tensor([[r.token_ids[computed]] for r in requests], device=engine.device)
    positions = torch.full_like(ids, computed)
    return cache, ids, positions


def compare(engine: Engine, n: int, context: int, steps: int, seed: int) -> dict:
    runner = prefilled_runner(engine, n, context, steps, seed)
    cache, ids, positions = contiguous_cache(engine, runner)
    captured = []
    hook = engine.model.register_forward_hook(lambda module, args, output: captured.append(output.logits))
    try:
        with torch.inference_mode():
            runner.step()  # the paged step, its logits captured
            contiguous = engine.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
    finally:
        hook.remove()
    paged_logits, contiguous_logits = captured[0][0], contiguous.logits[:, -1]
    difference = ((paged_logits - contiguous_logits).abs().max() / contiguous_logits.abs().max()).item()
    ids = contiguous_logits.argmax(-1, keepdim=True)
    paged_ms, contiguous_ms, paged_attention, contiguous_attention = [], [], [], []
    with torch.inference_mode():
        for _ in range(steps):
            with timed_attention() as seconds:
                start = time.perf_counter()
                runner.step()
                paged_ms.append((time.perf_counter() - start) * 1e3)
            paged_attention.append(sum(seconds) * 1e3)
            positions = positions + 1
            with timed_attention() as seconds:
                start = time.perf_counter()
                out = engine.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
                synchronize(engine.device)
                contiguous_ms.append((time.perf_counter() - start) * 1e3)
            contiguous_attention.append(sum(seconds) * 1e3)
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
    figures = runner.last_step
    for request in list(runner.scheduler.running):
        runner.scheduler.finish(request)
    slot_bytes = 2 * engine.kv.num_kv_heads * engine.kv.head_dim * engine.kv.dtype.itemsize  # K and V, one layer
    return {"decodes": n, "context": context, "max_logit_difference": difference,
            "paged_ms": statistics.median(paged_ms), "contiguous_ms": statistics.median(contiguous_ms),
            "paged_attention_ms": statistics.median(paged_attention),
            "contiguous_attention_ms": statistics.median(contiguous_attention),
            "slots_needed": figures.num_slots_needed, "slots_copied": figures.num_slots_copied,
            "mb_copied_per_step": figures.num_slots_copied * slot_bytes * engine.kv.num_layers / 1e6,
            "floor_ms": floor_ms(engine, n, repeats=steps)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python prefix_caching.py --bench paged",
                                     description="a decode step on the paged pool against a contiguous cache")
    add_model_arguments(parser)
    parser.add_argument("--decodes", type=positive_int, nargs="+", default=[32, 16])
    parser.add_argument("--context", type=positive_int, default=1024, help="tokens of each request's context")
    parser.add_argument("--steps", type=positive_int, default=5, help="decode steps timed, each way")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.num_blocks is None and args.kv_memory_gb is None:  # room for every context, whatever the block size
        args.num_blocks = max(args.decodes) * -(-(args.context + args.steps + 8) // args.block_size) + 1
    console, engine, device = open_engine(args)
    rows = [compare(engine, n, args.context, args.steps, args.seed) for n in args.decodes]
    table = Table(title=f"a decode step over distinct {args.context:,}-token contexts, {device}, "
                        f"{torch.get_num_threads()} threads, {engine.dtype}")
    for column in ("decodes", "paged", "contiguous (DynamicCache)", "paged / contiguous", "attention, paged",
                   "attention, contiguous", "copied a step", "floor", "logits differ by (of their size)"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["decodes"]), f"{row['paged_ms']:,.0f} ms", f"{row['contiguous_ms']:,.0f} ms",
                      f"{row['paged_ms'] / row['contiguous_ms']:.2f}x", f"{row['paged_attention_ms']:,.0f} ms",
                      f"{row['contiguous_attention_ms']:,.0f} ms",
                      f"{row['slots_copied']:,} slots, {row['mb_copied_per_step']:,.0f} MB",
                      f"{row['floor_ms']:,.0f} ms", f"{row['max_logit_difference']:.1e}")
    console.print(table)
    console.print("paged: this engine's step, each context read from the pool through its block table in every "
                  "layer; contiguous: transformers' batched decode with a DynamicCache of the same K/V (it appends "
                  "each step's K/V with torch.cat, outside the attention function). 'copied a step': the slots "
                  "the paged step copies out of the pool in each layer, and their bytes over all layers.")
    results = {"device": device, "threads": torch.get_num_threads(), "rows": rows}
    save_json(args.json, results, console)
    return results
