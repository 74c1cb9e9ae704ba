"""
Seeing the allocator: rich views of its state, and the vLLM design doc's examples replayed.

Read allocator/prefix_caching.py first; this file draws what it holds and checks it against the doc.

    python allocator/prefix_caching.py --walkthrough     # runs walkthrough() below

    render_block_table   a request's blocks: logical -> physical, tokens, hash, ref count
    render_free_queue    the free queue from head (evicted next) to tail
    render_cache_map     block hash -> the blocks holding that content
    render_stats         hit rate, evictions, blocks cached
    render_pool          every block of the pool, coloured by state
    walkthrough          Time 1 to 6 and "duplicated blocks", each state checked

Reference: vLLM v1 design doc, "Automatic Prefix Caching"
(https://docs.vllm.ai/en/latest/design/prefix_caching.html).
"""

from __future__ import annotations

from rich.columns import Columns
from rich.console import Console, Group
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from allocator import KVCacheBlock, PrefixCachingAllocator, short_hash

# -----------------------------------------------------------------------------
# 1. Rich views: see the state
#
# Colours used everywhere: green = in use (ref count > 0), yellow = free but still cached
# (a later request can hit it), dim = free and empty.

IN_USE, CACHED_FREE, EMPTY = "bold green", "yellow", "dim"


def _style(block: KVCacheBlock) -> str:
    if block.ref_cnt > 0:
        return IN_USE
    return CACHED_FREE if block.block_hash is not None else EMPTY


def _tokens(block: KVCacheBlock, block_size: int, token_repr) -> str:
    shown = [token_repr(t) for t in block.token_ids]
    return " ".join(shown + ["·"] * (block_size - len(shown)))  # · = empty slot


def render_block_table(alloc: PrefixCachingAllocator, request_id: str, token_repr=str):
    """A request's block table: logical block -> physical block, tokens, hash, ref count."""
    table = Table(title=f"block table of {request_id!r}", title_justify="left")
    for column in ("logical", "block", "tokens", "hash", "ref"):
        table.add_column(column, justify="right" if column in ("logical", "block", "ref") else "left")
    for i, block_id in enumerate(alloc.block_tables[request_id]):
        block = alloc.blocks[block_id]
        table.add_row(
            str(i), str(block_id), _tokens(block, alloc.block_size, token_repr),
            short_hash(block.block_hash), str(block.ref_cnt), style=_style(block),
        )
    return table


def render_free_queue(alloc: PrefixCachingAllocator, max_blocks: int = 256):
    """The free queue from head (evicted first) to tail, cached blocks in yellow.

    Up to 16 blocks: a table with each block's short hash. More: a wrapped line of ids.
    """
    blocks = list(alloc.free_queue)
    title = f"free queue: {len(blocks)} blocks, head (evicted first) -> tail"
    if len(blocks) > 16:
        line = Text(f"{title} (yellow: still cached)\n", style="italic")
        for block in blocks[:max_blocks]:
            line.append(str(block.block_id), style=_style(block)).append(" ")
        if len(blocks) > max_blocks:
            line.append(f"... {len(blocks) - max_blocks} more", style="italic")
        return line
    table = Table(title=title, title_justify="left", show_header=False, min_width=len(title))
    table.add_column("", style="bold")
    for _ in blocks:
        table.add_column(justify="center")
    table.add_row("block", *[f"[{_style(b)}]{b.block_id}" for b in blocks])
    table.add_row("hash", *[f"[{_style(b)}]{short_hash(b.block_hash)[:4]}" for b in blocks])
    return table


def render_cache_map(alloc: PrefixCachingAllocator, token_repr=str):
    """The cache map: block hash -> the block(s) holding that content."""
    table = Table(title=f"cache map: {len(alloc.cached_blocks)} hashes", title_justify="left")
    for column in ("hash", "blocks", "tokens", "ref counts"):
        table.add_column(column)
    for block_hash, blocks in alloc.cached_blocks.items():
        first = next(iter(blocks.values()))
        table.add_row(
            short_hash(block_hash),
            ", ".join(f"[{_style(b)}]{b.block_id}[/]" for b in blocks.values()),
            _tokens(first, alloc.block_size, token_repr),
            ", ".join(str(b.ref_cnt) for b in blocks.values()),
        )
    return table


