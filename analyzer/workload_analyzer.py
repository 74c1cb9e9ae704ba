"""
The workload analyzer: how much would prefix caching save on your own traffic, and how big
must the pool be? It reads a request log, tokenizes it with the model's tokenizer and
replays it through this course's allocator, offline, on a CPU.

    python prefix_caching.py --analyze LOG [--model M] [--chat-template FILE] [--block-size 16] [--num-blocks N]
        [--plot FILE.png] [--like vllm|sglang|llamacpp|engine] [--kv-model NAME|CONFIG --concurrency N --context TOKENS]
        [--replicas N --router cache_aware|round_robin|random|power_of_two [--in-flight N]] [--json FILE]

Read request_logs.py (what a log holds), allocator/prefix_caching.py (the allocator it replays
through) and caching_models.py (its steps in a fast form, and two other servers' caches)
first; kv_memory.py turns the working set into GiB, fleet.py routes a log among replicas and
fleet_replay.py replays their pools, one request at a time or with requests in flight.
log_replay.py measures (1. the log tokenized as it streams, 2. its replay through
PrefixCachingAllocator, 3. the curve and the working set); this file reports:

    4. what to act on  the prefixes behind the hits (a tree), the block size, warnings (a
                       chat template that leaves the requests' tools out among them)
    5. the command     the report; with --kv-model, the memory to buy (kv_memory.py)

What the replay is, and is not. It sends the log's requests one after another, each freed
before the next, and decodes nothing: the engine of this course, given the same requests in
the same order with max_tokens=1 and a pool of the same size, reports the same cached tokens
for every request (tests/analyzer/test_workload_analyzer.py checks it). A server differs in two ways. It also caches the
blocks a reply fills while it decodes, so a later turn that sends the reply back can hit more
than the replay counts; and it holds many running requests' blocks at once, which leaves less
of a small pool for the cache. By default the pool is replayed as vLLM v1 runs one:
num_blocks counts vLLM's num_gpu_blocks, one of which is the null block BlockPool sets aside
at start-up (vllm/v1/core/block_pool.py), freed blocks without a hash go to the head of the free
queue (free_uncached_first=True), and chats are rewritten as vLLM's OpenAI server rewrites them
(vllm_requests.py). --like engine replays this course's Engine instead: every block usable, those
blocks to the tail (the design doc's order, Engine's default); --like sglang and --like llamacpp
replay those servers' caches (caching_models.py says how, and where a serial replay is approximate).
All three render chats as logged: what SGLang's and llama.cpp's servers change is not modelled.
A file of ShareGPT conversations lists each one's turns back to back; --conversations-at-once
N replays N of them taking turns, as users chatting at the same time.

Reference: the long vLLM article (README, Sources) sizes a cache by its working set: the unique
prefixes times their blocks, plus 20 % headroom for LRU churn; here the replay measures it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import heapq
import json
import math
import os
import re
import tempfile
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from jinja2 import TemplateError
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.tree import Tree

from analyzer.caching_models import EVICTION_POLICIES, RADIX_CACHE_ONLY_POLICIES, SERVER_EVICTION_POLICIES, VLLM, SGLang
from analyzer.fleet import POLICIES, ROUTER_VERSION, NotRoutable, RouterFlags, route_log
from analyzer.fleet_replay import (DRAWS, Fleet, Service, Spread, Timeline, fleet_json, print_fleet, replay_fleet,
                                   replay_in_time)
from analyzer.llama_slots import LlamaCpp
from analyzer.kv_memory import KNOWN_MODELS, UnsupportedModel, kv_shape, memory_to_buy, server_flags
from analyzer.log_replay import (CURVE_POINTS, FLAT, LIKE, NARROWING_STEPS, TOKENIZE_BATCH, CacheModel, Curve, Replay,
                                 TokenizedLog, hit_rate_curve, lengths_of, replay, smallest_pool, tokenized_batches)
from analyzer.request_logs import Log, LoggedRequest, LogError, add_log_arguments, interleaved
from analyzer.vllm_requests import server_chats
from commands.flags import positive_int
from engine.model_files import DEFAULT_MODEL, load_tokenizer, training_context

# -----------------------------------------------------------------------------
# 4. What to act on: the prefixes behind the hits, the block size, warnings


def prefix_tree(result: Replay, decode, top: int = 3, depth: int = 4) -> Tree:
    """The hit blocks as a tree of prefixes: runs of blocks hit by the same requests become one
    node, labelled with their text; at each level the `top` that saved the most tokens."""
    children: dict[int | None, list[int]] = {}
    for block_hash, block in result.prefix_blocks.items():
        children.setdefault(block.parent, []).append(block_hash)
    saved: dict[int, int] = {}

    def total(block_hash: int) -> int:  # tokens its subtree saved, iteratively (chains are long)
        order, todo = [], [block_hash]
        while todo:
            node = todo.pop()
            order.append(node)
            todo.extend(children.get(node, []))
        for node in reversed(order):
            below = sum(saved[child] for child in children.get(node, []))
            saved[node] = result.prefix_blocks[node].hits * result.block_size + below
        return saved[block_hash]

    roots = children.get(None, [])
    for root in roots:
        total(root)
    tree = Tree(f"[bold]prefixes that were hit[/] (pool of {result.num_blocks:,} blocks of {result.block_size}; "
                f"tokens saved by a prefix and all that follows it; requests that hit it)")

    def add(parent_node: Tree, heads: list[int], level: int) -> None:
        heads = sorted(heads, key=lambda h: -saved[h])
        for head in heads[:top]:
            run = [head]  # follow the chain while every block was hit by the same requests
            while len(children.get(run[-1], [])) == 1:
                (child,) = children[run[-1]]
                if result.prefix_blocks[child].hits != result.prefix_blocks[head].hits:
                    break
                run.append(child)
            tokens = [t for h in run for t in result.prefix_blocks[h].token_ids]
            text = decode(tokens).replace("\n", "\\n")
            text = text if len(text) <= 72 else f"{text[:40]} ... {text[-28:]}"
            node = parent_node.add(f"{len(run)} block{'s' * (len(run) > 1)}, {saved[head]:,} tokens saved, hit by "
                                   f"{result.prefix_blocks[head].hits:,}: [cyan]{text}[/]")
            if level + 1 < depth:
                add(node, children.get(run[-1], []), level + 1)
        if len(heads) > top:
            rest = sum(saved[h] for h in heads[top:])
            parent_node.add(f"[dim]{len(heads) - top:,} more, {rest:,} tokens saved between them[/]")

    add(tree, roots, 0)
    return tree


BLOCK_SIZES = (8, 16, 32)  # vLLM's CacheConfig: on CUDA, block sizes up to 32 (vllm/config/cache.py)


def block_size_effect(prompts, salts, studied: Replay, model: VLLM = LIKE["vllm"]) -> list[Replay]:
    """The studied replay beside the same log on pools of the same memory (num_blocks x
    block_size tokens) cut into the other BLOCK_SIZES: smaller blocks reuse more of a
    prefix's partly shared last block; bigger ones mean fewer, larger units to look up and
    evict."""
    replays = [studied]
    for size in BLOCK_SIZES:
        blocks = studied.num_blocks * studied.block_size // size
        if size != studied.block_size and blocks >= smallest_pool(prompts, size, model):
            replays.append(replay(prompts, salts, blocks, size, model=model))
    return sorted(replays, key=lambda r: r.block_size)


VARIABLE = re.compile(r"[0-9A-Fa-f:._-]*\d[0-9A-Fa-f:._-]*")  # a run of digits: a time, a date, an id
HEAD_CHARS = 2000  # how much of a prompt's start is grouped by
MIN_GROUP = 5


@dataclass
class VariableStart:
    """Prompts that agree but for numbers early on: sharing stops at the first difference."""

    requests: int  # how many prompts start this way
    distinct: int  # in how many different spellings
    position: int  # the character where the first two examples differ
    examples: tuple[str, str]  # the text around that character, in two of them
    tokens_after: int  # tokens of the shared start after that character, computed again each time


def digest(text: str) -> bytes:
    """A text's 128-bit BLAKE2b digest."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def first_text(prompt) -> str:
    """The start of a prompt as text: the first message's content, or the text itself."""
    if isinstance(prompt, str):
        return prompt
    return prompt[0]["content"] if prompt and isinstance(prompt[0], dict) else ""


