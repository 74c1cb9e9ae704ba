"""
Many requests, one forward pass: the step that runs what scheduler.py plans, on the paged pool.

Read one_request.py first (stage 7: one request at a time, its cached prefix copied out of
the pool into a private DynamicCache), scheduler.py (what runs in the next step) and
batch_attention.py (how one forward pass attends for every request). Here no DynamicCache
is kept between steps: in every layer, the model's attention copies each request's blocks out
of the pool through its block table, whole blocks, padded to the longest context of its group,
into one buffer the pool reuses (StepFigures counts the slots a layer needs, attends over and
copies). vLLM's kernels copy nothing: flash_attn_varlen_func gets the paged cache and the
block table (vllm/v1/attention/backends/flash_attn.py).

    _State, StepFigures  what the runner keeps with each request; how big a step was
    BatchRunner          schedule, run the step, sample a token per request, finish requests

A runner takes the EngineParts it runs on (one_request.py), not the Engine. engine_loop.py
steps one for callers in many threads (Engine(batching=True): the server's clients). How many
threads a step runs with on a CPU is cpu_threads.py's to choose.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable

import torch

from batch_attention import StepInputs, build_step, use_pool_attention
from cpu_threads import ThreadChooser, one_pass
from one_request import EngineParts
from outputs import Generation, ReplyBuilder
from prefix_caching import OutOfBlocksError
from sampling import SamplingParams, sample_batch
from scheduler import FINISHED, Request, Scheduler, StepPlan
from step_budget import StepBudget


@dataclass
class _State:
    """What the runner keeps with each request (Request.payload)."""

    params: SamplingParams
    generator: torch.Generator | None
    builder: ReplyBuilder  # the reply, and its text as the tokens come (outputs.py)
    arrival: float
    admitted_at: float | None = None
    new_text: str = ""  # what the last sampled token added to the reply's text
    events: queue.SimpleQueue | None = None  # where an EngineLoop (engine_loop.py) sends its StreamEvents
    gone: Callable[[], bool] | None = None  # an EngineLoop's check: has the caller left?

    @property
    def reply(self) -> Generation:
        return self.builder.reply


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


class BatchRunner:
    """Runs requests together over an engine's model and pool: one forward pass per step for
    all of them, planned by a Scheduler of its own.

    parts: what it runs on (one_request.EngineParts). Every step holds parts.lock, and
    parts.allocator_lock around the allocator's and the scheduler's bookkeeping only.
    """

    def __init__(self, parts: EngineParts, *, cascade_attention: bool = True, threads: ThreadChooser | None = None,
                 choose_threads: bool = True, step_budget: StepBudget | None = None, **scheduler_options) -> None:
        """cascade_attention: decodes that share a long prefix's blocks may attend over them
        once (shared_prefix_attention), where counted work says it pays (decode_groups);
        False: never. threads: the ThreadChooser to use (one that has measured
        already, as the Engine's), or None for a new one; choose_threads=False keeps torch's
        own thread count for every step. step_budget: picks each step's token budget from a
        target step time (step_budget.py), up to max_num_batched_tokens; None: the budget is
        max_num_batched_tokens every step. scheduler_options: Scheduler's max_num_seqs,
        max_num_batched_tokens and enable_chunked_prefill."""
        self.parts = parts
        self.cascade_attention = cascade_attention
        # On a GPU the CPU only launches kernels: nothing to choose there.
        cpu = parts.device.type == "cpu"
        self.threads = (threads or ThreadChooser()) if cpu and choose_threads else None
        self.step_budget = step_budget
        use_pool_attention(parts.model)
        self.scheduler = Scheduler(parts.allocator, **scheduler_options)
        self.last_plan: StepPlan | None = None  # the latest step's plan; None while one is being made
        self.num_steps = 0  # steps that scheduled anything: one forward pass each
        self.last_step: StepFigures | None = None  # the latest of them, maybe running now

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
            stop: tuple[str, ...] = ()) -> Request:
        request = self.new_request(request_id, prompt_ids, params, cache_salt, stop)
        self.scheduler.add(request)
        return request

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                    stop: tuple[str, ...] = ()) -> Request:
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        reply = Generation(request_id, prompt_tokens=len(prompt_ids))
        builder = ReplyBuilder(reply, self.parts.tokenizer, self.parts.stop_token_ids, stop, params.max_tokens)
        state = _State(params, generator, builder, time.perf_counter())
        return Request(request_id, list(prompt_ids), cache_salt, params.max_tokens, payload=state)

    def step(self) -> list[Request]:
        """Schedule, run one forward pass, sample; returns the requests that finished (their
        blocks freed, their replies complete).

        Holds parts.lock for the step (so it never interleaves with another caller's steps)
        and parts.allocator_lock around the allocator's bookkeeping only. If it raises, the
        requests of last_plan (all of them, if that is None) are the ones it left half done."""
        parts, scheduler = self.parts, self.scheduler
        self.last_plan = None
        with parts.lock:
            with parts.allocator_lock:
                budget = None
                if self.step_budget is not None:
                    threads = self.thread_count(chosen=False)
                    budget = self.step_budget.tokens(scheduler.running, scheduler.waiting, threads)
                plan = self.last_plan = scheduler.schedule(budget)
                block_tables = {s.request.request_id: list(parts.allocator.block_tables[s.request.request_id])
                                for s in plan.scheduled}
            if not plan.scheduled:
                return []
            started = time.perf_counter()
            inputs = build_step(plan, parts.kv, block_tables, parts.device, self.cascade_attention)
            self.num_steps += 1
            self.last_step = StepFigures.of(plan, inputs)
            now = time.perf_counter()
            for s in plan.scheduled:
                if s.request.payload.admitted_at is None:  # its first admission: its hit is known
                    s.request.payload.admitted_at = now
                    s.request.payload.reply.cached_tokens = s.request.num_cached_tokens
            prefill = self.last_step.num_prefill_tokens > 0
            kind = (prefill, plan.num_tokens.bit_length())  # steps about as big are timed together
            with one_pass(self.threads, parts.device, kind, may_probe=not prefill), torch.inference_mode():
                logits = parts.model(
                    input_ids=inputs.input_ids, position_ids=inputs.positions, use_cache=False,
                    logits_to_keep=inputs.last_token, pool_step=inputs,
                ).logits[0]  # (requests that sample, vocab)
            for s in plan.scheduled:
                s.request.num_computed_tokens = s.end  # its K/V are in the pool now
            # Every request samples before any finishes: a failure in one leaves them all as
            # they were, for the caller to fail together.
            sampling = [s.request for s in plan.scheduled if s.samples]
            tokens = sample_batch(logits, [r.payload.params for r in sampling], [r.payload.generator for r in sampling])
            if self.step_budget is not None:  # sampling waited for the device: the step is done
                seconds = time.perf_counter() - started
                with parts.allocator_lock:  # what snapshot() reads the learned costs under
                    self.step_budget.record(self.thread_count(chosen=True), plan, seconds)
            finished = [request for request, token in zip(sampling, tokens) if self._add_token(request, token)]
            with parts.allocator_lock:
                for request in finished:
                    scheduler.finish(request)
        end = time.perf_counter()
        for request in finished:
            self.close_reply(request, end)
        return finished

    def thread_count(self, chosen: bool):
        """What step costs are learned under: None on a GPU; on a CPU the thread count the
        next step will likely run with (chosen=False), or the one the latest ran with."""
        if self.parts.device.type != "cpu":
            return None
        if self.threads is None:
            return torch.get_num_threads()
        return self.threads.used if chosen else (self.threads.threads or torch.get_num_threads())

    @staticmethod
    def close_reply(request: Request, end: float) -> None:
        """A finished request's reply gets its times and preemptions."""
        state, reply = request.payload, request.payload.reply
        reply.total_ms = (end - state.arrival) * 1e3
        reply.wait_ms = (state.admitted_at - state.arrival) * 1e3
        reply.num_preemptions = request.num_preemptions

    def _add_token(self, request: Request, token: int) -> bool:
        """Add the request's sampled token to it and to its reply; whether that finished it."""
        state = request.payload
        request.output_ids.append(token)
        if len(request.output_ids) == 1:
            state.reply.ttft_ms = (time.perf_counter() - state.arrival) * 1e3
        state.new_text, finish_reason = state.builder.add(token)
        return finish_reason is not None

    def run(self, requests: list[Request]) -> list[Generation]:
        """Step until every one of `requests` has finished; their replies, in order.

        The runner's scheduler sees only its own requests. If a step can run none of them
        while none runs, the pool is held by someone else (a stream of the same engine): that
        raises OutOfBlocksError instead of waiting for blocks this runner cannot see freed."""
        while any(r.status != FINISHED for r in requests):
            self.step()
            plan = self.last_plan
            if not (plan.scheduled or plan.preempted or self.scheduler.running):
                raise OutOfBlocksError(
                    f"the KV pool is held by other requests of this engine ({self.parts.allocator.num_free_blocks} "
                    f"blocks free): use Engine(batching=True) to queue every caller's requests together"
                )
        return [r.payload.reply for r in requests]
