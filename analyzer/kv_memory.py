"""
The memory to buy: a working set in blocks, turned into GiB of KV cache for a named model,
and into the flags that give a server that much.

The workload analyzer (workload_analyzer.py) finds the working set: the smallest pool that
saves 95 % of what a pool that never evicts saves. That is a count of blocks of the model it
tokenized with; what a deployer buys is bytes, for their model:

    1. the model's KV shape   layers, KV heads, head size, the KV dtype: from a config.json,
                              or a small table of well-known grouped-query-attention models
    2. bytes                  per token and per block, as vLLM counts them; the cache's
                              working set plus the running requests' own KV
    3. flags                  vLLM's, SGLang's and llama.cpp's, named from their sources

    >>> shape = KNOWN_MODELS["Llama-3.1-8B"]
    >>> shape.bytes_per_token(), shape.bytes_per_block(16)     # 128 KiB a token, 2 MiB a block
    (131072, 2097152)

A model whose attention is not one K and one V per KV head per token is refused by name: MLA
(DeepSeek's kv_lora_rank: one compressed latent per token) and sliding windows (a layer keeps
only the last window's tokens). Their bytes per token need other formulas, not these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from analyzer.llama_slots import StateBytes

# -----------------------------------------------------------------------------
# 1. The model's KV shape

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class KVShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str  # the KV cache's dtype as a server serves the model (served_dtype), unless it is told otherwise
    config_dtype: str | None = None  # the checkpoint's own (its config.json's), where it differs from dtype

    def bytes_per_token(self) -> int:
        """K and V, for every KV head, in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]

    def bytes_per_block(self, block_size: int) -> int:
        """vllm/v1/kv_cache_interface.py, AttentionSpec.page_size_bytes: block_size x
        num_kv_heads x (head_size + head_size_v) x dtype size, one page per layer."""
        return self.num_layers * block_size * self.num_kv_heads * (self.head_size + self.head_size) \
            * DTYPE_BYTES[self.dtype]


# From each model's config.json on its Hugging Face page: num_hidden_layers,
# num_key_value_heads, head_dim (or hidden_size / num_attention_heads), torch_dtype.
KNOWN_MODELS = {shape.name: shape for shape in (
    KVShape("Llama-3.1-8B", 32, 8, 128, "bfloat16"),
    KVShape("Llama-3.1-70B", 80, 8, 128, "bfloat16"),
    KVShape("Qwen2.5-7B", 28, 4, 128, "bfloat16"),  # its sliding_window is unused: use_sliding_window is false
    KVShape("Mistral-7B-v0.3", 32, 8, 128, "bfloat16"),  # v0.1 had a 4,096-token window: refused
    KVShape("SmolLM2-135M", 30, 3, 64, "bfloat16"),  # this course's default model
)}


def served_dtype(config_dtype: str) -> str:
    """The dtype vLLM serves a checkpoint in at its default `--dtype auto`, and so its KV
    cache's (_resolve_auto_dtype in vllm/config/model.py): a float32 checkpoint is downcast
    to the platform's first supported dtype, bfloat16 on a GPU that has it (NVIDIA from
    Ampere on, the GPUs these sizes are for); any other dtype is served as it is.

    >>> served_dtype("float32"), served_dtype("float16")
    ('bfloat16', 'float16')
    """
    return "bfloat16" if config_dtype == "float32" else config_dtype


class UnsupportedModel(ValueError):
    """A model whose KV cache these formulas do not describe; the message says why."""


def kv_shape(model: str, kv_dtype: str | None = None) -> KVShape:
    """The KV shape of a model in KNOWN_MODELS or of a config.json (or a folder holding one);
    `kv_dtype` overrides the model's dtype (a server's --kv-cache-dtype)."""
    if model in KNOWN_MODELS:
        shape = KNOWN_MODELS[model]
    else:
        path = Path(model)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise UnsupportedModel(f"{model!r} is neither a config.json nor one of {', '.join(KNOWN_MODELS)}; "
                                   f"give the path of the model's config.json")
        try:
            config = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise UnsupportedModel(f"{path}: not a JSON config ({err})") from None
        shape = shape_from_config(config, path.parent.name or str(path))
    if kv_dtype is not None:
        if kv_dtype not in DTYPE_BYTES:
            raise UnsupportedModel(f"unknown KV dtype {kv_dtype!r}; give one of {', '.join(DTYPE_BYTES)}")
        shape = KVShape(shape.name, shape.num_layers, shape.num_kv_heads, shape.head_size, kv_dtype)
    return shape