class StartsSeen:
    """The starts of the prompts, gathered as the log streams by, for variable_starts. It keeps
    36 bytes a prompt: 128-bit digests of its start, blanked and as written (two starts share
    one with a chance of about 2**-128), and the number of its text in a temporary file that
    holds the first text of each start; found(), once at the end, counts the digests and reads
    back the texts of the groups it reports. (Each start and its text in memory took kilobytes.)"""

    RECENT = 4096  # starts remembered: each blanked and its text written once while it is

    def __init__(self) -> None:
        self.keys = bytearray()  # for each prompt with text: the digest of its blanked start, then of its start
        self.text_of = array("I")  # ... and the number of its text in the file
        self.texts = tempfile.TemporaryFile()  # utf-8
        self.text_at = array("Q", [0])  # where each text starts in the file, and the end of the last
        self.recent: dict[str, tuple[bytes, int]] = {}  # start -> (its keys, the number of its text)
        self.requests = 0

    def add(self, prompt) -> None:
        self.requests += 1
        text = first_text(prompt)
        if text:
            start = text[:HEAD_CHARS]
            seen = self.recent.get(start)
            if seen is None:
                if len(self.recent) >= self.RECENT:
                    self.recent.clear()
                written = self.texts.write(text.encode("utf-8", "surrogatepass"))  # JSON allows a lone surrogate
                self.text_at.append(self.text_at[-1] + written)
                seen = self.recent[start] = (digest(VARIABLE.sub("#", start)) + digest(start), len(self.text_at) - 2)
            self.keys += seen[0]
            self.text_of.append(seen[1])

    def text(self, number: int) -> str:
        self.texts.flush()
        at, end = self.text_at[number], self.text_at[number + 1]
        return os.pread(self.texts.fileno(), end - at, at).decode("utf-8", "surrogatepass")

    def found(self, tokenizer) -> list[VariableStart]:
        least = max(MIN_GROUP, self.requests // 100)
        sizes = Counter(bytes(self.keys[at : at + 16]) for at in range(0, len(self.keys), 32))  # by blanked start
        groups = {group: {} for group, size in sizes.items() if size >= least}  # -> {start: its first text}
        for i, at in enumerate(range(0, len(self.keys), 32)):
            spellings = groups.get(bytes(self.keys[at : at + 16]))
            if spellings is not None:
                spellings.setdefault(bytes(self.keys[at + 16 : at + 32]), self.text_of[i])
        found = []
        for group, spellings in groups.items():
            size = sizes[group]
            if len(spellings) < max(2, size // 2):
                continue
            texts = (self.text(number) for number in spellings.values())
            a, b = (text for _, text in heapq.nsmallest(2, ((text[:HEAD_CHARS], text) for text in texts)))
            position = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            # The text both share after the first difference, read with every number blanked out.
            blank_a, blank_b = VARIABLE.sub("#", a), VARIABLE.sub("#", b)
            common = next((i for i, (x, y) in enumerate(zip(blank_a, blank_b)) if x != y),
                          min(len(blank_a), len(blank_b)))
            after = blank_a[len(VARIABLE.sub("#", a[:position])) : common]
            tokens_after = len(tokenizer.encode(after, add_special_tokens=False)) if tokenizer else len(after.split())
            found.append(VariableStart(size, len(spellings), position,
                                       (a[max(0, position - 14):position + 24], b[max(0, position - 14):position + 24]),
                                       tokens_after))
        self.texts.close()  # found once, at the end
        return sorted(found, key=lambda v: -v.requests * v.tokens_after)


def variable_starts(requests: list[LoggedRequest], tokenizer) -> list[VariableStart]:
    """Groups of prompts whose starts are equal once every number is blanked out, but not as
    written: a timestamp or a request id early in a shared system prompt.

    >>> same = "You are a helpful assistant for our shop, answer briefly. " * 4
    >>> logged = [LoggedRequest(f"Time 09:00:{i:02d}. " + same + f"Q{i}", None, "") for i in range(6)]
    >>> found = variable_starts(logged, tokenizer=None)
    >>> found[0].requests, found[0].position, found[0].examples[0][:16], found[0].tokens_after
    (6, 12, 'Time 09:00:00. Y', 41)
    """
    starts = StartsSeen()
    for request in requests:
        starts.add(request.prompt)
    return starts.found(tokenizer)


# --- Tools: what a chat template without a tool block leaves out
#
# vLLM hands a request's tools to the chat template (apply_chat_template(..., tools=...),
# vllm/entrypoints/openai/serving_chat.py) and an assistant's tool_calls with the message; a
# template that has no tool block renders neither, so the server computes no tokens for them
# and neither does the replay. Which is right depends on the deployed model's template:
# --chat-template gives it. A template is probed once with a made-up tool and call; what it
# leaves out is counted as the JSON a tool-aware template writes (`tool | tojson`).


def template_renders_tools(tokenizer) -> tuple[bool, bool]:
    """(does the chat template render a request's tools, does it render an assistant's tool_calls)."""
    tool = {"type": "function", "function": {"name": "probe_tool_name", "description": None, "parameters": None}}
    call = {"id": "call_0", "type": "function", "function": {"name": "probe_call_name", "arguments": {}}}
    chat = [{"role": "user", "content": "Hi"}]
    try:
        with_tools = tokenizer.apply_chat_template(chat, tools=[tool], tokenize=False, add_generation_prompt=True)
        with_call = tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                                          {"role": "tool", "content": "ok", "tool_call_id": "call_0"}],
                                                  tokenize=False, add_generation_prompt=True)
    except TemplateError:  # a template strict about roles: it is not the one to count tools with
        return True, True
    return "probe_tool_name" in with_tools, "probe_call_name" in with_call


