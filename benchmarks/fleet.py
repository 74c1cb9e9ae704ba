"""The analyzer's fleet prediction (analyzer/fleet.py) checked request by request against the
real router: the same log through sglang-router 0.3.2 in front of replicas of this course's
server, one request after another, under each policy.

    python prefix_caching.py --bench fleet                       # two logs, 3 replicas, four policies
    python prefix_caching.py --bench fleet --replicas 2 --num-blocks 300 --json out.json

The two logs have different shapes: the multi-turn chats of lessons/data (40 users, 8 chatting
at a time, their histories sent back each turn) and request_logs.agent (six agents' sessions,
three at a time, history growing to about 3,500 tokens, each its own tenant's cache_salt).
Each replica is a server of this course in this process over a 2-layer Llama with random
weights on the default model's vocabulary and 8,192 positions (what a prompt finds cached does
not depend on the weights; a 135M model would spend the run prefilling), a pool of
--num-blocks blocks in vLLM's order (hashless blocks freed first), so the analyzer replays
each replica as --like vllm with one block more, vLLM's null block. The router is started
as its CLI starts it (benchmarks/router.py), a fresh one for each policy, the replicas'
caches reset, its tree's eviction out of reach (--max-tree-size 2**26 characters, the
default, far above these logs).

For each request: the replica the router chose against the predicted one (compared up to a
renaming, each numbered by its first request: the router's order of its workers is a hash
map's), and the cached tokens that replica reported against the prediction. random and
power_of_two draw their replicas, so for them the prediction of which replica is chance; the
replicas' cached tokens are also checked given the router's own picks (the same replay, with
the replicas the router chose). One more column replays the prediction as if the router passed
a chat's cache_salt on to the replica: on the agents' log, whose sessions are tenants with the
same system prompt, that is the rule that decides whether a replica finds it cached.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import tempfile
from pathlib import Path

from analyzer.fleet import RouterFlags, Routing, route_log
from analyzer.log_replay import LIKE, tokenize_log
from analyzer.request_logs import Log, agent, interleave, write_log
from analyzer.workload_analyzer import replay_fleet
from benchmarks import save_json
from benchmarks.router import POLICIES, ROUTER_VERSION, Fleet, replay_through_router, reset_caches, router
from commands.flags import positive_int

ROOT = Path(__file__).resolve().parents[1]
MULTI_TURN = ROOT / "lessons" / "data" / "multi_turn.jsonl.xz"
POSITIONS = 8192  # the replicas' model: room for the agents' longest history


def canonical(replicas: list[int]) -> list[int]:
    """Replicas renamed by their first request: the same split of a log reads the same.

    >>> canonical([2, 2, 0, 1, 0])
    [0, 0, 1, 2, 1]
    """
    names: dict[int, int] = {}
    return [names.setdefault(r, len(names)) for r in replicas]


def compare(predicted_replicas: list[int], predicted_cached, real) -> dict:
    """Per request: the same replica (up to a renaming), the same cached tokens, both."""
    same_replica = [a == b for a, b in zip(canonical(predicted_replicas), canonical([r.replica for r in real]))]
    same_cached = [int(a) == r.cached_tokens for a, r in zip(predicted_cached, real)]
    return {"requests": len(real), "same_replica": sum(same_replica), "same_cached": sum(same_cached),
            "both": sum(a and b for a, b in zip(same_replica, same_cached))}


def logs(folder: Path, conversations_at_once: int) -> dict[str, list]:
    """The two logs' requests, by name, in the order they are sent."""
    agent_log = folder / "agent.jsonl"
    write_log(agent_log, agent())
    return {f"multi_turn x{conversations_at_once}": interleave(Log.read(MULTI_TURN).requests, conversations_at_once),
            "agent": Log.read(agent_log).requests}


def start_replicas(n: int, num_blocks: int, block_size: int, stack):
    """n servers of this course in this process, each with its own engine and pool; their URLs."""
    from engine.llm_engine import Engine
    from engine.model_files import load_tokenizer
    from engine.model_loader import random_model, tiny_llama
    from server import create_app
    from serving.connections import serve_in_background

    # No line per request on the screen, nor for the router's probes: its HTTP/2 preface (505)
    # and SGLang's routes this server has not (404); a request that fails raises in the replay.
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    logging.getLogger("server").setLevel(logging.ERROR)
    tokenizer = load_tokenizer()
    config = tiny_llama(tokenizer).config
    config.max_position_embeddings = POSITIONS
    model = random_model(config, device="cpu")
    urls = []
    for _ in range(n):
        engine = Engine(model=model, tokenizer=tokenizer, block_size=block_size, num_blocks=num_blocks,
                        free_uncached_first=True)
        url, server = serve_in_background(create_app(engine, model_name="tiny-8k"))
        stack.callback(engine.close)
        stack.callback(server.shutdown)
        urls.append(url)
    return tokenizer, urls