def render_stats(alloc: PrefixCachingAllocator):
    table = Table(title="stats", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    s = alloc.stats
    rows = {
        "requests": s.requests,
        "hit rate": f"{s.hit_rate:.1%} ({s.hit_tokens}/{s.queried_tokens} tokens)",
        "blocks free / in use / cached": (
            f"{alloc.num_free_blocks} / {alloc.num_blocks_in_use} / {alloc.num_cached_blocks}"
        ),
        "evictions": s.evictions,
        "hash collisions": s.hash_collisions,
        "refused allocations": s.refused,
    }
    for name, value in rows.items():
        table.add_row(name, str(value))
    return table


def render_pool(alloc: PrefixCachingAllocator, token_repr=str, title: str = "block pool"):
    """Everything at once: every block, the free queue, the block tables, the cache map."""
    cells = [
        Panel(
            f"{_tokens(b, alloc.block_size, token_repr)}\n{short_hash(b.block_hash)} ref={b.ref_cnt}",
            title=str(b.block_id), style=_style(b), expand=False,
        )
        for b in alloc.blocks[:64]
    ]
    parts = [Columns(cells), render_free_queue(alloc)]
    parts += [render_block_table(alloc, rid, token_repr) for rid in alloc.block_tables]
    if alloc.cached_blocks:
        parts.append(render_cache_map(alloc, token_repr))
    parts.append(render_stats(alloc))
    legend = f"[{IN_USE}]in use[/]  [{CACHED_FREE}]free, cached[/]  [{EMPTY}]free, empty[/]"
    return Panel(Group(*parts), title=title, subtitle=legend)


# -----------------------------------------------------------------------------
# 2. The walkthrough: the design doc's examples, replayed
#
# Block size 4, 10 blocks. Token ids are made up; only which ones repeat matters.

_R0 = list(range(15))  # request 0's prompt; later requests share its first 10 or 12 tokens

# (title, what happens, the step, the request whose block table to show) for Time 1 to 6.
DESIGN_DOC_STEPS = [
    ("Time 1", "Request 0 arrives with 15 prompt tokens: 3 full blocks are cached, the 4th holds 3 tokens.",
     lambda a: a.allocate_with_prefix("request 0", _R0), "request 0"),
    ("Time 2", "Request 0 decodes token 15 (block 3 fills and is cached), then 16 (needs block 4).",
     lambda a: (a.append_token("request 0", 15), a.append_token("request 0", 16)), "request 0"),
    ("Time 3", "Request 1 arrives with 14 tokens; its first 10 equal request 0's. Only 2 full blocks "
     "(8 tokens) hit: the 3rd block matches just 2 of its 4 tokens.",
     lambda a: a.allocate_with_prefix("request 1", _R0[:10] + [100, 101, 102, 103]), "request 1"),
    ("Time 4", "Request 0 finishes. Blocks 4, 3, 2 join the free queue in reverse order (2 and 3 keep "
     "their hash); 0 and 1 stay, request 1 still uses them.",
     lambda a: a.free("request 0"), None),
    ("Time 5", "Request 1 finishes: blocks 6, 5, 1, 0 join the tail.",
     lambda a: a.free("request 1"), None),
    ("Time 6", "Request 2 arrives with 29 tokens; its first 12 equal request 0's. Hits 0, 1, 2 are touched "
     "(taken out of the free queue) before 5 new blocks are popped from the head; block 3 still held a "
     "hash, so it is evicted.",
     lambda a: a.allocate_with_prefix("request 2", _R0[:12] + list(range(200, 217))), "request 2"),
]

# What the doc's figures show after each step: (label, how to read it off, expected).
DESIGN_DOC_STATES = {
    "Time 1": [("block table of request 0", lambda a: a.block_tables["request 0"], [0, 1, 2, 3])],
    "Time 2": [("block table of request 0", lambda a: a.block_tables["request 0"], [0, 1, 2, 3, 4])],
    "Time 3": [("cached tokens of request 1", lambda a: a.stats.hit_tokens, 8),
               ("block table of request 1", lambda a: a.block_tables["request 1"], [0, 1, 5, 6])],
    "Time 4": [("free queue", lambda a: a.free_queue.block_ids(), [7, 8, 9, 4, 3, 2])],
    "Time 5": [("free queue", lambda a: a.free_queue.block_ids(), [7, 8, 9, 4, 3, 2, 6, 5, 1, 0])],
    "Time 6": [("block table of request 2", lambda a: a.block_tables["request 2"], [0, 1, 2, 7, 8, 9, 4, 3]),
               ("blocks evicted", lambda a: a.stats.evictions, 1),
               ("free queue", lambda a: a.free_queue.block_ids(), [6, 5])],
}


def design_doc_example(until: int = 6, **allocator_options) -> PrefixCachingAllocator:
    """The allocator after Time 1..`until` of the design doc's example; `allocator_options`
    replay it with other settings (e.g. free_uncached_first=True).

    >>> design_doc_example(until=5).free_queue.block_ids()
    [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    """
    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4, **allocator_options)
    for _, _, step, _ in DESIGN_DOC_STEPS[:until]:
        step(alloc)
    return alloc


