"""
A fleet: N replicas of one server behind SGLang's router, sglang-router 0.3.2 (the package
requirements.txt pins: Rust, sgl-project/sglang's sgl-model-gateway/ at its version 0.3.2;
the files cited below, under that folder, were read in the release's source distribution on
PyPI). The router picks a replica for each request; each replica keeps its own prefix cache,
replayed by caching_models.py as one server is.

    python prefix_caching.py --analyze LOG --replicas 3 --router cache_aware --like vllm

Read request_logs.py (what a logged request holds) first. In this file:

    1. the routing text   what the router reads of a request: text, never tokens
    2. the text tree      the router's guess of each replica's cache (src/policies/tree.rs)
    3. the policies       round_robin, cache_aware, random, power_of_two (src/policies/)
    4. a log routed       the replica of every request, in log order

Where a replay of one request at a time is approximate. The router also balances load: a
replica's load is its requests in flight (src/core/worker.rs, WorkerLoadGuard), and one
after another no request is in flight when the next is routed (a reply not streamed frees
its load before the router answers; a streamed one when its body is dropped, as the client
reads its end: src/routers/http/router.rs, send_typed_request; a client that sends the next
request that very moment may still find it counted). So every load is 0 here: cache_aware's
balancing (max - min load > balance_abs_threshold and max > min x balance_rel_threshold)
never fires, and where it picks the least loaded replica it takes the first of equals.
Under concurrency loads differ and that changes the picks: fleet_replay.py's
replay_in_time keeps the loads, and the policies read them. The tree holds characters, not
tokens: a text match the router counts is not the blocks a replica finds (a replica hashes
tokens after the chat template, whole blocks, under a salt). The tree's eviction runs on a
clock (--eviction-interval-secs, 60 s, trims each replica's characters to --max-tree-size,
2**26); a replay has no clock, so the tree here never evicts and the route_log result says
when a replica's characters pass the limit (past it, the prediction is approximate). Which
replica is "first" is the order of the router's worker registry, a hash map
(src/core/worker_registry.rs, get_all over a DashMap): fixed while the router runs, not
known before; replicas here are numbered in that order, so compare them with a real
router's up to a renaming.

What the router ignores. It routes by text, so `cache_salt` (a tenant's salt) does not
separate students' prefixes in its tree: two tenants with the same system prompt go to the
same replica. A chat request's body is rebuilt from the router's own type
(ChatCompletionRequest in src/protocols/chat.rs has no cache_salt and keeps no unknown field),
so a chat request's salt never reaches the replica either and its pool shares salted
prefixes as if unsalted; a completions request keeps unknown fields (CompletionRequest's
`other`, src/protocols/completion.rs), so its salt reaches the replica, whose pool separates
it as one server's does.

tests/analyzer/test_fleet.py replays these rules by hand, and holds requests in flight at workers behind
the real router to see its tree's rules with loads apart; benchmarks/fleet.py checks the
prediction against the real router request by request, on two logs.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from analyzer.caching_models import common_prefix
from analyzer.request_logs import LoggedRequest

POLICIES = ("round_robin", "cache_aware", "random", "power_of_two")  # launch_router's --policy, but manual


def pinned_version(package: str) -> str:
    """The version requirements.txt pins `package` to (its one home; every file that names the
    router's version reads it here, or is held to it by tests/project/test_pins.py)."""
    for line in (Path(__file__).resolve().parents[1] / "requirements.txt").read_text().splitlines():
        name, pinned, version = line.split("#")[0].partition("==")
        if pinned and name.strip().lower() == package:
            return version.strip()
    raise LookupError(f"requirements.txt pins no {package}")


ROUTER_VERSION = pinned_version("sglang-router")  # the router whose source the comments below cite


# -----------------------------------------------------------------------------
# 1. The routing text
#
# GenerationRequest::extract_text_for_routing: a chat request's messages' text joined by a
# space (src/protocols/chat.rs: every role's content, an assistant's reasoning_content too,
# empty contents skipped, a message's text parts joined by a space); a completions request's
# prompt, a list of prompts joined by a space, the whole list routed as one request
# (src/protocols/completion.rs). The log reader joins a message's text parts with a newline, as
# vLLM does, so for a message of several text parts the text here has a newline where the
# router has a space (the same length, so the same match rate, unless two texts differ
# only there); an assistant's reasoning_content is not in the log reader's messages.


class NotRoutable(ValueError):
    """A request the router refuses: it routes text, and a prompt of token ids is not text."""


def routing_text(prompt: str | list) -> str:
    """What the router matches in its tree: a text prompt, or the chat's contents joined by a space.

    >>> routing_text([{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": ""},
    ...               {"role": "user", "content": "Hi"}])
    'Be brief. Hi'
    """
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], dict):
        return " ".join(m["content"] for m in prompt if m.get("content"))
    raise NotRoutable("sglang-router takes a completions prompt as text (its StringOrArray holds strings): "
                      "a prompt of token ids is refused there; give the log's prompts as text")


