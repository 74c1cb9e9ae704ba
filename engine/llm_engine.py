"""
The engine: a Hugging Face model served with automatic prefix caching, the front of its one
engine loop.

Read allocator/prefix_caching.py (the allocator) first. The files under this one, each with one role,
are listed in the README's reading-order table ("The code, in reading order"): the pool, the
one finisher of reply text, a request (engine/request.py), the sampler, the thread policy, stage 7's
one-request path (and EngineParts, what it and the loop are handed instead of the Engine),
and stage 8's scheduler, budget policies, attention, model runner, batch runner and loop.

This file builds the model, the allocator and the pool (bundled once as EngineParts) from
one EngineConfig, checks what callers send (the prompt, the SamplingParams, the salt, the
request id) once, before any work, and submits the request to the engine loop (stage 8's
scheduler, budget and batch runner), which trusts it. Every caller's request runs there:
generate, stream, generate_batch, the server, the benches. Stage 7's path (engine/one_request.py's
run_request) is the lesson's and the demo's, called by name over an Engine's parts, not a
mode of the Engine. Nothing under this file imports it.

    EngineConfig       every option but the model, checked when made
    Engine             Engine(...), tokenize, generate, stream, generate_batch, snapshot,
                       reset_prefix_cache, close (and `with Engine(...) as engine:`)

A prompt is checked and tokenized by engine/prompts.py; the flags that make an Engine from a
command line are commands/model_flags.py's.

References: vLLM v1 (vllm/v1/engine/llm_engine.py and core.py: an EngineCore composing a
Scheduler and a model executor, with an output processor beside it); nano-vllm
(nanovllm/engine/llm_engine.py at commit bb823b3 of its main branch: LLMEngine composes Scheduler and
ModelRunner, and its step is schedule, run, postprocess).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import threading
import time
import weakref
from dataclasses import dataclass, fields, replace
from types import SimpleNamespace
from typing import Callable, Iterator, Sequence

import torch

from allocator import HASH_ALGOS, PrefixCachingAllocator, check_cache_salt, check_text
from engine.batch_attention import build_step, pool_attention
from engine.cpu_threads import ThreadChooser, in_own_thread, one_pass, synchronize
from engine.engine_loop import (
    ClientGoneError, EngineLoop, EngineStoppedError, LoopSnapshot, QueueFullError, thaw_startup_heap,
)
from engine.fixed_past import FixedBuffers
from engine.kv_pool import PagedKVPool
from engine.model_loader import load_model
from engine.model_runner import ModelRunner
from engine.one_request import EngineParts, forward, gather
from engine.outputs import Generation, StreamEvent
from engine.prompts import tokenize_prompts
from engine.request import FINISHED, Request, SamplingParams
from engine.sampling import sample, sample_batch
from engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, ScheduledRequest, StepPlan, check_step_size, keys_attended
from engine.step_budget import CALIBRATION_TOKENS, DEFAULT_TARGET_STEP_MS, ModelShape, StepBudget

log = logging.getLogger("engine")

# -----------------------------------------------------------------------------
# The Engine and its configuration

DEFAULT_KV_MEMORY_GB = 0.5  # the pool's size when neither num_blocks nor kv_memory_gb is given
# The steps whose attention an engine times when made (_timed_attention): a chunk of ATTENTION_CHUNK
# tokens after a context of ATTENTION_CONTEXT, and ATTENTION_DECODES decodes of half as long a one
ATTENTION_CHUNK, ATTENTION_CONTEXT, ATTENTION_DECODES = 64, 2048, 8
DEFAULT_MAX_NUM_SEQS = 64  # batching: requests in one step at most (vLLM's --max-num-seqs)


@dataclass(frozen=True)
class EngineConfig:
    """Every option of an Engine but its model, checked once when made (ValueError).

    The pool: block_size, and num_blocks or kv_memory_gb (DEFAULT_KV_MEMORY_GB GiB when
    neither is given); enable_caching, hash_algo, free_uncached_first (the allocator's).
    Every caller's requests run in one engine loop (engine/engine_loop.py). A step: max_num_seqs
    requests at most, and a token budget that is max_num_batched_tokens every step when it
    is given (vLLM's meaning), or else as many tokens as fit in target_step_ms (engine/step_budget.py,
    DEFAULT_TARGET_STEP_MS unless given), at most DEFAULT_MAX_NUM_BATCHED_TOKENS.
    enable_chunked_prefill, cascade_attention (decodes sharing a long prefix read it once,
    where it pays), choose_threads (False keeps torch's thread count on a CPU), fair_share
    (the waiting queue read least-served tenant first, and a tenant far ahead held to a
    smaller share of a step: engine/scheduler.py and engine/step_budget.py; False: arrival order),
    static_decode (a step that only decodes, and one with a prompt's chunk of at most 512
    tokens in all, runs padded to fixed shapes, replayed as a CUDA graph on a GPU:
    engine/model_runner.py, and stage 7's requests run over fixed buffers,
    their passes replayed the same way: engine/fixed_past.py; None: on a GPU only; True on a
    CPU runs them eagerly).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_gb: float | None = None
    enable_caching: bool = True
    hash_algo: str = "sha256"
    free_uncached_first: bool = False
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    target_step_ms: float | None = None
    enable_chunked_prefill: bool = True
    cascade_attention: bool = True
    choose_threads: bool = True
    fair_share: bool = True
    static_decode: bool | None = None

    def __post_init__(self):
        for name in ("enable_caching", "free_uncached_first", "enable_chunked_prefill",
                     "cascade_attention", "choose_threads", "fair_share"):
            if not isinstance(getattr(self, name), bool):  # a string such as 'False' is truthy
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r:.40}")
        if self.static_decode is not None and not isinstance(self.static_decode, bool):
            raise ValueError(f"static_decode must be True, False or None, got {self.static_decode!r:.40}")
        for name in ("block_size", "num_blocks", "max_num_batched_tokens"):
            value = getattr(self, name)
            if (value is not None or name == "block_size") and not is_count(value):
                raise ValueError(f"{name} must be an int >= 1{'' if name == 'block_size' else ' or None'}, "
                                 f"got {value!r:.40}")
        memory = self.kv_memory_gb
        if memory is not None and not (is_number(memory) and 0 < memory < math.inf):
            raise ValueError(f"kv_memory_gb must be a number of GiB above 0, got {memory!r:.40}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r:.40}")
        if self.num_blocks is not None and self.kv_memory_gb is not None:
            raise ValueError("size the pool by num_blocks or by kv_memory_gb, not both")
        if self.max_num_batched_tokens is not None and self.target_step_ms is not None:
            raise ValueError("give max_num_batched_tokens (the same budget every step) or target_step_ms (a budget "
                             "from a step time), not both")
        target = self.target_step_ms
        if target is not None and not (is_number(target) and 0 < target < math.inf):
            raise ValueError(f"target_step_ms must be a number of milliseconds above 0, got {target!r:.40}")
        check_step_size(self.max_num_seqs, self.token_cap)

    @property
    def token_cap(self) -> int:
        """The most tokens a batched step computes."""
        return DEFAULT_MAX_NUM_BATCHED_TOKENS if self.max_num_batched_tokens is None else self.max_num_batched_tokens

    @property
    def step_target_ms(self) -> float | None:
        """The target step time the budget comes from; None: the budget is fixed."""
        if self.max_num_batched_tokens is not None:
            return None
        return DEFAULT_TARGET_STEP_MS if self.target_step_ms is None else self.target_step_ms

    @property
    def scheduler_options(self) -> dict:
        return {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.token_cap,
                "enable_chunked_prefill": self.enable_chunked_prefill, "fair_share": self.fair_share}


CONFIG_FIELDS = tuple(f.name for f in fields(EngineConfig))


def is_number(value) -> bool:
    """An int or a float, not a bool (True is an int to Python, not a size)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_count(value) -> bool:
    """A whole number >= 1, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def sampling_params(params: SamplingParams | None, sampling: dict) -> SamplingParams:
    """One SamplingParams from params= or from its fields as keywords (max_tokens=8, ...)."""
    if params is None:
        unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
        if unknown:
            raise TypeError(f"unknown argument {unknown[0]!r}; a request's sampling takes {', '.join(SAMPLING_FIELDS)}")
        return SamplingParams(**sampling)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if sampling:
        raise ValueError(f"give params= or its fields ({', '.join(sorted(sampling))}), not both")
    return params


def checked_salt(cache_salt) -> str | None:
    """cache_salt checked at the front (ValueError): None, or a short printable str."""
    try:
        cache_salt = check_cache_salt(cache_salt)
    except TypeError as err:
        raise ValueError(str(err)) from None
    return None if cache_salt is None else check_text(cache_salt, "cache_salt")


class EngineClosedError(RuntimeError):
    """The Engine was closed: its pool, model and thread are given back. Make a new one."""


class Engine:
    """A Hugging Face causal LM served with automatic prefix caching.

        engine = Engine()                        # the offline default, SmolLM2-135M-Instruct
        engine = Engine("HuggingFaceTB/SmolLM2-360M-Instruct", device="cuda")
        engine = Engine(model=model, tokenizer=tokenizer, num_blocks=64)   # objects you already have
        with Engine() as engine: ...                                     # closed at the end

    Options are EngineConfig's, as keywords or as config=EngineConfig(...) (engine.config).
    engine.model, engine.tokenizer, engine.allocator (the block bookkeeping) and engine.kv
    (the K/V memory its block ids point into). engine.parts bundles them with the locks and
    the stop tokens (one_request.EngineParts): what every runner of the engine is handed,
    and what those attributes read.

    stream, generate and generate_batch submit to one engine loop (engine/engine_loop.py), in a
    thread started by the first request, that runs every caller's requests in the same
    forward passes, each layer's attention copying every request's context out of the pool
    by its block table (engine/batch_engine.py says how much); a busy pool makes requests wait
    instead of refusing them. Stage 7's one request at a time, its cached prefix gathered
    into a DynamicCache, is one_request.generate(engine.parts, ...): what the lesson and the
    demo run. A request's sampling is one SamplingParams, given as params= or as its fields
    (max_tokens=32, temperature=0.7, stop=["\n"], ...).

    Every argument is checked here, at the front, before any work; the layers under it
    trust what it hands them.

    close() (or the end of a `with` block, or dropping the last reference) stops the loop's
    thread and lets the pool and the model go: nothing else keeps a dropped Engine alive.

    Two locks. engine.lock is held for every step (the loop's, or one of stage 7's); hold it
    yourself to read the pool between two steps.
    engine.allocator_lock is held only around the allocator's bookkeeping, microseconds at a
    time and never across a forward pass: hold it to read the allocator while a step runs.
    """
    def __init__(self, model_name_or_path: str | None = None, *, model=None, tokenizer=None, device=None, dtype=None,
                 config: EngineConfig | None = None, **options):
        if "batching" in options:
            raise TypeError("batching is not an option: every Engine runs its callers' requests in one engine loop "
                            "(engine/engine_loop.py); stage 7's one request at a time is one_request.generate(engine.parts, "
                            "...)")
        unknown = sorted(set(options) - set(CONFIG_FIELDS))
        if unknown:
            raise TypeError(f"unknown option {unknown[0]!r}; an Engine takes {', '.join(CONFIG_FIELDS)}")
        config = EngineConfig(**options) if config is None else replace(config, **options)
        if model is None and tokenizer is None:
            model, tokenizer = in_own_thread(load_model, model_name_or_path, device=device, dtype=dtype)
        elif model is None or tokenizer is None:
            raise ValueError("pass both model= and tokenizer=, or neither (to load model_name_or_path)")
        elif model_name_or_path is not None or device is not None or dtype is not None:
            raise ValueError(
                "model= is already loaded: move and cast it yourself (model.to(device, dtype)) "
                "instead of passing model_name_or_path, device or dtype"
            )
        self.config = config
        device, self.dtype = model.device, model.dtype
        shape = PagedKVPool.shape_from_config(model.config)
        num_blocks = config.num_blocks
        if num_blocks is None:
            per_block = PagedKVPool.bytes_per_block(**shape, block_size=config.block_size, dtype=self.dtype)
            budget = DEFAULT_KV_MEMORY_GB if config.kv_memory_gb is None else config.kv_memory_gb
            num_blocks = int(budget * 2**30 // per_block)  # the allocator's; the pool's scratch block is one more
            if num_blocks < 1:
                raise ValueError(f"kv_memory_gb={budget} is less than one block ({per_block:,} bytes)")
        allocator = PrefixCachingAllocator(num_blocks, config.block_size, hash_algo=config.hash_algo,
                                           enable_caching=config.enable_caching,
                                           free_uncached_first=config.free_uncached_first)
        # The engine's own tensor work (loading, the pool's zeros, calibration, warm-up) runs on threads that
        # end with it: none leaves an OpenMP pool beside the loop's (cpu_threads.in_own_thread says why).
        kv = in_own_thread(PagedKVPool, **shape, num_blocks=num_blocks, block_size=config.block_size, dtype=self.dtype,
                           device=device)

        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        stop_token_ids = frozenset({eos} if isinstance(eos, int) else eos or ())
        self.max_model_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self._request_counter = itertools.count()
        target = config.step_target_ms  # None: the budget is max_num_batched_tokens every step
        shape = ModelShape.of(model)
        self.step_budget = None if target is None else StepBudget(shape, target, config.token_cap)
        self._key_cost = shape.key_cost  # fair share charges a tenant each key its tokens attend to
        # Every forward pass on a CPU picks its thread count by measuring (cpu_threads.ThreadChooser):
        # one request's, and each batched step's. choose_threads=False keeps torch's.
        threads = ThreadChooser() if config.choose_threads else None
        # One lock around every step that touches the pool or the model, so several streams
        # (a server's clients) interleave their steps token by token. Reentrant: a caller that
        # holds it can still close() a stream, whose cleanup takes it again.
        # Stage 7's request over buffers allocated once where the decode step is padded too (on a GPU,
        # where both are replayed as CUDA graphs; forced on a CPU, eagerly): engine/fixed_past.py.
        fixed = None
        if config.static_decode or (config.static_decode is None and device.type == "cuda"):
            max_len = min(self.max_model_len or num_blocks * config.block_size, num_blocks * config.block_size)
            fixed = FixedBuffers(model, kv, max_len, graphs=device.type == "cuda")  # its tensors: the first request's
        self._parts: EngineParts | None = EngineParts(model, tokenizer, stop_token_ids, allocator, kv, device,
                                                      lock=threading.RLock(), allocator_lock=threading.RLock(),
                                                      threads=threads, fixed=fixed)
        # The engine's one scheduler, in a thread started by the first request.
        self.loop = EngineLoop(self.parts, **self._runner_options())
        if self.step_budget is not None:
            passes, attention = in_own_thread(self._timed_passes)
            self.step_budget.calibrate(self.loop.runner.thread_count(chosen=False), passes, attention)
            self.loop.publish(step_ended=True)  # the costs calibrated: /health shows them before any step
        # Stops the loop's thread when the engine is closed or dropped; holds the loop, never the engine.
        self._finalizer = weakref.finalize(self, _close_loop, self.loop)

    def _runner_options(self) -> dict:
        """The engine loop's BatchRunner options, from the config."""
        return {"cascade_attention": self.config.cascade_attention, "threads": self.threads,
                "choose_threads": self.config.choose_threads, "step_budget": self.step_budget,
                "static_decode": self.config.static_decode, "key_cost": self._key_cost,
                **self.config.scheduler_options}

    # --- the configuration, read from self.config ---------------------------------------------

    @property
    def scheduler_options(self) -> dict:
        """max_num_seqs, max_num_batched_tokens and enable_chunked_prefill of a batched step."""
        return self.config.scheduler_options

    @property
    def target_step_ms(self) -> float | None:
        """The step time a batched step's budget comes from; None: max_num_batched_tokens every step."""
        return self.config.step_target_ms

    @property
    def cascade_attention(self) -> bool:
        return self.config.cascade_attention

    # --- the parts: read from self.parts, so the engine and its loop never disagree ------------
    # To run on other parts (other stop tokens, another lock), replace the bundle between
    # requests: engine.parts = dataclasses.replace(engine.parts, stop_token_ids=...). The
    # engine loop takes them for its next step; a runner made before keeps what it was given.

    @property
    def parts(self) -> EngineParts:
        if self._parts is None:
            raise EngineClosedError("this Engine was closed (its pool and model are given back); make a new one")
        return self._parts

    @parts.setter
    def parts(self, parts: EngineParts) -> None:
        self._parts = self.loop.parts = parts

    @property
    def model(self):
        return self.parts.model

    @property
    def tokenizer(self):
        return self.parts.tokenizer

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.parts.stop_token_ids

    @property
    def allocator(self) -> PrefixCachingAllocator:
        return self.parts.allocator

    @property
    def kv(self) -> PagedKVPool:
        return self.parts.kv

    @property
    def device(self) -> torch.device:
        return self.parts.device

    @property
    def lock(self) -> threading.RLock:
        return self.parts.lock

    @property
    def allocator_lock(self) -> threading.RLock:
        return self.parts.allocator_lock

    @property
    def threads(self) -> ThreadChooser | None:
        return self.parts.threads

    # --- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine loop's thread (after the step it runs) and let go of the pool and
        the model: a closed engine refuses every call with EngineClosedError. Idempotent."""
        self._finalizer()
        self._parts, self.loop = None, None

    @property
    def closed(self) -> bool:
        return self._parts is None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- prompts -----------------------------------------------------------------------------

    def tokenize(self, prompt) -> list[int]:
        """Token ids of a prompt: a str (tokenized as is), a list of chat messages
        ({"role", "content"}: the chat template with the assistant's turn opened), or a list
        of token ids (used as they are)."""
        (ids,) = tokenize_prompts(self.tokenizer, [prompt], self.vocab_size)
        return ids

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse early a request that could never run to max_tokens, however empty the pool."""
        # The last sampled token is never fed back, so the reply needs max_tokens - 1 slots.
        needed = num_prompt_tokens + max_tokens - 1
        if self.max_model_len is not None and needed >= self.max_model_len:
            raise ValueError(
                f"{num_prompt_tokens} prompt tokens + max_tokens={max_tokens} exceed the model's "
                f"context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )
        capacity = self.allocator.num_blocks * self.allocator.block_size
        if needed > capacity:
            raise ValueError(
                f"{num_prompt_tokens} prompt tokens + max_tokens={max_tokens} need {needed} slots but the "
                f"whole KV pool has {capacity} ({self.allocator.num_blocks} blocks of "
                f"{self.allocator.block_size}); lower max_tokens or give more blocks (num_blocks / --num-blocks)"
            )

    # --- running a request ---------------------------------------------------------------

    def generate(self, prompt, params: SamplingParams | None = None, *, cache_salt: str | None = None,
                 request_id: str | None = None, **sampling) -> Generation:
        """Run one request to the end and return its Generation (see stream for the arguments)."""
        for event in self.stream(prompt, params, cache_salt=cache_salt, request_id=request_id, **sampling):
            pass
        return event.generation

    def generate_batch(self, prompts: Sequence, params: SamplingParams | None = None, *,
                       cache_salt: str | None = None, max_num_seqs: int | None = None,
                       max_num_batched_tokens: int | None = None, **sampling) -> list[Generation]:
        """Run many requests together, one forward pass per step for all of them (continuous
        batching on the paged pool: engine/batch_engine.py); their Generations, in the order given.

        Every prompt is checked before any runs. They join the engine loop's queue, behind
        every request submitted before them, and share its steps with every other caller;
        requests that do not all fit in the pool at once wait, or are preempted and resumed,
        instead of being refused. max_num_seqs and max_num_batched_tokens are the engine's
        settings: giving other values is an error.
        """
        params, cache_salt = sampling_params(params, sampling), checked_salt(cache_salt)
        given = {name: value for name, value in [("max_num_seqs", max_num_seqs),
                                                 ("max_num_batched_tokens", max_num_batched_tokens)]
                 if value is not None}
        for name, value in given.items():
            fixed = name != "max_num_batched_tokens" or self.target_step_ms is None
            if value != self.scheduler_options[name] or not fixed:
                raise ValueError(
                    f"{name}={value!r:.40}: this engine batches every caller's requests in one loop, with "
                    f"{name}={self.scheduler_options[name]} (set it when making the Engine); leave it out"
                )
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts (str, messages or token ids)")
        all_ids = tokenize_prompts(self.tokenizer, prompts, self.vocab_size)
        for ids in all_ids:
            self._check_fits(len(ids), params.max_tokens)
        request_ids = [f"batch-{next(self._request_counter)}" for _ in all_ids]
        requests = [self.loop.new_request(rid, ids, params, cache_salt) for rid, ids in zip(request_ids, all_ids)]
        self.loop.submit(requests)
        replies = []
        try:
            for request in requests:
                for event in self.loop.events(request):
                    pass
                replies.append(event.generation)
        finally:
            for request in requests:  # after a failure, the ones still queued or running
                if request.status != FINISHED:
                    self.loop.cancel(request)
        return replies

    def stream(self, prompt, params: SamplingParams | None = None, *, cache_salt: str | None = None,
               request_id: str | None = None, tenant: str | None = None, gone: Callable[[], bool] | None = None,
               max_waiting: int | None = None, timeout: float | None = None, **sampling) -> Iterator[StreamEvent]:
        """Yield a StreamEvent per generated token; the last one holds the finished Generation.

        Every argument is checked here, at the call, before anything runs: a bad one raises
        ValueError. The request takes its blocks when iteration starts and gives them back
        when it ends, fails, or is closed early (a client that disconnects: close() the
        iterator). A request id still running raises ValueError here too, or at the first
        next() if another request takes it in between.
        params: a SamplingParams, or its fields as keywords (max_tokens, temperature, top_p,
            seed, stop: a str or a list of them; the reply ends before the first one it
            contains, with finish_reason "stop", and the stop text is not part of it).
        cache_salt: requests hit each other's blocks only when their salts are equal
            (None and "" are the public cache).
        A server's guards (the engine loop's, engine/engine_loop.py):
        tenant: who asks (a budget policy may share steps by it);
        gone: a check the loop calls while the request waits and before each of its prefill
            steps; True drops the request, and iteration raises ClientGoneError (a check that
            raises ends its own request with that error);
        max_waiting: QueueFullError at the first next() if more requests would then wait;
        timeout: seconds the whole request may take; then iteration raises TimeoutError.
        """
        params, cache_salt = sampling_params(params, sampling), checked_salt(cache_salt)
        prompt_ids = self.tokenize(prompt)
        self._check_fits(len(prompt_ids), params.max_tokens)
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty str or None, got {request_id!r:.40}")
        with self.allocator_lock:
            if request_id is None:  # the next automatic id that no running request has taken
                request_id = f"request-{next(self._request_counter)}"
                while self._running(request_id):
                    request_id = f"request-{next(self._request_counter)}"
            elif self._running(request_id):
                raise ValueError(f"request id {request_id!r} is already running; pick another id")
        request = self.loop.new_request(request_id, prompt_ids, params, cache_salt, gone, tenant)
        return self._stream_in_loop(request, max_waiting, timeout)

    def _running(self, request_id: str) -> bool:
        return request_id in self.allocator.requests or request_id in self.loop.live

    def _stream_in_loop(self, request, max_waiting: int | None, timeout: float | None) -> Iterator[StreamEvent]:
        """Submit to the engine loop when iteration starts; its events as they come."""
        loop = self.loop
        loop.submit([request], max_waiting)
        yield from loop.events(request, timeout)

    def snapshot(self) -> LoopSnapshot:
        """The engine loop's queues, steps and pool figures (who runs, who waits, the last
        step, the free blocks), as the loop last published them: read without a lock, so
        without waiting for a step or for the loop."""
        return self.loop.snapshot()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing changed) while a request holds blocks.
        The loop's snapshot shows it at once. (engine.allocator.reset_prefix_cache() forgets
        them too, but the snapshot shows it only when the loop next publishes.)"""
        with self.allocator_lock:
            if not self.allocator.reset_prefix_cache():
                return False
            self.loop.publish()
        return True

    def charge(self, tenant: str | None, num_tokens: int) -> None:
        """Count work done for `tenant` outside a step (a prompt tokenized, then refused)
        against its fair share."""
        self.loop.charge(tenant, num_tokens)

    def drain(self, grace: float) -> None:
        """Shut the engine down gently (EngineLoop.drain): waiting requests end with
        EngineStoppedError, running ones get `grace` seconds, then finish with "abort"."""
        self.loop.drain(grace)

    def _timed_passes(self) -> tuple[list[tuple[int, float]], dict | None]:
        """(prompt tokens, seconds) of a plain forward pass of each of CALIBRATION_TOKENS, in
        the context every pass runs in, after one untimed pass of each size: what the step
        budget's first fit is made of. And the engine's own attention timed in a few steps
        (_timed_attention), or None where the pool is too small to time it."""
        timed = []
        with self.lock, torch.inference_mode():
            for num_tokens in [min(n, self.max_model_len or n) for n in CALIBRATION_TOKENS] * 2:
                with one_pass(self.threads, self.device, ("calibration", num_tokens), may_probe=False):
                    start = time.perf_counter()
                    self.model(input_ids=torch.zeros(1, num_tokens, dtype=torch.long, device=self.device),
                               logits_to_keep=1)
                    synchronize(self.device)
                    timed.append((num_tokens, time.perf_counter() - start))
            with one_pass(self.threads, self.device, "calibration", may_probe=False):
                attention = self._timed_attention()
        return timed[len(CALIBRATION_TOKENS):], attention  # the first of each size paid its one-time setup

    def _timed_attention(self) -> dict | None:
        """The pool attention of one layer (batch_attention.pool_attention) timed in four steps,
        times the layers: a chunk of ATTENTION_CHUNK tokens at the start of a context and after
        ATTENTION_CONTEXT cached tokens, and ATTENTION_DECODES decodes of one block's context and
        of half as long a one as that (each less where the pool is smaller).
        Each is (query-key pairs, keys read, seconds), what AttentionCosts.timed is given: the
        median of five runs after one untimed. Their keys are whatever the pool's blocks hold;
        the steps write theirs there, as a step does: nothing is cached yet, and a block's
        slots are written before any request reads them. None where the pool holds less than
        half of those contexts."""
        pool, block_size = self.kv, self.kv.block_size
        long_chunk = min(ATTENTION_CONTEXT, (pool.num_blocks * block_size - ATTENTION_CHUNK) // block_size * block_size)
        long_decode = min(ATTENTION_CONTEXT // 2, pool.num_blocks // ATTENTION_DECODES * block_size)
        if long_chunk < ATTENTION_CONTEXT // 2 or long_decode < ATTENTION_CONTEXT // 4:
            return None
        config = self.model.config.get_text_config()
        heads = config.num_attention_heads
        layers = config.num_hidden_layers

        @torch.inference_mode()
        def timed(rows: list[tuple[int, int]]) -> tuple[int, int, float]:
            scheduled, tables, first = [], {}, 0
            for i, (start, end) in enumerate(rows):
                blocks = -(-end // block_size)
                tables[str(i)], first = list(range(first, first + blocks)), first + blocks
                scheduled.append(ScheduledRequest(Request(str(i), [0] * end), start, end))
            inputs = build_step(StepPlan(scheduled, []), pool, tables, self.device, cascade=False)
            num_tokens = inputs.input_ids.shape[1]
            query = torch.randn(1, heads, num_tokens, pool.head_dim, dtype=pool.dtype, device=self.device)
            key, value = torch.randn(2, 1, pool.num_kv_heads, num_tokens, pool.head_dim, dtype=pool.dtype,
                                     device=self.device)
            layer, seconds = SimpleNamespace(layer_idx=0), []
            for _ in range(6):
                start = time.perf_counter()
                pool_attention(layer, query, key, value, None, scaling=pool.head_dim ** -0.5, pool_step=inputs)
                synchronize(self.device)
                seconds.append(time.perf_counter() - start)
            pairs = sum(keys_attended(start, end) for start, end in rows)
            return pairs, sum(end for _, end in rows), layers * statistics.median(seconds[1:])

        return {"chunks": (timed([(0, ATTENTION_CHUNK)]), timed([(long_chunk, long_chunk + ATTENTION_CHUNK)])),
                "decodes": (timed([(block_size - 1, block_size)] * ATTENTION_DECODES),
                            timed([(long_decode - 1, long_decode)] * ATTENTION_DECODES))}

    def warm_up(self, stage_7: bool = True, loop_graphs: bool = True) -> None:
        """Run every kind of pass a request's path runs once, before anything is timed, so the
        first timed request pays for no one-time setup (buffers, kernel choices, the CUDA
        context, and on a GPU each kernel's first load, which cost the demo's first round
        on an H200 20 ms a write and 15 a gather). Through the pool's scratch block, which the
        allocator never hands out: the pool is as empty after it as before, and a first
        request computes all of its tokens. On a thread that ends with it, so no OpenMP pool
        of its stays beside the loop's (cpu_threads.in_own_thread says why).

        Stage 7's path (one_request.run_request): an empty gather and a prefill of one block,
        its K/V written, a greedy and a sampled pick, the block gathered back and a suffix pass
        over it (a masked pass, as a HIT's), a decode token after it. The batched path
        (engine/model_runner.py): a prompt's chunk and a decode of it, greedy and sampled
        picks from the decode's logits (sampling.sample_batch), both padded where the engine
        pads and captured as CUDA graphs where it runs graphs (in a runner of its own, so the
        loop's graphs count only the shapes below and what real steps captured). Then, on a
        GPU, CUDA graphs captured before any request, each logged on the "engine" logger with
        the time it took: every pass of stage 7's requests up to fixed_past.START_SLOTS tokens
        and every decode token (FixedBuffers.capture_at_start), and the engine loop's decode
        steps and steps with a prompt's chunk whose contexts are within
        model_runner.START_TOKENS tokens (ModelRunner.capture_at_start), so /health counts them
        from the start. stage_7=False: the batched path only, for an engine whose every
        request goes through its loop (server.py): stage 7's fixed buffers are never allocated.
        loop_graphs=False: no graph of the loop's captured, for a command whose every request
        runs stage 7's path (the demo)."""
        in_own_thread(self._warm_up, stage_7, loop_graphs)

    def _warm_up(self, stage_7: bool, loop_graphs: bool) -> None:
        scratch, block_size = self.kv.scratch_block, self.kv.block_size
        suffix = [0] * max(1, block_size // 2)
        if stage_7:
            self._warm_up_stage_7(scratch, block_size, suffix)
        # A runner of its own (torch's thread count, graphs dropped after): the loop's thread
        # chooser and graphs see only real steps.
        runner = ModelRunner(self.parts, max_num_seqs=1, static_decode=self.config.static_decode)
        with self.lock:
            request = Request("warm-up", suffix)
            tables = {request.request_id: [scratch]}  # within one block
            runner.run(StepPlan([ScheduledRequest(request, 0, len(suffix))], []), tables)
            request.append_output(0)
            logits = runner.run(StepPlan([ScheduledRequest(request, len(suffix), len(suffix) + 1)], []), tables)
            sample_batch(logits.expand(2, -1), [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9)],
                         [None, torch.Generator().manual_seed(0)])  # the step's picks, greedy and sampled
            if stage_7 and self.parts.fixed is not None and self.parts.fixed.capture_at_start():  # on a GPU
                figures = self.parts.fixed.figures()
                log.info("captured %d shapes of stage 7's pass as CUDA graphs before any request, in %.1f s",
                         figures["captured"], figures["capture_s"])
            loop_runner = self.loop.runner.model_runner
            if loop_graphs and loop_runner.capture_at_start():  # on a GPU
                figures = loop_runner.graph_figures()
                log.info("captured %d shapes of the engine loop's steps as CUDA graphs before any request, in %.1f s",
                         figures["captured"], figures["capture_s"])
        synchronize(self.device)

    def _warm_up_stage_7(self, scratch: int, block_size: int, suffix: list[int]) -> None:
        kv = self.kv
        sampled = SamplingParams(temperature=1.0, top_p=0.9)
        with self.lock, torch.inference_mode(), one_pass(self.threads, self.device, "warm-up", may_probe=False):
            cache = gather(self.parts, [])
            logits = forward(self.model, [0] * block_size, cache)
            kv.write(cache, [scratch], 0, block_size)
            sample(logits, SamplingParams()), sample(logits, sampled, torch.Generator().manual_seed(0))
            del cache  # fixed buffers (engine/fixed_past.py) serve one request at a time: this one is done
            cache = gather(self.parts, [scratch])
            forward(self.model, suffix, cache)
            forward(self.model, [0], cache)
            del cache


def _close_loop(loop: EngineLoop) -> None:
    """An Engine's finalizer: stop its loop's thread. The heap frozen for the loop's steps is
    thawed, so a collection can take the dropped engine's objects that sit in cycles. A loop
    never started (no request was submitted) froze nothing: nothing to thaw."""
    started = loop.started
    loop.stop()
    if started:
        thaw_startup_heap()