def _check(console, label: str, got, expected) -> None:
    mark = "[green]matches the design doc[/]" if got == expected else f"[red]differs from the doc: {expected}[/]"
    console.print(f"  {label}: {got}  {mark}")


def walkthrough(console=None) -> PrefixCachingAllocator:
    """Replay 'Example' (Time 1 to 6) and 'Duplicated blocks' from the vLLM v1 design doc."""
    console = console or Console()

    def step(title: str, text: str) -> None:
        console.print(Rule(title))
        console.print(text)

    alloc = PrefixCachingAllocator(num_blocks=10, block_size=4)
    for title, text, action, shown in DESIGN_DOC_STEPS:
        step(title, text)
        action(alloc)
        if shown:
            console.print(render_block_table(alloc, shown))
        console.print(render_free_queue(alloc))
        if title == "Time 5":
            console.print(render_cache_map(alloc))
        for label, read, expected in DESIGN_DOC_STATES[title]:
            _check(console, label, read(alloc), expected)
    alloc.free("request 2")

    letters = lambda t: chr(ord("A") + t)  # noqa: E731  token 0 is A, 1 is B, ...
    dup = PrefixCachingAllocator(num_blocks=10, block_size=4)
    step("Duplicated blocks", "Request 1: prompt ABCDEF, greedy output GHI. Tokens join as they are decoded.")
    dup.allocate_with_prefix("request 1", [0, 1, 2, 3, 4, 5])  # A B C D E F
    for token in (6, 7, 8):  # G H I
        dup.append_token("request 1", token)
    console.print(render_block_table(dup, "request 1", letters))
    _check(console, "block table of request 1", dup.block_tables["request 1"], [0, 1, 2])
    console.print("Request 2 sends the same prompt and decodes the same G, H. ABCD hits block 0; EFGH "
                  "fills a new block 3 that is cached again under block 1's hash: tables are append-only.")
    dup.allocate_with_prefix("request 2", [0, 1, 2, 3, 4, 5])
    for token in (6, 7):
        dup.append_token("request 2", token)
    console.print(render_block_table(dup, "request 2", letters), render_cache_map(dup, letters))
    _check(console, "block table of request 2", dup.block_tables["request 2"], [0, 3])
    efgh = dup.block_hash(1)
    _check(console, "blocks cached under EFGH's hash", sorted(dup.cached_blocks[efgh]), [1, 3])
    dup.free("request 1")
    dup.free("request 2")
    console.print(render_pool(dup, letters, title="after both are freed"))
    return alloc