@dataclass
class ToolsSeen:
    """The requests that send tools or tool calls, and the tokens a template without a tool
    block leaves out of them, gathered as the log streams by."""

    renders_tools: bool
    renders_calls: bool
    count_tokens: Callable[[str], int]
    with_tools: int = 0  # requests that send tools
    tool_sets: set = field(default_factory=set)  # the distinct lists of tools they send
    tool_tokens: int = 0  # tokens of their definitions the template left out
    with_calls: int = 0  # requests whose history holds an assistant turn that calls tools
    call_tokens: int = 0  # tokens of those calls the template left out
    empty_turns: int = 0  # of those turns, the ones with no text: rendered as empty messages

    def add(self, request: LoggedRequest) -> None:
        if request.tools:
            key = json.dumps(request.tools, sort_keys=True)
            self.with_tools += 1
            self.tool_sets.add(key)
            if not self.renders_tools:
                self.tool_tokens += self.count_tokens(json.dumps(request.tools))
        if not isinstance(request.prompt, list):
            return
        calls = [m for m in request.prompt if isinstance(m, dict) and m.get("tool_calls")]
        if calls:
            self.with_calls += 1
            if not self.renders_calls:
                for message in calls:
                    self.empty_turns += not message["content"]
                    self.call_tokens += self.count_tokens(json.dumps(
                        [{"name": c["function"].get("name"), "arguments": c["function"].get("arguments")}
                         for c in message["tool_calls"]]))

    def notes(self, requests: int) -> list[str]:
        notes = []
        if self.with_tools and not self.renders_tools:
            notes.append(
                f"{self.with_tools:,} of {requests:,} requests send tools ({len(self.tool_sets):,} distinct lists), "
                f"and the model's chat template has no tool block: {self.tool_tokens:,} tokens of tool definitions "
                f"(as JSON, {self.tool_tokens / self.with_tools:,.0f} a request) are not in the replay. A server with "
                f"this template leaves them out too; if yours serves another one, give it with --chat-template.")
        if self.with_calls and not self.renders_calls:
            notes.append(
                f"{self.with_calls:,} requests send back assistant turns that call tools, and the model's chat "
                f"template renders no tool_calls: {self.call_tokens:,} tokens of calls (as JSON) are not in the "
                f"replay, and {self.empty_turns:,} turns that only call tools render as empty messages.")
        return notes

    @property
    def left_out(self) -> int:
        return self.tool_tokens + self.call_tokens


