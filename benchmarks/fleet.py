"""The analyzer's fleet prediction (analyzer/fleet.py) checked request by request against the
real router: the same log through sglang-router 0.3.2 in front of replicas of this course's
server, one request after another, under each policy.

    python prefix_caching.py --bench fleet                       # two logs, 3 replicas, four policies
    python prefix_caching.py --bench fleet --replicas 2 --num-blocks 300 --json out.json
    python prefix_caching.py --bench fleet --in-flight 3 --runs 2   # with requests in flight, twice

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

For each request: the replica the router chose against the predicted one (compared up to
the renaming that agrees most, `renamed`: the router's order of its workers is a hash map's),
and the cached tokens that replica reported against the prediction. random and
power_of_two draw their replicas, so for them the prediction of which replica is chance; the
replicas' cached tokens are also checked given the router's own picks (the same replay, with
the replicas the router chose). One more column replays the prediction as if the router passed
a chat's cache_salt on to the replica: on the agents' log, whose sessions are tenants with the
same system prompt, that is the rule that decides whether a replica finds it cached.

With --in-flight N the log is sent N requests at a time (replay_in_flight), as a busy fleet
gets it: the router sees loads and a replica's steps interleave its requests' chunks, which
the prediction one request after another does not see, and the prediction in time
(analyzer/fleet_replay.py, replay_in_time) does: N clients, the router's loads, each replica's
scheduler with a fixed budget of --max-num-batched-tokens a step (the replicas get the same
budget, not the time-based one a server of this course starts with, so the chunks are the
prediction's to know), its steps timed by a cost model measured before the runs on one
replica's engine (a step of 16 and of 512 tokens: its fixed cost and its cost a token) and
the gap of a request through the router (measured_service). --runs R sends each log R times
under each policy: how often the real router agrees with itself is the bar any prediction
of it can be held to.

With --keys the fleet is a class's, as benchmarks/router.py serves one: each replica takes the
students' keys (api_keys, salt_by_api_key) and the teacher's as its admin key, the router's
control plane the teacher's, and the class's door (benchmarks/router_front.py) stands in front;
each tenant of a log (its cache_salt, and the requests without one) sends with a student's key.
A replica then salts every request by its key, whatever the router drops of a chat's body,
and shares its steps fairly among the keys: both predictions replay that (every salt reaching
its replica; in time, fair share by key).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import json
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from analyzer.fleet import RouterFlags, Routing, route_log
from analyzer.log_replay import LIKE, tokenize_log
from analyzer.request_logs import Log, LoggedRequest, agent, interleave, write_log
from analyzer.fleet_replay import DRAWS, VLLM_SERVE_BUDGET, Service, replay_fleet, replay_in_time
from benchmarks import save_json
from benchmarks.router import (POLICIES, ROUTER_VERSION, Fleet, FleetError, Keys, Routed, clients, front,
                               replay_through_router, reset_caches, router, send)
from commands.flags import positive_int

ROOT = Path(__file__).resolve().parents[1]
MULTI_TURN = ROOT / "lessons" / "data" / "multi_turn.jsonl.xz"
POSITIONS = 8192  # the replicas' model: room for the agents' longest history
SEEDS = itertools.count(1)  # each request's seed, by which its replica notes it (noting)


def renamed(predicted: list[int], real: list[int]) -> list[int]:
    """`real`'s replicas renamed the way that agrees with `predicted` on the most requests: the
    router's order of its workers is a hash map's, so only the split of a log can be compared,
    not the names (and with requests in flight, the first requests may reach it in any order).
    Past 6 replicas (720 renamings), each real replica takes the name predicted for its first request.

    >>> renamed([0, 0, 1, 2, 1], [2, 2, 0, 1, 1])
    [0, 0, 1, 2, 2]
    """
    k = max([*predicted, *real], default=-1) + 1
    if k > 6:
        first: dict[int, int] = {}
        for a, b in zip(predicted, real):
            first.setdefault(b, a)
        return [first[b] for b in real]
    best = max(itertools.permutations(range(k)), key=lambda names: sum(a == names[b] for a, b in zip(predicted, real)))
    return [best[b] for b in real]


def compare(predicted_replicas: list[int], predicted_cached, real) -> dict:
    """Per request: the same replica (up to a renaming), the same cached tokens, both."""
    real_replicas = renamed(predicted_replicas, [r.replica for r in real])
    same_replica = [a == b for a, b in zip(predicted_replicas, real_replicas)]
    same_cached = [int(a) == r.cached_tokens for a, r in zip(predicted_cached, real)]
    return {"requests": len(real), "same_replica": sum(same_replica), "same_cached": sum(same_cached),
            "both": sum(a and b for a, b in zip(same_replica, same_cached))}


def logs(folder: Path, conversations_at_once: int) -> dict[str, list]:
    """The two logs' requests, by name, in the order they are sent."""
    agent_log = folder / "agent.jsonl"
    write_log(agent_log, agent())
    return {f"multi_turn x{conversations_at_once}": interleave(Log.read(MULTI_TURN).requests, conversations_at_once),
            "agent": Log.read(agent_log).requests}


