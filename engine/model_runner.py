"""
The model runner: a step's plan in, the logits of every request that samples out.

Read engine/batch_attention.py first (how one forward pass attends for every request over the
pool), then engine/static_decode.py (a decode step with fixed shapes). The runner knows nothing of
queues, budgets or replies: engine/batch_engine.py's BatchRunner hands it a plan and gets logits
back, as nano-vllm's LLMEngine hands its ModelRunner the scheduled sequences
(nanovllm/engine/model_runner.py at bb823b3: prepare_prefill or prepare_decode builds the
inputs, run_model returns the logits; its run also samples, which here stays with the step).

    StepFigures   how big one step was: requests, tokens, slots attended over and copied
    DecodeGraphs  CUDA graphs of the padded decode step, one per (size, width) of its ladders
    ModelRunner   run: one forward pass, eager (build_step's packed step) or, for a step that
                  only decodes, the padded step of engine/static_decode.py, replayed as a graph on a
                  GPU; on a CPU with the thread count engine/cpu_threads.py picks

On a GPU a decode step of a small model is mostly the CPU's work: the Python of the forward
pass and of its attention, and one launch for each of its hundreds of kernels, while the GPU
itself is done in a fraction of that. A CUDA graph records the kernels of one forward pass
once and replays them all with a single launch: no Python, no per-kernel launch. It replays
the same kernels over the same addresses and shapes, so the step's inputs are copied into
buffers allocated once (static_decode.DecodeBuffers) and the batch is padded to a rung of a
ladder. What a graph cannot replay is a shape it was not captured with: a step with a
prompt's chunk changes its token count every step, and runs eagerly, as does a step larger
than the ladders. nano-vllm captures its decode step the same way (nanovllm/engine/
engine/model_runner.py: capture_cudagraph, and run_model, which replays it), as does vLLM (capture_model
and _dummy_run in vllm/v1/worker/gpu_model_runner.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.batch_attention import StepInputs, build_step, use_pool_attention
from engine.cpu_threads import ThreadChooser, one_pass
from engine.one_request import EngineParts
from engine.scheduler import StepPlan
from engine.static_decode import DecodeBuffers, block_widths, decode_sizes, forward, rung

log = logging.getLogger("engine")


@dataclass(frozen=True)
class StepFigures:
    """How big one step was: its requests, the tokens of its forward pass, how many of those
    were prefill (a prompt's uncached part, or a resumed request's text again), and the pool
    slots its attention needed, read (padding included) and copied out of the pool (whole
    blocks), in each layer."""

    num_requests: int
    num_tokens: int
    num_prefill_tokens: int
    num_slots_needed: int
    num_slots_read: int
    num_slots_copied: int

    @classmethod
    def of(cls, plan: StepPlan, inputs: StepInputs) -> StepFigures:
        prefill = sum(s.end - s.start for s in plan.scheduled if s.is_prefill)
        return cls(len(plan.scheduled), plan.num_tokens, prefill, inputs.slots_needed, inputs.slots_read,
                   inputs.slots_copied)

    @classmethod
    def padded(cls, plan: StepPlan, size: int, width: int, block_size: int) -> StepFigures:
        """A padded decode step's: every one of its `size` rows reads `width` whole blocks."""
        read = size * width * block_size
        prefill = sum(s.end - s.start for s in plan.scheduled if s.is_prefill)
        return cls(len(plan.scheduled), plan.num_tokens, prefill, sum(s.end for s in plan.scheduled), read, read)


class DecodeGraphs:
    """The padded decode step (static_decode.forward) as CUDA graphs, one per (size, width),
    each captured the first time a step of its shape runs: a warm-up pass, then the capture
    (torch.cuda.graph records on a side stream of its own), as nano-vllm's capture_cudagraph
    does. nano-vllm captures every batch size when the model loads, since its attention
    kernel reads each row's context wherever it ends; here the block-table width is a shape
    too, and most (size, width) pairs never come. Every graph allocates from the first one's
    memory pool: they replay one at a time, and each keeps its logits tensor alive."""

    def __init__(self, model, buffers: DecodeBuffers):
        self.model, self.buffers = model, buffers
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_pool = None

    def has(self, size: int, width: int) -> bool:
        return (size, width) in self.graphs

    def replay(self, size: int, width: int) -> torch.Tensor:
        """Run the graph of (size, width) over what the buffers hold now: logits (size, vocab)."""
        graph, logits = self.graphs[size, width]
        graph.replay()
        return logits

    def capture(self, size: int, width: int) -> None:
        """Record the padded step of (size, width) over the buffers (which hold a real step:
        the warm-up writes its K/V, and so will the replay, the same values)."""
        forward(self.model, self.buffers, size, width)  # warm-up: what runs once (lazy setup) runs outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            logits = forward(self.model, self.buffers, size, width)
        self.memory_pool = graph.pool()
        self.graphs[size, width] = graph, logits