def warnings(starts: StartsSeen, tokenizer, curve: Curve, studied: Replay, replies: bool = False) -> list[str]:
    """What a user can change, worded from what the replay found."""
    notes = []
    for v in starts.found(tokenizer)[:3]:
        notes.append(
            f"{v.requests:,} prompts start alike but for numbers ({v.distinct:,} spellings): at character {v.position} "
            f"one says {v.examples[0]!r}, another {v.examples[1]!r}. Blocks are named by every token before them, so "
            f"sharing stops at the block holding it and the ~{v.tokens_after:,} tokens after it are computed again "
            f"each time. Move the time or id to the end of the prompt, after the shared text.")
    if studied.hot_misses:
        worst = max(studied.hot_misses, key=lambda m: m.hits_before)
        tokens = sum(m.tokens for m in studied.hot_misses)
        notes.append(
            f"LRU evicted hot prefixes {len(studied.hot_misses):,} times at {studied.num_blocks:,} blocks, "
            f"{tokens:,} prompt tokens computed again. Worst: request {worst.request:,} recomputed {worst.tokens:,} "
            f"tokens that {worst.hits_before:,} requests had hit, after {worst.since_last_hit:,} requests without "
            f"them (a burst of other traffic). LRU counts when a block was last used, not how often; "
            + (f"a pool of {curve.working_set:,} blocks (the working set) keeps them."
               if studied.num_blocks < curve.working_set else "a bigger pool keeps them longer."))
    if replies:
        notes.append("The log sends replies back (assistant turns): a server also caches the blocks a reply fills "
                     "while it decodes, so a later turn can hit more than this replay, which caches prompts only.")
    return notes


def sends_replies(prompt) -> bool:
    """Does a prompt send an assistant turn back?"""
    return isinstance(prompt, list) and any(isinstance(m, dict) and m.get("role") == "assistant" for m in prompt)


# -----------------------------------------------------------------------------
# 5. The command