def noting(app, served: dict[int, list[int]], index: int):
    """Replica `index`'s WSGI app, wrapped: the `seed` of each request it is sent noted as served
    there. A greedy request's seed changes no reply, and the router passes it on (it rebuilds a
    chat's body from its own type, which drops `user`). It reads the body and hands the app an
    unread copy."""

    def wrapped(environ, start_response):
        length = int(environ.get("CONTENT_LENGTH") or 0)
        if length:
            body = environ["wsgi.input"].read(length)
            environ["wsgi.input"] = io.BytesIO(body)
            try:
                seed = json.loads(body).get("seed")
            except (ValueError, AttributeError):
                seed = None
            if isinstance(seed, int):
                served.setdefault(seed, []).append(index)
        return app(environ, start_response)

    return wrapped


def start_replicas(n: int, num_blocks: int, block_size: int, stack, model_name: str | None = None,
                   max_num_batched_tokens: int = VLLM_SERVE_BUDGET, keys: Keys | None = None):
    """n servers of this course in this process, each with its own engine and pool (over the
    2-layer random model, or `model_name`'s real one, shared) and a fixed budget of
    `max_num_batched_tokens` a step, a class's servers under `keys`: the tokenizer, their URLs,
    the replicas each request's seed was sent to (noting), the engines, and what fair share
    charges a key attended to (the model's ModelShape.key_cost)."""
    from engine.llm_engine import Engine
    from engine.model_files import load_tokenizer
    from engine.model_loader import load_model, random_model, tiny_llama
    from engine.step_budget import ModelShape
    from server import create_app
    from serving.connections import serve_in_background

    # No line per request on the screen, nor for the router's probes: its HTTP/2 preface (505)
    # and SGLang's routes this server has not (404); a request that fails raises in the replay.
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    logging.getLogger("server").setLevel(logging.ERROR)
    if model_name is None:
        tokenizer = load_tokenizer()
        config = tiny_llama(tokenizer).config
        config.max_position_embeddings = POSITIONS
        model = random_model(config, device="cpu")
    else:
        model, tokenizer = load_model(None if model_name == "default" else model_name)
    urls, served, engines = [], {}, []
    for index in range(n):
        engine = Engine(model=model, tokenizer=tokenizer, block_size=block_size, num_blocks=num_blocks,
                        free_uncached_first=True, max_num_batched_tokens=max_num_batched_tokens)
        engines.append(engine)
        class_server = {} if keys is None else {"salt_by_api_key": True, "api_keys": frozenset(keys.students),
                                                "admin_key": keys.teacher}
        app = create_app(engine, model_name="tiny-8k" if model_name is None else model_name, **class_server)
        app.wsgi_app = noting(app.wsgi_app, served, index)
        url, server = serve_in_background(app)
        stack.callback(engine.close)
        stack.callback(server.shutdown)
        urls.append(url)
    return tokenizer, urls, served, engines, ModelShape.of(model).key_cost


def measured_service(engine, urls: list[str], max_num_batched_tokens: int, keys: Keys | None = None,
                     reps: int = 3) -> Service:
    """The prediction's cost model, measured on this fleet before its runs: one replica's
    engine timed on prompts of 16 and 512 new random tokens, one step each (the fastest of
    `reps`), gives a step's fixed cost and its cost a token; a 16-token request through a
    router of its own (a short text of random words), at the client, less that step, gives the gap. The caches are reset
    after."""
    rng = random.Random(0)

    def step_ms(n: int) -> float:
        times = []
        for _ in range(reps):
            prompt = [rng.randrange(1000, 30_000) for _ in range(n)]
            start = time.perf_counter()
            engine.generate(prompt, max_tokens=1)
            times.append((time.perf_counter() - start) * 1e3)
        return min(times)

    short, long = step_ms(16), step_ms(512)
    token_ms = max(0.0, (long - short) / (512 - 16))
    fixed_ms = max(0.001, short - 16 * token_ms)
    with router(urls, "round_robin", control_key=keys and keys.teacher) as url:
        client = clients(Fleet(url, tuple(urls), "round_robin", keys), [LoggedRequest("", None, "")])[0]
        trips = []
        for _ in range(2 * reps + 1):
            prompt = " ".join(f"w{rng.randrange(10**6)}" for _ in range(4))  # text: the router takes no token ids
            start = time.perf_counter()
            client.complete(prompt, 1)
            trips.append((time.perf_counter() - start) * 1e3)
    reset_caches(urls, keys and keys.teacher)
    return Service(max_num_batched_tokens, engine.config.max_num_seqs, fixed_ms, token_ms,
                   max(0.0, statistics.median(trips) - short))


