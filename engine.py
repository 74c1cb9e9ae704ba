"""
The engine: a Hugging Face model served with automatic prefix caching, one front for both
ways of running it.

Read prefix_caching.py (the allocator) first. The files under this one, each with one role,
are listed in the README's reading-order table ("The code, in reading order"): the pool, the
sampler, the one finisher of reply text, the thread policy, stage 7's one-request engine (and
EngineParts, what both engines are handed instead of the Engine), and stage 8's scheduler,
step budget, attention, batch runner and engine loop.

This file builds the model, the allocator and the pool (bundled once as EngineParts),
checks what callers send (the prompt, the sampling arguments, the stop strings, the
request id) before any work, and hands the request to one of the two engines. Nothing
under it imports it.

    1. the Engine          Engine(...), tokenize, generate, stream, generate_batch, snapshot
    2. command-line flags  the model and pool flags the demo, benchmarks and server share

References: vLLM v1 (vllm/v1/engine/llm_engine.py and core.py: an EngineCore composing a
Scheduler and a model executor, with an output processor beside it); nano-vllm
(nanovllm/engine/llm_engine.py at commit bb823b3 of its main branch: LLMEngine composes Scheduler and
ModelRunner, and its step is schedule, run, postprocess).
"""

from __future__ import annotations

import argparse
import itertools
import math
import threading
import time
from typing import Callable, Iterator, Sequence

import torch
from jinja2 import TemplateError

from batch_engine import BatchRunner
from cpu_threads import ThreadChooser
from engine_loop import ClientGoneError, EngineLoop, EngineStoppedError, LoopSnapshot, QueueFullError
from kv_pool import PagedKVPool
from model_loader import DTYPES, DEFAULT_MODEL, load_model
from one_request import EngineParts, run_request
from outputs import Generation, StreamEvent, check_stop
from prefix_caching import PrefixCachingAllocator, check_cache_salt, check_text
from sampling import SamplingParams
from scheduler import FINISHED, check_step_size
from step_budget import DEFAULT_TARGET_STEP_MS, ModelShape, StepBudget

# -----------------------------------------------------------------------------
# 1. The Engine

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's chat API's roles
DEFAULT_KV_MEMORY_GB = 0.5  # the pool's size when neither num_blocks nor kv_memory_gb is given
DEFAULT_MAX_NUM_SEQS = 64  # batching: requests in one step at most (vLLM's --max-num-seqs)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # batching: tokens one step computes at most (vLLM's flag of that name)


def check_request(max_tokens, temperature, top_p, seed, cache_salt, stop):
    """The arguments every request takes, checked (ValueError): (SamplingParams, salt, stop)."""
    params = SamplingParams(max_tokens, temperature, top_p, seed)
    try:
        cache_salt = check_cache_salt(cache_salt)
    except TypeError as err:
        raise ValueError(str(err)) from None
    stop = check_stop(stop)
    for text, what in [(cache_salt or "", "cache_salt"), *((s, "a stop string") for s in stop)]:
        check_text(text, what)
    return params, cache_salt, stop