def plot_curve(curve: Curve, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    sizes = [r.num_blocks for r in curve.replays]
    block_size = curve.replays[0].block_size
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sizes, [100 * r.hit_rate for r in curve.replays], marker="o", label="hit rate (% of prompt tokens)")
    ax.axvline(curve.working_set, color="grey", ls="--", lw=1, label=f"working set: {curve.working_set:,} blocks")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"cache size: num_blocks (blocks of {block_size} tokens)")
    ax.set_ylabel("prefix cache hit rate (% of prompt tokens)")
    ax.set_ylim(-3, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefix_caching.py --analyze", description="Replay a request log through the allocator: hit rate and "
        "prefill saved vs pool size, the working set, the prefixes behind the hits, warnings.")
    add_log_arguments(parser)
    parser.add_argument("--model", default=None,
                        help=f"whose tokenizer and chat template (default: {DEFAULT_MODEL}, offline)")
    parser.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                        help="the chat template your server renders with, a Jinja file (vLLM's --chat-template); "
                        "default: the model's own")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default: 16, vLLM's)")
    parser.add_argument("--num-blocks", type=positive_int, default=None,
                        help="your deployment's pool (vLLM logs its KV cache size in tokens at start-up: divide by the "
                        "block size); default: the working set")
    parser.add_argument("--like", choices=list(LIKE), default="vllm",
                        help="whose prefix cache to replay (caching_models.py): vllm (block hashes, chats rewritten as "
                        "its server does: vllm_requests.py; the default), sglang (a radix tree; --page-size, "
                        "--eviction-policy), llamacpp (slots and a prompt cache of num_blocks x block_size tokens; "
                        "--parallel, --slot-prompt-similarity), engine (this course's Engine: no null block, hashless "
                        "freed blocks to the tail); the others render chats as logged (their servers' rewrites: not modelled)")
    parser.add_argument("--like-engine", dest="like", action="store_const", const="engine", help="as --like engine")
    parser.add_argument("--page-size", type=positive_int, default=1, metavar="N",
                        help="sglang: tokens per page, the unit it matches and caches (default 1: token by token)")
    parser.add_argument("--eviction-policy", choices=EVICTION_POLICIES, default="lru",
                        help=f"sglang: which leaves its tree evicts first (default lru). The server's "
                        f"--radix-eviction-policy takes {', '.join(SERVER_EVICTION_POLICIES)}; "
                        f"{', '.join(RADIX_CACHE_ONLY_POLICIES)} only SGLang's RadixCache class takes, the server "
                        "refuses them. priority orders as lru here: a log carries no request priorities, and the "
                        "replay caches no reply")
    parser.add_argument("--slru-protected-threshold", type=int, default=None, metavar="N",
                        help="sglang, slru: hits that move a leaf from the segment evicted first to the protected "
                        "one (default 2; the server's --radix-eviction-policy-config '{\"protected_threshold\": N}')")
    parser.add_argument("--tlru-threshold", type=int, default=None, metavar="TOKENS",
                        help="sglang, tlru (needed): the tokens a prefill may compute within your time-to-first-token "
                        "target. A conversation's tokens past (the longest it has been + the estimate - this) are "
                        "evicted first (the server's --radix-eviction-policy-config '{\"threshold\": N}')")
    parser.add_argument("--tlru-next-prompt-estimate", type=int, default=None, metavar="TOKENS",
                        help="sglang, tlru: the tokens you expect a conversation's next prompt to add, below "
                        "--tlru-threshold (default 0; the config's \"next_prompt_estimate\")")
    parser.add_argument("--parallel", type=positive_int, default=None, metavar="N",
                        help="llamacpp: slots (default: llama-server's auto, 4 with a unified KV cache)")
    parser.add_argument("--slot-prompt-similarity", type=float, default=0.1, metavar="F",
                        help="llamacpp: the share of a prompt a slot must hold to be chosen (default 0.1; 0: LRU only)")
    parser.add_argument("--ctx-size", type=int, default=0, metavar="N",
                        help="llamacpp: -c, split across the slots unless --kv-unified; a prompt as long as a slot's "
                        "share is refused (default 0: the model's training context a slot, as llama-server's --fit)")
    parser.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=None,
                        help="llamacpp: one KV cache for all slots, each may use all of -c (default: on with the "
                        "automatic --parallel, off with an explicit one, as llama-server)")
    parser.add_argument("--conversations-at-once", type=positive_int, default=1, metavar="N",
                        help="replay N conversations of the log at a time, taking turns (default 1: each one's turns "
                        "back to back, as the file lists them)")
    parser.add_argument("--plot", type=Path, default=None, help="write the hit rate curve to this PNG file")
    parser.add_argument("--top", type=positive_int, default=3,
                        help="prefixes shown at each level of the tree (default 3)")
    memory = parser.add_argument_group("the memory to buy (kv_memory.py)")
    memory.add_argument("--kv-model", default=None, metavar="NAME|CONFIG",
                        help=f"the model to size the KV cache for: a config.json, or one of {', '.join(KNOWN_MODELS)}")
    memory.add_argument("--kv-dtype", default=None, help="the KV cache's dtype, if not the model's (e.g. fp8)")
    memory.add_argument("--concurrency", type=positive_int, default=1,
                        help="requests running at once, each holding its own KV besides the cache (default 1)")
    memory.add_argument("--context", type=positive_int, default=None,
                        help="tokens a running request holds, prompt and reply (default: the log's longest prompt)")
    defaults = RouterFlags()
    fleet = parser.add_argument_group(f"a fleet behind sglang-router {ROUTER_VERSION} (fleet.py)")
    fleet.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                       help="predict N replicas of the --like server, each with a pool of --num-blocks (default: the "
                       "working set), behind the router")
    fleet.add_argument("--router", choices=POLICIES, default=defaults.policy,
                       help=f"the router's --policy (default {defaults.policy}, the router's)")
    fleet.add_argument("--cache-threshold", type=float, default=defaults.cache_threshold, metavar="F",
                       help=f"cache_aware: the share of a text its tree must match to follow it (default "
                       f"{defaults.cache_threshold})")
    fleet.add_argument("--balance-abs-threshold", type=int, default=defaults.balance_abs_threshold, metavar="N",
                       help=f"cache_aware: balance when loads differ by more (default {defaults.balance_abs_threshold}; "
                       "loads are 0 one request at a time)")
    fleet.add_argument("--balance-rel-threshold", type=float, default=defaults.balance_rel_threshold, metavar="F",
                       help=f"cache_aware: ... and the largest is more than F times the smallest (default "
                       f"{defaults.balance_rel_threshold})")
    fleet.add_argument("--max-tree-size", type=positive_int, default=defaults.max_tree_size, metavar="N",
                       help=f"cache_aware: characters of a replica the router's tree keeps past an eviction (default "
                       f"2**26); past it the prediction is approximate")
    fleet.add_argument("--router-seed", type=int, default=defaults.seed, metavar="N",
                       help="random, power_of_two: the seed of the draws (the router's own cannot be known)")
    fleet.add_argument("--json", type=Path, default=None, metavar="FILE",
                       help="with --replicas: write each request's replica and cached tokens, and the totals, to FILE")
    service = Service()
    fleet.add_argument("--in-flight", type=positive_int, default=1, metavar="N",
                       help="with --replicas: N clients, each sending the next request when its last is answered, the "
                       "replicas stepping in time (fleet_replay.py; --like vllm or engine). Default 1: one at a time")
    fleet.add_argument("--max-num-batched-tokens", type=positive_int, default=service.max_num_batched_tokens,
                       metavar="N", help=f"with --in-flight: a replica's tokens a step (default "
                       f"{service.max_num_batched_tokens}, vllm serve's below 70 GiB of GPU; its requests a step at most "
                       f"{service.max_num_seqs}, or N if fewer)")
    fleet.add_argument("--step-ms", type=float, default=service.step_ms, metavar="MS",
                       help=f"with --in-flight: a step's fixed cost (default {service.step_ms:g} ms)")
    fleet.add_argument("--token-ms", type=float, default=service.token_ms, metavar="MS",
                       help=f"with --in-flight: a step's cost a token it computes (default {service.token_ms:g} ms)")
    fleet.add_argument("--gap-ms", type=float, default=service.gap_ms, metavar="MS",
                       help=f"with --in-flight: from a reply to the client's next request at a replica (default "
                       f"{service.gap_ms:g} ms)")
    return parser


