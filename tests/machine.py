"""How busy this machine is, for the few limits in the suite that are times.

A limit on a child's start-up or on a server's answer is a guard against a hang, not a claim
about speed: it is measured on a quiet machine and stretched by how much busier this one is
now (the 1-minute load average per core, at least 1), and a message that reports it says the
load it was measured at. Imports nothing heavy, so the exercises' grader can use it too.
"""

import os


def cores() -> int:
    return os.cpu_count() or 1


def load() -> float:
    """The 1-minute load average (0 where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def busy_factor() -> float:
    """How many times slower than a quiet machine a CPU-bound step may run now: the runnable
    processes per core, at least 1."""
    return max(1.0, load() / cores())


def scaled(seconds: float) -> float:
    """A limit of `seconds` on a quiet machine, stretched by how busy this one is now."""
    return seconds * busy_factor()


def load_note() -> str:
    """The load a timed rule was checked at, for its failure message."""
    return f"load {load():.1f} on {cores()} cores"
