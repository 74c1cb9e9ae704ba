"""
Many requests, one forward pass: the step that runs what scheduler.py plans, on the paged pool.

Read one_request.py first (stage 7: one request at a time, its cached prefix copied out of
the pool into a private DynamicCache), scheduler.py (what runs in the next step) and
batch_attention.py (how one forward pass attends for every request). Here no DynamicCache
is kept between steps: in every layer, the model's attention copies each request's whole
context out of the pool through its block table, K and V of every slot it reads, padded to
the longest context of its group (StepInputs.slots_read counts the slots a layer reads; the
README's "Measured" has them for 16 to 64 decodes behind a system prompt). vLLM's kernels copy
nothing: flash_attn_varlen_func gets the paged
cache and the block table (vllm/v1/attention/backends/flash_attn.py).

    1. the batch runner  schedule, run the step, sample a token per request, finish requests
    2. the engine loop   a thread that steps the runner for callers in other threads
                         (Engine(batching=True): the server's clients)

How many threads a step runs with on a CPU is cpu_threads.py's to choose.
"""

from __future__ import annotations

import atexit
import gc
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from batch_attention import StepInputs, build_step, use_pool_attention
from cpu_threads import ThreadChooser, one_pass
from outputs import Generation, ReplyBuilder, StreamEvent
from prefix_caching import OutOfBlocksError
from sampling import SamplingParams, sample_batch
from scheduler import FINISHED, Request, Scheduler, StepPlan
from step_budget import StepBudget


# -----------------------------------------------------------------------------
# 1. The batch runner


@dataclass
class _State:
    """What the runner keeps with each request (Request.payload)."""

    params: SamplingParams
    generator: torch.Generator | None
    builder: ReplyBuilder  # the reply, and its text as the tokens come (outputs.py)
    arrival: float
    admitted_at: float | None = None
    new_text: str = ""  # what the last sampled token added to the reply's text
    events: queue.SimpleQueue | None = None  # where an EngineLoop sends this request's StreamEvents
    gone: Callable[[], bool] | None = None  # an EngineLoop's check: has the caller left?

    @property
    def reply(self) -> Generation:
        return self.builder.reply


@dataclass(frozen=True)
class StepFigures:
    """How big one step was: its requests, the tokens of its forward pass, how many of those
    were prefill (a prompt's uncached part, or a resumed request's text again), and the pool
    slots its attention needed and read (padding included), in each layer."""

    num_requests: int
    num_tokens: int
    num_prefill_tokens: int
    num_slots_needed: int
    num_slots_read: int

    @classmethod
    def of(cls, plan: StepPlan, inputs: StepInputs) -> StepFigures:
        prefill = sum(s.end - s.start for s in plan.scheduled if s.is_prefill)
        return cls(len(plan.scheduled), plan.num_tokens, prefill, inputs.slots_needed, inputs.slots_read)