@dataclass
class Summary:
    """What one run of the command found and how long it took (the benchmark reads it)."""

    requests: int
    prompt_tokens: int
    working_set: int
    tokenize_seconds: float  # reading the log and tokenizing it
    seconds: float  # the whole run


def cache_model(args: argparse.Namespace) -> CacheModel:
    """The caching model the flags describe."""
    if args.like == "sglang":
        given = {"--slru-protected-threshold": (args.slru_protected_threshold, "slru"),
                 "--tlru-threshold": (args.tlru_threshold, "tlru"),
                 "--tlru-next-prompt-estimate": (args.tlru_next_prompt_estimate, "tlru")}
        for flag, (value, policy) in given.items():
            if value is not None and args.eviction_policy != policy:
                raise ValueError(f"{flag} is a setting of --eviction-policy {policy}, not {args.eviction_policy}: "
                                 f"SGLang's server refuses a config key its policy does not take")
        if args.eviction_policy == "tlru" and args.tlru_threshold is None:
            raise ValueError("--eviction-policy tlru needs --tlru-threshold TOKENS, the tokens a prefill may compute "
                             "within your time-to-first-token target (SGLang's server refuses tlru without one)")
        settings = {"slru_protected_threshold": args.slru_protected_threshold, "tlru_threshold": args.tlru_threshold,
                    "tlru_next_prompt_estimate": args.tlru_next_prompt_estimate}
        return SGLang(args.page_size, args.eviction_policy, **{k: v for k, v in settings.items() if v is not None})
    if args.like == "llamacpp":
        if not 0 <= args.slot_prompt_similarity <= 1:
            raise ValueError(f"--slot-prompt-similarity must be between 0 and 1, got {args.slot_prompt_similarity}")
        if args.ctx_size < 0:
            raise ValueError(f"--ctx-size must be 0 (the model's training context a slot) or more, got {args.ctx_size}")
        # llama-server: an automatic --parallel is 4 slots on one unified KV cache (tools/server/server.cpp)
        kv_unified = args.parallel is None if args.kv_unified is None else args.kv_unified
        return LlamaCpp(args.parallel or 4, args.slot_prompt_similarity, kv_unified=kv_unified, n_ctx=args.ctx_size,
                        n_ctx_train=training_context(args.model))
    return LIKE[args.like]


MODEL_NAMES = {"vllm": "vLLM's block pool", "engine": "this course's Engine", "sglang": "SGLang's radix tree",
               "llamacpp": "llama.cpp's slots and prompt cache"}


def print_memory_to_buy(console: Console, shape, args: argparse.Namespace, working_set: int, context: int) -> None:
    """The working set and the running requests' own KV in GiB for the --kv-model, and the flags."""
    m = memory_to_buy(shape, args.block_size, working_set, args.concurrency, context)
    per_block = shape.bytes_per_block(args.block_size)
    console.print(f"\n[bold]Memory to buy[/] for {shape.name} (KV in {shape.dtype}"
        f"{f', as vLLM serves its {shape.config_dtype} checkpoint' if shape.config_dtype else ''}: "
        f"{shape.bytes_per_token() / 1024:,.0f} KiB a token, {per_block / 2**20:,.2f} MiB a block of {args.block_size}): "
        f"the working set, {m.cache_blocks:,} blocks, is {m.gib(m.cache_blocks):,.2f} GiB; {m.concurrency:,} running "
        f"request(s) of {m.context:,} tokens hold {m.gib(m.running_blocks):,.2f} GiB more: [bold]{m.gib():,.2f} GiB[/] "
        f"of KV cache in all"
        + (". (Blocks of the default model's tokens: give --model, the deployed model's tokenizer, for its own.)"
           if args.model is None else "."))
    for server, flags in server_flags(m).items():
        console.print(f"  {server}: {flags}")