def shape_from_config(config: dict, name: str) -> KVShape:
    """Read a Hugging Face config.json (a multimodal one's text_config); refuse MLA and
    sliding windows by name.

    >>> shape_from_config({"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    ...                    "hidden_size": 256, "torch_dtype": "float16"}, "tiny")
    KVShape(name='tiny', num_layers=2, num_kv_heads=2, head_size=32, dtype='float16', config_dtype=None)
    """
    config = config.get("text_config") or config
    if config.get("kv_lora_rank"):
        raise UnsupportedModel(f"{name} uses multi-head latent attention (kv_lora_rank "
                               f"{config['kv_lora_rank']}): its KV is one compressed latent per token, which "
                               f"this formula does not count; not supported yet")
    uses_window = config.get("use_sliding_window", True) and config.get("sliding_window")
    if uses_window or "sliding_attention" in (config.get("layer_types") or []):
        raise UnsupportedModel(f"{name} uses sliding-window attention (sliding_window "
                               f"{config.get('sliding_window')}): its layers keep only a window of tokens, "
                               f"which this formula does not count; not supported yet")
    try:
        layers, heads, hidden = config["num_hidden_layers"], config["num_attention_heads"], config.get("hidden_size")
        head_size = config.get("head_dim") or hidden // heads
    except (KeyError, TypeError):
        raise UnsupportedModel(f"{name}: the config lacks num_hidden_layers, num_attention_heads and head_dim "
                               f"(or hidden_size); is it a decoder-only language model's config.json?") from None
    # vLLM takes a config without a dtype as float32 (unless its safetensors say otherwise), then downcasts it.
    own = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    if own not in DTYPE_BYTES:
        raise UnsupportedModel(f"{name}: unknown dtype {own!r}; give the KV dtype explicitly")
    dtype = served_dtype(own)
    return KVShape(name, layers, config.get("num_key_value_heads") or heads, head_size, dtype,
                   own if own != dtype else None)


# -----------------------------------------------------------------------------
# 2. Bytes: the cache's working set and the running requests' own KV
#
# The working set is the cache that keeps what the traffic reuses. Requests that are running
# hold their own blocks besides (the replay frees each one before the next): for
# `concurrency` requests of `context` tokens (prompt and reply), concurrency x
# ceil(context / block_size) blocks more.

GIB = 2**30


@dataclass(frozen=True)
class MemoryToBuy:
    shape: KVShape
    block_size: int
    cache_blocks: int  # the working set
    running_blocks: int  # concurrency x ceil(context / block_size)
    concurrency: int
    context: int

    @property
    def blocks(self) -> int:
        return self.cache_blocks + self.running_blocks

    @property
    def bytes(self) -> int:
        return self.blocks * self.shape.bytes_per_block(self.block_size)

    def gib(self, blocks: int | None = None) -> float:
        return (self.blocks if blocks is None else blocks) * self.shape.bytes_per_block(self.block_size) / GIB


def memory_to_buy(shape: KVShape, block_size: int, working_set: int, concurrency: int, context: int) -> MemoryToBuy:
    """
    >>> m = memory_to_buy(KNOWN_MODELS["Llama-3.1-8B"], 16, working_set=1000, concurrency=8, context=4096)
    >>> m.running_blocks, round(m.gib(m.cache_blocks), 2), round(m.gib(), 2)
    (2048, 1.95, 5.95)
    """
    return MemoryToBuy(shape, block_size, working_set, concurrency * -(-context // block_size), concurrency, context)


# -----------------------------------------------------------------------------
# 3. The flags that give a server that much
#
# vLLM (vllm/config/cache.py, CacheConfig): --block-size, and the pool as a count of blocks
# (--num-gpu-blocks-override) or as bytes (--kv-cache-memory-bytes, which then takes the place
# of --gpu-memory-utilization). SGLang (python/sglang/srt/arg_groups/fields/schedule.py):
# --max-total-tokens counts the pool in tokens, --page-size its unit, --mem-fraction-static
# the share of GPU memory for weights and pool together. llama.cpp (common/arg.cpp): -c is
# the KV of the running sequences, split across --parallel slots unless --kv-unified; the
# prefixes it keeps between requests live in host memory, the prompt cache of --cache-ram MiB,
# which counts what llama.cpp copies of a sequence: its K/V and 12 bytes a token of cell
# (position, sequence count and id), and a header of 32 bytes and 24 a layer an entry, here
# left to the rounding up to whole MiB (llama_slots.StateBytes).


def server_flags(m: MemoryToBuy) -> dict[str, str]:
    """One line of flags per server (with tensor parallelism, each GPU holds its share)."""
    running_tokens = m.concurrency * m.context
    cache_tokens = m.cache_blocks * m.block_size
    per_token = StateBytes.llama_cpp(m.shape.num_layers, m.shape.bytes_per_token()).per_token
    cache_mib = -(-cache_tokens * per_token // 2**20)
    return {
        "vLLM": f"--block-size {m.block_size} --num-gpu-blocks-override {m.blocks} "
                f"(or --kv-cache-memory-bytes {m.bytes})",
        "SGLang": f"--max-total-tokens {m.blocks * m.block_size} (or a --mem-fraction-static that leaves "
                  f"{m.gib():.2f} GiB for the KV pool beside the weights)",
        "llama.cpp": f"-c {running_tokens} --parallel {m.concurrency} --kv-unified --cache-ram {cache_mib} "
                     f"(the running sequences on the device, the cached prefixes in host memory)",
    }
