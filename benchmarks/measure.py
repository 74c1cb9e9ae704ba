"""
Numbers a student can trust on a busy laptop: counts first, then times worded from what
was measured.

Counts do not move: the tokens a model embedded, the K/V it computed or took from the pool
are the same on every machine, so a model stage leads with them (TokenCounter). Times do
move: another program can take the cores for a moment, or for a whole run. So a stage times
each measurement a few times and keeps the median (Runs), and applies one rule to say
whether the machine was busy:

    the slowest run of one measurement took BUSY (1.5) times the fastest or more,
    and NOISE_MS (20 ms) more;

or, for a measurement timed once (no spread to judge), other programs kept
ThreadChooser.OTHERS (0.75) cores or more busy while it ran (engine/cpu_threads.py reads it from
/proc/stat, as a batched step does to pick its threads).

On a quiet machine repeated runs agree within a few percent; a spread that wide means
something else had the cores while they ran. (A gap of a few ms between runs of a short step
is timer and memory noise, not another program: hence the 20 ms.) Conclusions are then
worded from the medians, never written in advance:

    >>> cold, warm = Runs([812, 790, 845]), Runs([101, 97, 120])
    >>> how_much_faster(warm, cold)
    '8.0x faster'
    >>> how_much_faster(Runs([5317]), Runs([1579]))   # seen on a busy 2-core machine
    'not faster on this run'
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


BUSY = 1.5  # slowest / fastest run of one measurement at or above this, ...
NOISE_MS = 20.0  # ... and at least this many ms apart: the machine was busy
CLEARLY = 1.1  # "faster" only when the medians are at least 10% apart: less is noise


@dataclass
class Runs:
    """The milliseconds of a few runs of one measurement.

    >>> runs = Runs([120.0, 100.0, 104.0])
    >>> runs.median, round(runs.spread, 2), runs.disturbed, str(runs)
    (104.0, 1.2, False, '104 ms')
    >>> Runs([16, 24]).disturbed, Runs([160, 240]).disturbed   # 8 ms apart is noise; 80 ms is not
    (False, True)
    """
    ms: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    @property
    def spread(self) -> float:
        """Slowest / fastest run: close to 1 on a quiet machine."""
        return max(self.ms) / max(min(self.ms), 1e-6)

    @property
    def disturbed(self) -> bool:
        """True when the runs disagree as they do only on a busy machine (the rule above)."""
        return self.spread >= BUSY and max(self.ms) - min(self.ms) >= NOISE_MS

    def __str__(self) -> str:
        return f"{self.median:,.0f} ms" if self.median >= 10 else f"{self.median:.2g} ms"


def speedup(fast: Runs, slow: Runs) -> float | None:
    """How many times faster `fast` was than `slow` (their medians), or None unless it was
    clearly faster (by CLEARLY or more).

    >>> speedup(Runs([100]), Runs([800]))
    8.0
    >>> speedup(Runs([100]), Runs([105])) is None   # 5%: noise, not a result
    True
    """
    ratio = slow.median / fast.median
    return ratio if ratio >= CLEARLY else None


def how_much_faster(fast: Runs, slow: Runs) -> str:
    """'8.0x faster', or 'not faster on this run': never 'faster' when it was not."""
    ratio = speedup(fast, slow)
    return f"{ratio:.1f}x faster" if ratio else "not faster on this run"


def busy_note(*runs: Runs, others: dict[str, float | None] | None = None) -> str:
    """A sentence saying the machine was busy, or '' when the runs of every measurement agreed
    and no other program kept the cores busy. others: for measurements timed once, how many
    cores other programs used meanwhile (cpu_threads.cores_used_by_others; None: unknown).

    >>> busy_note(Runs([100, 104, 98]), others={"(a)": 0.1, "(c)": None})
    ''
    >>> busy_note(Runs([100, 104, 98]), Runs([1579, 5317]))
    'The machine was busy: the runs of one measurement differed by up to 3.4x (slowest / fastest), so take the times as rough.'
    >>> busy_note(Runs([100, 104, 98]), others={"(a)": 1.83, "(c)": 0.2})
    'The machine was busy: other programs kept 1.8 cores busy during (a), so take the times as rough.'
    """
    reasons = []
    disturbed = [r.spread for r in runs if r.disturbed]
    if disturbed:
        reasons.append(f"the runs of one measurement differed by up to {max(disturbed):.1f}x (slowest / fastest)")
    loaded = []
    if others:  # measured by the engine's thread chooser; imported here, so that the allocator's benchmark needs no torch
        from engine.cpu_threads import ThreadChooser

        loaded = [f"{cores:.1f} cores busy during {name}" for name, cores in others.items()
                  if cores is not None and cores >= ThreadChooser.OTHERS]
    if loaded:
        reasons.append("other programs kept " + ", ".join(loaded))
    if not reasons:
        return ""
    return f"The machine was busy: {' and '.join(reasons)}, so take the times as rough."


def conclusion(claim: str, fast: Runs, slow: Runs, *others: Runs) -> str:
    """`claim` (a sentence that says `fast` beat `slow`) when the medians show it, with a word
    if the machine was busy; when they do not, what to make of that instead. `others` are
    the stage's other timings, looked at for the busy rule only.

    >>> conclusion("Warm beat cold.", Runs([100, 103]), Runs([800, 790]))
    'Warm beat cold.'
    >>> conclusion("Warm beat cold.", Runs([5317, 5100, 2300]), Runs([1579, 1500, 1620]))
    'The machine was busy: the runs of one measurement differed by up to 2.3x (slowest / fastest), so take the times as rough. The counts above still hold.'
    >>> print(conclusion("Warm beat cold.", Runs([5317]), Runs([1579])))
    The times do not show it on this run, though the runs agreed with each other: either something else had the machine for the whole of one measurement, or on this hardware the difference is too small to see. The counts above still hold; run the stage again to time it again.
    """
    note = busy_note(fast, slow, *others)
    if speedup(fast, slow) is not None:
        return f"{claim} {note}".strip()
    if note:
        return f"{note} The counts above still hold."
    return ("The times do not show it on this run, though the runs agreed with each other: either something "
            "else had the machine for the whole of one measurement, or on this hardware the difference is too "
            "small to see. The counts above still hold; run the stage again to time it again.")


class TokenCounter:
    """Counts the tokens a model embeds. Every token a forward pass runs over goes through
    the input embedding exactly once, so this is the model's work in tokens, counted (a
    forward hook), not inferred from the code that calls it.

    >>> import torch
    >>> embedding = torch.nn.Embedding(100, 8)
    >>> with TokenCounter(embedding) as embedded:
    ...     _ = embedding(torch.tensor([[1, 2, 3]]))  # a prefill of 3 tokens
    ...     _ = embedding(torch.tensor([[4]]))  # one decode step
    >>> embedded.tokens, embedded.passes
    (4, 2)
    """

    def __init__(self, embedding) -> None:
        self.embedding = embedding  # model.get_input_embeddings()
        self.tokens = self.passes = 0

    def __enter__(self) -> TokenCounter:
        self.hook = self.embedding.register_forward_hook(self._count)
        return self

    def __exit__(self, *exc) -> None:
        self.hook.remove()

    def _count(self, module, inputs, output) -> None:
        self.tokens += inputs[0].numel()
        self.passes += 1
