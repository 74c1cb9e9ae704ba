"""
The engine: a Hugging Face model served with automatic prefix caching.

Read prefix_caching.py (the allocator: which block holds which tokens) first. This file adds
the memory those block ids name and the model that fills it:

    1. the paged KV pool   PagedKVPool: the K/V tensors behind the allocator's blocks
    2. sampling            SamplingParams and sample: greedy, temperature, top_p, seed
    3. the engine          Engine.generate / stream: look up the cached prefix, gather it into
                           past_key_values, run the model on the rest only, write the new K/V
                           back into the request's blocks, decode, free
    4. command-line flags  the model and pool flags the demo, benchmarks and server share

References: vLLM v1 (vllm/v1/worker/gpu_model_runner.py, vllm/v1/core/kv_cache_manager.py);
transformers' DynamicCache (past_key_values).
"""

from __future__ import annotations

import argparse
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache

from model_loader import DTYPES, DEFAULT_MODEL, load_model
from prefix_caching import OutOfBlocksError, PrefixCachingAllocator, check_cache_salt, check_text

# -----------------------------------------------------------------------------
# 1. The paged KV pool
#
# The allocator hands out block ids; this is the memory they name. It is allocated once,
# from the model's shape, and never grows: one slot per (block, position in block), and each
# slot holds one token's key and value vectors in every layer. A cached block is just a
# block whose slots were written by an earlier request and not overwritten since.
#
# The model itself still attends over an ordinary transformers DynamicCache, one per request:
# a hit is *gathered* from the pool into a fresh DynamicCache, and whatever the model
# computes is *written* back into the request's slots, so the blocks that fill are truly
# there for the next request. (vLLM's attention kernels read the pool in place instead;
# the copy is the price of running an unmodified Hugging Face model.)