class BatchRunner:
    """Runs requests together over an engine's model and pool: one forward pass per step for
    all of them, planned by a Scheduler of its own.

    engine: what it runs on (engine.Engine): its model, tokenizer, stop_token_ids, allocator,
    kv (the PagedKVPool), and its two locks: lock, held for every step, and allocator_lock,
    held around the allocator's and the scheduler's bookkeeping only.
    """

    def __init__(self, engine, *, cascade_attention: bool = True, threads: ThreadChooser | None = None,
                 choose_threads: bool = True, step_budget: StepBudget | None = None, **scheduler_options) -> None:
        """cascade_attention: decodes that share a long prefix's blocks may attend over them
        once (shared_prefix_attention), where counted work says it pays (decode_groups);
        False: never. threads: the ThreadChooser to use (one that has measured
        already, as the Engine's), or None for a new one; choose_threads=False keeps torch's
        own thread count for every step. step_budget: picks each step's token budget from a
        target step time (step_budget.py), up to max_num_batched_tokens; None: the budget is
        max_num_batched_tokens every step. scheduler_options: Scheduler's max_num_seqs,
        max_num_batched_tokens and enable_chunked_prefill."""
        self.engine = engine
        self.cascade_attention = cascade_attention
        # On a GPU the CPU only launches kernels: nothing to choose there.
        cpu = engine.device.type == "cpu"
        self.threads = (threads or ThreadChooser()) if cpu and choose_threads else None
        self.step_budget = step_budget
        use_pool_attention(engine.model)
        self.scheduler = Scheduler(engine.allocator, **scheduler_options)
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
        builder = ReplyBuilder(reply, self.engine.tokenizer, self.engine.stop_token_ids, stop, params.max_tokens)
        state = _State(params, generator, builder, time.perf_counter())
        return Request(request_id, list(prompt_ids), cache_salt, params.max_tokens, payload=state)

    def step(self) -> list[Request]:
        """Schedule, run one forward pass, sample; returns the requests that finished (their
        blocks freed, their replies complete).

        Holds engine.lock for the step (so it never interleaves with another caller's steps)
        and engine.allocator_lock around the allocator's bookkeeping only. If it raises, the
        requests of last_plan (all of them, if that is None) are the ones it left half done."""
        engine, scheduler = self.engine, self.scheduler
        self.last_plan = None
        with engine.lock:
            with engine.allocator_lock:
                budget = None
                if self.step_budget is not None:
                    threads = self.thread_count(chosen=False)
                    budget = self.step_budget.tokens(scheduler.running, scheduler.waiting, threads)
                plan = self.last_plan = scheduler.schedule(budget)
                block_tables = {s.request.request_id: list(engine.allocator.block_tables[s.request.request_id])
                                for s in plan.scheduled}
            if not plan.scheduled:
                return []
            started = time.perf_counter()
            inputs = build_step(plan, engine.kv, block_tables, engine.device, self.cascade_attention)
            self.num_steps += 1
            self.last_step = StepFigures.of(plan, inputs)
            now = time.perf_counter()
            for s in plan.scheduled:
                if s.request.payload.admitted_at is None:  # its first admission: its hit is known
                    s.request.payload.admitted_at = now
                    s.request.payload.reply.cached_tokens = s.request.num_cached_tokens
            prefill = self.last_step.num_prefill_tokens > 0
            kind = (prefill, plan.num_tokens.bit_length())  # steps about as big are timed together
            with one_pass(self.threads, engine.device, kind, may_probe=not prefill), torch.inference_mode():
                logits = engine.model(
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
                with engine.allocator_lock:  # what snapshot() reads the learned costs under
                    self.step_budget.record(self.thread_count(chosen=True), plan, seconds)
            finished = [request for request, token in zip(sampling, tokens) if self._add_token(request, token)]
            with engine.allocator_lock:
                for request in finished:
                    scheduler.finish(request)
        end = time.perf_counter()
        for request in finished:
            self.close_reply(request, end)
        return finished

    def thread_count(self, chosen: bool):
        """What step costs are learned under: None on a GPU; on a CPU the thread count the
        next step will likely run with (chosen=False), or the one the latest ran with."""
        if self.engine.device.type != "cpu":
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
                    f"the KV pool is held by other requests of this engine ({self.engine.allocator.num_free_blocks} "
                    f"blocks free): use Engine(batching=True) to queue every caller's requests together"
                )
        return [r.payload.reply for r in requests]


# -----------------------------------------------------------------------------
# 2. The engine loop: calls from many threads, one forward pass per step for all of them
#
# It is supervised. A step that fails is the batch runner's business: its requests fail, the
# loop goes on. A failure anywhere else in the loop (or its thread dying) fails every request
# the scheduler held and the loop starts over, with the pool checked whole; if the pool cannot
# be put right, the loop stops for good (`failure`) and refuses every request at once. No
# caller waits forever: a caller looks at the loop whenever POLL_S passes without an event,
# and may give its request a deadline.

log = logging.getLogger("engine")
POLL_S = 0.5  # a caller that waited this long for an event checks that the loop is alive


