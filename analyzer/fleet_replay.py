"""
A fleet replayed: each replica's pool with the requests the router gave it, one request after
another, or with requests in flight, in time.

    python prefix_caching.py --analyze LOG --replicas 3 --router cache_aware                  # one at a time
    python prefix_caching.py --analyze LOG --replicas 3 --router cache_aware --in-flight 3    # three at a time

Read fleet.py (the router's picks) and log_replay.py (one pool replayed) first. In this file:

    1. one at a time   the picks first, then each replica's pool replayed with its requests
    2. in time         clients, the router and the replicas' steps on one clock
    3. the report      the table, the notes, --json

Why time matters. One request after another, no replica is busy when the router picks and no
prompt is half computed when the next one looks up its prefix. With N requests in flight both
change, and measured against the real router (benchmarks/fleet.py, docs/analyzer.md) both
show:

  - the router sees loads: cache_aware sends a text that matches little to the least loaded
    replica, not the first one, and power_of_two takes the less loaded of its two draws;
  - a replica runs its requests side by side, a step at a time, under a token budget
    (max_num_batched_tokens, vLLM's flag): a long prompt comes in chunks, and a request
    admitted between two chunks of another looks its prefix up then and takes its hits out
    of the free queue, before the other's next chunk takes blocks from it. One after
    another, the whole prompt takes its blocks first and may evict those hits. On a pool
    that holds about three prompts of SmolLM2, sharing 256 tokens a step, three in flight found
    48.5 % to 52.6 % of the prompt tokens cached (four runs) where one at a time found 43.5 %.

So a replica here is this course's scheduler (engine/scheduler.py, vLLM v1's order: decodes,
prompts still prefilling, then waiting requests in arrival order; its prompts share a step's
tokens equally, where vLLM's running prompt takes what it needs first) over this course's
allocator, the pool the server runs, with a fixed budget a step. Its steps take time from a
cost model, Service: a fixed part and a part a token, and a gap between a reply and the
client's next request reaching a replica (the router, the network). The clients are a stated
concurrency, --in-flight N: each of N clients sends the log's next request when its last is
answered (logs carry no arrival times). What the router's picks and the pools' hits depend
on is the order of events, not their scale: a cost model that is right in its proportions
(how a step's cost grows with its tokens, against the gap) gives the same order as the real
one. What no cost model gives is the order of events of the same moment: two clients answered
in one step send again together, and which request a real replica admits first is a race of
its threads; replay_in_time's `ties` draws that order, and the report gives the hit rate over
several draws beside the prediction. Replies are not known, so a request decoding more than one
token appends tokens that no later prompt can hit.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from array import array
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from allocator import PrefixCachingAllocator
from analyzer.caching_models import VLLM
from analyzer.fleet import ROUTER_VERSION, CacheAware, PowerOfTwo, RouterFlags, Routing, routed_requests
from analyzer.log_replay import LIKE, CacheModel, Replay, lengths_of, replay
from analyzer.request_logs import LoggedRequest
from engine.scheduler import Request, Scheduler, check_step_size

# -----------------------------------------------------------------------------
# 1. One at a time
#
# The router picks a replica for every request from its text alone (fleet.py), so the picks
# come first; then each replica's pool is replayed, as one server's, with the requests it
# got in log order, each under the salt the replica receives (none for a chat request
# through this router). The replicas share nothing, so the fleet's cached tokens are
# theirs side by side.


@dataclass
class Fleet:
    routing: Routing
    replays: list[Replay]  # each replica's, over the requests it got (an empty one: 0 of 0)
    cached: array  # the cached tokens of each request, in log order
    prompt_tokens: array  # of each request
    in_flight: int = 1  # requests in flight at once: 1, one after another (section 1); more, in time (section 2)

    @property
    def hit_rate(self) -> float:
        total = sum(self.prompt_tokens)
        return sum(self.cached) / total if total else 0.0


def replay_fleet(prompts: list[array], salts: list[str | None], routing: Routing, num_blocks: int, block_size: int,
                 model: CacheModel = LIKE["vllm"]) -> Fleet:
    """Each replica's pool of `num_blocks` replayed with the requests routed to it.

    >>> from analyzer.fleet import RouterFlags, route_log
    >>> log = [LoggedRequest(f"line {i}", None, f"line {i}") for i in range(3)]
    >>> prompts = [array("I", list(range(32)) + [i]) for i in range(3)]   # two shared blocks of 16, then 1 token
    >>> routing = route_log(log, 2, RouterFlags("round_robin"))
    >>> replay_fleet(prompts, [None] * 3, routing, num_blocks=8, block_size=16).cached.tolist()
    [0, 0, 32]
    """
    cached = array("I", [0] * len(prompts))
    replays = []
    for replica in range(routing.replicas):
        mine = routing.indices_of(replica)
        if not mine:
            replays.append(Replay(num_blocks, block_size, array("I"), 0, 0))
            continue
        its_salts = [salts[i] if routing.keeps_salt[i] else None for i in mine]
        replays.append(replay([prompts[i] for i in mine], its_salts, num_blocks, block_size, model=model))
        for i, n in zip(mine, replays[-1].cached):
            cached[i] = n
    return Fleet(routing, replays, cached, array("I", map(len, prompts)))


# -----------------------------------------------------------------------------
# 2. In time
#
# One clock, three kinds of event: a client sends (the router picks with the loads of that
# moment and the request joins its replica's waiting queue), a replica's step ends (its
# scheduled tokens are computed, a request that sampled its last token is answered and frees
# its blocks, its client sends again a gap later), and a replica with work starts its next
# step. Events at the same moment run in the order they were made.

VLLM_SERVE_BUDGET = 2048  # vllm serve's max_num_batched_tokens below 70 GiB of GPU (vllm/engine/arg_utils.py)


@dataclass(frozen=True)
class Service:
    """A replica's step: its token budget, and what it costs in time; the gap from a reply to
    the client's next request at a replica. vLLM's budget is 2,048 tokens a step on most GPUs,
    8,192 on those of 70 GiB or more and 16,384 from 160 GiB (`_set_default_args` in
    vllm/engine/arg_utils.py); the costs are a guess in proportion (a step of that budget's
    tokens about 11 times one of a few), to be measured on the server for its own."""

    max_num_batched_tokens: int = VLLM_SERVE_BUDGET
    max_num_seqs: int = 256  # vllm serve's, on the same GPUs; at most the budget (vLLM refuses more)
    step_ms: float = 10.0  # a step's fixed cost
    token_ms: float = 0.05  # and each token it computes
    gap_ms: float = 1.0  # from a reply to the client's next request at its replica

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is an int of 1 or more, got {value!r}")
        for name in ("step_ms", "token_ms", "gap_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} is a number of milliseconds, 0 or more, got {value!r}")
        if self.step_ms == 0 and self.token_ms == 0:
            raise ValueError("a step takes some time: give step_ms or token_ms above 0")
        check_step_size(self.max_num_seqs, self.max_num_batched_tokens)  # as vLLM's config, and the scheduler's

    def seconds(self, tokens: int) -> float:
        return (self.step_ms + self.token_ms * tokens) / 1e3


@dataclass
class Timeline:
    """When each request was sent and answered, and the loads the router saw for it."""

    sent: list[float] = field(default_factory=list)  # seconds, by log index
    answered: list[float] = field(default_factory=list)
    loads_seen: list[tuple[int, ...]] = field(default_factory=list)  # each replica's requests in flight, by log index
    steps: list[int] = field(default_factory=list)  # each replica's steps
    preemptions: list[int] = field(default_factory=list)  # each replica's


def replay_in_time(requests: list[LoggedRequest], prompts, salts: list[str | None], replicas: int, flags: RouterFlags,
                   num_blocks: int, block_size: int, in_flight: int, service: Service = Service(),
                   model: VLLM = LIKE["vllm"], max_tokens: int = 1, keyed: bool = False,
                   key_cost: float = 0.0, ties: int | None = None) -> tuple[Fleet, Timeline]:
    """The log sent by `in_flight` clients, each sending its next request (the log's next one
    not yet sent) when its last is answered, through the router to `replicas` replicas, each
    a scheduler over a pool of `num_blocks` (vLLM's num_gpu_blocks, its null block among them
    where the model has one) stepping in time as `service` says.

    keyed: a class's fleet of this course's servers (--api-keys, --salt-by-api-key), each
    request's cache_salt standing for its client's key: the replica salts the request by the
    key whatever the router drops, and serves each key its fair share (the Scheduler's
    fair_share, charging `key_cost` a key attended to, as the engine's).

    ties: None runs events of the same moment in the order they were made (the first client
    first); a seed shuffles them. Two replies of one step send their clients' next requests at
    the same moment, and which reaches the replica first is a race of a real fleet's threads
    that decides which of them the next step admits first and what it evicts: on a replica of
    SmolLM2 sharing 256 tokens a step, 49.6 % cached in order, 53.3 % in reverse order, and
    48.5 % to 52.6 % in four real runs. report_in_time replays several seeds.

    >>> log = [LoggedRequest(f"line {i}", None, f"line {i}") for i in range(3)]
    >>> prompts = [array("I", list(range(32)) + [i]) for i in range(3)]
    >>> fleet, _ = replay_in_time(log, prompts, [None] * 3, 2, RouterFlags("round_robin"), 8, 16, in_flight=1)
    >>> fleet.cached.tolist()   # one at a time: as replay_fleet
    [0, 0, 32]
    >>> fleet, _ = replay_in_time(log, prompts, [None] * 3, 1, RouterFlags("round_robin"), 8, 16, in_flight=3)
    >>> fleet.cached.tolist()   # together: the second and third wait for the first's blocks, then hit them
    [0, 32, 32]
    """
    if not isinstance(model, VLLM):
        raise ValueError("requests in flight are replayed with vLLM's pool or this course's engine (--like vllm or "
                         "engine): the others' schedulers are not modelled")
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"--in-flight is 1 or more, got {in_flight!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens is 1 or more, got {max_tokens!r}")
    usable = num_blocks - model.null_block
    lengths = lengths_of(prompts)  # a TokenizedLog's, without reading its file
    for i, length in enumerate(lengths):  # each must fit alone, or its replica would wait for ever
        if -(-(length + max_tokens - 1) // block_size) > usable:
            raise ValueError(f"request {i} ({requests[i].where}): {length:,} tokens and {max_tokens} to decode "
                             f"need more than the {usable:,} usable blocks of {block_size} of a replica's pool")
    if replicas < 1:
        raise ValueError(f"--replicas is 1 or more, got {replicas}")
    n = len(prompts)
    routing = Routing(replicas, flags.policy, [0] * n, [None] * n, [True] * n,
                      predictable=flags.policy in ("round_robin", "cache_aware"))
    policy, loads = flags.policy_for(replicas), [0] * replicas
    if isinstance(policy, (CacheAware, PowerOfTwo)):
        policy.loads = loads  # the router's count of each replica's requests in flight, kept below
    schedulers = [Scheduler(PrefixCachingAllocator(usable, block_size, free_uncached_first=model.free_uncached_first),
                            max_num_seqs=service.max_num_seqs, max_num_batched_tokens=service.max_num_batched_tokens,
                            fair_share=keyed, key_cost=key_cost)
                  for _ in range(replicas)]
    running_plan = [None] * replicas  # the plan of each replica's step in progress
    timeline = Timeline([0.0] * n, [0.0] * n, [()] * n, [0] * replicas, [0] * replicas)
    cached = array("I", [0] * n)
    routed = routed_requests(requests)
    left = {}  # a routed request's index -> its log requests not yet answered
    events: list = []  # (time, order, what, which)
    order = itertools.count()
    shuffle = None if ties is None else random.Random(ties)

    def at(when: float, what: str, which: int) -> None:
        heapq.heappush(events, (when, next(order) if shuffle is None else shuffle.random(), what, which))

    def send(j: int, now: float) -> None:
        choice = policy.route(routed[j].text)
        replica = choice.replica
        for i in routed[j].requests:
            routing.replica[i], routing.match_rate[i] = choice.replica, choice.match_rate
            timeline.sent[i], timeline.loads_seen[i] = now, tuple(loads)
            salt = salts[i] if routed[j].keeps_salt or keyed else None
            routing.keeps_salt[i] = routed[j].keeps_salt or keyed
            schedulers[replica].add(Request(str(i), list(prompts[i]), salt, tenant=salts[i] if keyed else None))
        loads[replica] += 1
        left[j] = len(routed[j].requests)
        if (isinstance(policy, CacheAware) and routing.over_tree_size is None
                and max(policy.tree.chars.values()) > flags.max_tree_size):
            routing.over_tree_size = routed[j].requests[-1]
        if running_plan[replica] is None:
            start_step(replica, now)

    def start_step(replica: int, now: float) -> None:
        scheduler = schedulers[replica]
        plan = scheduler.schedule()
        while not plan.scheduled and plan.preempted:  # a step that only preempted: the engine steps again
            plan = scheduler.schedule()
        if not plan.scheduled:
            raise RuntimeError(f"replica {replica} has work but scheduled nothing")  # each prompt fits, checked above
        running_plan[replica] = plan
        timeline.steps[replica] += 1
        timeline.preemptions[replica] += len(plan.preempted)
        at(now + service.seconds(sum(s.end - s.start for s in plan.scheduled)), "step ends", replica)

    owner = {i: j for j, r in enumerate(routed) for i in r.requests}
    next_to_send = min(in_flight, len(routed))
    for j in range(next_to_send):
        at(0.0, "send", j)
    while events:
        now, _, what, which = heapq.heappop(events)
        if what == "send":
            send(which, now)
            continue
        replica, plan = which, running_plan[which]
        running_plan[replica] = None
        for s in plan.scheduled:
            request = s.request
            request.num_computed_tokens = s.end
            if not s.samples:
                continue
            request.append_output(0)  # a reply's token: unknown, so no later prompt hits its block
            if len(request.output_ids) < max_tokens:
                continue
            schedulers[replica].finish(request)
            i = int(request.request_id)
            cached[i], timeline.answered[i] = request.num_cached_tokens, now
            j = owner[i]
            left[j] -= 1
            if not left[j]:  # the reply goes back through the router, which frees its load
                loads[replica] -= 1
                if next_to_send < len(routed):
                    at(now + service.gap_ms / 1e3, "send", next_to_send)
                    next_to_send += 1
        if schedulers[replica].has_work():
            start_step(replica, now)
    replays = []
    for replica in range(replicas):
        mine = routing.indices_of(replica)
        replays.append(Replay(num_blocks, block_size, array("I", (cached[i] for i in mine)),
                              sum(lengths[i] for i in mine), schedulers[replica].allocator.stats.evictions))
    return Fleet(routing, replays, cached, array("I", lengths), in_flight), timeline


# -----------------------------------------------------------------------------
# 3. The report
#
# random and power_of_two draw their replicas, so a prediction is one draw's; the report adds
# the hit rates of DRAWS draws (--router-seed 0, 1, ...): how far the draws alone move it. In
# flight, requests that reach a replica at the same moment race (replay_in_time's ties), and
# the report adds the hit rates of DRAWS orders of them.

DRAWS = 16


@dataclass
class Spread:
    """The fleet's hit rate over several replays: of the router's draws, or of the orders of
    requests that arrive together."""

    of: str  # "draws" or "orders"
    hit_rates: list[float]

    def as_dict(self) -> dict:
        rates = self.hit_rates
        return {self.of: len(rates), "mean": sum(rates) / len(rates), "min": min(rates), "max": max(rates)}

    def sentence(self) -> str:
        rates, n = self.hit_rates, len(self.hit_rates)
        what = (f"{n} draws (--router-seed 0 to {n - 1})" if self.of == "draws" else
                f"{n} orders of the requests that reach a replica at the same moment (a race of a real fleet)")
        return (f"Over {what} the fleet's hit rate is {sum(rates) / n:.1%} on average, from {min(rates):.1%} to "
                f"{max(rates):.1%}.")

# How far each prediction held against the real router, by policy, one request at a time and
# with 3 in flight: the checks of docs/analyzer.md ("How far to trust it" sums them up), on the
# multi-turn and agents' logs, open and keyed fleets, a 2-layer model and SmolLM2.
TRUST = {
    ("round_robin", False): "exact: the same replica and cached tokens on every request",
    ("cache_aware", False): "exact: the same replica and cached tokens on every request",
    ("power_of_two", False): "its replicas a draw (the same replica on 31 to 42 % of requests); each replica's "
                             "cached tokens exact on the router's own picks",
    ("random", False): "its replicas a draw (the same replica on 31 to 42 % of requests); each replica's cached "
                       "tokens exact on the router's own picks",
    ("round_robin", True): "78 to 100 % of requests alike with a real run, never more than 9 points below two real "
                           "runs' agreement; the hit rate within 2.4 points",
    ("cache_aware", True): "88 to 100 % of requests alike with a real run, never more than 9 points below two real "
                           "runs' agreement; the hit rate within 3.0 points",
    ("power_of_two", True): "its replicas a draw (9 to 27 % alike, as two real runs are); the mean of 16 draws' hit "
                            "rates within 3.0 points",
    ("random", True): "its replicas a draw (11 to 25 % alike, as two real runs are); the mean of 16 draws' hit rates "
                      "within 2.1 points",
}


def trust(policy: str, in_flight: int) -> str:
    """How far the prediction for `policy` held against the real router (TRUST)."""
    return TRUST[policy, in_flight > 1]


def fleet_json(fleet: Fleet, requests: list[LoggedRequest], args: argparse.Namespace, flags: RouterFlags,
               timeline: Timeline | None = None, service: Service | None = None,
               spread: Spread | None = None) -> dict:
    """The prediction for each request and the totals, as --json writes them."""
    out = {
        "log": str(args.log), "replicas": fleet.routing.replicas, "router": flags.policy,
        "router_flags": {"cache_threshold": flags.cache_threshold, "balance_abs_threshold": flags.balance_abs_threshold,
                         "balance_rel_threshold": flags.balance_rel_threshold, "max_tree_size": flags.max_tree_size},
        "replicas_are_predicted": fleet.routing.predictable, "like": args.like, "in_flight": fleet.in_flight,
        "trust": {"measured": trust(flags.policy, fleet.in_flight), "where": "docs/analyzer.md, How far to trust it"},
        "num_blocks_per_replica": fleet.replays[0].num_blocks, "block_size": fleet.replays[0].block_size,
        "requests": [{"index": i, "where": r.where, "replica": fleet.routing.replica[i],
                      "prompt_tokens": fleet.prompt_tokens[i], "cached_tokens": fleet.cached[i],
                      "match_rate": fleet.routing.match_rate[i], "salt_reaches_replica": fleet.routing.keeps_salt[i]}
                     for i, r in enumerate(requests)],
        "per_replica": [{"replica": k, "requests": len(r.cached), "prompt_tokens": r.prompt_tokens,
                         "cached_tokens": r.cached_tokens, "hit_rate": r.hit_rate} for k, r in enumerate(fleet.replays)],
        "total": {"requests": len(requests), "prompt_tokens": sum(fleet.prompt_tokens),
                  "cached_tokens": sum(fleet.cached), "hit_rate": fleet.hit_rate}}
    if spread is not None:
        out[f"hit_rate_over_{spread.of}"] = spread.as_dict()
    if timeline is not None:
        out["service"] = {"max_num_batched_tokens": service.max_num_batched_tokens,
                          "max_num_seqs": service.max_num_seqs, "step_ms": service.step_ms,
                          "token_ms": service.token_ms, "gap_ms": service.gap_ms}
        for i, row in enumerate(out["requests"]):
            row |= {"sent_s": timeline.sent[i], "answered_s": timeline.answered[i],
                    "loads_seen": list(timeline.loads_seen[i])}
    return out


def print_fleet(console: Console, fleet: Fleet, requests: list[LoggedRequest], one_server: Replay,
                flags: RouterFlags, server: str, spread: Spread | None = None) -> None:
    """Each replica's requests and hit rate, the fleet's, and what the prediction cannot see."""
    routing = fleet.routing
    sent = "one request at a time" if fleet.in_flight == 1 else f"{fleet.in_flight} requests in flight"
    table = Table("replica", "requests", "prompt tokens", "cached tokens", "hit rate",
                  title=f"{routing.replicas} replicas ({server}, {fleet.replays[0].num_blocks:,} blocks each) "
                  f"behind sglang-router's {flags.policy}, {sent}")
    for k, r in enumerate(fleet.replays):
        table.add_row(str(k), f"{len(r.cached):,}", f"{r.prompt_tokens:,}", f"{r.cached_tokens:,}", f"{r.hit_rate:.1%}")
    table.add_row("[bold]fleet[/]", f"{len(requests):,}", f"{sum(fleet.prompt_tokens):,}", f"{sum(fleet.cached):,}",
                  f"[bold]{fleet.hit_rate:.1%}[/]")
    console.print(table)
    console.print(f"How far to trust it, as measured against the real router (docs/analyzer.md): "
                  f"{trust(flags.policy, fleet.in_flight)}.")
    console.print(f"One server with one such pool, one request at a time: {one_server.hit_rate:.1%}. Replicas are "
                  f"numbered in the router's order of its workers, which a real router draws at start: compare them "
                  f"up to a renaming.")
    if flags.policy == "cache_aware" and fleet.in_flight == 1:
        console.print("[yellow]note:[/] one request at a time no replica is busy, so cache_aware sends every request "
                      "that matches little to the first replica, and the rest follow their text there (fleet.py); "
                      "under concurrency such requests go to idle replicas instead: --in-flight N replays that.")
    if fleet.in_flight > 1:
        console.print("[yellow]note:[/] in time (fleet_replay.py): the loads the router saw and the hits a replica's "
                      "steps left depend on the order of events, which the step costs and gap decide (--step-ms, "
                      "--gap-ms, --max-num-batched-tokens): give your server's.")
    if not routing.predictable:
        console.print(f"[yellow]note:[/] {flags.policy} draws its replicas at random (fleet.py): how many requests each "
                      f"gets is predicted, not which; the hit rates are one draw's (--router-seed).")
    if spread is not None:
        console.print(spread.sentence())
    dropped = sum(1 for r, keeps in zip(requests, routing.keeps_salt) if r.cache_salt is not None and not keeps)
    if dropped:
        console.print(f"[yellow]warning:[/] {dropped:,} chat requests carry a cache_salt that sglang-router {ROUTER_VERSION} drops "
                      f"(its chat request type has no such field): their replicas share those prefixes across tenants.")
    if routing.over_tree_size is not None:
        console.print(f"[yellow]warning:[/] after request {routing.over_tree_size:,} a replica's text in the router's tree "
                      f"passes --max-tree-size {flags.max_tree_size:,} characters: the router evicts on a clock, which "
                      f"a replay has not, so its picks from there on are approximate.")
