"""
The engine loop: a thread that steps one BatchRunner for callers in many threads.

Read engine/batch_engine.py first: the step (schedule, one forward pass, a token per request).
Every Engine (engine/llm_engine.py) submits every request here, whoever calls (generate, stream,
generate_batch, a server's clients), so one scheduler plans every step. Callers read each
request's StreamEvents from a queue; a loop that fails outside a step is dead (crash-only),
and a gentle shutdown drains it. After each change to its queues or the pool, the loop
publishes a snapshot of itself, which /health, /cache and the page read without a lock.

    1. the loop's pieces  POLL_S, freeze_startup_heap, the errors callers see, LoopSnapshot
    2. the engine loop    submit, events, cancel; the thread and its death; drain, stop;
                          publish, snapshot

References: vLLM v1 (vllm/v1/engine/core.py: EngineCoreProc.run_busy_loop takes new requests
from an input queue, then steps the scheduler and the model while any request is unfinished).
"""

from __future__ import annotations

import atexit
import gc
import logging
import queue
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import Callable

from engine.batch_engine import BatchRunner, StepFigures
from engine.one_request import EngineParts
from engine.request import FINISHED, Request, SamplingParams

# -----------------------------------------------------------------------------
# 1. The loop's pieces: its errors, its snapshot, the heap it freezes

log = logging.getLogger("engine")
POLL_S = 0.5  # a caller that waited this long for an event checks that the loop is alive


def freeze_startup_heap() -> None:
    """Move every object alive now (the model, the tokenizer, the pool's bookkeeping) out of
    the garbage collector's sight, once per process. They are never garbage, yet every full
    collection walked them, inside whichever step it fell in: a stall every stream saw
    (docs/measured.md has what it cost). vLLM does the same after its warm-up
    (freeze_gc_heap in vllm/utils/gc_utils.py)."""
    if gc.get_freeze_count() == 0:
        gc.collect()  # garbage first: what is frozen is never collected
        gc.freeze()


_LOOPS: weakref.WeakSet = weakref.WeakSet()  # every EngineLoop whose thread was started


def thaw_startup_heap() -> None:
    """Undo freeze_startup_heap after an engine closed: what was frozen may be garbage now,
    and a frozen object in a reference cycle is never collected. Unfrozen, the objects are
    the collector's again (the closed engine's pool is freed by its reference count at close,
    not by a collection). If another loop still serves, the heap is collected and frozen
    again at once, so nothing of the closed engine stays frozen; otherwise the next loop to
    start collects before it freezes, and a process that makes and closes engines one after
    another (a notebook, the tests) pays one full collection an engine, not two."""
    gc.unfreeze()
    if any(loop._thread.is_alive() for loop in list(_LOOPS)):
        gc.collect()
        gc.freeze()


class QueueFullError(RuntimeError):
    """More requests wait than the caller allows (submit's max_waiting): try again later."""


class EngineStoppedError(RuntimeError):
    """The engine loop takes no requests: it is shutting down, stopped, or dead (it failed)."""


class ClientGoneError(ConnectionError):
    """The request's caller left (its `gone` check said so) before the loop spent more on it."""


@dataclass(frozen=True)
class LoopSnapshot:
    """The engine loop and its pool at one moment, published whole by the loop
    (EngineLoop.publish) and never changed after: a status page reads it without a lock.

    The queues and the pool are as the loop's latest bookkeeping left them (while a step
    runs: as that step planned them); last_step and step_budget are the latest step's that
    ended, so a slow prefill shows the one before it."""

    running: list[tuple[str, str | None]]  # (request id, cache_salt), in admission order
    waiting: list[tuple[str, str | None]]  # the same, in queue order: the head is admitted next
    prefilling: dict[str, tuple[int, int]]  # running requests part-way through their prompt: (computed, total)
    num_preemptions: int
    num_steps: int
    last_step: StepFigures | None
    step_budget: dict | None  # the target step time and the costs learned (StepBudget.describe)
    served: dict  # tenant -> tokens computed for it (its fair-share counter), tenants with work or ahead
    least_served: int | None  # the least-served tenant with work's count (None: nobody has work)
    failure: str | None  # what killed the loop (it refuses every request), or None
    # The pool, read in the same hold of allocator_lock as the queues above.
    num_free_blocks: int
    num_cached_blocks: int
    blocks_in_use: int
    running_requests: int  # requests that hold blocks (the allocator's block tables)
    cache_stats: dict  # the allocator's hit counters (CacheStats.as_dict)
    cuda_graphs: dict | None  # the decode step's graphs (ModelRunner.graph_figures); None: none run (a CPU)