def main(argv: list[str] | None = None) -> list[dict]:
    import contextlib

    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=positive_int, default=3)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--num-blocks", type=positive_int, default=300,
                        help="each replica's pool (default 300 blocks: the longest prompt fits, the logs evict)")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--conversations-at-once", type=positive_int, default=8, metavar="N",
                        help="the multi-turn log's users chatting at a time (default 8)")
    parser.add_argument("--requests", type=positive_int, default=None, metavar="N",
                        help="send only the first N requests of each log")
    parser.add_argument("--json", metavar="PATH", help="also write the results, every request's prediction and reply")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 130))
    results = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fleet-") as folder, contextlib.ExitStack() as stack:
        tokenizer, urls = start_replicas(args.replicas, args.num_blocks, args.block_size, stack)
        for name, requests in logs(Path(folder), args.conversations_at_once).items():
            requests = requests[: args.requests]
            prompts = tokenize_log(requests, tokenizer)
            salts = [r.cache_salt for r in requests]
            for policy in args.policies:
                reset_caches(urls)
                with router(urls, policy) as url:
                    real = replay_through_router(Fleet(url, tuple(urls), policy), requests)
                routing = route_log(requests, args.replicas, RouterFlags(policy))
                # --like vllm: the replicas free hashless blocks first; the analyzer counts vLLM's null block too
                predicted = replay_fleet(prompts, salts, routing, args.num_blocks + 1, args.block_size, LIKE["vllm"])
                result = {"log": name, "policy": policy} | compare(routing.replica, predicted.cached, real)
                given = Routing(args.replicas, policy, [r.replica for r in real], routing.match_rate,
                                routing.keeps_salt, predictable=True)
                on_its_picks = replay_fleet(prompts, salts, given, args.num_blocks + 1, args.block_size, LIKE["vllm"])
                result["same_cached_on_its_picks"] = sum(int(a) == r.cached_tokens for a, r in zip(on_its_picks.cached, real))
                salted = Routing(args.replicas, policy, routing.replica, routing.match_rate, [True] * len(requests),
                                 predictable=True)  # as if the router passed every cache_salt on
                had_salt = replay_fleet(prompts, salts, salted, args.num_blocks + 1, args.block_size, LIKE["vllm"])
                result["same_cached_had_the_salt_arrived"] = compare(routing.replica, had_salt.cached, real)["both"]
                result["same_prompt_tokens"] = sum(len(p) == r.prompt_tokens for p, r in zip(prompts, real))
                result["hit_rate"] = {"predicted": round(predicted.hit_rate, 4),
                                      "real": round(sum(r.cached_tokens for r in real) / sum(r.prompt_tokens for r in real), 4)}
                result["per_request"] = [{"predicted_replica": p, "replica": r.replica, "predicted_cached": int(c),
                                          "cached": r.cached_tokens, "prompt_tokens": r.prompt_tokens}
                                         for p, c, r in zip(routing.replica, predicted.cached, real)]
                results.append(result)
                console.print(f"  {name}, {policy}: {result['both']} of {result['requests']} requests alike")
    load_after = os.getloadavg()

    table = Table(title=f"the fleet prediction against sglang-router {ROUTER_VERSION}: {args.replicas} replicas of "
                        f"{args.num_blocks} blocks of {args.block_size}, requests one after another",
                  caption="same replica: up to a renaming of the replicas; its picks: the replicas' caches replayed "
                          "with the replicas the router chose; salt kept: the prediction had the router passed a chat's "
                          "cache_salt on")
    for column in ("log", "policy", "requests", "same replica", "same cached", "both", "cached, its picks",
                   "both, salt kept", "hit rate: predicted", "real"):
        table.add_column(column, justify="right", no_wrap=column == "log")
    for r in results:
        n = r["requests"]
        table.add_row(r["log"], r["policy"], str(n), f"{r['same_replica'] / n:.0%}", f"{r['same_cached'] / n:.0%}",
                      f"{r['both'] / n:.0%}", f"{r['same_cached_on_its_picks'] / n:.0%}",
                      f"{r['same_cached_had_the_salt_arrived'] / n:.0%}", f"{r['hit_rate']['predicted']:.1%}",
                      f"{r['hit_rate']['real']:.1%}")
    console.print(table)
    console.print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}; "
                  f"{platform.machine()}, {os.cpu_count()} cores")
    save_json(args.json, {"router": ROUTER_VERSION, "replicas": args.replicas, "num_blocks": args.num_blocks,
                          "block_size": args.block_size, "runs": results}, console)
    return results


if __name__ == "__main__":
    main()
