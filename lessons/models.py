"""
The model a model stage (1, 2, 7, 8, 9, and 10's sections 6 and 8) runs, chosen on its command line:

    (no flag)        SmolLM2-135M-Instruct, the offline default (model_loader.load_model)
    --model NAME     any Hugging Face causal LM, by id or local path
    --tiny           a 2-layer Llama with random weights, built in a second: for tests and
                     quick runs. Its text is gibberish, but every comparison a stage makes
                     (cached against uncached, warm against cold) holds for it as well.
    --device, --dtype  where and in what precision it runs (default: cuda if there is a GPU)

    >>> vars(parse_args("a model stage", ["--tiny"]))
    {'model': None, 'device': None, 'dtype': None, 'tiny': True}
"""

import argparse

from commands.model_flags import add_model_arguments, engine_from_flags, pool_arguments
from engine import Engine
from engine.cpu_threads import ThreadChooser
from engine.model_loader import (
    DEFAULT_MODEL, DTYPES, default_model_dir, load_model, resolve_device, resolve_dtype, tiny_llama,
)


def add_arguments(parser: argparse.ArgumentParser, engine: bool = False) -> None:
    """--model, --device, --dtype and --tiny; with engine=True also the KV pool's
    --block-size and --num-blocks (model_flags.add_model_arguments)."""
    if engine:
        add_model_arguments(parser)
    else:
        group = parser.add_argument_group("model")
        group.add_argument("--model", default=None, help=f"Hugging Face id or local path (default: {DEFAULT_MODEL}, offline)")
        group.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when there is a GPU)")
        group.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--tiny", action="store_true", help="a tiny model with random weights: seconds, gibberish text")


def parse_args(description: str, argv: list[str] | None = None, engine: bool = False,
               formatter_class=argparse.HelpFormatter) -> argparse.Namespace:
    """The command line of a model stage (see add_arguments)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=formatter_class)
    add_arguments(parser, engine)
    args = parser.parse_args(argv)
    if args.tiny and args.model is not None:
        parser.error(f"--tiny and --model {args.model} name two different models: pass one of them")
    return args


def load(args: argparse.Namespace, tiny_context: int = 1024):
    """(model, tokenizer) as the flags ask; the tiny model borrows SmolLM2's tokenizer, and
    has tiny_context positions."""
    if not args.tiny:
        return load_model(args.model, device=args.device, dtype=args.dtype)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    device = resolve_device(args.device)
    return tiny_llama(tokenizer, tiny_context).to(device, resolve_dtype(args.dtype, device)), tokenizer


# The thread count of every forward pass a stage runs itself (stages 1 and 2), chosen as the
# engine chooses it (engine/cpu_threads.py): a timing on a busy laptop is then the engine's, not
# torch's threads waiting for a core another program took.
THREADS = ThreadChooser()

TINY_NUM_BLOCKS = 1024  # the default 0.5 GiB budget would give the tiny model 65,536 of its small blocks


def make_engine(args: argparse.Namespace, max_num_batched_tokens: int | None = None, tiny_context: int = 1024) -> Engine:
    """An Engine over the model the flags name, its pool sized by --block-size and --num-blocks
    (or --kv-memory-gb): its requests run in stage 8's engine loop, as `python server.py`'s do;
    stage 7 runs engine/one_request.py's path over its parts."""
    if not args.tiny:
        return engine_from_flags(args, max_num_batched_tokens=max_num_batched_tokens)
    model, tokenizer = load(args, tiny_context)
    pool = pool_arguments(args)
    if pool["num_blocks"] is None and pool["kv_memory_gb"] is None:
        pool["num_blocks"] = TINY_NUM_BLOCKS
    return Engine(model=model, tokenizer=tokenizer, max_num_batched_tokens=max_num_batched_tokens, **pool)


def describe(model, args: argparse.Namespace) -> str:
    """One line saying what runs where, and for the tiny model, why its text is gibberish."""
    text = model.config.get_text_config()
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    name = "tiny random Llama" if args.tiny else args.model or DEFAULT_MODEL
    line = (f"[bold]{name}[/]: {text.num_hidden_layers} layers, {millions:,.1f}M parameters, "
            f"on {model.device}, {str(model.dtype).removeprefix('torch.')}")
    if args.tiny:
        line += (". [italic]Its weights are random: its text is gibberish and its timings say little about "
                 "a real model, but what the stage counts and compares holds all the same.[/]")
    return line
