"""
Automatic prefix caching, the way vLLM v1 does it: a course you can run, read and test.

This file is the front door. Imported, it gives the allocator's names (their code is
allocator/prefix_caching.py, pure Python: importing this file loads no torch):

    from prefix_caching import PrefixCachingAllocator

Run, it is the course's command line:

    python prefix_caching.py --walkthrough      # the documented example, block for block
    python prefix_caching.py --demo             # a real model, MISS then HITs (--no-cache to compare)
    python prefix_caching.py --analyze LOG      # your own traffic replayed: hit rate vs pool size
    python prefix_caching.py --bench NAME       # a measurement (--bench NAME --help: what it times)

It sits above everything it runs (commands/, analyzer/, benchmarks/), and no module of the
course imports it: each imports the package it needs, so the imports point one way, down. A
mode's modules are imported only when it is asked for, since most of them load torch.
"""

from __future__ import annotations

import argparse
import importlib

from allocator import *  # noqa: F403 (the names listed in allocator.__all__)
from allocator import __all__  # noqa: F401

DESCRIPTION = "Automatic prefix caching, the way vLLM v1 does it: a course you can run, read and test."
EPILOG = """References:
    vLLM v1 design doc, "Automatic Prefix Caching"
        https://docs.vllm.ai/en/latest/design/prefix_caching.html
    vLLM source: vllm/v1/core/block_pool.py, kv_cache_utils.py, kv_cache_manager.py
    the allocator this course builds: allocator/prefix_caching.py

Run:
    python prefix_caching.py --walkthrough      # the documented example, block for block
    python prefix_caching.py --demo             # a real model, MISS then HITs (--no-cache to compare)
    python prefix_caching.py --analyze LOG      # your own traffic replayed: hit rate vs pool size
    python prefix_caching.py --bench NAME       # a measurement (--bench NAME --help: what it times)"""

BENCHMARKS = ("allocator", "ttft", "throughput", "chunked_prefill", "stalls", "attention", "paged", "padded_decode", "step_profile",
              "busy", "server_load", "server_abuse", "first_prompt", "cache_probe", "analyzer", "caching_models", "router",
              "fleet", "gpu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="prefix_caching.py", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    parser.add_argument("-h", "--help", action="store_true", help="this help; after a mode, that mode's flags")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--walkthrough", action="store_true", help="replay the vLLM design doc's worked example")
    mode.add_argument("--demo", action="store_true", help="a real model answering questions behind one long system prompt")
    mode.add_argument("--analyze", metavar="LOG",
                      help="replay a request log through the allocator: hit rate vs pool size, the working set, "
                      "hot prefixes, warnings (the flags after it are the analyzer's)")
    mode.add_argument("--bench", choices=BENCHMARKS, help="run a benchmark; the flags after it are the benchmark's")
    args, rest = parser.parse_known_args(argv)
    if args.help and (args.demo or args.bench or args.analyze):
        rest.append("--help")  # the mode's own parser lists its flags
    if args.analyze:
        from analyzer import workload_analyzer  # no torch: a log needs only a tokenizer

        workload_analyzer.main([args.analyze, *rest])
    elif args.bench:
        importlib.import_module(f"benchmarks.{args.bench}").main(rest)
    elif args.demo:
        from commands import demo  # the modes import torch and the model: only the one asked for is loaded
        from commands.model_flags import add_model_arguments

        demo_parser = argparse.ArgumentParser(prog="prefix_caching.py --demo", description=demo.__doc__.strip().split("\n")[0])
        demo_parser.add_argument("--no-cache", action="store_true", help="the same requests with prefix caching off")
        demo_parser.add_argument("--json", metavar="PATH", help="also write each request's tokens and TTFT as JSON")
        demo_parser.add_argument("--long-prefix", action=argparse.BooleanOptionalAction, default=None,
                                 help="then ask again behind the course reader (4,000+ shared tokens) and find where a "
                                      "HIT starts to pay (default: on a GPU only)")
        add_model_arguments(demo_parser)
        demo.run_demo(demo_parser.parse_args(rest))
    elif args.help:
        parser.print_help()
    elif rest or not args.walkthrough:
        parser.error(f"unrecognized arguments: {' '.join(rest)}" if rest
                     else "choose --walkthrough, --demo, --analyze LOG or --bench NAME")
    else:
        from commands.walkthrough import walkthrough

        walkthrough()



if __name__ == "__main__":
    main()
