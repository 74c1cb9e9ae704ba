"""
The model runner: a step's plan in, the logits of every request that samples out.

Read batch_attention.py first (how one forward pass attends for every request over the
pool). The runner knows nothing of queues, budgets or replies: batch_engine.py's BatchRunner
hands it a plan and gets logits back, as nano-vllm's LLMEngine hands its ModelRunner the
scheduled sequences (nanovllm/engine/model_runner.py at bb823b3: prepare_prefill or
prepare_decode builds the inputs, run_model returns the logits; its run also samples,
which here stays with the step).

    StepFigures   how big one step was: requests, tokens, slots attended over and copied
    ModelRunner   prepare (the step's inputs, a decode step's in buffers it keeps), run
                  (one forward pass, on a CPU with the thread count cpu_threads.py picks)

A decode-only step's token ids, positions, slots and sampled rows go into tensors the runner
allocates once and keeps, so a decode step's inputs live at the same addresses every step:
what replaying it as a CUDA graph needs (nano-vllm's run_model copies a decode step's
input_ids, positions, slot_mapping, context_lens and block_tables into the graph_vars its
capture_cudagraph allocated, then replays the graph).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from batch_attention import StepInputs, build_step, use_pool_attention
from cpu_threads import ThreadChooser, one_pass
from one_request import EngineParts
from scheduler import StepPlan


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


class ModelRunner:
    """Runs one step's forward pass over the paged pool for every scheduled request.

    parts: the model and pool (one_request.EngineParts); cascade_attention: decodes sharing a
    long prefix's blocks may attend over them once, where counted work says it pays
    (batch_attention.decode_groups); threads: the CPU thread policy (cpu_threads.py), or None
    for torch's own count (and on a GPU, where the CPU only launches kernels).
    """

    def __init__(self, parts: EngineParts, cascade_attention: bool = True, threads: ThreadChooser | None = None):
        self.parts, self.cascade_attention, self.threads = parts, cascade_attention, threads
        use_pool_attention(parts.model)
        self.last_step: StepFigures | None = None  # the latest step's figures
        self._decode: dict[str, torch.Tensor] = {}  # a decode step's inputs, kept: see prepare

    def prepare(self, plan: StepPlan, block_tables: dict[str, list[int]]) -> StepInputs:
        """The step's inputs (batch_attention.build_step); a decode-only step's ids,
        positions, slots and sampled rows copied into the runner's kept buffers."""
        inputs = build_step(plan, self.parts.kv, block_tables, self.parts.device, self.cascade_attention)
        self.last_step = StepFigures.of(plan, inputs)
        if self.last_step.num_tokens != self.last_step.num_requests:
            return inputs  # a prompt's chunk: shapes change every step, nothing to keep
        n = self.last_step.num_tokens
        fresh = {"input_ids": inputs.input_ids[0], "positions": inputs.positions[0],
                 "slot_mapping": inputs.slot_mapping, "last_token": inputs.last_token}
        if not self._decode or self._decode["input_ids"].numel() < n:  # grown to the most decodes seen
            size = max(n, 2 * self._decode["input_ids"].numel() if self._decode else n)
            self._decode = {name: torch.zeros(size, dtype=t.dtype, device=t.device) for name, t in fresh.items()}
        kept = {}
        for name, t in fresh.items():
            kept[name] = self._decode[name][: t.numel()]
            kept[name].copy_(t)
        return replace(inputs, input_ids=kept["input_ids"][None], positions=kept["positions"][None],
                       slot_mapping=kept["slot_mapping"], last_token=kept["last_token"])

    def run(self, plan: StepPlan, block_tables: dict[str, list[int]]) -> torch.Tensor:
        """One forward pass for the plan: logits (requests that sample, vocab)."""
        inputs = self.prepare(plan, block_tables)
        prefill = self.last_step.num_prefill_tokens > 0
        kind = (prefill, plan.num_tokens.bit_length())  # steps about as big are timed together
        with one_pass(self.threads, self.parts.device, kind, may_probe=not prefill), torch.inference_mode():
            return self.parts.model(
                input_ids=inputs.input_ids, position_ids=inputs.positions, use_cache=False,
                logits_to_keep=inputs.last_token, pool_step=inputs,
            ).logits[0]

    def thread_count(self, chosen: bool):
        """What step costs are learned under: None on a GPU; on a CPU the thread count the
        next step will likely run with (chosen=False), or the one the latest ran with."""
        if self.parts.device.type != "cpu":
            return None
        if self.threads is None:
            return torch.get_num_threads()
        return self.threads.used if chosen else (self.threads.threads or torch.get_num_threads())