@dataclass
class RoutedRequest:
    """What one request of the log is to the router: the requests it routes as one, and the text."""

    requests: list[int]  # indices in the log: one, or the prompts of one completions request
    text: str
    keeps_salt: bool  # does the replica get the request's cache_salt? (a chat request's is dropped)


def routed_requests(requests: list[LoggedRequest]) -> list[RoutedRequest]:
    """The log's requests as the router sees them: a completions request whose "prompt" was a
    list (the log reader made a request of each prompt, in a row, from one line) is one.

    >>> log = [LoggedRequest("a b", None, "line 1"), LoggedRequest("c", None, "line 1"),
    ...        LoggedRequest([{"role": "user", "content": "d"}], "s", "line 2")]
    >>> [(r.requests, r.text, r.keeps_salt) for r in routed_requests(log)]
    [([0, 1], 'a b c', True), ([2], 'd', False)]
    """
    routed: list[RoutedRequest] = []
    for i, request in enumerate(requests):
        is_chat = isinstance(request.prompt, list) and bool(request.prompt) and isinstance(request.prompt[0], dict)
        try:
            text = routing_text(request.prompt)
        except NotRoutable as err:
            raise NotRoutable(f"{request.where}: {err}") from None
        if not is_chat and routed and routed[-1].keeps_salt and requests[i - 1].where == request.where:
            routed[-1].requests.append(i)  # the next prompt of the same completions request
            routed[-1].text += " " + text
        else:
            routed.append(RoutedRequest([i], text, keeps_salt=not is_chat))
    return routed


# -----------------------------------------------------------------------------
# 2. The text tree
#
# src/policies/tree.rs, Tree: one radix tree of characters for all replicas (tenants), each
# node holding a run of text, its children keyed by their first character, and the
# replicas that sent that text. insert(text, replica) walks the shared part, splitting a
# node where the text leaves it (the upper half keeps the node's replicas and the replica
# that created it), and adds the rest as a new leaf created by that replica.
# prefix_match_with_counts(text) walks as far as the text goes, into a node it only partly
# matches, and names the node's `last_tenant`: the replica whose insert created it (set at
# creation, copied on a split, never changed by a later insert), so the replica that first
# sent the text matched, not the one that sent it last. Each replica's characters are counted
# (tenant_char_count) for the eviction that trims them to max_tree_size.
# The characters two texts share (shared_prefix_count) are counted by caching_models'
# common_prefix, which compares slices by halves: a chat's history is thousands of characters.


class TextNode:
    __slots__ = ("text", "children", "replicas", "creator")

    def __init__(self, text: str, creator: int | None, replicas: set[int]) -> None:
        self.text = text
        self.children: dict[str, TextNode] = {}  # by first character
        self.replicas = replicas  # the replicas whose inserts passed through it
        self.creator = creator  # last_tenant: the replica that created it (None: the root)


