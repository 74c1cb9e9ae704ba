"""
The model runner: a step's plan in, the logits of every request that samples out.

Read engine/batch_attention.py first (how one forward pass attends for every request over the
pool), then engine/static_decode.py (a decode step with fixed shapes). The runner knows nothing of
queues, budgets or replies: engine/batch_engine.py's BatchRunner hands it a plan and gets logits
back, as nano-vllm's LLMEngine hands its ModelRunner the scheduled sequences
(nanovllm/engine/model_runner.py at bb823b3: prepare_prefill or prepare_decode builds the
inputs, run_model returns the logits; its run also samples, which here stays with the step).

    StepFigures   how big one step was: requests, tokens, slots attended over and copied
    DecodeGraphs  CUDA graphs of the padded decode step, one per (size, reads) of its ladders
    ChunkGraphs   CUDA graphs of the padded step with a prompt's chunk, one per (tokens, reads)
    ModelRunner   run: one forward pass, eager (build_step's packed step) or padded: a step
                  that only decodes as engine/static_decode.py pads it, one with a prompt's chunk
                  of at most 512 tokens in all as engine/static_chunk.py does, each replayed as a
                  graph on a GPU; on a CPU with the thread count engine/cpu_threads.py picks

On a GPU a decode step of a small model is mostly the CPU's work: the Python of the forward
pass and of its attention, and one launch for each of its hundreds of kernels, while the GPU
itself is done in a fraction of that. A CUDA graph records the kernels of one forward pass
once and replays them all with a single launch: no Python, no per-kernel launch. It replays
the same kernels over the same addresses and shapes, so the step's inputs are copied into
buffers allocated once (static_decode.DecodeBuffers) and the batch is padded to a rung of a
ladder. What a graph cannot replay is a shape it was not captured with: a step with a
prompt's chunk changes its token count every step, so its tokens are padded to a ladder of
their own (engine/static_chunk.py); a step larger than the ladders runs eagerly. nano-vllm captures its decode step the same way (nanovllm/engine/
engine/model_runner.py: capture_cudagraph, and run_model, which replays it), as does vLLM (capture_model
and _dummy_run in vllm/v1/worker/gpu_model_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch_attention import StepInputs, build_step, use_pool_attention
from engine.cpu_threads import ThreadChooser, one_pass
from engine.cuda_graphs import Graphs
from engine.one_request import EngineParts
from engine.scheduler import StepPlan
from engine.static_chunk import MAX_SCORES, MAX_TOKENS, ChunkBuffers, chunk_rung, chunk_sizes
from engine.static_chunk import forward as chunk_forward
from engine.static_decode import DecodeBuffers, block_counts, decode_sizes, forward, padded_to, rung

# capture_at_start's bound: steps whose contexts are within this many tokens (a row's, for a
# decode step; all of a step's requests', for a step with a prompt's chunk), as stage 7's
# passes are captured up to engine/fixed_past.py's START_SLOTS
START_TOKENS = 1024


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
    def padded(cls, plan: StepPlan, reads: int, block_size: int) -> StepFigures:
        """A padded step's: its requests read `reads` whole blocks in all, padding included."""
        read = reads * block_size
        prefill = sum(s.end - s.start for s in plan.scheduled if s.is_prefill)
        return cls(len(plan.scheduled), plan.num_tokens, prefill, sum(s.end for s in plan.scheduled), read, read)


class DecodeGraphs(Graphs):
    """The padded decode step (static_decode.forward) as CUDA graphs (engine/cuda_graphs.py), one
    per (size, reads), each captured the first time a step of its shape runs. nano-vllm captures
    every batch size when the model loads, since its attention kernel reads each row's context
    wherever it ends; here the count of blocks read is a shape too, and most (size, reads) pairs
    never come."""

    def __init__(self, model, buffers: DecodeBuffers):
        # forward looked up at each call, so a test's stand-in for it is the one captured
        super().__init__(lambda size, reads: forward(model, buffers, size, reads), buffers.input_ids.numel(),
                         "the decode step of (rows, blocks read)")


class ChunkGraphs(Graphs):
    """The padded step with a prompt's chunk (static_chunk.forward) as CUDA graphs, one per
    (tokens, reads), each captured the first time a step of its shape runs."""

    def __init__(self, model, buffers: ChunkBuffers):
        super().__init__(lambda tokens, reads: chunk_forward(model, buffers, tokens, reads), buffers.max_rows,
                         "the step with a prompt's chunk of (tokens, blocks read)")