def main(argv: list[str] | None = None, console: Console | None = None) -> Summary:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model = cache_model(args)
        shape = kv_shape(args.kv_model, args.kv_dtype) if args.kv_model else None
        flags = RouterFlags(args.router, args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold,
                            args.max_tree_size, args.router_seed)
        args.service = Service(args.max_num_batched_tokens, min(Service.max_num_seqs, args.max_num_batched_tokens),
                               args.step_ms, args.token_ms, args.gap_ms)
    except (ValueError, OSError, UnsupportedModel) as err:
        parser.error(str(err))
    if args.json is not None and args.replicas is None:
        parser.error("--json writes a fleet's prediction: give --replicas N too")
    if args.in_flight > 1 and (args.replicas is None or args.like not in ("vllm", "engine")):
        parser.error("--in-flight N replays a fleet in time: give --replicas N, with --like vllm or engine (the other "
                     "servers' schedulers are not modelled)")
    console = console or Console()
    start = time.perf_counter()
    try:
        tokenizer = load_tokenizer(args.model)
    except OSError as err:
        parser.error(str(err))
    if args.chat_template is not None:
        try:
            tokenizer.chat_template = args.chat_template.read_text(encoding="utf-8")
        except OSError as err:
            parser.error(f"--chat-template {args.chat_template}: {err.strerror}; give a Jinja file")
    with TokenizedLog() as prompts:
        try:
            read = read_log_streaming(args, tokenizer, prompts, console)
        except LogError as err:
            parser.error(str(err))
        return analyse(args, parser, model, shape, flags, tokenizer, prompts, read, console, start)


@dataclass
class ReadLog:
    """What reading the log found besides the token ids: for the report and the warnings."""

    log: Log  # its notes: bad records, content parts left out
    starts: StartsSeen
    tools: ToolsSeen
    replies: bool  # some chat sends an assistant turn back
    seconds: float
    requests: list[LoggedRequest] | None  # kept for --replicas only: the router's tree holds every text anyway


