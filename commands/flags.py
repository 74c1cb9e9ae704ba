"""
Command-line flags: the argparse types every command of the course shares, without torch.

    positive_int     an int >= 1 (a block size, a pool's blocks, a count of requests)
    positive_float   a finite number > 0 (GiB of KV memory, a step time)

A bad value is a usage error that says what was wrong, before any model loads. The model
and pool flags the demo, benchmarks and server share (add_model_arguments) are commands/model_flags.py's,
after engine/llm_engine.py in the reading order, since they show the engine's defaults; these types are
apart so that the workload analyzer (analyzer/) can use them without loading torch.

    >>> positive_int("16"), positive_float("0.5")
    (16, 0.5)
"""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1, refused with a usage error otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value
