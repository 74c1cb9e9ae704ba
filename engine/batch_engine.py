"""
Many requests, one forward pass: the step that runs what engine/scheduler.py plans, on the paged pool.

Read engine/one_request.py first (stage 7: one request at a time, its cached prefix copied out of
the pool into a private DynamicCache), engine/scheduler.py (what runs in the next step),
engine/step_budget.py (how much it may compute) and engine/model_runner.py (plan in, logits out). Here no
DynamicCache is kept between steps: in every layer, the model's attention copies each
request's blocks out of the pool through its block table, whole blocks, padded to the
longest context of its group, into one buffer the pool reuses (StepFigures counts the slots
a layer needs, attends over and copies). vLLM's kernels copy nothing: flash_attn_varlen_func
gets the paged cache and the block table (vllm/v1/attention/backends/flash_attn.py).

    BatchRunner   step: schedule, run the model, sample, finish; add and run for callers
                  who step it themselves (generate_batch, the lessons)

The step reads as nano-vllm's (nanovllm/engine/llm_engine.py at bb823b3: schedule, run,
postprocess). What it may compute is a budget policy's to say, how many threads a pass runs
with the model runner's thread policy: objects handed in, not branches of the step.
A failure in one request's bookkeeping (its reply builder) ends that request only; a
failure of the step itself (the model, the sampler) raises, for the caller to end the
step's requests (engine/engine_loop.py does).

A runner takes the EngineParts it runs on (engine/one_request.py), not the Engine. engine/engine_loop.py
steps one for callers in many threads (every Engine's requests: the server's clients too).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from allocator import OutOfBlocksError
from engine.cpu_threads import GpuClock, ThreadChooser
from engine.model_runner import ModelRunner, StepFigures
from engine.one_request import EngineParts
from engine.outputs import Generation, ReplyBuilder
from engine.request import FINISHED, Request, SamplingParams
from engine.sampling import sample_batch
from engine.scheduler import Scheduler, StepPlan
from engine.step_budget import FixedBudget, StepBudget

__all__ = ["BatchRunner", "StepFigures"]


class BatchRunner:
    """Runs requests together over an engine's model and pool: one forward pass per step for
    all of them, planned by a Scheduler of its own.

    parts: what it runs on (one_request.EngineParts). Every step holds parts.lock, and
    parts.allocator_lock around the allocator's and the scheduler's bookkeeping only.
    on_bookkept, if set, is called at the end of each such hold, still under the lock: after
    the plan (step_ended=False) and after the finished requests are freed, before any event
    goes out (step_ended=True). The engine loop publishes its snapshot there.
    """

    def __init__(self, parts: EngineParts, *, cascade_attention: bool = True, threads: ThreadChooser | None = None,
                 choose_threads: bool = True, step_budget: StepBudget | None = None,
                 static_decode: bool | None = None, **scheduler_options) -> None:
        """cascade_attention: decodes that share a long prefix's blocks may attend over them
        once (shared_prefix_attention), where counted work says it pays (decode_groups);
        False: never. threads: the ThreadChooser to use (one that has measured already, as
        the Engine's), or None for a new one; choose_threads=False keeps torch's own thread
        count for every step. step_budget: the budget policy (engine/step_budget.py's StepBudget,
        or any object with its budget, record and describe); None: max_num_batched_tokens
        every step (FixedBudget). static_decode: a step that only decodes, and one with a prompt's
        chunk of at most 512 tokens, runs padded to a ladder's shape, a CUDA graph on a GPU
        (engine/model_runner.py); None: on a GPU only.
        scheduler_options: Scheduler's max_num_seqs, max_num_batched_tokens and
        enable_chunked_prefill."""
        self.parts = parts
        self.scheduler = Scheduler(parts.allocator, **scheduler_options)
        self.budget = step_budget or FixedBudget(self.scheduler.max_num_batched_tokens)
        # On a GPU the CPU only launches kernels: nothing to choose there.
        cpu = parts.device.type == "cpu"
        self.model_runner = ModelRunner(parts, cascade_attention,
                                        (threads or ThreadChooser()) if cpu and choose_threads else None,
                                        max_num_seqs=self.scheduler.max_num_seqs, static_decode=static_decode)
        self.last_plan: StepPlan | None = None  # the latest step's plan; None while one is being made
        self.num_steps = 0  # steps that scheduled anything: one forward pass each
        self.block_tables: dict[str, list[int]] = {}  # the latest plan's requests' tables, as planned
        self.on_bookkept: Callable[[bool], None] | None = None  # called with step_ended (see above)
        self.gpu_clock = GpuClock(parts.device)
        self.last_gpu_ms: float | None = None  # the latest step's pass and sampling on the GPU's clock; None on a CPU

    @property
    def last_step(self) -> StepFigures | None:
        """The latest step's figures (maybe running now)."""
        return self.model_runner.last_step

    @property
    def threads(self) -> ThreadChooser | None:
        return self.model_runner.threads

    def thread_count(self, chosen: bool):
        return self.model_runner.thread_count(chosen)

    # --- requests in ---------------------------------------------------------------------

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, **request_fields) -> Request:
        """A Request with its reply builder and sampler; request_fields: Request's (tenant,
        events). Trusts its caller: the Engine's front checked every argument."""
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        reply = Generation(request_id, prompt_tokens=len(prompt_ids))
        builder = ReplyBuilder(reply, self.parts.tokenizer, self.parts.stop_token_ids, params.stop, params.max_tokens)
        return Request(request_id, list(prompt_ids), cache_salt, params, builder=builder, generator=generator,
                       **request_fields)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
            **request_fields) -> Request:
        request = self.new_request(request_id, prompt_ids, params, cache_salt, **request_fields)
        self.scheduler.add(request)
        return request

    # --- the step ------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Schedule, run one forward pass, sample, finish; returns the requests that finished
        (their blocks freed, their replies complete, their last event sent).

        If it raises, the requests of last_plan (all of them, if that is None) are the ones
        it left half done."""
        with self.parts.lock:
            plan = self.schedule()
            if not plan.scheduled:
                return []
            started = time.perf_counter()
            self.gpu_clock.start()
            logits = self.model_runner.run(plan, self.block_tables)
            sampling = [s.request for s in plan.scheduled if s.samples]
            tokens = sample_batch(logits, [r.params for r in sampling], [r.generator for r in sampling])
            self.last_gpu_ms = self.gpu_clock.stop()
            with self.parts.allocator_lock:  # what a published snapshot reads the learned costs under
                self.budget.record(self.thread_count(chosen=True), plan, time.perf_counter() - started)
            return self.postprocess(plan, tokens)

    def schedule(self) -> StepPlan:
        """The budget policy's budget, the scheduler's plan, and the block tables it runs on."""
        self.last_plan = None
        with self.parts.allocator_lock:
            budget = self.budget.budget(self.scheduler.candidates(), self.thread_count(chosen=False))
            plan = self.last_plan = self.scheduler.schedule(budget)
            tables = self.parts.allocator.block_tables
            self.block_tables = {s.request.request_id: list(tables[s.request.request_id]) for s in plan.scheduled}
            if plan.scheduled:
                self.num_steps += 1
            self._bookkept(step_ended=False)
        now = time.perf_counter()
        for s in plan.scheduled:
            if s.request.admitted_at is None:  # its first admission: its hit is known
                s.request.admitted_at = now
                s.request.reply.cached_tokens = s.request.num_cached_tokens
        return plan

    def postprocess(self, plan: StepPlan, tokens: list[int]) -> list[Request]:
        """Each request's K/V are in the pool now; each that sampled takes its token (its
        reply builder may finish it); the finished give their blocks back, then every
        sampled token's event goes out (the last one after the free, so whoever sees a
        finish reason sees the pool whole)."""
        sampled = iter(tokens)
        news, failed = [], []
        for s in plan.scheduled:
            s.request.num_computed_tokens = s.end
            if s.samples:
                try:
                    news.append((s.request, *self._add_token(s.request, next(sampled))))
                except Exception as err:  # this request's bookkeeping: it alone fails
                    failed.append((s.request, err))
        finished = [request for request, _, _, finish_reason in news if finish_reason is not None]
        with self.parts.allocator_lock:
            for request in finished + [request for request, _ in failed]:
                self.scheduler.finish(request)
            self._bookkept(step_ended=True)
        end = time.perf_counter()
        for request in finished:
            self.close_reply(request, end)
        for request, token, text, _ in news:
            if request.events is not None:
                request.events.put(request.reply.event(token, text))
        for request, err in failed:
            self.fail(request, err)
        return finished

    def _bookkept(self, step_ended: bool) -> None:
        if self.on_bookkept is not None:
            self.on_bookkept(step_ended)

    def _add_token(self, request: Request, token: int) -> tuple[int, str, str | None]:
        """Add the request's sampled token to it and to its reply: (token, new text, finish reason)."""
        request.append_output(token)
        if len(request.output_ids) == 1:
            request.reply.ttft_ms = (time.perf_counter() - request.arrival) * 1e3
        return token, *request.builder.add(token)

    @staticmethod
    def close_reply(request: Request, end: float) -> None:
        """A finished request's reply gets its times and preemptions."""
        reply = request.reply
        reply.total_ms = (end - request.arrival) * 1e3
        reply.wait_ms = ((request.admitted_at or end) - request.arrival) * 1e3
        reply.num_preemptions = request.num_preemptions

    @staticmethod
    def fail(request: Request, err: BaseException) -> None:
        """The request ended with `err` (already out of the scheduler): its caller gets it
        instead of its next event."""
        request.status, request.error = FINISHED, err
        if request.events is not None:
            request.events.put(err)

    # --- stepping it yourself ------------------------------------------------------------

    def run(self, requests: list[Request]) -> list[Generation]:
        """Step until every one of `requests` has finished; their replies, in order. A
        request that failed raises its error once the others are done.

        The runner's scheduler sees only its own requests. If a step can run none of them
        while none runs, the pool is held by someone else (a stream of the same engine): that
        raises OutOfBlocksError instead of waiting for blocks this runner cannot see freed."""
        while any(r.status != FINISHED for r in requests):
            self.step()
            plan = self.last_plan
            if not (plan.scheduled or plan.preempted or self.scheduler.running):
                raise OutOfBlocksError(
                    f"the KV pool is held by other requests of this engine ({self.parts.allocator.num_free_blocks} "
                    f"blocks free): engine.generate_batch queues every caller's requests together in the engine loop"
                )
        for request in requests:
            if request.error is not None:
                raise request.error
        return [r.reply for r in requests]