def check_prompt(prompt, vocab_size: int | None = None) -> str:
    """Refuse a prompt no tokenizer should see (ValueError); its kind: "text", "messages" or "ids".

    >>> check_prompt("Hi"), check_prompt([{"role": "user", "content": "Hi"}]), check_prompt([1, 2])
    ('text', 'messages', 'ids')
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty: give some text, messages or token ids")
        check_text(prompt, "the prompt")
        return "text"
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(f"prompt must be a non-empty str, list of messages or list of token ids, got {prompt!r:.80}")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            bound = "be >= 0" if vocab_size is None else f"be in [0, {vocab_size}) for this model"
            raise ValueError(f"token ids must {bound}; got {bad[:5]}")
        return "ids"
    for message in prompt:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f'each chat message must be a dict {{"role": str, "content": str}}, got {message!r:.80}')
        if message["role"] not in CHAT_ROLES:
            raise ValueError(f"unknown chat role {message['role']!r:.40}; "
                             f"a message's role is one of {', '.join(CHAT_ROLES)}")
        check_text(message["content"], "a message's content")
    return "messages"


def tokenize_prompts(tokenizer, prompts: Sequence, vocab_size: int | None = None) -> list[list[int]]:
    """Token ids of each prompt (see check_prompt for the kinds), every one checked first.

    Texts are encoded as they are; messages go through the chat template with the
    assistant's turn opened. Both in one batch call each: the tokenizer's Rust code then
    works through thousands of prompts at a time (a workload log) instead of one by one.
    """
    kinds = [check_prompt(prompt, vocab_size) for prompt in prompts]
    if "messages" in kinds and not tokenizer.chat_template:
        raise ValueError("this tokenizer has no chat template: pass the prompt as a str instead of messages")
    ids: list[list[int] | None] = [list(p) if kind == "ids" else None for p, kind in zip(prompts, kinds)]
    texts = [i for i, kind in enumerate(kinds) if kind == "text"]
    if texts:
        for i, encoded in zip(texts, tokenizer([prompts[i] for i in texts])["input_ids"]):
            ids[i] = encoded
    chats = [i for i, kind in enumerate(kinds) if kind == "messages"]
    if chats:
        try:
            rendered = tokenizer.apply_chat_template([list(prompts[i]) for i in chats], add_generation_prompt=True,
                                                     return_dict=False)
        except TemplateError:
            raise ValueError(refused_by_template(tokenizer, prompts, chats)) from None
        for i, encoded in zip(chats, rendered):
            ids[i] = list(encoded)
    return ids


def refused_by_template(tokenizer, prompts: Sequence, chats: list[int]) -> str:
    """Why the model's chat template refused a batch: the first prompt it refuses alone, and
    the template's own words (a template may demand alternating roles, or no system turn)."""
    for i in chats:
        try:
            tokenizer.apply_chat_template(list(prompts[i]), add_generation_prompt=True)
        except TemplateError as err:
            where = f"prompt {i}" if len(prompts) > 1 else "the messages"
            return f"the model's chat template refused {where}: {err}; change the roles or their order"
    return "the model's chat template refused the messages"


