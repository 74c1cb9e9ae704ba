"""The GPU path checked in one command, on a machine with no network:

    python prefix_caching.py --bench gpu [--config-dir DIR] [--tiny] [--json PATH] [--device ... --dtype ...]

The model is the default, SmolLM2-135M-Instruct, when its weights load. When they cannot (no
network, no cached weights), it is a model of the same config with random weights (seed 0) and
the real tokenizer, read from a folder of config and tokenizer files: --config-dir, else the
project's model cache (PREFIX_CACHING_HOME, engine/model_files.py), and the output says so. Greedy
decoding on random weights is as deterministic as on trained ones, so exactness and timings
hold; the words do not. A --config-dir with weights in it loads them. --tiny runs the tests'
2-layer random Llama (model_loader.tiny_llama): end to end on a CPU in seconds.

It runs, one after another, then prints one table (--json writes the numbers):

1. The demo's requests (commands/demo.py): five questions behind one system prompt, a MISS then HITs,
   then again with the cache emptied (the steady state: every pass of a shape seen before),
   then on CUDA behind the course reader (the demo's --long-prefix part), where the context holds it;
   each request's TTFT, prefill phases (on CUDA each on the GPU's own clock too, CUDA events:
   engine/cpu_threads.GpuClock) and the graphs captured while it ran, one more HIT
   under torch's profiler (kernel launches, wall time, the GPU's time in kernels),
   the first round against the steady one phase by phase, and the pool after the warm-up.
2. Exactness: prompts behind the demo's system prompt, long prompts of random tokens and short
   ones, each against plain model.generate (greedy), on every path a request can take: stage
   7's one request at a time (one_request.generate over an Engine's parts), the engine loop
   with shared-prefix (cascade) attention allowed, and without. Required in fp32: a reply that
   differs makes the exit status 1. On CUDA also in bf16, reported only: random weights give
   near-flat logits, and a near-tie can flip with the shape of the batch. Scaling the output
   layer would not make a mismatch mean more: the rounding of the hidden state reaches the
   logits through the same weights, so it grows with the margins between them.
3. TTFT cold vs warm (benchmarks/ttft.py's cold_vs_warm), prefixes up to the model's context.
4. Throughput (benchmarks/throughput.py's run_ours): (a) sequential, (b) batched with caching
   off, (c) batched with caching on, both engines warmed first, each way's steps counted from
   its runner's plans (a replayed graph included) with the graphs captured while it was timed,
   and (c) against its floor. On CUDA on a Llama-3.2-1B shape in bf16 (random weights, the same
   tokenizer), where a batch has real work to share. throughput.py's (d), transformers' own
   batching, is left out: it loads the model again from its files.
5. Decode: ms a token on stage 7's path (the demo's) and through the engine loop, one stream
   and 16 together (ms a step, and on CUDA the step on the GPU's clock), on the model of parts 1-3.
6. One long chat among short streams (benchmarks/padded_decode.py's scene): the padded decode
   step of one 8,000-token chat among 63 of 64 tokens against 64 of 64 tokens.
7. TTFT cold and warm on the throughput's model (the 1B shape on CUDA) at prefixes up to 8,000
   tokens, the cold prefill against its arithmetic floor (its multiply-adds at the rate this
   device reaches on one large matrix product, measured in the run).

Sizes (ON_GPU) are chosen to fit in 6 minutes on an H100, within one call of a lent machine:
24 exactness prompts of 24 new tokens (three paths, fp32 and bf16), TTFT at 1,024, 4,096 and
8,128 prefix tokens (8,192 is the default's context) three times each, throughput at 16 and
64 requests of 32 new tokens. Decoding one token at a time is what takes the time there (each
costs mostly Python and kernel launches, whatever the model's size), so the sizes count such
tokens: about 5,000 in all, model.generate's included. On a CPU, and with --tiny, the sizes
are SMALL: a minute or less.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch
import transformers
from rich.table import Table
from transformers import AutoConfig

from benchmarks import save_json
from benchmarks.engines import captured, device_name, open_console, stage_7, unwatch_steps, watch_steps
from benchmarks.padded_decode import scene
from benchmarks.throughput import counted, floor_seconds, questions, run_ours, summary
from benchmarks.ttft import SUFFIX_LEN, cold_vs_warm, random_tokens
from commands.demo import COURSE_READER, DEMO_MAX_TOKENS, DEMO_QUESTIONS, DEMO_SYSTEM_PROMPT, demo_prompt
from commands.model_flags import add_model_arguments, pool_arguments
from engine.cpu_threads import in_own_thread, synchronize
from engine.llm_engine import Engine
from engine.model_files import DEFAULT_MODEL, converted_default, load_tokenizer
from engine.model_loader import load_model, random_model, resolve_device, resolve_dtype, tiny_llama
from engine.one_request import generate, greedy_reference
from engine.request import SamplingParams
from engine.step_budget import ModelShape


@dataclass(frozen=True)
class Sizes:
    """How much of each part runs."""

    shared_prompts: int  # exactness: prompts behind the demo's system prompt ...
    long_prompts: tuple[int, ...]  # ... and prompts of this many random tokens (and SHORT_PROMPTS)
    exact_tokens: int  # new tokens of each exactness reply
    prefixes: tuple[int, ...]  # TTFT: shared prefixes, each with a SUFFIX_LEN-token suffix
    repeats: int  # TTFT: runs of each, the median reported
    requests: tuple[int, ...]  # throughput: requests at once
    new_tokens: int  # throughput: new tokens of each reply
    long_among_short: tuple[int, int, int]  # one chat of this many tokens among (n) short ones of (tokens), n
    floor_prefixes: tuple[int, ...]  # TTFT against the arithmetic floor, on the throughput's model
    decode_streams: int = 16  # decode: streams decoding together
    repeats_long: int = 7  # one long chat among short streams: runs of each step (the first two not counted)


ON_GPU = Sizes(shared_prompts=16, long_prompts=(600, 1000, 1400, 1800), exact_tokens=24,
               prefixes=(1024, 4096, 8128), repeats=3, requests=(16, 64), new_tokens=32,
               long_among_short=(8000, 64, 63), floor_prefixes=(512, 1024, 2048, 4096, 8000))

SMALL = Sizes(shared_prompts=4, long_prompts=(100, 200), exact_tokens=8,
              prefixes=(64, 128), repeats=1, requests=(4,), new_tokens=4, long_among_short=(120, 6, 3),
              floor_prefixes=(128,), decode_streams=4, repeats_long=3)
SHORT_PROMPTS = ["Hello", "What is two plus two?", "Name a colour.", "Tell me a story about a cat."]
# Every path a request can take, and the Engine options of each: stage 7's (None: engine/one_request.py
# over the engine's parts) and the engine loop's.
PATHS = {"one request": None,
         "batched, cascade allowed": {"cascade_attention": True},
         "batched, cascade off": {"cascade_attention": False}}

# Llama-3.2-1B's layers, widths and heads (llama_1b gives it random weights and the model's vocabulary).
LLAMA_1B_SHAPE = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                  "max_position_embeddings": 8192}


# -----------------------------------------------------------------------------
# The model: its weights when they load, else random weights of its config


@dataclass(frozen=True)
class Loaded:
    model: torch.nn.Module  # float32: exactness is required there
    tokenizer: object
    name: str  # what it is, in words
    random_weights: bool


def load(args: argparse.Namespace) -> Loaded:
    """The model the flags name, in float32 (see the module's docstring)."""
    device = resolve_device(args.device)
    if args.tiny:
        tokenizer = load_tokenizer(args.config_dir)  # None: the default's
        return Loaded(tiny_llama(tokenizer).to(device), tokenizer, "the tests' tiny Llama (2 layers)", True)
    try:
        model, tokenizer = load_model(args.config_dir or args.model, device=device, dtype=torch.float32)
        return Loaded(model, tokenizer, args.config_dir or args.model or DEFAULT_MODEL, False)
    except OSError as err:
        if args.model is not None:  # a model of its own: no config of the default's stands in for it
            raise
        config_dir = Path(args.config_dir or converted_default())
        if not (config_dir / "config.json").is_file():
            raise OSError(f"{err}\nNor is there a config.json in {config_dir} to build random weights of its shape: "
                          f"pass --config-dir DIR, a folder with the model's config.json and tokenizer files") from err
    model = random_model(AutoConfig.from_pretrained(config_dir), device=device, dtype=torch.float32)
    return Loaded(model, load_tokenizer(str(config_dir)), f"the config in {config_dir}", True)


def llama_1b(model) -> torch.nn.Module:
    """A model of Llama-3.2-1B's shape on `model`'s vocabulary, random weights, bfloat16."""
    config = copy.deepcopy(model.config)
    for name, value in LLAMA_1B_SHAPE.items():
        setattr(config, name, value)
    return random_model(config, device=model.device, dtype=torch.bfloat16)


# -----------------------------------------------------------------------------
# The parts


PHASES = ("lookup", "gather", "forward", "write", "sample")  # a request's prefill (one_request.run_request)


def demo_requests(engine: Engine) -> dict:
    """The demo's questions one after another, twice: as a user first sees them (the first
    computes the system prompt, a MISS; the others find its blocks, HITs), then the same again
    with the pool's cache emptied first, every pass of the same shape as before: the steady
    state. Then, on a GPU where the model's context holds them, the same questions behind the
    course reader (the demo's --long-prefix part, 4,000+ shared tokens: where a HIT pays there),
    stage 7's passes of that length captured first. Each request's TTFT and prefill phases,
    the graphs captured while it ran, and the pool after the warm-up (empty: the warm-up runs
    through the scratch block)."""
    engine.warm_up()
    pool_after_warm_up = {"free_blocks": engine.allocator.num_free_blocks, "blocks": engine.allocator.num_blocks,
                          "cached_blocks": engine.allocator.num_cached_blocks}
    reader = f"{DEMO_SYSTEM_PROMPT}\n\n{COURSE_READER}"
    longest = max(len(engine.tokenize(demo_prompt(reader, q))) for q in DEMO_QUESTIONS) + DEMO_MAX_TOKENS
    systems = {"first": DEMO_SYSTEM_PROMPT, "steady": DEMO_SYSTEM_PROMPT}
    room = min(engine.max_model_len or longest, engine.allocator.num_blocks * engine.allocator.block_size)
    if engine.device.type == "cuda" and longest <= room:  # as the demo: on a GPU, where its context holds it
        systems["reader"] = reader
        if engine.parts.fixed is not None:
            engine.parts.fixed.capture_at_start(up_to=longest)
    rounds = {}
    for name, system in systems.items():
        engine.allocator.reset_prefix_cache()
        rows = []
        for question in DEMO_QUESTIONS:
            captures = captured(engine)
            synchronize(engine.device)
            reply = stage_7(engine, demo_prompt(system, question), DEMO_MAX_TOKENS)
            rows.append({"cached_tokens": reply.cached_tokens, "computed_tokens": reply.computed_prompt_tokens,
                         "ttft_ms": reply.ttft_ms, "captures": captured(engine) - captures,
                         "phases_ms": {phase: getattr(reply.prefill, f"{phase}_ms") for phase in PHASES},
                         "phases_gpu_ms": reply.prefill.gpu_ms})  # the GPU's clock (CUDA events); None on a CPU
        rounds[name] = rows
    first, steady = rounds["first"], rounds["steady"]
    return {"pool_after_warm_up": pool_after_warm_up, "rounds": rounds,
            # each phase of the first round against the steady round's, request by request (the worst)
            "first_over_steady": {phase: max(f["phases_ms"][phase] / max(s["phases_ms"][phase], 1e-3)
                                             for f, s in zip(first, steady)) for phase in PHASES},
            "steady_miss_over_hits": [steady[0]["ttft_ms"] / row["ttft_ms"] for row in steady[1:]],
            "reader_miss_over_hits": ([rounds["reader"][0]["ttft_ms"] / row["ttft_ms"] for row in rounds["reader"][1:]]
                                      if "reader" in rounds else None)}


LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}