def slot_ids(block_table: list[int], block_size: int, start: int, end: int, device=None):
    """Flat slot index of tokens start..end-1: block_table[i // block_size] * block_size + i % block_size.

    >>> slot_ids([7, 2], block_size=4, start=3, end=6).tolist()   # token 3 in block 7; 4, 5 in block 2
    [31, 8, 9]
    """
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_table)[positions // block_size]
    return (blocks * block_size + positions % block_size).to(device)


class PagedKVPool:
    """The K/V tensors behind the allocator's blocks.

        data[layer, 0, block, offset]  the key of one token,   shape (num_kv_heads, head_dim)
        data[layer, 1, block, offset]  the value of that token

    >>> kv = PagedKVPool(num_layers=2, num_kv_heads=1, head_dim=8, num_blocks=4, block_size=4)
    >>> tuple(kv.data.shape)
    (2, 2, 4, 4, 1, 8)
    """
    def __init__(self, *, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype=None, device=None):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.data = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype or torch.float32, device=device
        )

    @staticmethod
    def shape_from_config(config) -> dict:
        """Layers, KV heads and head dim of a transformers model config."""
        text = config.get_text_config()
        if any(kind != "full_attention" for kind in getattr(text, "layer_types", None) or ()):
            raise ValueError(
                f"{text.model_type} has sliding-window layers, whose cache drops old tokens; "
                f"this pool assumes every layer attends to the whole prefix"
            )
        return {
            "num_layers": text.num_hidden_layers,
            "num_kv_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        }

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def device(self):
        return self.data.device

    @staticmethod
    def bytes_per_block(*, num_layers, num_kv_heads, head_dim, block_size, dtype) -> int:
        """K and V of block_size tokens in every layer: 2 x layers x tokens x heads x dim x bytes.

        >>> import torch   # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims
        >>> PagedKVPool.bytes_per_block(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
        737280
        """
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def gather(self, block_ids: list[int], config):
        """A fresh DynamicCache holding the K/V of `block_ids`, in order.

        One index_select copies the blocks of every layer at once; the per-layer tensors
        handed to the cache are views of that one copy, in the (batch, heads, tokens, dim)
        layout attention expects.
        """
        if not block_ids:
            return DynamicCache(config=config)
        kv = self.tokens_of(block_ids)
        return DynamicCache([(kv[layer, 0], kv[layer, 1]) for layer in range(self.num_layers)], config=config)

    def tokens_of(self, block_ids: list[int]):
        """The K/V of every slot of `block_ids`, token after token, in attention's layout:
        (layers, 2, 1, num_kv_heads, len(block_ids) * block_size, head_dim).

        >>> kv = PagedKVPool(num_layers=2, num_kv_heads=1, head_dim=8, num_blocks=4, block_size=4)
        >>> tuple(kv.tokens_of([3, 1]).shape)
        (2, 2, 1, 1, 8, 8)
        """
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        kv = self.data.index_select(2, index).flatten(2, 3)  # (layers, 2, tokens, heads, dim)
        return kv.transpose(2, 3).unsqueeze(2)  # (layers, 2, 1, heads, tokens, dim)

    def slots(self, layer: int):
        """Layer `layer` of the pool as (K/V, slot, kv heads, dim): slot = block * block_size + offset."""
        return self.data[layer].view(2, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)

    def write(self, cache, block_table: list[int], start: int, end: int) -> None:
        """Copy tokens start..end-1 of a request's DynamicCache into its slots."""
        slots = slot_ids(block_table, self.block_size, start, end, self.device)
        flat = self.data.view(self.num_layers, 2, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        for layer, (keys, values, *_) in enumerate(cache):
            flat[layer, 0, slots] = keys[0, :, start:end].transpose(0, 1)  # (tokens, heads, dim)
            flat[layer, 1, slots] = values[0, :, start:end].transpose(0, 1)

    def __str__(self) -> str:
        total = self.data.numel() * self.data.element_size()
        return (
            f"paged KV pool: {self.num_blocks} blocks x {self.block_size} slots "
            f"({self.num_blocks * self.block_size:,} tokens), each slot {self.num_layers} layers x K,V x "
            f"{self.num_kv_heads} heads x {self.head_dim} dims; {str(self.dtype).removeprefix('torch.')} "
            f"on {self.device}, {total / 2**20:,.1f} MiB ({total / self.num_blocks / 2**10:,.0f} KiB a block)"
        )


# -----------------------------------------------------------------------------
# 3. The engine: one request, from prompt to reply
#
#   allocate_with_prefix   which leading blocks are cached? take them, and new blocks for the rest
#   gather                 copy the hit blocks' K/V from the pool into a fresh DynamicCache
#   forward                run the model on the uncached suffix only
#   write                  copy the suffix's new K/V into the request's blocks
#   sample                 the first token: time to first token (TTFT) ends here
#   decode                 one token at a time: append_token, forward, write its slot, sample
#   free                   the blocks go back to the pool, still cached
#
# A sampled token goes to the allocator only when its K/V is about to be computed, so the
# last token of a reply never does: no cached block ever holds a slot nobody wrote.


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy (argmax); top_p keeps the smallest set of
    tokens whose probabilities add up to at least top_p; seed makes sampling repeatable."""
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        # Stored as floats: an int such as 10**400 or 2**64 would otherwise overflow only
        # later, inside the sampler, after the whole prefill ran.
        object.__setattr__(self, "temperature", _as_float(self.temperature, "temperature"))
        object.__setattr__(self, "top_p", _as_float(self.top_p, "top_p"))
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf and softmax gives NaN; the limit of
        # sampling as temperature falls to 0 is argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


GREEDY_BELOW_TEMPERATURE = 1e-5


def _as_float(x, name: str) -> float:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise ValueError(f"{name} must be a number, got {x!r:.40}")
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{name} is too large to be a number of this engine (got an int of {len(str(x))} digits)") from None


def sample(logits, params: SamplingParams, generator=None) -> int:
    """One token id from the logits of the last position.

    >>> import torch
    >>> sample(torch.tensor([0.1, 2.0, 0.3]), SamplingParams())   # greedy: the largest logit
    1
    >>> sample(torch.tensor([0.1, 2.0, 0.3]), SamplingParams(temperature=1.0, top_p=0.5))  # 1 alone has p > 0.5
    1
    """
    if params.greedy:
        return int(logits.argmax())
    # Sampling runs on the CPU so a seed gives the same tokens on every device.
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above each one
        drop = before >= params.top_p  # the set already reached top_p without this token
        drop[0] = False  # the most likely token always stays, however small top_p is
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class PrefillTiming:
    """Where the time to first token went, in milliseconds."""
    lookup_ms: float = 0.0  # hash the prompt's blocks, find the cached prefix, allocate the rest
    gather_ms: float = 0.0  # copy the hit blocks' K/V out of the pool
    forward_ms: float = 0.0  # run the model on the uncached suffix
    write_ms: float = 0.0  # copy the suffix's new K/V into the request's blocks
    sample_ms: float = 0.0  # pick the first token


@dataclass
class Generation:
    """One reply, and what prefix caching did for it."""
    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from the pool instead of the model
    token_ids: list[int] = field(default_factory=list)  # generated only; ends with EOS if it stopped there
    text: str = ""  # the generated tokens decoded, special tokens left out
    finish_reason: str | None = None  # "stop" (EOS) or "length" (max_tokens), once finished
    ttft_ms: float = 0.0  # request in -> first token sampled
    total_ms: float = 0.0
    prefill: PrefillTiming = field(default_factory=PrefillTiming)  # one request at a time only
    wait_ms: float = 0.0  # request in -> admitted by the scheduler (generate_batch)
    num_preemptions: int = 0  # times the scheduler took its blocks back to make room

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens the model had to run: the uncached suffix."""
        return self.prompt_tokens - self.cached_tokens


@dataclass
class StreamEvent:
    """One generated token, as Engine.stream yields it."""
    token_id: int
    text: str  # the text this token adds ("" while a character is only half decoded)
    finish_reason: str | None  # None until the last event: then "stop" or "length"
    generation: Generation  # the reply being built (one object, filled in as the stream goes)


class _Stopwatch:
    """Milliseconds between laps. On a GPU work runs asynchronously, so each lap first
    waits for it to finish: otherwise the time lands in whichever lap waits next."""
    def __init__(self, device):
        self.device = device
        self.last = time.perf_counter()

    def lap(self) -> float:
        if self.device.type == "cuda":

            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed, self.last = (now - self.last) * 1e3, now
        return elapsed


CHAT_ROLES = ("system", "user", "assistant")


def _check_stop(stop) -> tuple[str, ...]:
    """stop as a tuple of non-empty strings: None -> (), "x" -> ("x",)."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r:.60}")
    for s in stops:
        check_text(s, "a stop string")
    return tuple(stops)


def _check_request(max_tokens, temperature, top_p, seed, cache_salt, stop):
    """The arguments every request takes, checked (ValueError): (SamplingParams, salt, stop)."""
    params = SamplingParams(max_tokens, temperature, top_p, seed)
    try:
        cache_salt = check_cache_salt(cache_salt)
    except TypeError as err:
        raise ValueError(str(err)) from None
    return params, cache_salt, _check_stop(stop)


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a stop string.

    >>> _held_back("The answer is 4", ("4.", "Q:"))   # "4" may become "4."
    1
    """
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held


DEFAULT_KV_MEMORY_GB = 0.5  # the pool's size when neither num_blocks nor kv_memory_gb is given


class Engine:
    """A Hugging Face causal LM served with automatic prefix caching.

        engine = Engine()                        # the offline default, SmolLM2-135M-Instruct
        engine = Engine("HuggingFaceTB/SmolLM2-360M-Instruct", device="cuda")
        engine = Engine(model=model, tokenizer=tokenizer, num_blocks=64)   # objects you already have

    engine.model, engine.tokenizer, engine.allocator (the block bookkeeping) and engine.kv
    (the K/V memory its block ids point into). The pool is sized by num_blocks or by a
    memory budget, kv_memory_gb (0.5 GiB when neither is given).

    One request at a time (the default): stream and generate run their own steps, in the
    caller's thread, gathering the cached prefix into a DynamicCache (what stage 7 teaches).
    batching=True: stream and generate submit to an engine loop (batch_engine.py) that runs
    every caller's request in the same forward passes, reading the pool in place; a busy pool
    makes requests wait instead of refusing them. generate_batch batches either way.

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
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
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

        self.model, self.tokenizer = model, tokenizer
        self.device, self.dtype = model.device, model.dtype
        shape = PagedKVPool.shape_from_config(model.config)
        if num_blocks is None:
            per_block = PagedKVPool.bytes_per_block(**shape, block_size=block_size, dtype=self.dtype)
            budget = DEFAULT_KV_MEMORY_GB if kv_memory_gb is None else kv_memory_gb
            num_blocks = int(budget * 2**30 // per_block)
            if num_blocks < 1:
                raise ValueError(f"kv_memory_gb={budget} is less than one block ({per_block:,} bytes)")
        self.allocator = PrefixCachingAllocator(
            num_blocks, block_size, hash_algo=hash_algo,
            enable_caching=enable_caching, free_uncached_first=free_uncached_first,
        )
        self.kv = PagedKVPool(**shape, num_blocks=num_blocks, block_size=block_size, dtype=self.dtype, device=self.device)

        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        self.stop_token_ids = {eos} if isinstance(eos, int) else set(eos or ())
        self.max_model_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self._request_counter = itertools.count()
        # One lock around every step that touches the pool or the model, so several streams
        # (a server's clients) interleave their steps token by token. Reentrant: a caller that
        # holds it can still close() a stream, whose cleanup takes it again.
        self.lock = threading.RLock()
        self.allocator_lock = threading.RLock()
        self.batching = batching
        self.scheduler_options = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
        self.loop = None  # the EngineLoop, started by the first batched request

    # --- prompts -----------------------------------------------------------------------------

    def tokenize(self, prompt) -> list[int]:
        """Token ids of a prompt: a str (tokenized as is), a list of chat messages
        ({"role", "content"}: the chat template with the assistant's turn opened), or a list
        of token ids (used as they are)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give some text, messages or token ids")
            return self.tokenizer.encode(check_text(prompt, "the prompt"))
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(
                f"prompt must be a non-empty str, list of messages or list of token ids, got {prompt!r:.80}"
            )
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab_size = self.model.get_input_embeddings().num_embeddings
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token ids must be in [0, {vocab_size}) for this model; got {bad[:5]}")
            return list(prompt)
        for message in prompt:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
                raise ValueError(
                    f'each chat message must be a dict {{"role": str, "content": str}}, got {message!r:.80}'
                )
            if message["role"] not in CHAT_ROLES:
                raise ValueError(f"unknown chat role {message['role']!r:.40}; a message's role is one of {', '.join(CHAT_ROLES)}")
            check_text(message["content"], "a message's content")
        if not self.tokenizer.chat_template:
            raise ValueError("this tokenizer has no chat template: pass the prompt as a str instead of messages")
        return list(self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, return_dict=False))

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
                       stop: str | Sequence[str] | None = None, *, max_num_seqs: int = 64,
                       max_num_batched_tokens: int = 2048) -> list[Generation]:
        """Run many requests together, one forward pass per step for all of them (continuous
        batching on the paged pool: batch_engine.py); their Generations, in the order given.

        Every prompt is checked before any runs. Requests that do not all fit in the pool at
        once wait, or are preempted and resumed, instead of being refused.
        """
        from batch_engine import BatchRunner  # it builds on this file, so it is imported when used

        params, cache_salt, stop = _check_request(max_tokens, temperature, top_p, seed, cache_salt, stop)
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts (str, messages or token ids)")
        all_ids = [self.tokenize(prompt) for prompt in prompts]
        for ids in all_ids:
            self._check_fits(len(ids), max_tokens)
        runner = BatchRunner(self, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        requests = [runner.add(f"batch-{next(self._request_counter)}", ids, params, cache_salt, stop) for ids in all_ids]
        try:
            return runner.run(requests)
        finally:
            with self.allocator_lock:
                for request in requests:  # after a failure: give every block back
                    runner.scheduler.finish(request)

    def stream(self, prompt, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, cache_salt: str | None = None, request_id: str | None = None,
               stop: str | Sequence[str] | None = None) -> Iterator[StreamEvent]:
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
        """
        arrival = time.perf_counter()
        params, cache_salt, stop = _check_request(max_tokens, temperature, top_p, seed, cache_salt, stop)
        prompt_ids = self.tokenize(prompt)
        self._check_fits(len(prompt_ids), max_tokens)
        if request_id is None:
            request_id = f"request-{next(self._request_counter)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str or None, got {request_id!r:.40}")
        with self.allocator_lock:
            if request_id in self.allocator.requests or (self.loop is not None and request_id in self.loop.live):
                raise ValueError(f"request id {request_id!r} is already running; pick another id")
        if self.batching:
            return self._run_batched(request_id, prompt_ids, params, cache_salt, stop)
        return self._run(request_id, prompt_ids, params, cache_salt, stop, arrival)

    def _run_batched(self, request_id, prompt_ids, params, cache_salt, stop) -> Iterator[StreamEvent]:
        """Submit to the engine loop when iteration starts; its events as they come."""
        from batch_engine import EngineLoop  # it builds on this file, so it is imported when used

        with self.allocator_lock:
            if self.loop is None:
                self.loop = EngineLoop(self, **self.scheduler_options)
        yield from self.loop.events(self.loop.submit(request_id, prompt_ids, params, cache_salt, stop))

    def _forward(self, token_ids: list[int], past_key_values):
        """Logits of the last position. past_key_values grows in place by len(token_ids)
        tokens; position ids continue after what it already holds."""
        input_ids = torch.tensor([token_ids], device=self.device)
        output = self.model(input_ids=input_ids, past_key_values=past_key_values, use_cache=True, logits_to_keep=1)
        return output.logits[0, -1]

    def _run(self, request_id, prompt_ids, params, cache_salt, stop, arrival) -> Iterator[StreamEvent]:

        alloc, block_size = self.allocator, self.allocator.block_size
        reply = Generation(request_id, prompt_tokens=len(prompt_ids))
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        allocated = False
        num_computed = 0  # tokens whose K/V are in the pool
        try:
            # Allocation and prefill are one step, under one hold of the lock. allocate_with_prefix
            # caches the prompt's full blocks at once; if the lock were let go before their K/V
            # is written, another request could hit them and read slots nobody wrote yet.
            with self.lock, torch.inference_mode():
                clock = _Stopwatch(self.device)
                with self.allocator_lock:
                    try:
                        num_cached, _ = alloc.allocate_with_prefix(request_id, prompt_ids, cache_salt=cache_salt)
                    except OutOfBlocksError as err:
                        raise OutOfBlocksError(f"{err} (num_blocks / --num-blocks). Now: {self.kv}") from err
                    table = list(alloc.block_tables[request_id])
                allocated = True
                reply.cached_tokens = num_computed = num_cached
                reply.prefill.lookup_ms = clock.lap()
                past_key_values = self.kv.gather(table[: num_cached // block_size], self.model.config)
                reply.prefill.gather_ms = clock.lap()
                logits = self._forward(prompt_ids[num_cached:], past_key_values)
                reply.prefill.forward_ms = clock.lap()
                self.kv.write(past_key_values, table, num_cached, len(prompt_ids))
                num_computed = len(prompt_ids)
                reply.prefill.write_ms = clock.lap()
                token = sample(logits, params, generator)
                reply.prefill.sample_ms = clock.lap()
            reply.ttft_ms = (time.perf_counter() - arrival) * 1e3

            while True:
                reply.token_ids.append(token)
                text, hit_stop = self._new_text(reply, stop)
                if hit_stop or token in self.stop_token_ids:
                    reply.finish_reason = "stop"
                elif len(reply.token_ids) == params.max_tokens:
                    reply.finish_reason = "length"
                if reply.finish_reason:
                    break
                yield StreamEvent(token, text, None, reply)
                with self.lock, torch.inference_mode():
                    with self.allocator_lock:
                        alloc.append_token(request_id, token)  # its K/V is computed right below
                        table = list(alloc.block_tables[request_id])
                    logits = self._forward([token], past_key_values)
                    self.kv.write(past_key_values, table, num_computed, num_computed + 1)
                    num_computed += 1
                    token = sample(logits, params, generator)
        finally:
            if allocated:
                with self.allocator_lock:
                    # Normally every token is computed by now; after a failure, free un-caches
                    # the blocks whose slots were never written.
                    alloc.free(request_id, num_computed_tokens=num_computed)
        # The last event comes after the free, so whoever sees finish_reason sees the pool whole.
        reply.total_ms = (time.perf_counter() - arrival) * 1e3
        if not hit_stop:
            text += self._new_text(reply, stop, final=True)[0]  # what was held back
        yield StreamEvent(token, text, reply.finish_reason, reply)

    def _new_text(self, reply: Generation, stop: tuple[str, ...] = (), final: bool = False) -> tuple[str, bool]:
        """Decode the reply so far; return what it adds to reply.text, and whether it
        reached a stop string (the text is then cut just before it).

        Text that could be the start of a stop string is held back until the next tokens
        tell, and so is half a multi-byte character; final=True lets it all out.
        """
        text = self.tokenizer.decode(reply.token_ids, skip_special_tokens=True)
        found = [i for i in (text.find(s, max(0, len(reply.text) - len(s))) for s in stop) if i >= 0]
        if found:
            end = min(found)
        elif final:
            end = len(text)
        elif text.endswith("\ufffd"):
            return "", False  # a multi-byte character split across tokens: wait for its other bytes
        else:
            end = len(text) - _held_back(text, stop)
        end = max(end, len(reply.text))
        new, reply.text = text[len(reply.text) : end], text[:end]
        return new, bool(found)

    def warm_up(self) -> None:
        """One throwaway forward pass outside the pool, so the first timed request does not
        pay for one-time setup (buffer allocation, kernel choice, the CUDA context)."""
        with self.lock, torch.inference_mode():
            self.model(input_ids=torch.zeros(1, 16, dtype=torch.long, device=self.device), logits_to_keep=1)


# -----------------------------------------------------------------------------
# 4. Command-line flags: the model and the pool, shared by the demo, benchmarks and server


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