def read_log_streaming(args: argparse.Namespace, tokenizer, prompts: TokenizedLog, console: Console) -> ReadLog:
    """Read, tokenize and keep the log's token ids in `prompts`, a batch at a time, with a
    progress bar: how much of the file is read, the requests and tokens a second."""
    start = time.perf_counter()
    log = Log([])
    renders_tools, renders_calls = template_renders_tools(tokenizer)
    counted: dict[str, int] = {}  # a tool list or call's tokens, counted once (an agent sends the same ones)

    def count_tokens(text: str) -> int:
        if text not in counted:
            if len(counted) > 10_000:
                counted.clear()
            counted[text] = len(tokenizer.encode(text, add_special_tokens=False))
        return counted[text]

    starts, tools, replies = StartsSeen(), ToolsSeen(renders_tools, renders_calls, count_tokens), False
    kept = [] if args.replicas is not None else None
    columns = (TextColumn("reading and tokenizing"), BarColumn(), TaskProgressColumn(),
               TextColumn("{task.fields[requests]:,} requests, {task.fields[rate]:,.0f} tokens/s"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("", total=None, requests=0, rate=0)
        file_read = lambda done, size: progress.update(task, completed=done, total=size)  # noqa: E731
        requests = interleaved(log.stream(args.log, args.max_log_bytes, args.skip_bad, file_read),
                              args.conversations_at_once)
        tokens = 0
        for request, ids in tokenized_batches(requests, tokenizer, server_chats(LIKE[args.like], tokenizer)):
            prompts.append(ids, request.cache_salt)
            starts.add(request.prompt)
            tools.add(request)
            if kept is not None:
                kept.append(request)
            replies = replies or sends_replies(request.prompt)
            tokens += len(ids)
            if len(prompts) % TOKENIZE_BATCH == 0:
                progress.update(task, requests=len(prompts), rate=tokens / (time.perf_counter() - start))
    return ReadLog(log, starts, tools, replies, time.perf_counter() - start, kept)


def analyse(args, parser, model: CacheModel, shape, flags: RouterFlags, tokenizer, prompts: TokenizedLog,
            read: ReadLog, console: Console, start: float) -> Summary:
    """The report on a log read and tokenized: the curve, the working set, the tree, warnings."""
    salts = prompts.salts
    tokenized = time.perf_counter()
    total = sum(prompts.lengths)
    left_out = (f"; the chat template leaves out {read.tools.left_out:,} tokens of tools, see the warnings"
                if read.tools.left_out else "")
    console.print(f"{args.log}: {len(prompts):,} requests, {total:,} prompt tokens "
                  f"({total / len(prompts):,.0f} a request{left_out}), read and tokenized in {tokenized - start:.1f} s")
    smallest = smallest_pool(prompts, args.block_size, model)
    if args.num_blocks is not None and args.num_blocks < smallest:
        parser.error(f"--num-blocks {args.num_blocks} cannot hold the longest prompt; give at least {smallest}")

    with console.status(f"replaying {len(prompts):,} requests at {CURVE_POINTS + NARROWING_STEPS} pool sizes"):
        curve = hit_rate_curve(prompts, salts, args.block_size, model)
    most = curve.replays[-1]
    table = Table("num_blocks", "tokens", "hit rate", "prefill tokens saved", "evictions",
                  title=f"the log replayed at each pool size ({MODEL_NAMES[args.like]})")
    for r in curve.replays:
        mark = " [bold](working set)[/]" if r.num_blocks == curve.working_set else ""
        table.add_row(f"{r.num_blocks:,}{mark}", f"{r.num_blocks * r.block_size:,}", f"{r.hit_rate:.1%}",
                      f"{r.cached_tokens:,}", f"{r.evictions:,}")
    console.print(table)
    rule = math.ceil(curve.footprint.shared_blocks * 1.2)
    console.print(
        f"Working set: {curve.working_set:,} blocks ({curve.working_set * args.block_size:,} tokens) save "
        f"{FLAT:.0%} of what a pool with room for the whole log saves ({most.hit_rate:.1%} hit rate, "
        f"{most.cached_tokens:,} tokens, at {most.num_blocks:,} blocks). "
        f"The article's rule (the long write-up on vLLM v1's prefix caching the course started from: a pool of "
        f"the blocks later requests start with, its unique prefixes times their blocks, plus 20 % for LRU's "
        f"churn) gives {curve.footprint.shared_blocks:,} x 1.2 = {rule:,} blocks ({curve.footprint.distinct_blocks:,} distinct "
        f"full blocks in the log).")
    if shape is not None:
        print_memory_to_buy(console, shape, args, curve.working_set, args.context or max(prompts.lengths))

    studied_size = args.num_blocks or curve.working_set
    by_blocks = isinstance(model, VLLM)  # the tree, the hot misses and the block sizes are read from block hashes
    studied = replay(prompts, salts, studied_size, args.block_size, model=model, watch=by_blocks)
    console.print(f"\nAt {studied_size:,} blocks{' (--num-blocks)' if args.num_blocks else ''}: hit rate "
                  f"{studied.hit_rate:.1%}, {studied.cached_tokens:,} of {studied.prompt_tokens:,} prompt tokens "
                  f"not computed again, {studied.evictions:,} evictions.")
    for note in model.notes(lengths_of(prompts), studied) if isinstance(model, LlamaCpp) else []:
        console.print(f"[yellow]{note}[/]")
    if by_blocks:
        console.print(prefix_tree(studied, tokenizer.decode, top=args.top))
        table = Table("block size", "num_blocks", "hit rate", "prefill tokens saved",
                      title=f"the same memory ({studied_size * args.block_size:,} tokens) in other block sizes",
                      caption="a size is left out when its pool cannot hold the longest prompt")
        for r in block_size_effect(prompts, salts, studied, model):
            table.add_row(str(r.block_size), f"{r.num_blocks:,}", f"{r.hit_rate:.1%}", f"{r.cached_tokens:,}")
        console.print(table)
    else:
        console.print(f"(the prefix tree, hot misses and block sizes are vLLM's: see them with --like vllm) "
                      f"{MODEL_NAMES[args.like]} is replayed one request at a time: where that is approximate, "
                      f"see caching_models.py.")

    if args.replicas is not None:
        held = list(prompts) if args.in_flight == 1 else prompts

        def predict(flags: RouterFlags, ties: int | None = None) -> tuple[Fleet, Timeline | None]:
            if args.in_flight == 1:
                return replay_fleet(held, salts, route_log(read.requests, args.replicas, flags), studied_size,
                                    args.block_size, model), None
            return replay_in_time(read.requests, prompts, salts, args.replicas, flags, studied_size, args.block_size,
                                  args.in_flight, args.service, model, ties=ties)

        try:
            fleet, timeline = predict(flags)
        except NotRoutable as err:
            parser.error(str(err))
        if not fleet.routing.predictable:  # the router's draws
            spread = Spread("draws", [predict(dataclasses.replace(flags, seed=s))[0].hit_rate for s in range(DRAWS)])
        elif args.in_flight > 1:  # the races of requests that arrive together
            spread = Spread("orders", [predict(flags, ties=s)[0].hit_rate for s in range(DRAWS)])
        else:
            spread = None
        print_fleet(console, fleet, read.requests, studied, flags, MODEL_NAMES[args.like], spread)
        if args.json is not None:
            written = fleet_json(fleet, read.requests, args, flags, timeline, args.service, spread)
            args.json.write_text(json.dumps(written, indent=1))
            console.print(f"wrote {args.json}")

    notes = read.log.notes() + read.tools.notes(len(prompts)) + warnings(read.starts, tokenizer, curve, studied,
                                                                         read.replies)
    for note in notes:
        console.print(f"[yellow]warning:[/] {note}")
    if args.plot:
        plot_curve(curve, args.plot, f"{args.log.name}: hit rate vs cache size ({len(prompts):,} requests)")
        console.print(f"wrote {args.plot}")
    seconds = time.perf_counter() - start
    console.print(f"{len(prompts):,} requests analysed in {seconds:.1f} s "
                  f"({tokenized - start:.1f} s reading and tokenizing).")
    return Summary(len(prompts), total, curve.working_set, tokenized - start, seconds)