@dataclass
class TextTree:
    root: TextNode = field(default_factory=lambda: TextNode("", None, set()))
    chars: dict[int, int] = field(default_factory=dict)  # tenant_char_count: characters each replica sent

    def match(self, text: str) -> tuple[int, int | None]:
        """prefix_match_with_counts: the characters of `text` the tree holds, and the replica
        that created the deepest node reached (None when nothing matched)."""
        node, matched = self.root, 0
        while matched < len(text):
            child = node.children.get(text[matched])
            if child is None:
                break
            shared = common_prefix(text[matched:], child.text)
            matched += shared
            node = child
            if shared < len(child.text):
                break
        return matched, node.creator

    def insert(self, text: str, replica: int) -> None:
        self.root.replicas.add(replica)
        self.chars.setdefault(replica, 0)
        node, done = self.root, 0
        while done < len(text):
            child = node.children.get(text[done])
            if child is None:  # the rest of the text is a new leaf, created by this replica
                node.children[text[done]] = TextNode(text[done:], replica, {replica})
                self.chars[replica] += len(text) - done
                return
            shared = common_prefix(text[done:], child.text)
            if shared < len(child.text):  # split: the shared part becomes a node above the child
                top = TextNode(child.text[:shared], child.creator, set(child.replicas))
                child.text = child.text[shared:]
                top.children[child.text[0]] = child
                node.children[top.text[0]] = top
                child = top
            if replica not in child.replicas:
                child.replicas.add(replica)
                self.chars[replica] += len(child.text)
            node, done = child, done + shared


# -----------------------------------------------------------------------------
# 3. The policies
#
# Each picks a replica among `replicas`, numbered in the router's order. Loads are all 0 in a
# serial replay (the module's docstring says why), which decides the load-based choices.


@dataclass(frozen=True)
class Choice:
    replica: int
    match_rate: float | None = None  # cache_aware: the share of the text its tree matched


class Policy(Protocol):
    def route(self, text: str) -> Choice: ...


@dataclass
class RoundRobin:
    """src/policies/round_robin.rs: a counter, modulo the healthy replicas: 0, 1, 2, 0, 1, ..."""

    replicas: int
    count: int = 0

    def route(self, text: str) -> Choice:
        self.count += 1
        return Choice((self.count - 1) % self.replicas)


@dataclass
class Random:
    """src/policies/random.rs: a uniform draw. The router's draws cannot be known, so this one,
    seeded, predicts only how many requests each replica gets, not which."""

    replicas: int
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def route(self, text: str) -> Choice:
        return Choice(self.rng.randrange(self.replicas))


@dataclass
class PowerOfTwo:
    """src/policies/power_of_two.rs: two distinct random replicas, the lower load of the two,
    the first on a tie. The loads are the replicas' tokens from their /get_load (polled by
    src/core/worker_manager.rs, LoadMonitor; -1 for a replica without that route, such as this
    course's server) or, where either is missing, requests in flight: equal (-1 and -1, or 0
    and 0) one request at a time, so the first draw wins, and this is Random again. With
    requests in flight (fleet_replay.py keeps `loads`) the less loaded of the two wins.

    >>> p = PowerOfTwo(3, random.Random(0), loads=[0, 5, 0])
    >>> [p.route("").replica for _ in range(6)]   # never 1, the busy one
    [2, 0, 2, 2, 2, 2]
    """

    replicas: int
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    loads: list[int] = field(default_factory=list)  # requests in flight: all 0 one at a time

    def route(self, text: str) -> Choice:
        if self.replicas == 1:
            return Choice(0)
        first = self.rng.randrange(self.replicas)
        second = self.rng.randrange(self.replicas - 1)  # among the others
        second += second >= first
        if self.loads and self.loads[second] < self.loads[first]:
            return Choice(second)
        return Choice(first)


