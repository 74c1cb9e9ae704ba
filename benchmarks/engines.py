"""What every model benchmark starts with: a console, the engine its flags ask for, the name of
the machine the numbers are measured on (said with every figure), stage 7's path for the
benchmarks that time it (the demo's), and the steps an engine's loop runs, as its scheduler
planned them."""

from __future__ import annotations

import itertools
import platform
import sys
import time
from typing import NamedTuple

import torch
from rich.console import Console

from commands.model_flags import engine_from_flags
from engine.llm_engine import Engine, Generation
from engine.one_request import generate
from engine.request import SamplingParams


def open_console() -> Console:
    """A console as wide as the terminal; 120 columns in a log file, so it keeps every column."""
    return Console(width=None if sys.stdout.isatty() else 120)


def open_engine(args) -> tuple[Console, Engine, str]:
    """(console, Engine from add_model_arguments' flags, the device's name)."""
    console = open_console()
    engine = engine_from_flags(args)
    return console, engine, device_name(engine.device)


def device_name(device: torch.device) -> str:
    """The GPU's name ("NVIDIA H100 80GB HBM3"), or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


REQUEST_IDS = itertools.count()


def stage_7(engine: Engine, prompt, max_tokens: int) -> Generation:
    """One request on stage 7's path over the engine's parts (one_request.generate), as the
    demo and lesson 7 run it: its cached prefix gathered into past_key_values, its phases
    (lookup, gather, forward, write, sample) timed on its Generation."""
    return generate(engine.parts, f"bench-{next(REQUEST_IDS)}", engine.tokenize(prompt), SamplingParams(max_tokens))


def captured(engine: Engine) -> int:
    """CUDA graphs the engine has captured so far: stage 7's (engine/fixed_past.py) and its
    loop's (engine/model_runner.py); 0 on a CPU. A bench counts it before and after what it
    times, and prints the difference."""
    figures = [engine.parts.fixed.figures() if engine.parts.fixed is not None else None,
               engine.loop.runner.model_runner.graph_figures()]
    return sum(f["captured"] for f in figures if f is not None)


class StepSeen(NamedTuple):
    """One step an engine's loop ran (watch_steps): when, and what its scheduler planned."""

    start: float  # time.perf_counter() around it
    end: float
    prefill_tokens: int
    threads: int | None  # the thread count it ran with (None: a GPU)
    tokens: int  # the tokens it computed
    samples: int  # ... and how many of them picked a next token
    gpu_ms: float | None = None  # its pass and sampling on the GPU's clock (BatchRunner.last_gpu_ms); None on a CPU


def watch_steps(engine: Engine) -> list[StepSeen]:
    """Every step with requests in it that the engine's loop runs from now on, appended to the
    list returned once its tokens are sampled and before any of them goes out (so a caller
    whose reply came in that step finds the step listed), until unwatch_steps. Read from the
    scheduler's plan, not from the model: a decode step replayed as a CUDA graph
    (engine/model_runner.py) runs no Python of the model, so a hook on the model would not see
    it, and the padded decode step passes the model other arguments than an eager pass does."""
    runner, steps, started = engine.loop.runner, [], [0.0]
    step, postprocess = runner.step, runner.postprocess

    def watched_step():
        started[0] = time.perf_counter()
        return step()

    def watched_postprocess(plan, tokens):
        threads = runner.threads.used if runner.threads else None
        steps.append(StepSeen(started[0], time.perf_counter(), runner.last_step.num_prefill_tokens, threads,
                              plan.num_tokens, sum(s.samples for s in plan.scheduled), runner.last_gpu_ms))
        return postprocess(plan, tokens)

    runner.step, runner.postprocess = watched_step, watched_postprocess
    return steps


def unwatch_steps(engine: Engine) -> None:
    """The loop's steps run unwatched again (watch_steps)."""
    for name in ("step", "postprocess"):
        vars(engine.loop.runner).pop(name, None)
