"""What every model benchmark starts with: a console, the engine its flags ask for, and the
name of the machine the numbers are measured on (said with every figure)."""

from __future__ import annotations

import platform
import sys

import torch
from rich.console import Console

from engine import Engine
from model_flags import pool_arguments


def open_engine(args) -> tuple[Console, Engine, str]:
    """(console, Engine from add_model_arguments' flags, the device's name)."""
    console = Console(width=None if sys.stdout.isatty() else 120)  # a log file keeps every column
    engine = Engine(args.model, device=args.device, dtype=args.dtype, **pool_arguments(args))
    if engine.device.type == "cuda":
        device = torch.cuda.get_device_name(engine.device)
    else:
        device = platform.processor() or platform.machine()
    return console, engine, device
