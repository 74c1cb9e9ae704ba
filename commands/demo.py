"""
The demo: a course assistant whose long system prompt is shared by every request.

    python prefix_caching.py --demo                 # MISS, then HITs
    python prefix_caching.py --demo --no-cache      # the same requests with prefix caching off
    python prefix_caching.py --demo --long-prefix   # then again behind the course reader (on a GPU: always)

Each request runs stage 7's path over the engine's parts (one_request.generate): its cached
prefix gathered from the pool into past_key_values, the model run on the rest.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from commands.model_flags import engine_from_flags
from commands.walkthrough import render_free_queue, render_stats
from engine.cpu_threads import GPU_ATTENTION, ThreadChooser, cores_used_by_others, cpu_sample
from engine.llm_engine import Generation
from engine.model_loader import DEFAULT_MODEL
from engine.one_request import generate
from engine.request import SamplingParams

# -----------------------------------------------------------------------------
# Every question arrives with the same few hundred tokens of instructions in front. The
# first request computes them (MISS); the others find their blocks in the pool (HIT) and
# run the model on their own question only.

DEMO_SYSTEM_PROMPT = """\
You are Ada, the teaching assistant of "How Computers Work", an evening course for adults \
who have never studied computer science. Students write to you between lessons with \
questions about the material.

How to answer:
- Answer in two or three short sentences of plain English. Students read your answers on \
their phones.
- Start with the direct answer, then give one everyday comparison that makes the idea stick.
- Avoid jargon. When a technical word is needed, explain it in the same sentence.
- Be warm and encouraging. Many students are nervous about technology; never make a question \
sound silly.
- If you are not sure of something, say so instead of guessing.
- Do not write code unless the student asks for it.
- Never share personal data about other students or the teachers.

About the course: it runs for ten weeks, one evening a week, in room 4 of the Port Alder \
community college. Week 1 is about what a computer is: a processor that follows \
instructions, memory that holds the data it is working on, and storage that keeps files when \
the power is off. Week 2 covers binary numbers and how text, pictures and sound become \
numbers. Week 3 is about how programs are written and run, and what an algorithm is. Week 4 \
explains operating systems, files and folders. Week 5 is about networks and the internet: \
addresses, packets, routers and the web. Week 6 covers security: passwords, encryption and \
common scams. Week 7 is about databases and spreadsheets. Week 8 introduces artificial \
intelligence and how chat assistants like you are trained. Week 9 is about the environmental \
cost of computing, and week 10 is a review with a friendly quiz that does not count towards \
anything.

Course rules: homework is optional but encouraged. Lessons are recorded and the recordings \
are posted on the course page the next morning. Students who miss a lesson can ask the \
teacher for the slides. Office hours are on Thursdays from 5 pm to 6 pm in room 4, no \
appointment needed.