def profiled_hit(engine: Engine) -> dict:
    """One of the demo's HITs on stage 7's path (its system prompt cached by part 1), two tokens,
    under torch's profiler: the kernel launches (a graph replay is one), the wall time, and the
    time the GPU spent in kernels. Where the GPU's share is small, the pass is the CPU's
    launching, which a graph replaces with one launch. Nothing of the GPU on a CPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prompt = [{"role": "system", "content": DEMO_SYSTEM_PROMPT}, {"role": "user", "content": DEMO_QUESTIONS[1]}]
    synchronize(engine.device)
    with torch.profiler.profile(activities=activities) as profile:
        start = time.perf_counter()
        reply = stage_7(engine, prompt, 2)
        synchronize(engine.device)
        wall = time.perf_counter() - start
    events = profile.key_averages()
    return {"cached_tokens": reply.cached_tokens, "wall_ms": 1000 * wall,
            "launches": sum(e.count for e in events if e.key in LAUNCHES),
            "gpu_ms": sum(e.self_device_time_total for e in events) / 1000}


def exactness_prompts(engine: Engine, sizes: Sizes) -> list[list[int]]:
    """Token ids of every exactness prompt: behind the demo's system prompt, long, short."""
    rng = random.Random(0)
    prompts = questions(sizes.shared_prompts)
    prompts += [random_tokens(rng, n, engine.vocab_size) for n in sizes.long_prompts]
    return [engine.tokenize(p) for p in prompts + SHORT_PROMPTS]


