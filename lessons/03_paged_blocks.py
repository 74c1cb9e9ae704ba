"""
Stage 3: paged blocks and block tables, with prefix caching off.

Before anything is cached, the pool itself. Every running request needs a place for the
K/V of each of its tokens. Give each request one contiguous region sized for the longest
sequence it might reach, and most of that region sits empty (internal fragmentation),
while the holes left by finished requests come in awkward sizes (external fragmentation).
PagedAttention cuts the KV cache into fixed-size blocks instead; a request's *block
table* maps its logical block i (tokens i*block_size .. (i+1)*block_size-1) to any free
physical block, wherever it is.

New in this stage (marked # NEW): PrefixCachingAllocator with enable_caching=False, the
block table, and slot() (where one token's K/V lives).

Read: allocator/prefix_caching.py, section 3: PrefixCachingAllocator.get_new_blocks and .slot (printed
      when the stage starts).

Run:  python lessons/03_paged_blocks.py
"""

import argparse

from rich.console import Console
from rich.rule import Rule
from rich.table import Table

from allocator import PrefixCachingAllocator
from commands.walkthrough import render_block_table, render_pool
from lessons.reading import show_code

BLOCK_SIZE = 4
MAX_LEN = 16  # the longest sequence a request may grow to (prompt + answer)
PROMPT_LENGTHS = {"r0": 10, "r1": 5, "r2": 14, "r3": 7}


def prompt(request_id: str, length: int) -> list[int]:
    """Tokens 100, 101, ... for r1, 200, 201, ... for r2: easy to spot in the pool view."""
    start = 100 * int(request_id[1:])
    return list(range(start, start + length))


def longest_free_run(alloc: PrefixCachingAllocator) -> int:
    """The most consecutive free block ids: all a contiguous allocator could hand out."""
    free, best, run = set(alloc.free_queue.block_ids()), 0, 0
    for block_id in range(alloc.num_blocks):
        run = run + 1 if block_id in free else 0
        best = max(best, run)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)  # no flags: --help prints the docstring above and exits
    console = Console()
    show_code(console, PrefixCachingAllocator.get_new_blocks, PrefixCachingAllocator.slot)
    alloc = PrefixCachingAllocator(num_blocks=12, block_size=BLOCK_SIZE, enable_caching=False)  # NEW

    console.print(Rule("1. Four requests, each gets only the blocks its tokens fill"))
    for request_id, length in PROMPT_LENGTHS.items():
        alloc.allocate_with_prefix(request_id, prompt(request_id, length))
    console.print(render_pool(alloc, title="the pool: 12 blocks of 4 token slots"))

    table = Table("request", "tokens", "blocks", "slots reserved", "slots wasted", title="memory: paged vs contiguous")
    used = sum(PROMPT_LENGTHS.values())
    paged = sum(len(alloc.block_tables[r]) for r in PROMPT_LENGTHS) * BLOCK_SIZE  # NEW
    for request_id, length in PROMPT_LENGTHS.items():
        blocks = alloc.block_tables[request_id]  # NEW
        table.add_row(request_id, str(length), str(blocks), str(len(blocks) * BLOCK_SIZE), str(len(blocks) * BLOCK_SIZE - length))
    table.add_row("paged, all", str(used), "", str(paged), f"{paged - used} ({(paged - used) / paged:.0%})", style="bold")
    contiguous = len(PROMPT_LENGTHS) * MAX_LEN
    table.add_row(f"contiguous, {MAX_LEN} each", str(used), "", str(contiguous),
                  f"{contiguous - used} ({(contiguous - used) / contiguous:.0%})", style="bold")
    console.print(table)
    console.print(f"A paged request wastes less than one block ({BLOCK_SIZE} slots): only its last block is partly empty.")

    console.print(Rule("2. Holes anywhere are fine"))
    r0_blocks, r2_blocks = alloc.block_tables["r0"], alloc.block_tables["r2"]
    alloc.free("r0")
    alloc.free("r2")
    run = longest_free_run(alloc)
    console.print(f"r0 and r2 finished: {alloc.num_free_blocks} blocks are free, but at most {run} of them "
                  f"are consecutive (free queue, head first: {alloc.free_queue.block_ids()}).")
    console.print(f"Freed blocks join the tail of the free queue, each request's last block first: r0's "
                  f"{r0_blocks} went in as {r0_blocks[::-1]}, then r2's {r2_blocks} as {r2_blocks[::-1]}; new "
                  f"blocks come from the head. Without caching the order does not matter. Once blocks keep their "
                  f"K/V for reuse (stages 5 and 6) it does: a request's last block stands for its longest prefix, "
                  f"the least likely to be asked for again, so it should be the first one reused (stage 6).")
    alloc.allocate_with_prefix("r4", prompt("r4", 20))  # 5 blocks: more than any hole
    console.print(render_block_table(alloc, "r4"))
    console.print(f"r4 needs 5 blocks; a contiguous allocator would refuse it (longest run {run}). "
                  f"Its block table is {alloc.block_tables['r4']}: scattered, and nobody cares.")

    console.print(Rule("3. Where token p lives: table entry p // block_size, slot p % block_size"))
    for position in (0, 3, 4, 13, 19):
        block_id, offset = alloc.slot("r4", position)  # NEW
        console.print(f"  r4 token {position:2d} -> block {block_id:2d}, slot {offset}")
    console.print("This is the lookup the attention kernel does for every token it reads.")

    console.print(Rule("4. Without caching, the same prompt is computed again"))
    again = alloc.allocate_with_prefix("r1 again", prompt("r1", 5))
    console.print(f"r1's prompt sent again: num_cached_tokens = {again.num_cached_tokens}, "
                  f"blocks holding a hash: {alloc.num_cached_blocks}. Blocks are anonymous; "
                  f"stage 4 gives each full block a name so it can be found again.")


if __name__ == "__main__":
    main()