def replay_in_flight(f: Fleet, requests: list, in_flight: int, served: dict[int, list[int]],
                     max_tokens: int = 1) -> list[Routed]:
    """The log sent `in_flight` requests at a time, in its order: each of `in_flight` clients
    sends the next request not yet sent as soon as its last one is answered (so a conversation's
    next turn may leave before its last is answered, where the log holds fewer users at a time
    than requests in flight). Who served each request is the replicas' own note of its `seed`
    (noting): the replicas' request counts cannot tell apart requests in flight together."""
    senders = clients(f, requests)
    seeds = list(itertools.islice(SEEDS, len(requests)))  # none sent before in this process

    def one(i: int) -> Routed:
        seed = seeds[i]
        reply = send(senders[i], requests[i], max_tokens, seed=seed)
        replicas = served.pop(seed, [])
        if len(replicas) != 1:
            raise FleetError(f"request {i} ({requests[i].where}) reached replicas {replicas}; exactly one should "
                             f"have seen it (did the router retry it, or drop its seed?)")
        if reply.prompt_tokens is None or reply.cached_tokens is None:
            raise FleetError(f"request {i} ({requests[i].where}): the reply carried no usage with cached tokens")
        return Routed(replicas[0], reply.prompt_tokens, reply.cached_tokens, reply.ttft_ms)

    with ThreadPoolExecutor(in_flight) as pool:
        return list(pool.map(one, range(len(requests))))


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
    parser.add_argument("--logs", nargs="+", choices=("multi_turn", "agent"), default=["multi_turn", "agent"],
                        help="the logs to send (default both)")
    parser.add_argument("--requests", type=positive_int, default=None, metavar="N",
                        help="send only the first N requests of each log")
    parser.add_argument("--in-flight", type=positive_int, default=1, metavar="N",
                        help="requests in flight at once, sent in the log's order (default 1: one after another, "
                        "what the prediction assumes)")
    parser.add_argument("--model", default=None, metavar="NAME",
                        help="replicas of a real model ('default': this course's, SmolLM2-135M) whose prefills take "
                        "seconds on a CPU, not the 2-layer random one's milliseconds")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=VLLM_SERVE_BUDGET, metavar="N",
                        help=f"each replica's fixed budget a step, and the prediction's in time (default "
                        f"{VLLM_SERVE_BUDGET}, vllm serve's below 70 GiB of GPU)")
    parser.add_argument("--keys", action="store_true",
                        help="a class's fleet: replicas with the students' keys and --salt-by-api-key, the door in front")
    parser.add_argument("--runs", type=positive_int, default=1,
                        help="runs of each log and policy, a fresh router and empty caches each: how often the "
                        "router agrees with itself (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results, every request's prediction and reply")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 130))
    results = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fleet-") as folder, contextlib.ExitStack() as stack:
        keys = Keys.generate(8) if args.keys else None
        tokenizer, urls, served, engines, key_cost = start_replicas(
            args.replicas, args.num_blocks, args.block_size, stack, args.model, args.max_num_batched_tokens, keys)
        service = measured_service(engines[0], urls, args.max_num_batched_tokens, keys) if args.in_flight > 1 else None
        if service is not None:
            console.print(f"the prediction in time: a step {service.step_ms:.1f} ms + {service.token_ms:.3f} ms a token, "
                          f"a gap of {service.gap_ms:.1f} ms through the router (measured_service)")
        for name, requests in logs(Path(folder), args.conversations_at_once).items():
            if name.split()[0] not in args.logs:
                continue
            requests = requests[: args.requests]
            prompts = tokenize_log(requests, tokenizer)
            salts = [r.cache_salt for r in requests]
            for policy, run in itertools.product(args.policies, range(args.runs)):
                reset_caches(urls, keys and keys.teacher)
                with contextlib.ExitStack() as fronted:
                    url = fronted.enter_context(router(urls, policy, control_key=keys and keys.teacher))
                    door = url if keys is None else fronted.enter_context(front(url, keys))
                    fleet = Fleet(door, tuple(urls), policy, keys, url)
                    if args.in_flight == 1:
                        real = replay_through_router(fleet, requests)
                    else:
                        real = replay_in_flight(fleet, requests, args.in_flight, served)
                if run == 0:
                    first = real
                routing = route_log(requests, args.replicas, RouterFlags(policy))
                if keys is not None:  # every request salted by its key at its replica
                    routing.keeps_salt = [True] * len(requests)
                # --like vllm: the replicas free hashless blocks first; the analyzer counts vLLM's null block too
                predicted = replay_fleet(prompts, salts, routing, args.num_blocks + 1, args.block_size, LIKE["vllm"])
                result = {"log": name, "policy": policy, "run": run + 1} | compare(routing.replica, predicted.cached, real)
                result["like_run_1"] = compare([r.replica for r in first], [r.cached_tokens for r in first], real)
                if service is not None:
                    if run == 0:  # the same on every run: one clock, no draw but the seeded ones
                        def in_time_with(seed: int):
                            return replay_in_time(requests, prompts, salts, args.replicas, RouterFlags(policy, seed=seed),
                                                  args.num_blocks + 1, args.block_size, args.in_flight, service,
                                                  keyed=keys is not None, key_cost=key_cost)[0]

                        in_time = in_time_with(0)
                        # a router that draws: the mean of DRAWS draws, as the analyzer reports it beside one
                        rates = [in_time.hit_rate] if routing.predictable else [
                            in_time_with(seed).hit_rate for seed in range(DRAWS)]
                    result["in_time"] = compare(in_time.routing.replica, in_time.cached, real)
                    result["hit_rate_in_time"] = round(sum(rates) / len(rates), 4)
                    result["hit_rate_in_time_range"] = [round(min(rates), 4), round(max(rates), 4)]
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
                console.print(f"  {name}, {policy}, run {run + 1}: {result['both']} of {result['requests']} requests "
                              f"alike" + (f" ({result['in_time']['both']} in time)" if service else "")
                              + f", {result['like_run_1']['both']} as in run 1")
    load_after = os.getloadavg()

    sent = "one after another" if args.in_flight == 1 else f"{args.in_flight} in flight at a time"
    served_model = ("a 2-layer random model" if args.model is None else args.model) + (", keyed" if args.keys else "")
    table = Table(title=f"the fleet prediction against sglang-router {ROUTER_VERSION}: {args.replicas} replicas "
                        f"({served_model}) of {args.num_blocks} blocks of {args.block_size}, requests {sent}",
                  caption="same replica: up to a renaming of the replicas; its picks: the replicas' caches replayed "
                          "with the replicas the router chose; salt kept: the prediction had the router passed a chat's "
                          "cache_salt on; as run 1: the same replica and cached tokens as the first run of that log "
                          "and policy" + ("; in time: analyzer/fleet_replay.py's replay_in_time, its step costs and gap "
                                          f"measured before the runs, its hit rate for random and power_of_two the mean "
                                          f"of {DRAWS} draws" if service else ""))
    columns = ["log", "policy", "run", "requests", "same replica", "same cached", "both", "cached, its picks",
               "both, salt kept", "hit rate: predicted", "real", "both as run 1"]
    if service is not None:
        columns[9:9] = ["both, in time", "hit rate: in time"]
    for column in columns:
        table.add_column(column, justify="right", no_wrap=column == "log")
    for r in results:
        n = r["requests"]
        row = [r["log"], r["policy"], str(r["run"]), str(n), f"{r['same_replica'] / n:.0%}",
               f"{r['same_cached'] / n:.0%}", f"{r['both'] / n:.0%}", f"{r['same_cached_on_its_picks'] / n:.0%}",
               f"{r['same_cached_had_the_salt_arrived'] / n:.0%}", f"{r['hit_rate']['predicted']:.1%}",
               f"{r['hit_rate']['real']:.1%}", "" if r["run"] == 1 else f"{r['like_run_1']['both'] / n:.0%}"]
        if service is not None:
            row[9:9] = [f"{r['in_time']['both'] / n:.0%}", f"{r['hit_rate_in_time']:.1%}"]
        table.add_row(*row)
    console.print(table)
    console.print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}; "
                  f"{platform.machine()}, {os.cpu_count()} cores")
    save_json(args.json, {"router": ROUTER_VERSION, "model": served_model, "replicas": args.replicas,
                          "num_blocks": args.num_blocks,
                          "block_size": args.block_size, "in_flight": args.in_flight,
                          "max_num_batched_tokens": args.max_num_batched_tokens, "keys": args.keys,
                          "service": None if service is None else dataclasses.asdict(service), "runs": results}, console)
    return results


if __name__ == "__main__":
    main()
