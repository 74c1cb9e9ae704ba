"""
A tiny radix tree over token ids, the structure SGLang's RadixAttention caches prefixes in
(python/sglang/srt/mem_cache/radix_cache.py), kept to the one idea stage 10 compares.

vLLM names each full block by a chained hash and looks blocks up in a flat table. A radix
tree instead stores the token sequences themselves: each edge holds a run of tokens, and
a lookup walks down from the root as long as the tokens agree. So it matches at token
granularity, not block granularity, and needs no hash at all.

    >>> tree = RadixTree()
    >>> tree.insert([1, 2, 3, 4, 5]); tree.insert([1, 2, 3, 9])   # splits the edge after 1 2 3
    >>> tree.match_prefix([1, 2, 3, 4, 7]), tree.match_prefix([1, 2, 3, 9, 9]), tree.match_prefix([8])
    (4, 4, 0)

Left out on purpose: SGLang's tree also stores each token's KV slot index on the edges,
locks the nodes a running request uses (lock_ref, the ref count) and evicts the least
recently used unlocked leaves, the same policy as vLLM's free queue (the older vLLM design
doc, "Automatic Prefix Caching", section "Generalized Caching Policy"). The analyzer models
all of that (analyzer/caching_models.py, RadixTree: pages, locks, SGLang's eviction
policies); with nothing evicted the two find the same prefix for every request
(tests/course/test_lessons.py checks it on every workload here).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RadixNode:
    tokens: list[int] = field(default_factory=list)  # the edge from the parent to this node
    children: dict[int, RadixNode] = field(default_factory=dict)  # keyed by their first token


def _common_length(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class RadixTree:
    def __init__(self) -> None:
        self.root = RadixNode()

    def match_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` are stored in the tree."""
        node, matched = self.root, 0
        while matched < len(tokens) and tokens[matched] in node.children:
            child = node.children[tokens[matched]]
            n = _common_length(child.tokens, tokens[matched:])
            matched += n
            if n < len(child.tokens):  # the match ends inside this edge
                break
            node = child
        return matched

    def insert(self, tokens: list[int]) -> None:
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:  # nothing shares this token here: a new leaf holds the rest
                node.children[tokens[i]] = RadixNode(list(tokens[i:]))
                return
            n = _common_length(child.tokens, tokens[i:])
            if n < len(child.tokens):  # split the edge where the two sequences part
                middle = RadixNode(child.tokens[:n], {child.tokens[n]: child})
                child.tokens = child.tokens[n:]
                node.children[middle.tokens[0]] = middle
                child = middle
            node, i = child, i + n

    def num_tokens(self) -> int:
        """Tokens stored: each shared prefix once."""
        stack, total = [self.root], 0
        while stack:
            node = stack.pop()
            total += len(node.tokens)
            stack.extend(node.children.values())
        return total

    def render(self, token_repr=str):
        """The tree as a rich Tree, one line per edge."""
        from rich.tree import Tree

        def add(branch, node: RadixNode) -> None:
            for child in node.children.values():
                add(branch.add(" ".join(token_repr(t) for t in child.tokens)), child)

        view = Tree("[bold]root")
        add(view, self.root)
        return view