Students today are revising weeks 1 to 5."""

DEMO_QUESTIONS = [
    "What does the processor of a computer do?",
    "What is the difference between memory and storage?",
    "Why do computers use binary numbers?",
    "What is an algorithm?",
    "How does a message find its way across the internet?",
]

DEMO_MAX_TOKENS = 48
PASS = ("gather", "forward", "write")  # the phases of a prefill that run on the device


def run_demo(args: argparse.Namespace) -> list[Generation]:
    """Ask the support assistant DEMO_QUESTIONS one after another and show what the cache did;
    then, on a GPU (or with --long-prefix), the same questions behind the course reader too."""
    console = Console()
    engine = engine_from_flags(args, enable_caching=not args.no_cache)
    name = args.model or DEFAULT_MODEL
    console.print(f"[bold]{name}[/] on {engine.device}, {str(engine.dtype).removeprefix('torch.')}"
                  f"{' (given)' if args.dtype else ''}; {how_passes_run(engine.device)}; "
                  f"prefix caching [bold]{'off' if args.no_cache else 'on'}[/]")
    console.print(str(engine.kv))
    prompts = [demo_prompt(DEMO_SYSTEM_PROMPT, question) for question in DEMO_QUESTIONS]
    console.print(shared_prefix_sentence([engine.tokenize(p) for p in prompts], args.block_size) + "\n")
    engine.warm_up(loop_graphs=False)  # every request of the demo runs stage 7's path

    started, machine = time.perf_counter(), cpu_sample()
    replies = ask(console, engine, prompts, "demo")
    prompt_tokens = sum(r.prompt_tokens for r in replies)
    cached = sum(r.cached_tokens for r in replies)
    console.print(
        f"\n[bold]{len(replies)} requests in {time.perf_counter() - started:.1f} s.[/] Hit rate "
        f"{cached / prompt_tokens:.0%}: {cached:,} of {prompt_tokens:,} prompt tokens came from the pool, "
        f"so the model prefilled {prompt_tokens - cached:,} tokens instead of {prompt_tokens:,}."
    )
    others = cores_used_by_others(machine, cpu_sample())
    if engine.device.type == "cpu":
        console.print(machine_note(engine.threads, others))
    console.print(render_free_queue(engine.allocator, max_blocks=12), render_stats(engine.allocator))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"question": q, "cached_tokens": r.cached_tokens, "computed_tokens": r.computed_prompt_tokens,
                        "ttft_ms": round(r.ttft_ms, 2)} for q, r in zip(DEMO_QUESTIONS, replies)], f, indent=2)
    long_prefix = getattr(args, "long_prefix", None)
    if long_prefix or (long_prefix is None and engine.device.type == "cuda"):
        behind_the_reader(console, engine)
    return replies


def demo_prompt(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def ask(console: Console, engine, prompts: list[list[dict]], name: str) -> list[Generation]:
    """Each prompt through stage 7's path, one after another, each with its table: MISS or
    HIT, the tokens cached and computed, the TTFT and the speed-up over the first request."""
    replies: list[Generation] = []
    for i, (question, prompt) in enumerate(zip(DEMO_QUESTIONS, prompts), 1):
        # Stage 7's path (engine/one_request.py): the cached prefix gathered into past_key_values
        reply = generate(engine.parts, f"{name}-{i}", engine.tokenize(prompt), SamplingParams(max_tokens=DEMO_MAX_TOKENS))
        replies.append(reply)
        hit = reply.cached_tokens > 0
        table = Table(title=f"request {i}: {question}", title_justify="left", title_style="bold",
                      caption=reply.text.strip() + ("…" if reply.finish_reason == "length" else ""),
                      caption_justify="left", caption_style="cyan")
        gpu = reply.prefill.gpu_ms  # on a GPU: each phase on the GPU's own clock (CUDA events)
        for column in ("cache", "prompt tokens: cached + computed", "prefill (TTFT)", "speed-up vs request 1",
                       *(["gather + forward + write, wall / GPU clock"] if gpu else [])):
            table.add_column(column, justify="right")
        table.add_row(
            "[bold green]HIT" if hit else "[bold red]MISS",
            f"{reply.cached_tokens} + {reply.computed_prompt_tokens}",
            f"{reply.ttft_ms:,.0f} ms",
            f"{replies[0].ttft_ms / reply.ttft_ms:.1f}x" if i > 1 else "-",
            *([f"{sum(getattr(reply.prefill, f'{p}_ms') for p in PASS):,.1f} / {sum(gpu[p] for p in PASS):,.1f} ms"]
              if gpu else []),
        )
        console.print(table)
    return replies


# -----------------------------------------------------------------------------
# Behind a long prefix: where a GPU shows caching
#
# On a CPU a pass costs in proportion to its tokens, so the 448 tokens a HIT skips above pay
# at once. On a GPU a small model's pass costs its kernel launches and one read of its
# weights whatever its length: at the demo's 462-token prompt a HIT can come at most about 2x
# sooner than the MISS there (the arithmetic of a MISS against a HIT's read of the weights,
# docs/measured.md, "On a GPU"). Behind thousands of shared tokens the MISS has real work to
# do and the HITs skip it. So on a GPU the demo asks its questions again behind the course
# reader (COURSE_READER, ~3,700 tokens more), and measures where the HIT starts to pay.

COURSE_READER = (Path(__file__).with_name("course_reader.txt")).read_text()
CROSSOVER = 2.0  # "pays": a HIT at least this many times sooner than its MISS


def behind_the_reader(console: Console, engine) -> list[Generation]:
    """The demo's questions behind its system prompt and the course reader (a MISS, then HITs,
    the cache emptied first), then the crossover: a MISS and a HIT at growing lengths of that
    shared prefix, and the shortest at which the HIT came CROSSOVER times sooner."""
    system = f"{DEMO_SYSTEM_PROMPT}\n\n{COURSE_READER}"
    prompts = [demo_prompt(system, question) for question in DEMO_QUESTIONS]
    ids = [engine.tokenize(p) for p in prompts]
    shared = shared_tokens(ids)
    short = len(engine.tokenize(demo_prompt(DEMO_SYSTEM_PROMPT, DEMO_QUESTIONS[0])))
    console.print(f"\n[bold]Behind the course reader[/]: the same questions with the course's notes in the system "
                  f"prompt, {shared:,} shared tokens. On a GPU a small model's pass costs its kernel launches and one "
                  f"read of its weights whatever its length, so at the {short:,}-token prompt above a HIT comes at most "
                  f"about 2x sooner than its MISS; behind thousands of shared tokens the MISS has them to compute and "
                  f"a HIT does not. The cache is emptied first.")
    if engine.parts.fixed is not None:  # stage 7's passes over contexts this long, captured before the clock
        started, captured = time.perf_counter(), engine.parts.fixed.capture_at_start(up_to=max(map(len, ids)) + 64)
        if captured:
            console.print(f"(captured {captured} more shapes of stage 7's pass as CUDA graphs for these contexts, in "
                          f"{time.perf_counter() - started:.1f} s)")
    engine.allocator.reset_prefix_cache()
    replies = ask(console, engine, prompts, "reader")
    table = Table("shared prefix tokens", "MISS (TTFT)", "HIT (TTFT)", "HIT sooner by",
                  title="where the HIT starts to pay: the first two questions behind the first N tokens of the reader's "
                        "prompt, the cache emptied before each MISS", title_justify="left")
    crossover = None
    for n in [n for n in (256, 512, 1024, 2048) if n < shared] + [shared]:
        engine.allocator.reset_prefix_cache()
        miss, hit = (generate(engine.parts, f"reader-{n}-{i}", ids[0][:n] + ids[i][shared:], SamplingParams(max_tokens=1))
                     for i in (0, 1))
        ratio = miss.ttft_ms / hit.ttft_ms
        if crossover is None and ratio >= CROSSOVER:
            crossover = n
        table.add_row(f"{n:,}", f"{miss.ttft_ms:,.1f} ms", f"{hit.ttft_ms:,.1f} ms ({hit.cached_tokens:,} cached)",
                      f"{ratio:.1f}x")
    console.print(table)
    console.print(f"On this machine ({engine.device}), a HIT came {CROSSOVER:g}x sooner than its MISS "
                  + (f"from {crossover:,} tokens of shared prefix on." if crossover is not None
                     else f"at none of these prefixes, up to {shared:,} tokens."))
    return replies


def shared_prefix_sentence(prompts: list[list[int]], block_size: int) -> str:
    """What the prompts have in common, counted as the pool counts it: the tokens every one
    of them starts with, in full blocks and the tokens over (a request can hit only full
    blocks; the block the questions begin in is hit only by a question whose first tokens
    fill it the same way as an earlier one's).

    >>> shared_prefix_sentence([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9]], block_size=4)
    'The first 5 tokens of every prompt are the same (the system prompt, with the chat template): 1 full block of 4, and 1 token over, in the block the question begins in.'
    """
    shared = shared_tokens(prompts)
    full, over = divmod(shared, block_size)
    return (f"The first {shared} tokens of every prompt are the same (the system prompt, with the chat template): "
            f"{full} full block{'s' if full != 1 else ''} of {block_size}, and {over} token{'s' if over != 1 else ''} "
            f"over, in the block the question begins in.")


def shared_tokens(prompts: list[list[int]]) -> int:
    """How many tokens every prompt starts with.

    >>> shared_tokens([[1, 2, 3], [1, 2, 4], [1, 2]])
    2
    """
    shared = 0
    while all(len(p) > shared and p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    return shared


def how_passes_run(device: torch.device) -> str:
    """What the first line says of the kernels (engine/cpu_threads.py says why).

    >>> how_passes_run(torch.device("cuda"))
    'attention by flash, efficient or math kernels (never cuDNN: it plans each new shape)'
    """
    if device.type == "cuda":
        names = ", ".join(b.name.split("_")[0].lower() for b in GPU_ATTENTION)
        return f"attention by {names.replace(', math', ' or math')} kernels (never cuDNN: it plans each new shape)"
    if device.type == "cpu":
        return f"{torch.get_num_threads()} threads a pass, 1 while other programs keep the cores busy"
    return "torch's default kernels"


def machine_note(threads: ThreadChooser | None, others: float | None) -> str:
    """What the machine was doing while the demo ran, so a slow run explains itself: how many
    cores other programs kept busy (read from /proc/stat, on Linux) and the thread counts the
    forward passes ran with (engine/cpu_threads.py picks one thread while others are busy).

    >>> chooser = ThreadChooser(); chooser.passes = {1: 230, 2: 10}
    >>> machine_note(chooser, others=1.7)
    'The machine was busy: other programs kept 1.7 cores busy while the demo ran, so its times are slower than on a quiet machine. Forward passes: 230 with 1 thread, 10 with 2 threads.'
    """
    if others is None:
        sentence = "How busy the machine was is not known here (no /proc/stat)."
    elif others >= ThreadChooser.OTHERS:
        sentence = (f"The machine was busy: other programs kept {others:.1f} cores busy while the demo ran, so its "
                    f"times are slower than on a quiet machine.")
    else:
        sentence = f"The machine was quiet: other programs kept {others:.1f} cores busy while the demo ran."
    if threads is not None and threads.passes:
        counts = ", ".join(f"{n} with {t} thread{'s' if t > 1 else ''}" for t, n in sorted(threads.passes.items()))
        sentence += f" Forward passes: {counts}."
    return sentence