def freeze_startup_heap() -> None:
    """Move every object alive now (the model, the tokenizer, the pool's bookkeeping) out of
    the garbage collector's sight, once per process. They are never garbage, yet every full
    collection walked them: in a process holding SmolLM2 that took about 150 ms, inside
    whichever step it fell in, a stall every stream saw. vLLM does the same after its warm-up
    (freeze_gc_heap in vllm/utils/gc_utils.py)."""
    if gc.get_freeze_count() == 0:
        gc.collect()  # garbage first: what is frozen is never collected
        gc.freeze()


class QueueFullError(RuntimeError):
    """More requests wait than the caller allows (submit's max_waiting): try again later."""


class EngineStoppedError(RuntimeError):
    """The engine loop takes no requests: it is shutting down, or it failed for good."""


class ClientGoneError(ConnectionError):
    """The request's caller left (its `gone` check said so) before the loop spent more on it."""


@dataclass(frozen=True)
class LoopSnapshot:
    """The engine loop at one moment (EngineLoop.snapshot), for a status page."""

    running: list[tuple[str, str | None]]  # (request id, cache_salt), in admission order
    waiting: list[tuple[str, str | None]]  # the same, in queue order: the head is admitted next
    prefilling: dict[str, tuple[int, int]]  # running requests part-way through their prompt: (computed, total)
    num_preemptions: int
    num_steps: int
    last_step: StepFigures | None
    num_restarts: int  # failures outside a step the loop recovered from
    failure: str | None  # why the loop stopped for good (it refuses every request), or None
    step_budget: dict | None = None  # the target step time and the costs learned (StepBudget.describe)