def as_f32(x: float) -> float:
    """The router compares its match rate in f32 (a 32-bit float), as here."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass
class CacheAware:
    """src/policies/cache_aware.rs, CacheAwarePolicy::select_worker, with launch_router's
    defaults (bindings/python/src/sglang_router/router_args.py): balancing when loads are
    uneven (never, one request at a time); else the tree's match rate, matched characters
    over the text's characters (an empty text: 0); above cache_threshold, the replica that
    created the matched text; else the least loaded replica, the first of equals (0, one
    request at a time). Then the text is inserted under the chosen replica. So one request
    at a time, every request that matches little goes to the first replica, and what it sent
    is matched to it again. (The comment at the top of cache_aware.rs says a low match goes
    to the worker with the smallest tree; its select_worker, the code, takes the least
    loaded.)"""

    replicas: int
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    tree: TextTree = field(default_factory=TextTree)
    loads: list[int] = field(default_factory=list)  # requests in flight: all 0 one at a time

    def __post_init__(self) -> None:
        self.loads = self.loads or [0] * self.replicas

    def route(self, text: str) -> Choice:
        least = min(range(self.replicas), key=lambda r: self.loads[r])  # min_by_key: the first of equals
        high, low = max(self.loads), self.loads[least]
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            self.tree.insert(text, least)
            return Choice(least)
        matched, creator = self.tree.match(text)
        rate = as_f32(matched / len(text)) if text else 0.0
        replica = creator if rate > as_f32(self.cache_threshold) and creator is not None else least
        self.tree.insert(text, replica)
        return Choice(replica, rate)


@dataclass(frozen=True)
class RouterFlags:
    """The router's flags a fleet prediction takes: launch_router's names and defaults."""

    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**26  # characters of each replica in the tree; eviction trims them to this
    seed: int = 0  # random and power_of_two: our draws, never the router's

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--router must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"--cache-threshold is a share of the text, from 0 to 1, got {self.cache_threshold}")

    def policy_for(self, replicas: int) -> Policy:
        if self.policy == "round_robin":
            return RoundRobin(replicas)
        if self.policy == "random":
            return Random(replicas, random.Random(self.seed))
        if self.policy == "power_of_two":
            return PowerOfTwo(replicas, random.Random(self.seed))
        return CacheAware(replicas, self.cache_threshold, self.balance_abs_threshold, self.balance_rel_threshold)


# -----------------------------------------------------------------------------
# 4. A log routed


@dataclass
class Routing:
    replicas: int
    policy: str
    replica: list[int]  # of each request of the log, in log order
    match_rate: list[float | None]  # cache_aware's, for each request (the same for one line's prompts)
    keeps_salt: list[bool]  # does the replica get each request's cache_salt
    predictable: bool  # False for random and power_of_two: the replicas are a draw, not the router's
    over_tree_size: int | None = None  # the first request after which a replica's characters passed max_tree_size

    def indices_of(self, replica: int) -> list[int]:
        return [i for i, r in enumerate(self.replica) if r == replica]


def route_log(requests: list[LoggedRequest], replicas: int, flags: RouterFlags = RouterFlags()) -> Routing:
    """Route the log's requests one after another, as the router would with nothing in flight.

    >>> log = [LoggedRequest(t, None, f"line {i}") for i, t in enumerate(["system a", "system b", "other"])]
    >>> route_log(log, 2, RouterFlags("round_robin")).replica
    [0, 1, 0]
    """
    if replicas < 1:
        raise ValueError(f"--replicas is 1 or more, got {replicas}")
    policy = flags.policy_for(replicas)
    n = len(requests)
    routing = Routing(replicas, flags.policy, [0] * n, [None] * n, [True] * n,
                      predictable=flags.policy in ("round_robin", "cache_aware"))
    for routed in routed_requests(requests):
        choice = policy.route(routed.text)
        for i in routed.requests:
            routing.replica[i], routing.match_rate[i], routing.keeps_salt[i] = (
                choice.replica, choice.match_rate, routed.keeps_salt)
        if (isinstance(policy, CacheAware) and routing.over_tree_size is None
                and max(policy.tree.chars.values()) > flags.max_tree_size):
            routing.over_tree_size = routed.requests[-1]
    return routing
