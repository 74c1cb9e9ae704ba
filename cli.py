"""
The command line of `python prefix_caching.py`: --walkthrough, --demo, --analyze LOG, --bench NAME.

prefix_caching.py is the allocator, at the bottom of the course; the modes are built on it
(walkthrough.py, demo.py, analyzer/, benchmarks/), so the dispatch that imports them lives here, above
them all. prefix_caching.py's `if __name__ == "__main__":` calls main().
"""

from __future__ import annotations

import argparse
import importlib

import prefix_caching

BENCHMARKS = ("allocator", "ttft", "throughput", "chunked_prefill", "stalls", "attention", "paged", "step_profile",
              "busy", "server_load", "server_abuse", "first_prompt", "cache_probe", "analyzer", "caching_models", "router",
              "fleet", "gpu")


def main(argv: list[str] | None = None) -> None:
    paragraphs = prefix_caching.__doc__.split("\n\n")
    parser = argparse.ArgumentParser(prog="prefix_caching.py", description=paragraphs[0], epilog="\n\n".join(paragraphs[-2:]),
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
        import demo  # the modes import torch and the model: only the one asked for is loaded
        from model_flags import add_model_arguments

        demo_parser = argparse.ArgumentParser(prog="prefix_caching.py --demo", description=demo.__doc__.strip().split("\n")[0])
        demo_parser.add_argument("--no-cache", action="store_true", help="the same requests with prefix caching off")
        demo_parser.add_argument("--json", metavar="PATH", help="also write each request's tokens and TTFT as JSON")
        add_model_arguments(demo_parser)
        demo.run_demo(demo_parser.parse_args(rest))
    elif args.help:
        parser.print_help()
    elif rest or not args.walkthrough:
        parser.error(f"unrecognized arguments: {' '.join(rest)}" if rest
                     else "choose --walkthrough, --demo, --analyze LOG or --bench NAME")
    else:
        from walkthrough import walkthrough

        walkthrough()


if __name__ == "__main__":
    main()