class ModelRunner:
    """Runs one step's forward pass over the paged pool for every scheduled request.

    parts: the model and pool (one_request.EngineParts); cascade_attention: decodes sharing a
    long prefix's blocks may attend over them once, where counted work says it pays
    (batch_attention.decode_groups); threads: the CPU thread policy (engine/cpu_threads.py), or None
    for torch's own count (and on a GPU, where the CPU only launches kernels); max_num_seqs:
    the most requests a step holds, the top of the batch-size ladder. static_decode: steps run
    padded to fixed shapes, as CUDA graphs on a GPU and eagerly on a CPU: a step whose every
    request computes one token (engine/static_decode.py), and a step with a prompt's chunk of
    at most 512 tokens in all (engine/static_chunk.py); None: on a GPU only. If a shape's
    capture fails, the runner says why once (the "engine" logger) and runs later steps of that
    shape eagerly, unpadded; every other shape keeps its graph.
    """

    def __init__(self, parts: EngineParts, cascade_attention: bool = True, threads: ThreadChooser | None = None, *,
                 max_num_seqs: int, static_decode: bool | None = None):
        self.parts, self.cascade_attention, self.threads = parts, cascade_attention, threads
        use_pool_attention(parts.model)
        self.last_step: StepFigures | None = None  # the latest step's figures
        cuda = parts.device.type == "cuda"
        self.buffers: DecodeBuffers | None = None  # the padded decode step's inputs; None: every step eager
        self.chunk_buffers: ChunkBuffers | None = None  # the padded step with a prompt's chunk
        self.graphs: DecodeGraphs | None = None  # their graphs, on a GPU
        self.chunk_graphs: ChunkGraphs | None = None
        if static_decode or (static_decode is None and cuda):
            # at most every row reading the whole pool
            self.sizes, self.counts = decode_sizes(max_num_seqs), block_counts(max_num_seqs * parts.kv.num_blocks)
            self.buffers = DecodeBuffers(parts.kv, self.sizes[-1], self.counts[-1])
            self.chunk_buffers = ChunkBuffers(parts.kv, MAX_TOKENS, self.counts[-1], max_num_seqs)
            if cuda:
                self.graphs = DecodeGraphs(parts.model, self.buffers)
                self.chunk_graphs = ChunkGraphs(parts.model, self.chunk_buffers)

    def all_graphs(self) -> list[Graphs]:
        return [g for g in (self.graphs, self.chunk_graphs) if g is not None]

    @property
    def captures(self) -> int:
        """How many CUDA graphs this runner has captured (0 on a CPU)."""
        return sum(len(g.captures) for g in self.all_graphs())

    def graph_figures(self) -> dict | None:
        """The runner's CUDA graphs so far (Graphs.figures, both kinds together): shapes
        captured, the seconds their captures took in all, and shapes whose capture failed;
        None where no graph runs (a CPU)."""
        graphs = self.all_graphs()
        if not graphs:
            return None
        figures = [g.figures() for g in graphs]
        return {key: round(sum(f[key] for f in figures), 3) for key in figures[0]}

    def start_shapes(self, up_to: int = START_TOKENS) -> dict[str, list[tuple[int, int]]]:
        """The shapes capture_at_start captures: every decode step whose rows' contexts are
        each within `up_to` tokens (each size of the ladder, each rung of blocks read from one a
        row to `up_to` tokens a row), and every step with a prompt's chunk whose requests'
        contexts are within `up_to` tokens in all (each rung of tokens up to 512, each rung of
        blocks read from the chunk's own to `up_to` tokens' worth). Empty where nothing pads."""
        if self.buffers is None:
            return {"decode": [], "chunk": []}
        block_size = self.parts.kv.block_size
        per_row = -(-up_to // block_size)

        def reads(least: int, most: int) -> list[int]:
            low, high = padded_to(self.counts, least), padded_to(self.counts, most) or self.counts[-1]
            return [count for count in self.counts if low is not None and low <= count <= high]

        decode = [(size, count) for size in self.sizes for count in reads(size, size * per_row)]
        chunk = [(tokens, count) for tokens in chunk_sizes() if 1 < tokens <= up_to
                 for count in reads(-(-tokens // block_size) + 1, per_row + 1)
                 if tokens * count * block_size <= MAX_SCORES]
        return {"decode": decode, "chunk": chunk}

    def capture_at_start(self, up_to: int = START_TOKENS) -> int:
        """Capture start_shapes(up_to) as CUDA graphs before any request (on a GPU; nothing on
        a CPU), each over a step of padding only: every token on the pool's scratch block, so
        no request's K/V is read or written. Returns how many were captured; shapes captured
        already are skipped, and one that fails is marked failed as in a real step."""
        if not self.all_graphs():
            return 0
        before, empty = self.captures, StepPlan([], [])
        shapes = self.start_shapes(up_to)
        with torch.inference_mode():
            for shape in shapes["decode"]:
                if not self.graphs.has(*shape) and shape not in self.graphs.failed:
                    self.buffers.fill(empty, {}, *shape)
                    self.graphs.try_capture(*shape)
            for shape in shapes["chunk"]:
                if not self.chunk_graphs.has(*shape) and shape not in self.chunk_graphs.failed:
                    self.chunk_buffers.fill(empty, {}, *shape)
                    self.chunk_graphs.try_capture(*shape)
        return self.captures - before

    def run(self, plan: StepPlan, block_tables: dict[str, list[int]]) -> torch.Tensor:
        """One forward pass for the plan: logits (requests that sample, vocab)."""
        prefill = any(s.is_prefill for s in plan.scheduled)
        kind = (prefill, plan.num_tokens.bit_length())  # steps about as big are timed together
        with one_pass(self.threads, self.parts.device, kind, may_probe=not prefill), torch.inference_mode():
            if (shape := self.padded_rung(plan)) is not None:
                return self.run_padded(plan, block_tables, *shape)
            if (shape := self.chunk_rung(plan)) is not None:
                return self.run_chunk(plan, block_tables, *shape)
            return self.run_eager(plan, block_tables)

    def padded_rung(self, plan: StepPlan) -> tuple[int, int] | None:
        """The (size, reads) a decode-only step runs padded to; None: it does not (no padded
        path, a step with a prompt's chunk, one above the ladders, or a shape whose capture failed)."""
        if self.buffers is None or plan.num_tokens != len(plan.scheduled):
            return None
        shape = rung(plan, self.sizes, self.counts, self.parts.kv.block_size)
        return None if self.graphs is not None and shape in self.graphs.failed else shape

    def chunk_rung(self, plan: StepPlan) -> tuple[int, int] | None:
        """The (tokens, reads) a step with a prompt's chunk runs padded to; None: it does not
        (no padded path, a decode-only step, one above the ladders, or a shape whose capture failed)."""
        if self.chunk_buffers is None or plan.num_tokens == len(plan.scheduled):
            return None
        shape = chunk_rung(plan, self.counts, self.parts.kv.block_size)
        return None if self.chunk_graphs is not None and shape in self.chunk_graphs.failed else shape

    def run_eager(self, plan: StepPlan, block_tables: dict[str, list[int]]) -> torch.Tensor:
        """The step packed and grouped anew (batch_attention.build_step), shapes its own."""
        inputs = build_step(plan, self.parts.kv, block_tables, self.parts.device, self.cascade_attention)
        self.last_step = StepFigures.of(plan, inputs)
        return self.parts.model(
            input_ids=inputs.input_ids, position_ids=inputs.positions, use_cache=False,
            logits_to_keep=inputs.last_token, pool_step=inputs,
        ).logits[0]

    def run_padded(self, plan: StepPlan, block_tables: dict[str, list[int]], size: int, reads: int) -> torch.Tensor:
        """A decode-only step copied into the buffers and run padded (padded_pass)."""
        self.buffers.fill(plan, block_tables, size, reads)
        logits = self.padded_pass(self.graphs, lambda: forward(self.parts.model, self.buffers, size, reads), size, reads)
        if logits is None:
            return self.run_eager(plan, block_tables)  # that shape's capture failed: packed, eagerly
        self.last_step = StepFigures.padded(plan, reads, self.parts.kv.block_size)
        sampling = [i for i, s in enumerate(plan.scheduled) if s.samples]
        return logits[sampling]  # a copy: the next replay writes over the graphs' logits

    def run_chunk(self, plan: StepPlan, block_tables: dict[str, list[int]], tokens: int, reads: int) -> torch.Tensor:
        """A step with a prompt's chunk copied into its buffers and run padded (padded_pass)."""
        self.chunk_buffers.fill(plan, block_tables, tokens, reads)
        logits = self.padded_pass(self.chunk_graphs,
                                  lambda: chunk_forward(self.parts.model, self.chunk_buffers, tokens, reads), tokens, reads)
        if logits is None:
            return self.run_eager(plan, block_tables)
        self.last_step = StepFigures.padded(plan, reads, self.parts.kv.block_size)
        return logits[: sum(s.samples for s in plan.scheduled)].clone()  # the sampling requests' rows, kept

    @staticmethod
    def padded_pass(graphs: Graphs | None, run, *shape) -> torch.Tensor | None:
        """The padded pass of `shape` over what its buffers hold: run() eagerly where no graph
        runs (a CPU), else its graph replayed, captured first if the shape is new; None if that
        capture failed (the caller runs the step packed)."""
        if graphs is None:
            return run()
        if not graphs.has(*shape) and not graphs.try_capture(*shape):
            return None
        return graphs.replay(*shape)

    def thread_count(self, chosen: bool):
        """What step costs are learned under: None on a GPU; on a CPU the thread count the
        next step will likely run with (chosen=False), or the one the latest ran with."""
        if self.parts.device.type != "cpu":
            return None
        if self.threads is None:
            return torch.get_num_threads()
        return self.threads.used if chosen else (self.threads.threads or torch.get_num_threads())