def exactness(model, tokenizer, prompts: list[list[int]], max_tokens: int, pool: dict) -> dict[str, int]:
    """How many replies of each of the engine's PATHS equal model.generate's, token for token."""
    replies = {}
    for name, options in PATHS.items():
        with Engine(model=model, tokenizer=tokenizer, **pool, **(options or {})) as engine:
            if options is None:
                replies[name] = [generate(engine.parts, f"exact-{i}", p, SamplingParams(max_tokens=max_tokens))
                                 for i, p in enumerate(prompts)]
            else:
                replies[name] = engine.generate_batch(prompts, max_tokens=max_tokens)
            stop_token_ids = engine.stop_token_ids
    reference = [greedy_reference(model, p, max_tokens, stop_token_ids) for p in prompts]
    return {name: sum(r.token_ids == ref for r, ref in zip(got, reference)) for name, got in replies.items()}


def warmed(engine: Engine) -> Engine:
    """The engine after every kind of pass ran once (Engine.warm_up) and a batched step of two."""
    engine.warm_up()
    engine.generate_batch(["warm up"] * 2, max_tokens=2)
    return engine


def throughput(engine: Engine, sizes: Sizes) -> list[dict]:
    """throughput.py's ways (a), (b), (c) at each number of requests, both engines warmed first,
    each way's steps and tokens counted by its runner's plans (throughput.counted), and (c)
    against its floor."""
    off = warmed(Engine(model=engine.model, tokenizer=engine.tokenizer, block_size=engine.allocator.block_size,
                        num_blocks=engine.allocator.num_blocks, enable_caching=False))
    warmed(engine)
    runs = []
    for n in sizes.requests:
        prompts = [engine.tokenize(q) for q in questions(n)]
        a = run_ours(engine, prompts, sizes.new_tokens, batched=False)
        b = run_ours(off, prompts, sizes.new_tokens, batched=True)
        c = run_ours(engine, prompts, sizes.new_tokens, batched=True)
        floor = in_own_thread(floor_seconds, engine.model, engine.threads, [(s.tokens, s.samples) for s in c.steps])
        rows = [summary(name, run.seconds, run.outputs, run.ttfts_ms, a.outputs) | counted(run)
                for name, run in [("(a) sequential", a), ("(b) batched, caching off", b), ("(c) batched, caching on", c)]]
        runs.append({"requests": n, "rows": rows, "floor_seconds": round(floor, 4),
                     "c_over_floor": round(c.seconds / floor, 2)})
    off.close()
    return runs


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Floating-point operations a second of one large matrix product on `device`, measured:
    what this device computes when nothing but arithmetic limits it."""
    n = 4096 if device.type == "cuda" else 512
    a, b = torch.randn(2, n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    synchronize(device)
    return 10 * 2 * n ** 3 / (time.perf_counter() - start)


def ttft_against_floor(engine: Engine, prefixes: tuple[int, ...], repeats: int) -> dict:
    """TTFT cold and warm at each prefix (benchmarks/ttft.py's cold_vs_warm, stage 7's path), and
    the cold prefill's arithmetic floor: its multiply-adds (2 x the layers' parameters a token,
    the output layer's for the last token only, and causal attention's 2 x layers x heads x head
    dim x tokens squared) at matmul_rate."""
    model = engine.model
    shape, rate = ModelShape.of(model), matmul_rate(engine.device, engine.dtype)
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # then not in body_params
    per_token = shape.body_params - (0 if tied else head.numel())
    rng, rows = random.Random(1), []
    for prefix in [p for p in prefixes if p + SUFFIX_LEN < engine.max_model_len]:
        row = cold_vs_warm(engine, prefix, SUFFIX_LEN, repeats, rng)
        tokens = prefix + SUFFIX_LEN
        flops = (2 * per_token * tokens + 2 * head.numel()
                 + 2 * shape.layers * shape.heads * shape.head_dim * tokens ** 2)
        row["floor_ms"] = 1000 * flops / rate
        row["cold_over_floor"] = row["cold_ms"] / row["floor_ms"]
        rows.append(row)
    return {"matmul_tflops": rate / 1e12, "rows": rows}


def long_among_short(engine: Engine, long: int, short: int, n: int, repeats: int) -> dict:
    """benchmarks/padded_decode.py's scene twice: the first decode step of n + 1 short streams,
    and of one long chat among n short ones, each run packed and padded (a graph on a GPU):
    what the long chat adds to the padded step, whose rows each read their own blocks."""
    rows = {name: scene(engine, name, lengths, repeats=repeats, seed=seed)
            for seed, (name, lengths) in enumerate([("short only", [short] * (n + 1)),
                                                    ("one long", [long] + [short] * n)])}
    return {"rows": rows, "padded_long_over_short": rows["one long"]["padded_ms"] / rows["short only"]["padded_ms"]}


def decode_ms(engine: Engine, tokens: int, streams: int) -> dict:
    """Milliseconds a decoded token takes on each path, after a short prompt: stage 7's one
    request (the demo's), one stream through the engine loop, and `streams` streams decoding
    together (a step of them). From each reply's own clock: (total - TTFT) / (tokens - 1)."""
    warmed(engine)
    engine.allocator.reset_prefix_cache()
    prompts = [engine.tokenize(q) for q in questions(streams)]
    one = stage_7(engine, prompts[0], tokens)
    loop = engine.generate(prompts[1 % streams], max_tokens=tokens)
    steps = watch_steps(engine)
    try:
        engine.generate_batch(prompts, max_tokens=tokens)
    finally:
        unwatch_steps(engine)
    # Steps where every stream still running decodes (a random model's reply may stop early)
    decodes = [s for s in steps if s.tokens == s.samples and not s.prefill_tokens]
    per_token = [(r.total_ms - r.ttft_ms) / (len(r.token_ids) - 1) if len(r.token_ids) > 1 else None for r in (one, loop)]
    return {"tokens": tokens, "one_request_ms": per_token[0], "engine_one_stream_ms": per_token[1], "streams": streams,
            "engine_step_ms": 1000 * statistics.median(s.end - s.start for s in decodes) if decodes else None,
            "engine_step_gpu_ms": statistics.median(s.gpu_ms for s in decodes) if decodes and decodes[0].gpu_ms else None,
            "engine_step_streams": statistics.median(s.tokens for s in decodes) if decodes else None}


# -----------------------------------------------------------------------------
# The table


def results_table(results: dict) -> Table:
    """Every figure of the run in one table: part, what, result."""
    table = Table(title=f"GPU check on {results['device']}: {results['dtype']}, torch {results['torch']}, "
                        f"transformers {results['transformers']}, {results['date']}",
                  caption=f"{results['model']}; throughput: {results['throughput']['model']}; the whole check took "
                          f"{results['seconds']:,.0f} s", caption_justify="left")
    for column in ("part", "what", "result"):
        table.add_column(column, justify="left" if column != "result" else "right")
    demo = results["demo"]
    pool = demo["pool_after_warm_up"]
    table.add_row("demo", "the pool after the warm-up: free / blocks, cached",
                  f"{pool['free_blocks']} / {pool['blocks']}, {pool['cached_blocks']}")
    for name, rows in demo["rounds"].items():
        first = rows[0]["ttft_ms"]
        for i, row in enumerate(rows, 1):
            cache = "HIT" if row["cached_tokens"] else "MISS"
            phases = " ".join(f"{row['phases_ms'][phase]:.1f}" for phase in PHASES)
            if row["phases_gpu_ms"]:  # the GPU's clock beside the wall's, phase by phase
                phases += " (GPU " + " ".join(f"{row['phases_gpu_ms'][phase]:.1f}" for phase in PHASES) + ")"
            table.add_row("", f"{name} round, request {i}: {cache}, {row['cached_tokens']} + {row['computed_tokens']} "
                          f"tokens; phases ms ({', '.join(PHASES)}; on the GPU's clock); graphs captured",
                          f"TTFT {row['ttft_ms']:,.1f} ms" + (f" ({first / row['ttft_ms']:.1f}x request 1)" if i > 1
                                                             else "") + f"; {phases}; {row['captures']}")
    table.add_row("", "first round over steady, each phase, the worst request",
                  " ".join(f"{phase} {ratio:.2f}x" for phase, ratio in demo["first_over_steady"].items()))
    if demo["reader_miss_over_hits"] is not None:
        table.add_row("", "behind the course reader: each HIT sooner than the MISS by",
                      ", ".join(f"{ratio:.1f}x" for ratio in demo["reader_miss_over_hits"]))
    hit = results["profiled_hit"]
    table.add_row("", "a HIT and one decode token under the profiler: kernel launches, wall ms, GPU ms in kernels",
                  f"{hit['launches']:,}, {hit['wall_ms']:,.1f}, {hit['gpu_ms']:,.2f}")
    table.add_section()
    for dtype, counts in results["exactness"].items():
        for path, same in counts.items():
            table.add_row(f"exactness, {dtype}" if path == "one request" else "", f"{path}: replies equal to "
                          f"model.generate", f"{same} of {results['exactness_prompts']}")
    table.add_section()
    for i, row in enumerate(results["ttft"]):
        table.add_row("TTFT" if i == 0 else "", f"prefix {row['prefix_tokens']:,} + {row['suffix_tokens']}: "
                      f"cold / warm ms (warm / cold, ideal); captures while timed",
                      f"{row['cold_ms']:,.1f} / {row['warm_ms']:,.1f} ({row['ratio']:.2f}, {row['ideal_ratio']:.3f}); "
                      f"{row['captures_while_timed']}")
    table.add_section()
    for run in results["throughput"]["runs"]:
        for row in run["rows"]:
            table.add_row(f"throughput, {run['requests']} requests" if row is run["rows"][0] else "",
                          f"{row['name']}: requests/s (same as (a)), steps, captures while timed",
                          f"{row['requests_per_s']:,.2f} ({row['same_tokens_as_a']} of {run['requests']}); "
                          f"{row['steps_run']}, {row['captures_while_timed']}")
        table.add_row("", "(c) against its floor (the same passes, nothing in a pool)", f"{run['c_over_floor']:.2f}x")
    table.add_section()
    decode = results["decode"]
    for i, (what, ms) in enumerate([("one request (stage 7, the demo's): ms a token", decode["one_request_ms"]),
                                    ("the engine loop, one stream: ms a token", decode["engine_one_stream_ms"]),
                                    (f"the engine loop, {decode['streams']} streams (median "
                                     f"{decode['engine_step_streams'] or 0:g} decoding): ms a step",
                                     decode["engine_step_ms"])]):
        table.add_row("decode" if i == 0 else "", what, "-" if ms is None else f"{ms:,.2f}")
    if decode["engine_step_gpu_ms"] is not None:
        table.add_row("", "... that step on the GPU's clock (CUDA events around its pass and sampling): ms",
                      f"{decode['engine_step_gpu_ms']:,.2f}")
    table.add_section()
    scenes = results["long_among_short"]["rows"]
    for i, (name, row) in enumerate(scenes.items()):
        table.add_row("one long chat" if i == 0 else "", f"{name} ({len(row['context_tokens'])} streams): a decode "
                      f"step packed / padded ms (graphed: {row['graphed']})", f"{row['packed_ms']:,.2f} / "
                      f"{row['padded_ms']:,.2f}")
    table.add_row("", "the padded step with the long chat over without it",
                  f"{results['long_among_short']['padded_long_over_short']:.2f}x")
    table.add_section()
    floor = results["ttft_floor"]
    for i, row in enumerate(floor["rows"]):
        table.add_row(f"TTFT vs floor ({floor['matmul_tflops']:.3g} TFLOP/s)" if i == 0 else "",
                      f"{results['throughput']['model']}, prefix {row['prefix_tokens']:,} + {row['suffix_tokens']}: "
                      f"cold / warm / cold's floor ms; captures while timed", f"{row['cold_ms']:,.1f} / "
                      f"{row['warm_ms']:,.1f} / {row['floor_ms']:,.2f} ({row['cold_over_floor']:.1f}x); "
                      f"{row['captures_while_timed']}")
    return table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench gpu", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--config-dir", metavar="DIR",
                        help="a folder with config.json and the tokenizer's files: its weights if it has them, "
                        f"else random weights of its shape (default: {DEFAULT_MODEL} in the model cache)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny random Llama, small sizes: seconds on a CPU")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.model is not None and (args.tiny or args.config_dir):
        parser.error(f"--model {args.model} names the model; leave out --tiny and --config-dir")

    console = open_console()
    started = time.perf_counter()
    loaded = load(args)
    device = loaded.model.device
    dtype = resolve_dtype(args.dtype, device)
    on_gpu = device.type == "cuda" and not args.tiny
    sizes = ON_GPU if on_gpu else SMALL
    if loaded.random_weights:
        console.print(f"[bold yellow]Random weights[/] (seed 0) of {loaded.name}, with its real tokenizer: greedy "
                      f"decoding is still deterministic, so exactness and timings hold; the words do not.")
    timed = loaded.model if dtype == torch.float32 else copy.deepcopy(loaded.model).to(dtype)
    pool = pool_arguments(args)
    results = {"device": device_name(device), "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
               "transformers": transformers.__version__, "date": date.today().isoformat(),
               "model": f"{loaded.name}: random weights, seed 0" if loaded.random_weights else loaded.name,
               "random_weights": loaded.random_weights, "sizes": vars(sizes)}

    engine = Engine(model=timed, tokenizer=loaded.tokenizer, **pool)
    console.print(f"[bold]1. The demo's requests[/] on {device}, {results['dtype']}")
    results["demo"] = demo_requests(engine)

    results["profiled_hit"] = profiled_hit(engine)

    console.print("[bold]2. Exactness[/] against model.generate")
    prompts = exactness_prompts(engine, sizes)
    results["exactness_prompts"] = len(prompts)
    results["exactness"] = {"fp32": exactness(loaded.model, loaded.tokenizer, prompts, sizes.exact_tokens, pool)}
    if device.type == "cuda":
        bf16 = timed if dtype == torch.bfloat16 else copy.deepcopy(loaded.model).to(torch.bfloat16)
        results["exactness"]["bf16"] = exactness(bf16, loaded.tokenizer, prompts, sizes.exact_tokens, pool)

    console.print("[bold]3. TTFT[/], cold vs warm")
    engine.allocator.reset_prefix_cache()
    rng = random.Random(0)
    prefixes = [p for p in sizes.prefixes if p + SUFFIX_LEN < engine.max_model_len]  # within the model's context
    results["ttft"] = [cold_vs_warm(engine, p, SUFFIX_LEN, sizes.repeats, rng) for p in prefixes]

    big = llama_1b(loaded.model) if on_gpu else None
    throughput_on = "a Llama-3.2-1B shape, random weights, bfloat16" if big else "the same model"
    console.print(f"[bold]4. Throughput[/] on {throughput_on}")
    throughput_engine = engine if big is None else Engine(model=big, tokenizer=loaded.tokenizer, **pool)
    results["throughput"] = {"model": throughput_on, "new_tokens": sizes.new_tokens,
                             "runs": throughput(throughput_engine, sizes)}
    console.print(f"[bold]5. Decode[/]: ms a token on each path, {sizes.decode_streams} streams together")
    results["decode"] = decode_ms(engine, sizes.new_tokens * 2, sizes.decode_streams)
    console.print(f"[bold]7. TTFT against its arithmetic floor[/] on {throughput_on}")
    results["ttft_floor"] = ttft_against_floor(throughput_engine, sizes.floor_prefixes, sizes.repeats)
    long, short, n = sizes.long_among_short
    console.print(f"[bold]6. One long chat among short streams[/]: a decode step with one of {long:,} tokens among "
                  f"{n} of {short}, against {n + 1} of {short}")
    results["long_among_short"] = long_among_short(engine, long, short, n, sizes.repeats_long)
    results["cuda_graphs"] = {"engine": engine.loop.runner.model_runner.graph_figures(),
                              "throughput": throughput_engine.loop.runner.model_runner.graph_figures()}
    results["seconds"] = time.perf_counter() - started

    console.print(results_table(results))
    save_json(args.json, results, console)
    failed = {path: same for path, same in results["exactness"]["fp32"].items() if same != len(prompts)}
    if failed:
        raise SystemExit(f"exactness failed in fp32: replies equal to model.generate {failed}, of {len(prompts)}")
    return results


if __name__ == "__main__":
    main()