class ModelRunner:
    """Runs one step's forward pass over the paged pool for every scheduled request.

    parts: the model and pool (one_request.EngineParts); cascade_attention: decodes sharing a
    long prefix's blocks may attend over them once, where counted work says it pays
    (batch_attention.decode_groups); threads: the CPU thread policy (engine/cpu_threads.py), or None
    for torch's own count (and on a GPU, where the CPU only launches kernels); max_num_seqs:
    the most requests a step holds, the top of the batch-size ladder. static_decode: a step
    whose every request computes one token runs padded (engine/static_decode.py), as a CUDA graph on
    a GPU and eagerly on a CPU; None: on a GPU only. If a capture fails, the runner says why
    once (the "engine" logger) and runs every later step eagerly, unpadded.
    """

    def __init__(self, parts: EngineParts, cascade_attention: bool = True, threads: ThreadChooser | None = None, *,
                 max_num_seqs: int, static_decode: bool | None = None):
        self.parts, self.cascade_attention, self.threads = parts, cascade_attention, threads
        use_pool_attention(parts.model)
        self.last_step: StepFigures | None = None  # the latest step's figures
        cuda = parts.device.type == "cuda"
        self.buffers: DecodeBuffers | None = None  # the padded decode step's inputs; None: every step eager
        self.graphs: DecodeGraphs | None = None  # its graphs, on a GPU
        if static_decode or (static_decode is None and cuda):
            self.sizes, self.widths = decode_sizes(max_num_seqs), block_widths(parts.kv.num_blocks)
            self.buffers = DecodeBuffers(parts.kv, self.sizes[-1], self.widths[-1])
            self.graphs = DecodeGraphs(parts.model, self.buffers) if cuda else None

    def run(self, plan: StepPlan, block_tables: dict[str, list[int]]) -> torch.Tensor:
        """One forward pass for the plan: logits (requests that sample, vocab)."""
        prefill = any(s.is_prefill for s in plan.scheduled)
        kind = (prefill, plan.num_tokens.bit_length())  # steps about as big are timed together
        padded = self.padded_rung(plan)
        with one_pass(self.threads, self.parts.device, kind, may_probe=not prefill), torch.inference_mode():
            if padded is None:
                return self.run_eager(plan, block_tables)
            return self.run_padded(plan, block_tables, *padded)

    def padded_rung(self, plan: StepPlan) -> tuple[int, int] | None:
        """The (size, width) the step runs padded to; None: it runs eagerly (no padded path,
        a step with a prompt's chunk, or one above the ladders)."""
        if self.buffers is None or plan.num_tokens != len(plan.scheduled):
            return None
        return rung(plan, self.sizes, self.widths, self.parts.kv.block_size)

    def run_eager(self, plan: StepPlan, block_tables: dict[str, list[int]]) -> torch.Tensor:
        """The step packed and grouped anew (batch_attention.build_step), shapes its own."""
        inputs = build_step(plan, self.parts.kv, block_tables, self.parts.device, self.cascade_attention)
        self.last_step = StepFigures.of(plan, inputs)
        return self.parts.model(
            input_ids=inputs.input_ids, position_ids=inputs.positions, use_cache=False,
            logits_to_keep=inputs.last_token, pool_step=inputs,
        ).logits[0]

    def run_padded(self, plan: StepPlan, block_tables: dict[str, list[int]], size: int, width: int) -> torch.Tensor:
        """The step copied into the buffers and run padded: its graph replayed on a GPU
        (captured first if its shape is new), eagerly on a CPU."""
        self.buffers.fill(plan, block_tables, size, width)
        if self.graphs is None:
            logits = forward(self.parts.model, self.buffers, size, width)
        else:
            if not self.graphs.has(size, width):
                try:
                    self.graphs.capture(size, width)
                except Exception as err:  # an operation a graph cannot hold: every step eager from now on
                    log.warning("CUDA graphs off: capturing the decode step of %d rows x %d blocks failed (%s: %s); "
                                "every step runs eagerly", size, width, type(err).__name__, err)
                    self.buffers = self.graphs = None
                    return self.run_eager(plan, block_tables)
            logits = self.graphs.replay(size, width)
        self.last_step = StepFigures.padded(plan, size, width, self.parts.kv.block_size)
        sampling = [i for i, s in enumerate(plan.scheduled) if s.samples]
        return logits[sampling]  # a copy: the next replay writes over the graph's logits

    def thread_count(self, chosen: bool):
        """What step costs are learned under: None on a GPU; on a CPU the thread count the
        next step will likely run with (chosen=False), or the one the latest ran with."""
        if self.parts.device.type != "cpu":
            return None
        if self.threads is None:
            return torch.get_num_threads()
        return self.threads.used if chosen else (self.threads.threads or torch.get_num_threads())
