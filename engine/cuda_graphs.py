"""
CUDA graphs of a pass with fixed shapes, one per shape, captured the first time it runs.

Read engine/static_decode.py first (a batched decode step padded to fixed shapes); both padded
passes of the course are replayed through this file: the batched decode step
(engine/model_runner.py's DecodeGraphs) and stage 7's one request over fixed buffers
(engine/fixed_past.py).

A CUDA graph records the kernels of one pass once and replays them all with a single launch:
no Python, no per-kernel launch. It replays the same kernels over the same addresses and
shapes, so a pass's inputs live in buffers allocated once and its shape is a rung of a ladder.
A shape is captured the first time a pass of it runs: a warm-up pass (lazy setup runs outside
the graph), then the capture (torch.cuda.graph records on a side stream of its own), as
nano-vllm's capture_cudagraph does (nanovllm/engine/model_runner.py). Every graph allocates from
the first one's memory pool and writes its logits into one buffer they share: they replay one
at a time, and what one leaves there is read before the next replays.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

log = logging.getLogger("engine")


class Graphs:
    """CUDA graphs of `run(*shape)`, a pass over buffers allocated once that returns logits
    (rows, vocab), at most max_rows rows.

    captures: each capture's (shape, seconds), in order; failed: the shapes whose capture failed,
    which their caller runs without a graph from then on (the others keep theirs).
    """

    def __init__(self, run: Callable[..., torch.Tensor], max_rows: int, what: str):
        self.run, self.max_rows, self.what = run, max_rows, what
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.rows: dict[tuple, int] = {}  # each shape's rows of logits
        self.memory_pool = None
        self.logits: torch.Tensor | None = None  # (max_rows, vocab), allocated by the first capture
        self.captures: list[tuple[tuple, float]] = []
        self.failed: set[tuple] = set()

    def has(self, *shape) -> bool:
        return shape in self.graphs

    def replay(self, *shape) -> torch.Tensor:
        """Run the graph of `shape` over what the buffers hold now: its logits, a view of the
        shared buffer that the next replay writes over."""
        self.graphs[shape].replay()
        return self.logits[: self.rows[shape]]

    def capture(self, *shape) -> None:
        """Record the pass of `shape` over the buffers (which hold a real pass: the warm-up
        writes its K/V, and so will the replay, the same values)."""
        start = time.perf_counter()
        logits = self.run(*shape)  # warm-up: lazy setup runs outside the graph
        if self.logits is None:
            self.logits = logits.new_empty(self.max_rows, logits.shape[-1])
        rows = logits.shape[0]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            self.logits[:rows].copy_(self.run(*shape))
        self.memory_pool = graph.pool()
        self.graphs[shape], self.rows[shape] = graph, rows
        self.captures.append((shape, time.perf_counter() - start))
        log.info("captured %s %s as a CUDA graph in %.0f ms", self.what, shape, 1000 * self.captures[-1][1])

    def try_capture(self, *shape) -> bool:
        """Capture `shape` unless it failed before; False (and `shape` failed, said once on the
        "engine" logger) if the capture fails: an operation a graph cannot hold, or no memory."""
        if shape in self.failed:
            return False
        try:
            self.capture(*shape)
            return True
        except Exception as err:
            log.warning("CUDA graph of %s %s failed (%s: %s); passes of that shape run without one",
                        self.what, shape, type(err).__name__, err)
            self.failed.add(shape)
            return False

    def figures(self) -> dict:
        """Shapes captured, the seconds their captures took, shapes that failed."""
        return {"captured": len(self.captures), "capture_s": round(sum(s for _, s in self.captures), 3),
                "failed": len(self.failed)}
