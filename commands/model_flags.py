"""
The model and pool flags the demo, the benchmarks, the lessons and the server share.

    add_model_arguments   --model, --device, --dtype, --block-size, --num-blocks or --kv-memory-gb
    pool_arguments        the Engine's pool keywords from those flags
    engine_from_flags     the Engine those flags name: the one way a command loads its model

Read engine/llm_engine.py first: the flags show its defaults (the offline model, DEFAULT_KV_MEMORY_GB of
memory for the pool) and pool_arguments hands the pool's size to it. The argparse types are
commands/flags.py's, apart, so that commands without torch can use them.

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_model_arguments(parser)
    >>> pool_arguments(parser.parse_args(["--block-size", "8", "--num-blocks", "64"]))
    {'block_size': 8, 'num_blocks': 64, 'kv_memory_gb': None}
"""

from __future__ import annotations

import argparse

from commands.flags import positive_float, positive_int
from engine.llm_engine import DEFAULT_KV_MEMORY_GB, Engine
from engine.model_files import DEFAULT_MODEL
from engine.model_loader import DTYPES


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the model and size its KV pool (shared by the demo and benchmarks)."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None, help=f"Hugging Face id or local path (default: {DEFAULT_MODEL}, offline)")
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when there is a GPU)")
    group.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: fp32 on CPU, bf16 on a GPU that computes it natively, else fp16")
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


def engine_from_flags(args: argparse.Namespace, **options) -> Engine:
    """The Engine add_model_arguments' flags name: the model (--model, --device, --dtype, loaded
    on a thread of its own, engine/cpu_threads.py says why) and its pool; `options` are any other
    EngineConfig fields (enable_caching=False, config=...). The demo, the server and the
    benchmarks load their model through it, and the lessons for every model but --tiny's."""
    return Engine(args.model, device=args.device, dtype=args.dtype, **pool_arguments(args), **options)