# -----------------------------------------------------------------------------
# 2. The engine loop: calls from many threads, one forward pass per step for all of them
#
# Crash-only. A step that fails is the batch runner's business: its requests fail, the loop
# goes on. A failure anywhere else in the loop (or its thread dying) kills it: every request it
# holds, and every later one, gets EngineStoppedError with the cause (`failure`), until the
# engine is closed and made again; nothing restarts it (vLLM's EngineDeadError,
# vllm/v1/engine/exceptions.py). No caller waits forever: a caller looks at the loop whenever
# POLL_S passes without an event, and may give its request a deadline.


class EngineLoop:
    """A thread that owns the model and steps one BatchRunner while any request waits or runs:
    the engine's only scheduler, whoever calls.

    Callers (a server's request threads, generate_batch) submit requests and read each one's
    StreamEvents from a queue; a caller that gives up cancels, and the request's blocks are
    freed before the next step. A request may come with a `gone` check (its client hung up?),
    which the loop keeps beside it and asks while the request waits and before each of its
    prefill steps: yes drops the request; a check that raises ends that request alone.
    """

    def __init__(self, parts: EngineParts, **options) -> None:
        """parts: what the loop's BatchRunner runs on; options: BatchRunner's."""
        self.runner = BatchRunner(parts, **options)
        self._wake = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._cancelled: list[Request] = []
        self.live: dict[str, Request] = {}  # submitted and not finished, by request id
        # Each request's caller's hang-up check, asked while it waits or prefills (none: never asked).
        self._gone: weakref.WeakKeyDictionary[Request, Callable[[], bool]] = weakref.WeakKeyDictionary()
        self._thread: threading.Thread | None = None
        self._stopping = False  # stop(): the thread ends after its step
        self._closed: str | None = None  # why submit refuses (shutting down, stopped, or dead)
        self.failure: BaseException | None = None  # what killed the loop (it refuses every request), or None
        self._published: LoopSnapshot | None = None  # replaced whole by publish, read by snapshot
        # Each step publishes before its events go out. A weak reference: the runner never
        # keeps its loop alive, so a dropped engine's loop goes without waiting for a collection.
        publish = weakref.WeakMethod(self.publish)
        self.runner.on_bookkept = lambda step_ended: publish()(step_ended)
        self.publish(step_ended=True)

    @property
    def parts(self) -> EngineParts:
        return self.runner.parts

    @parts.setter
    def parts(self, parts: EngineParts) -> None:
        """Other parts for the steps to come (the Engine's parts setter): its runner's and
        its model runner's, replaced together."""
        self.runner.parts = self.runner.model_runner.parts = parts
        self.publish()  # their pool's figures

    @property
    def scheduler(self):
        return self.runner.scheduler

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                    gone: Callable[[], bool] | None = None, tenant: str | None = None) -> Request:
        """A Request whose events come to its caller through a queue of its own."""
        request = self.runner.new_request(request_id, prompt_ids, params, cache_salt, events=queue.SimpleQueue(),
                                          tenant=tenant)
        if gone is not None:
            with self._wake:
                self._gone[request] = gone
        return request

    def submit(self, requests: list[Request], max_waiting: int | None = None) -> None:
        """Queue `requests` in this order, behind everything submitted before; all of them or,
        when one is refused, none. max_waiting: refuse them (QueueFullError) if more than this
        many requests would then wait for admission."""
        self.check_alive()
        ids = [r.request_id for r in requests]
        repeated = sorted(i for i, n in Counter(ids).items() if n > 1)  # outside the locks: linear in the requests
        with self.parts.allocator_lock, self._wake:
            if self._closed:
                raise EngineStoppedError(self._closed)
            taken = sorted({*repeated, *(i for i in ids if i in self.live)})
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already running; pick another id")
            waiting = len(self.scheduler.waiting) + len(self._inbox)
            if max_waiting is not None and waiting + len(requests) > max_waiting:
                raise QueueFullError(f"{waiting} requests are waiting already, the most allowed is {max_waiting}")
            for request in requests:
                self.live[request.request_id] = request
                self._inbox.append(request)
            self.publish()  # waiting at once, even while the loop is inside a step
            if self._thread is None:
                freeze_startup_heap()
                self._start_thread()
                # At exit, by a weak reference: nothing here keeps a dropped engine's loop alive.
                atexit.register(_stop_at_exit, weakref.ref(self))
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        with self._wake:
            self._cancelled.append(request)
            # No longer shown waiting: replaced under _wake, which every publish holds too (and
            # reads _cancelled under), so none undoes it; a caller that gives up never waits
            # for allocator_lock.
            shown = self._published
            self._published = replace(shown, waiting=[w for w in shown.waiting if w[0] != request.request_id])
            self._wake.notify()

    def events(self, request: Request, timeout: float | None = None):
        """The request's StreamEvents as they come; cancels it if the caller stops early.
        timeout: seconds the whole request may take, after which TimeoutError ends it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:
                    event = request.events.get(timeout=POLL_S)
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

    @property
    def started(self) -> bool:
        """Whether its thread was started (at the first submit): only then was the heap frozen."""
        return self._thread is not None

    def _start_thread(self) -> None:
        # Started before it is published: a caller's check_alive must never see a thread that
        # has not started yet and take it for one that died.
        thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        thread.start()
        self._thread = thread
        _LOOPS.add(self)

    def _run(self) -> None:
        """The thread: serve until stopped. A failure outside a step is the engine's death:
        crash-only, as vLLM's EngineDeadError, no restart to reason about."""
        try:
            self._serve()
        except Exception as err:
            log.exception("the engine loop failed outside a step; the engine takes no more requests")
            self._die(err)

    def check_alive(self) -> None:
        """A caller's check (a dead thread sends no events): raise EngineStoppedError if the
        loop died (its thread too: marked dead here, once) or has stopped."""
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stopping and self.failure is None:
            self._die(RuntimeError("the engine loop's thread died"))
        if self.failure is not None or (self._stopping and thread is not None and not thread.is_alive()):
            raise EngineStoppedError(self._closed)

    def _die(self, err: BaseException) -> None:
        """The loop is dead, with its cause: every request it holds and every later one gets
        EngineStoppedError saying so, until the engine is closed and made again."""
        with self.parts.allocator_lock, self._wake:
            if self.failure is not None:
                return
            self.failure = err
            self._closed = (f"the engine failed ({err!r}) and takes no more requests; close it and make a new one "
                            "(a server: restart it)")
            lost, self._inbox = list(self.live.values()), deque()
            self.publish()
        for request in lost:
            self._end(request, EngineStoppedError(self._closed))

    def _serve(self) -> None:
        scheduler, parts = self.runner.scheduler, self.parts
        while True:
            with self._wake:
                while not (self._inbox or self._cancelled or scheduler.has_work() or self._stopping):
                    self._wake.wait()
                if self._stopping:
                    return
            with parts.allocator_lock:
                with self._wake:  # taken out and added in one hold: a publish meanwhile shows them waiting
                    inbox, self._inbox = list(self._inbox), deque()
                    cancelled, self._cancelled = self._cancelled, []
                for request in inbox:
                    scheduler.add(request)
                for request in cancelled:
                    if request.status != FINISHED:
                        scheduler.finish(request)
                        self._forget(request)
                departed = self._departed()
                if inbox or cancelled or departed:
                    self.publish()
            for request, err in departed:
                self._end(request, err)
            try:
                self.runner.step()  # sends each sampled token's event, and a failed request's error
            except Exception as err:
                self._fail(err)
                continue
            for s in self.runner.last_plan.scheduled:
                if s.request.status == FINISHED:
                    self._forget(s.request)

    def _departed(self) -> list[tuple[Request, BaseException]]:
        """Requests whose caller has gone, among those that wait or have prompt left to
        compute, finished here (under allocator_lock) before the next step spends on them,
        with what their callers get: ClientGoneError, or the error their check raised
        (a check that fails ends its own request only)."""
        scheduler, departed = self.scheduler, []
        for request in [*scheduler.waiting, *(r for r in scheduler.running if r.num_prefill_left)]:
            gone = self._gone.get(request)
            if gone is None:
                continue
            try:
                if gone():
                    departed.append((request, ClientGoneError("the client hung up before its request was done")))
            except Exception as err:
                departed.append((request, err))
        for request, _ in departed:
            scheduler.finish(request)
        return departed

    def _fail(self, err: Exception) -> None:
        """The step raised: every request in it (finished in it or not) ends with the error,
        its blocks freed; requests that were not in it go on."""
        scheduler, plan = self.runner.scheduler, self.runner.last_plan
        failed = [s.request for s in plan.scheduled] if plan else [*scheduler.running, *scheduler.waiting]
        with self.parts.allocator_lock:
            for request in failed:
                if request.status != FINISHED:
                    scheduler.finish(request)
            self.publish(step_ended=True)
        for request in failed:
            self._end(request, err)

    def _end(self, request: Request, err: BaseException) -> None:
        """The request's caller gets `err` instead of its next event."""
        self._forget(request)
        request.events.put(err)

    def _forget(self, request: Request) -> None:
        with self._wake:
            self.live.pop(request.request_id, None)
            self._gone.pop(request, None)

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
        with self.parts.lock:  # between two steps: none runs while the rest are cut short
            self._end_waiting()
            with self.parts.allocator_lock:
                running = list(self.scheduler.running)
                for request in running:
                    self.scheduler.finish(request)
                self.publish()
        end = time.perf_counter()
        for request in running:
            text = request.builder.abort()
            self.runner.close_reply(request, end)
            self._forget(request)
            last_token = request.output_ids[-1] if request.output_ids else -1  # -1: cut before its first token
            request.events.put(request.reply.event(last_token, text))
        self.stop()

    def _end_waiting(self) -> bool:
        """End every request that waits (preemption may add more) with EngineStoppedError;
        whether any request still runs."""
        with self.parts.allocator_lock, self._wake:
            waiting = [*self.scheduler.waiting, *self._inbox]
            for request in list(self.scheduler.waiting):
                self.scheduler.finish(request)
            for request in self._inbox:
                request.status = FINISHED  # it never reached the scheduler
            self._inbox = deque()
            running = bool(self.scheduler.running)
            self.publish()
        for request in waiting:
            self._end(request, EngineStoppedError(self._closed))
        return running

    def stop(self) -> None:
        """Let the step that runs finish, then end the thread. Called at exit: a thread
        killed inside a forward pass aborts the whole process ("terminate called without an
        active exception"), since torch's C++ frames cannot be unwound under it."""
        with self._wake:
            self._stopping = True
            self._closed = self._closed or ("the engine loop has stopped: its engine was closed, or the process "
                                            "is exiting")
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # --- its snapshot: published by the loop, read without a lock ---

    def publish(self, step_ended: bool = False) -> None:
        """Replace the published snapshot with the loop as it stands: called by whatever just
        changed its queues or the pool (a step's bookkeeping, through the runner's
        on_bookkept; submit, charge, Engine.reset_prefix_cache), in the same hold of
        allocator_lock, so a caller that got its last event reads its request gone and its
        blocks back. step_ended: take the latest step's figures too (last_step,
        step_budget); else they stay the last published. Linear in the requests, but for
        the allocator's num_cached_blocks, which counts over the blocks."""
        scheduler, alloc = self.scheduler, self.parts.allocator
        with self.parts.allocator_lock, self._wake:  # the inbox and the cancellations are under _wake
            cancelled = set(self._cancelled)
            waiting = [r for r in [*scheduler.waiting, *self._inbox] if r not in cancelled]
            last = self._published
            self._published = LoopSnapshot(
                running=[(r.request_id, r.cache_salt) for r in scheduler.running],
                waiting=[(r.request_id, r.cache_salt) for r in waiting],
                prefilling={r.request_id: (r.num_computed_tokens, r.num_computed_tokens + r.num_prefill_left)
                            for r in scheduler.running if r.num_prefill_left},
                num_preemptions=scheduler.num_preemptions,
                num_steps=self.runner.num_steps,
                last_step=self.runner.last_step if step_ended else last.last_step,
                step_budget=self.runner.budget.describe() if step_ended else last.step_budget,
                served=dict(scheduler.served),
                least_served=scheduler.least_served(),
                failure=None if self.failure is None else repr(self.failure),
                num_free_blocks=alloc.num_free_blocks,
                num_cached_blocks=alloc.num_cached_blocks,
                blocks_in_use=alloc.num_blocks_in_use,
                running_requests=len(alloc.block_tables),
                cache_stats=alloc.stats.as_dict(),
                cuda_graphs=self.runner.model_runner.graph_figures(),
            )

    def snapshot(self) -> LoopSnapshot:
        """Who runs, who waits, the steps so far and the pool, as the loop last published
        them. No lock: the snapshot is replaced whole, never changed, so a status page never
        waits for a step or for the loop."""
        return self._published

    def charge(self, tenant: str | None, num_tokens: int) -> None:
        """Count work done for a tenant outside a step (a prompt tokenized, then refused)
        against its fair share (Scheduler.charge)."""
        with self.parts.allocator_lock:
            self.scheduler.charge(tenant, num_tokens)
            self.publish()


def _stop_at_exit(loop_ref: weakref.ref) -> None:
    """Stop a loop still alive at exit (a weak reference: a dropped engine's loop is gone)."""
    loop = loop_ref()
    if loop is not None:
        loop.stop()