class EngineLoop:
    """A thread that owns the model and steps one BatchRunner while any request waits or runs:
    the engine's only scheduler, whoever calls.

    Callers (a server's request threads, generate_batch) submit requests and read each one's
    StreamEvents from a queue; a caller that gives up cancels, and the request's blocks are
    freed before the next step. A request may carry a `gone` check (its client hung up?): the
    loop asks it while the request waits and before each of its prefill steps, and drops the
    request when it says yes.
    """

    def __init__(self, engine, **options) -> None:
        self.engine = engine
        self.runner = BatchRunner(engine, **options)
        self._wake = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._cancelled: list[Request] = []
        self.live: dict[str, Request] = {}  # submitted and not finished, by request id
        self._thread: threading.Thread | None = None
        self._restarting = threading.Lock()  # one caller restarts a dead thread, not many
        self._stopping = False  # stop(): the thread ends after its step
        self._closed: str | None = None  # why submit refuses (shutting down, or failed for good)
        self.failure: BaseException | None = None  # what stopped the loop for good
        self.num_restarts = 0

    @property
    def scheduler(self):
        return self.runner.scheduler

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                    stop: tuple[str, ...] = (), gone: Callable[[], bool] | None = None) -> Request:
        request = self.runner.new_request(request_id, prompt_ids, params, cache_salt, stop)
        request.payload.events = queue.SimpleQueue()
        request.payload.gone = gone
        return request

    def submit(self, requests: list[Request], max_waiting: int | None = None) -> None:
        """Queue `requests` in this order, behind everything submitted before; all of them or,
        when one is refused, none. max_waiting: refuse them (QueueFullError) if more than this
        many requests would then wait for admission."""
        self.check_alive()
        ids = [r.request_id for r in requests]
        with self.engine.allocator_lock, self._wake:
            if self._closed:
                raise EngineStoppedError(self._closed)
            taken = sorted({i for i in ids if i in self.live or ids.count(i) > 1})
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already running; pick another id")
            waiting = len(self.scheduler.waiting) + len(self._inbox)
            if max_waiting is not None and waiting + len(requests) > max_waiting:
                raise QueueFullError(f"{waiting} requests are waiting already, the most allowed is {max_waiting}")
            for request in requests:
                self.live[request.request_id] = request
                self._inbox.append(request)
            if self._thread is None:
                freeze_startup_heap()
                self._start_thread()
                atexit.register(self.stop)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        with self._wake:
            self._cancelled.append(request)
            self._wake.notify()

    def events(self, request: Request, timeout: float | None = None):
        """The request's StreamEvents as they come; cancels it if the caller stops early.
        timeout: seconds the whole request may take, after which TimeoutError ends it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:
                    event = request.payload.events.get(timeout=POLL_S)
                except queue.Empty:
                    self.check_alive()
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"the request did not finish within {timeout:g} s; try a shorter one, "
                                           f"or again when fewer requests run") from None
                    continue
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if request.status != FINISHED:
                self.cancel(request)

    # --- the thread, and its supervision ---

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """The thread: serve until stopped; after a failure outside a step, start over."""
        while True:
            try:
                self._serve()
                return
            except Exception as err:
                log.exception("the engine loop failed outside a step; failing its requests and starting over")
                if not self._recover(err):
                    return

    def check_alive(self) -> None:
        """A caller's check (a dead thread sends no events): restart the loop's thread if it
        died; raise EngineStoppedError if the loop failed for good or has stopped."""
        with self._restarting:
            thread = self._thread
            if thread is not None and not thread.is_alive() and not self._stopping and self.failure is None:
                if self._recover(RuntimeError("the engine loop's thread died; its requests were lost")):
                    self._start_thread()
        if self.failure is not None or (self._stopping and thread is not None and not thread.is_alive()):
            raise EngineStoppedError(self._closed)

    def _recover(self, err: BaseException) -> bool:
        """After a failure outside a step: every request the loop had taken from its inbox
        (in the scheduler, or on its way there) ends with `err`, its blocks freed, and the
        pool must then be whole; requests still in the inbox go on. False (and the loop stops
        for good) when the pool cannot be put right."""
        scheduler, alloc = self.scheduler, self.engine.allocator
        try:
            with self.engine.allocator_lock:
                with self._wake:
                    queued = {id(request) for request in self._inbox}
                    lost = [request for request in self.live.values() if id(request) not in queued]
                for request in lost:
                    if request.status != FINISHED and (request in scheduler.running or request in scheduler.waiting):
                        scheduler.finish(request)
                    request.status = FINISHED
                if scheduler.running or scheduler.waiting or alloc.block_tables:
                    raise RuntimeError(f"after the failure, blocks are still held by {sorted(alloc.block_tables)}")
                alloc.check_invariants()
        except Exception as second:
            log.exception("the engine loop cannot start over: it refuses every request from now on")
            self._stop_for_good(second)
            return False
        self.num_restarts += 1
        for request in lost:
            self._end(request, err)
        return True

    def _stop_for_good(self, err: BaseException) -> None:
        with self._wake:
            self.failure, self._closed = err, f"the engine loop failed and could not be restarted: {err!r}"
            lost, self._inbox = list(self.live.values()), deque()
        for request in lost:
            self._end(request, EngineStoppedError(self._closed))

    def _serve(self) -> None:
        scheduler, engine = self.runner.scheduler, self.engine
        while True:
            with self._wake:
                while not (self._inbox or self._cancelled or scheduler.has_work() or self._stopping):
                    self._wake.wait()
                if self._stopping:
                    return
                inbox, self._inbox = list(self._inbox), deque()
                cancelled, self._cancelled = self._cancelled, []
            with engine.allocator_lock:
                for request in inbox:
                    scheduler.add(request)
                for request in cancelled:
                    if request.status != FINISHED:
                        scheduler.finish(request)
                        self._forget(request)
                departed = self._departed()
            for request in departed:
                self._end(request, ClientGoneError("the client hung up before its request was done"))
            try:
                finished = set(self.runner.step())
            except Exception as err:
                self._fail(err)
                continue
            for s in self.runner.last_plan.scheduled:
                if not s.samples:
                    continue  # a chunk of a prompt: nothing to tell its caller yet
                request, state = s.request, s.request.payload
                if request in finished:
                    self._forget(request)
                event = StreamEvent(request.output_ids[-1], state.new_text, state.reply.finish_reason, state.reply)
                state.events.put(event)

    def _departed(self) -> list[Request]:
        """Requests whose caller has gone, among those that wait or have prompt left to
        compute, finished here (under allocator_lock) before the next step spends on them."""
        scheduler = self.scheduler
        candidates = [*scheduler.waiting, *(r for r in scheduler.running if r.num_prefill_left)]
        departed = [r for r in candidates if r.payload.gone is not None and r.payload.gone()]
        for request in departed:
            scheduler.finish(request)
        return departed

    def _fail(self, err: Exception) -> None:
        """The step raised: every request in it (finished in it or not) ends with the error,
        its blocks freed; requests that were not in it go on."""
        scheduler, plan = self.runner.scheduler, self.runner.last_plan
        failed = [s.request for s in plan.scheduled] if plan else [*scheduler.running, *scheduler.waiting]
        with self.engine.allocator_lock:
            for request in failed:
                if request.status != FINISHED:
                    scheduler.finish(request)
        for request in failed:
            self._end(request, err)

    def _end(self, request: Request, err: BaseException) -> None:
        """The request's caller gets `err` instead of its next event."""
        self._forget(request)
        request.payload.events.put(err)

    def _forget(self, request: Request) -> None:
        with self._wake:
            self.live.pop(request.request_id, None)

    # --- shutting down ---

    def drain(self, grace: float) -> None:
        """A gentle shutdown: no new requests; waiting ones end now with EngineStoppedError;
        running ones get `grace` seconds to finish, then end with finish reason "abort" (their
        callers get a last event, as for any other ending); then the thread stops."""
        with self._wake:
            self._closed = "the server is shutting down; try again when it is back"
        deadline = time.monotonic() + grace
        while self._end_waiting() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.engine.lock:  # between two steps: none runs while the rest are cut short
            self._end_waiting()
            with self.engine.allocator_lock:
                running = list(self.scheduler.running)
                for request in running:
                    self.scheduler.finish(request)
        end = time.perf_counter()
        for request in running:
            state = request.payload
            text = state.builder.abort()
            self.runner.close_reply(request, end)
            self._forget(request)
            last_token = request.output_ids[-1] if request.output_ids else -1  # -1: cut before its first token
            state.events.put(StreamEvent(last_token, text, "abort", state.reply))
        self.stop()

    def _end_waiting(self) -> bool:
        """End every request that waits (preemption may add more) with EngineStoppedError;
        whether any request still runs."""
        with self.engine.allocator_lock, self._wake:
            waiting = [*self.scheduler.waiting, *self._inbox]
            for request in list(self.scheduler.waiting):
                self.scheduler.finish(request)
            for request in self._inbox:
                request.status = FINISHED  # it never reached the scheduler
            self._inbox = deque()
            running = bool(self.scheduler.running)
        for request in waiting:
            self._end(request, EngineStoppedError(self._closed))
        return running

    def stop(self) -> None:
        """Let the step that runs finish, then end the thread. Called at exit: a thread
        killed inside a forward pass aborts the whole process ("terminate called without an
        active exception"), since torch's C++ frames cannot be unwound under it."""
        with self._wake:
            self._stopping = True
            self._closed = self._closed or "the engine loop has stopped: the process is exiting"
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def snapshot(self) -> LoopSnapshot:
        """Who runs, who waits, and the steps so far, read without waiting for a forward pass:
        the scheduler's queues change only under engine.allocator_lock, which a step holds
        around its bookkeeping and never across the model."""
        with self.engine.allocator_lock, self._wake:
            scheduler, cancelled = self.scheduler, set(self._cancelled)
            waiting = [r for r in [*scheduler.waiting, *self._inbox] if r not in cancelled]
            return LoopSnapshot(
                running=[(r.request_id, r.cache_salt) for r in scheduler.running],
                waiting=[(r.request_id, r.cache_salt) for r in waiting],
                prefilling={r.request_id: (r.num_computed_tokens, r.num_computed_tokens + r.num_prefill_left)
                            for r in scheduler.running if r.num_prefill_left},
                num_preemptions=scheduler.num_preemptions,
                num_steps=self.runner.num_steps,
                last_step=self.runner.last_step,
                num_restarts=self.num_restarts,
                failure=None if self.failure is None else repr(self.failure),
                step_budget=None if self.runner.step_budget is None else self.runner.step_budget.describe(),
            )
