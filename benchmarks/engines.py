"""What every model benchmark starts with: a console, the engine its flags ask for, the name of
the machine the numbers are measured on (said with every figure), and stage 7's path for the
benchmarks that time it (the demo's)."""

from __future__ import annotations

import itertools
import platform
import sys

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