class Engine:
    """A Hugging Face causal LM served with automatic prefix caching.

        engine = Engine()                        # the offline default, SmolLM2-135M-Instruct
        engine = Engine("HuggingFaceTB/SmolLM2-360M-Instruct", device="cuda")
        engine = Engine(model=model, tokenizer=tokenizer, num_blocks=64)   # objects you already have

    engine.model, engine.tokenizer, engine.allocator (the block bookkeeping) and engine.kv
    (the K/V memory its block ids point into). The pool is sized by num_blocks or by a
    memory budget, kv_memory_gb (0.5 GiB when neither is given). engine.parts bundles them
    with the locks and the stop tokens (one_request.EngineParts): what every runner of the
    engine is handed, and what those attributes read.

    One request at a time (the default): stream and generate run one_request.py's steps in
    the caller's thread, gathering the cached prefix into a DynamicCache (what stage 7
    teaches). batching=True: stream, generate and generate_batch submit to one engine loop
    (engine_loop.py) that runs every caller's requests in the same forward passes, each
    layer's attention copying every request's context out of the pool by its block table
    (batch_engine.py says how much); a busy pool makes requests wait instead of refusing them.
    generate_batch batches either way.

    A batched step's token budget: by default as many tokens as fit in target_step_ms (400 ms
    unless given; step_budget.py learns what a step costs on this machine), at most 2,048, so
    a long prompt arriving is prefilled in chunks that keep every stream moving.
    max_num_batched_tokens=N makes it N every step instead (vLLM's meaning), the same plans on
    every machine: the lessons and tests pass one.

    Two locks. engine.lock is held for every step (a request's allocation and prefill
    together, or one decoded token); hold it yourself to read the pool between two steps.
    engine.allocator_lock is held only around the allocator's bookkeeping, microseconds at a
    time and never across a forward pass: hold it to read the allocator while a step runs.
    """
    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        model=None,
        tokenizer=None,
        device=None,
        dtype=None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory_gb: float | None = None,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        free_uncached_first: bool = False,
        batching: bool = False,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int | None = None,
        target_step_ms: float | None = None,
        enable_chunked_prefill: bool = True,
        cascade_attention: bool = True,
        choose_threads: bool = True,
    ):
        if model is None and tokenizer is None:
            model, tokenizer = load_model(model_name_or_path, device=device, dtype=dtype)
        elif model is None or tokenizer is None:
            raise ValueError("pass both model= and tokenizer=, or neither (to load model_name_or_path)")
        elif model_name_or_path is not None or device is not None or dtype is not None:
            raise ValueError(
                "model= is already loaded: move and cast it yourself (model.to(device, dtype)) "
                "instead of passing model_name_or_path, device or dtype"
            )
        if num_blocks is not None and kv_memory_gb is not None:
            raise ValueError("size the pool by num_blocks or by kv_memory_gb, not both")

        device, self.dtype = model.device, model.dtype
        shape = PagedKVPool.shape_from_config(model.config)
        if num_blocks is None:
            per_block = PagedKVPool.bytes_per_block(**shape, block_size=block_size, dtype=self.dtype)
            budget = DEFAULT_KV_MEMORY_GB if kv_memory_gb is None else kv_memory_gb
            num_blocks = int(budget * 2**30 // per_block)
            if num_blocks < 1:
                raise ValueError(f"kv_memory_gb={budget} is less than one block ({per_block:,} bytes)")
        allocator = PrefixCachingAllocator(
            num_blocks, block_size, hash_algo=hash_algo,
            enable_caching=enable_caching, free_uncached_first=free_uncached_first,
        )
        kv = PagedKVPool(**shape, num_blocks=num_blocks, block_size=block_size, dtype=self.dtype, device=device)

        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        stop_token_ids = frozenset({eos} if isinstance(eos, int) else eos or ())
        self.max_model_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self._request_counter = itertools.count()
        self.batching = batching
        # The token budget of a batched step: a fixed max_num_batched_tokens (vLLM's meaning), or,
        # when none is given, as many tokens as fit in target_step_ms (step_budget.py), up to
        # DEFAULT_MAX_NUM_BATCHED_TOKENS.
        if max_num_batched_tokens is not None and target_step_ms is not None:
            raise ValueError("give max_num_batched_tokens (the same budget every step) or target_step_ms (a budget "
                             "from a step time), not both")
        number = isinstance(target_step_ms, (int, float)) and not isinstance(target_step_ms, bool)
        if target_step_ms is not None and not (number and 0 < target_step_ms < math.inf):
            raise ValueError(f"target_step_ms must be a number of milliseconds above 0, got {target_step_ms!r:.40}")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
            target_step_ms = target_step_ms or DEFAULT_TARGET_STEP_MS
        check_step_size(max_num_seqs, max_num_batched_tokens)
        self.scheduler_options = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                                  "enable_chunked_prefill": enable_chunked_prefill}
        self.target_step_ms = target_step_ms  # None: the budget is max_num_batched_tokens every step
        self.step_budget = None if target_step_ms is None else StepBudget(
            ModelShape.of(model), target_step_ms, max_num_batched_tokens)
        self.cascade_attention = cascade_attention  # decodes sharing a long prefix read it once, where it pays
        # Every forward pass on a CPU picks its thread count by measuring (cpu_threads.ThreadChooser):
        # one request's, and each batched step's. choose_threads=False keeps torch's.
        threads = ThreadChooser() if choose_threads else None
        # One lock around every step that touches the pool or the model, so several streams
        # (a server's clients) interleave their steps token by token. Reentrant: a caller that
        # holds it can still close() a stream, whose cleanup takes it again.
        self.parts = EngineParts(model, tokenizer, stop_token_ids, allocator, kv, device,
                                 lock=threading.RLock(), allocator_lock=threading.RLock(), threads=threads)
        batch_options = {"cascade_attention": cascade_attention, "threads": threads,
                         "choose_threads": choose_threads, "step_budget": self.step_budget, **self.scheduler_options}
        # batching=True: the engine's one scheduler, in a thread started by the first request.
        self.loop = EngineLoop(self.parts, **batch_options) if batching else None

    # --- the parts: read from self.parts, so the engine and its runners never disagree --------
    # To run on other parts (another pool, other stop tokens), replace the bundle:
    # engine.parts = dataclasses.replace(engine.parts, kv=...). A runner made before, and the
    # engine loop (made with the engine), keep the parts they were given.

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

    # --- prompts -----------------------------------------------------------------------------

    def tokenize(self, prompt) -> list[int]:
        """Token ids of a prompt: a str (tokenized as is), a list of chat messages
        ({"role", "content"}: the chat template with the assistant's turn opened), or a list
        of token ids (used as they are)."""
        (ids,) = tokenize_prompts(self.tokenizer, [prompt], self.model.get_input_embeddings().num_embeddings)
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

    def generate(self, prompt, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, cache_salt: str | None = None, request_id: str | None = None,
                 stop: str | Sequence[str] | None = None) -> Generation:
        """Run one request to the end and return its Generation (see stream for the arguments)."""
        for event in self.stream(prompt, max_tokens, temperature, top_p, seed, cache_salt, request_id, stop):
            pass
        return event.generation

    def generate_batch(self, prompts: Sequence, max_tokens: int = 64, temperature: float = 0.0,
                       top_p: float = 1.0, seed: int | None = None, cache_salt: str | None = None,
                       stop: str | Sequence[str] | None = None, *, max_num_seqs: int | None = None,
                       max_num_batched_tokens: int | None = None) -> list[Generation]:
        """Run many requests together, one forward pass per step for all of them (continuous
        batching on the paged pool: batch_engine.py); their Generations, in the order given.

        Every prompt is checked before any runs. Requests that do not all fit in the pool at
        once wait, or are preempted and resumed, instead of being refused.
        With batching=True they join the engine loop's queue, behind every request submitted
        before them, and share its steps with every other caller; max_num_seqs and
        max_num_batched_tokens are then the engine's settings, and giving other values is an
        error. Without batching, a runner of their own steps them (with the engine's settings
        unless given), and fails with OutOfBlocksError if other streams hold the pool.
        """
        params, cache_salt, stop = check_request(max_tokens, temperature, top_p, seed, cache_salt, stop)
        given = {name: value for name, value in [("max_num_seqs", max_num_seqs),
                                                 ("max_num_batched_tokens", max_num_batched_tokens)] if value is not None}
        for name, value in given.items():
            fixed = name != "max_num_batched_tokens" or self.target_step_ms is None
            if self.batching and (value != self.scheduler_options[name] or not fixed):
                raise ValueError(
                    f"{name}={value!r:.40}: this engine batches every caller's requests in one loop, with "
                    f"{name}={self.scheduler_options[name]} (set it when making the Engine); leave it out"
                )
        options = self.scheduler_options | given
        check_step_size(options["max_num_seqs"], options["max_num_batched_tokens"])
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts (str, messages or token ids)")
        all_ids = tokenize_prompts(self.tokenizer, prompts, self.model.get_input_embeddings().num_embeddings)
        for ids in all_ids:
            self._check_fits(len(ids), max_tokens)
        request_ids = [f"batch-{next(self._request_counter)}" for _ in all_ids]
        if self.batching:
            return self._run_in_loop(request_ids, all_ids, params, cache_salt, stop)
        step_budget = None if "max_num_batched_tokens" in given else self.step_budget  # given: a fixed budget
        runner = BatchRunner(self.parts, cascade_attention=self.cascade_attention, threads=self.threads,
                             choose_threads=self.threads is not None, step_budget=step_budget, **options)
        requests = [runner.add(rid, ids, params, cache_salt, stop) for rid, ids in zip(request_ids, all_ids)]
        try:
            return runner.run(requests)
        finally:
            with self.allocator_lock:
                for request in requests:  # after a failure: give every block back
                    runner.scheduler.finish(request)

    def _run_in_loop(self, request_ids, all_ids, params, cache_salt, stop) -> list[Generation]:
        """generate_batch on a batching engine: submit every request at once, wait for each."""
        requests = [self.loop.new_request(rid, ids, params, cache_salt, stop) for rid, ids in zip(request_ids, all_ids)]
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

    def stream(self, prompt, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, cache_salt: str | None = None, request_id: str | None = None,
               stop: str | Sequence[str] | None = None, *, gone: Callable[[], bool] | None = None,
               max_waiting: int | None = None, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Yield a StreamEvent per generated token.

        Every argument is checked here, at the call, before anything runs: a bad one raises
        ValueError. The request takes its blocks when iteration starts and gives them back
        when it ends, fails, or is closed early (a client that disconnects: close() the
        iterator). A request id still running raises ValueError here too, or at the first
        next() if another request takes it in between.
        cache_salt: requests hit each other's blocks only when their salts are equal
            (None and "" are the public cache).
        stop: a str or a list of them; the reply ends before the first one it contains,
            with finish_reason "stop", and the stop text is not part of it.
        A server's guards, for a batching engine only (the engine loop's, engine_loop.py):
        gone: a check the loop calls while the request waits and before each of its prefill
            steps; True drops the request, and iteration raises ClientGoneError.
        max_waiting: QueueFullError at the first next() if more requests would then wait.
        timeout: seconds the whole request may take; then iteration raises TimeoutError.
        """
        arrival = time.perf_counter()
        params, cache_salt, stop = check_request(max_tokens, temperature, top_p, seed, cache_salt, stop)
        prompt_ids = self.tokenize(prompt)
        self._check_fits(len(prompt_ids), max_tokens)
        guards = {name: value for name, value in [("gone", gone), ("max_waiting", max_waiting), ("timeout", timeout)]
                  if value is not None}
        if guards and not self.batching:
            raise ValueError(f"{next(iter(guards))} is a guard of the batching engine's queue; this engine has none")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty str or None, got {request_id!r:.40}")
        with self.allocator_lock:
            if request_id is None:  # the next automatic id that no running request has taken
                request_id = f"request-{next(self._request_counter)}"
                while self._running(request_id):
                    request_id = f"request-{next(self._request_counter)}"
            elif self._running(request_id):
                raise ValueError(f"request id {request_id!r} is already running; pick another id")
        if self.batching:
            request = self.loop.new_request(request_id, prompt_ids, params, cache_salt, stop, gone)
            return self._stream_in_loop(request, max_waiting, timeout)
        return run_request(self.parts, request_id, prompt_ids, params, cache_salt, stop, arrival)

    def _running(self, request_id: str) -> bool:
        return request_id in self.allocator.requests or (self.loop is not None and request_id in self.loop.live)

    def _stream_in_loop(self, request, max_waiting: int | None, timeout: float | None) -> Iterator[StreamEvent]:
        """Submit to the engine loop when iteration starts; its events as they come."""
        self.loop.submit([request], max_waiting)
        yield from self.loop.events(request, timeout)

    def snapshot(self) -> LoopSnapshot | None:
        """The batching engine's queues and steps (who runs, who waits, the last step), read
        without waiting for a forward pass; None for an engine that does not batch."""
        return None if self.loop is None else self.loop.snapshot()

    def drain(self, grace: float) -> None:
        """Shut the batching engine down gently (EngineLoop.drain): waiting requests end with
        EngineStoppedError, running ones get `grace` seconds, then finish with "abort"."""
        if self.loop is not None:
            self.loop.drain(grace)

    def warm_up(self) -> None:
        """One throwaway forward pass outside the pool, so the first timed request does not
        pay for one-time setup (buffer allocation, kernel choice, the CUDA context)."""
        with self.lock, torch.inference_mode():
            self.model(input_ids=torch.zeros(1, 16, dtype=torch.long, device=self.device), logits_to_keep=1)


# -----------------------------------------------------------------------------
# 2. Command-line flags: the model and the pool, shared by the demo, benchmarks and server


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1, refused with a usage error otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the model and size its KV pool (shared by the demo and benchmarks)."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None, help=f"Hugging Face id or local path (default: {DEFAULT_MODEL}, offline)")
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when there is a GPU)")
    group.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    group.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default: 16)")
    size = group.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=positive_int, default=None,
                      help=f"blocks in the KV pool (default: as many as fit in {DEFAULT_KV_MEMORY_GB} GiB)")
    size.add_argument("--kv-memory-gb", type=positive_float, default=None,
                      help="size the KV pool by memory instead: as many blocks as fit in this many GiB")


def pool_arguments(args: argparse.Namespace) -> dict:
    """Engine keyword arguments from the pool flags of add_model_arguments."""
    return {"block_size": args.block_size, "num_blocks": args.num_blocks,
            "kv_memory_gb": getattr(args, "kv_memory_gb", None)}  # a hand-made Namespace may leave it out

