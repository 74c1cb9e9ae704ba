"""
Stage 6: the free queue and LRU eviction.

Stage 5 left free blocks that still hold K/V worth keeping. The free queue decides which
one is reused next: the head is evicted first, freed blocks join at the tail, so the block
that has sat unused the longest goes first (least recently used). A request frees its blocks
last block first, because the last block names the longest prefix and is the least likely
to be shared. A cache hit on a free block "touches" it: takes it out of the queue, from
wherever it is, before any new block is popped from the head.

This stage replays the vLLM design doc's worked example (commands/walkthrough.py), then
measures why the queue is a hand-made doubly linked list, and what newer vLLM changed.

New in this stage (marked # NEW): FreeKVCacheBlockQueue, eviction, free_uncached_first.

Read: allocator/prefix_caching.py, section 3: PrefixCachingAllocator.evict (printed when the stage
      starts). FreeKVCacheBlockQueue.remove is exercise 3 and PrefixCachingAllocator.free
      exercise 4: the stage prints them from exercises/free_queue.py and exercises/allocator.py
      in place of the reference's: write them first, then read the reference.

Run:  python lessons/06_free_queue_lru.py
"""

import argparse
import time
from collections import deque

from rich.console import Console
from rich.rule import Rule
from rich.table import Table

from allocator import FreeKVCacheBlockQueue, KVCacheBlock, PrefixCachingAllocator
from commands.walkthrough import design_doc_example, walkthrough
from lessons.reading import show_code, show_exercise
from lessons.workloads import multi_turn, replay

QUEUES = {"linked list": FreeKVCacheBlockQueue, "list": list, "deque": deque}  # NEW: the first, vs Python's own


def seconds_per_remove(queue_size: int, kind: str, repeats: int = 200) -> float:
    """Time taking a block out of the middle of a free queue of `queue_size` blocks (and
    appending it at the tail, as a freed block would be)."""
    blocks = [KVCacheBlock(i) for i in range(queue_size)]
    queue, middle = QUEUES[kind](blocks), queue_size // 2
    start = time.perf_counter()
    # A new block each time: block middle + i sits exactly in the middle, since the i blocks
    # before it have moved to the tail. (Removing one block again and again would find it
    # at the tail after the first time.)
    for block in blocks[middle : middle + repeats]:
        queue.remove(block)  # linked list: unlink it from its 2 neighbours; list, deque: scan to find it
        queue.append(block)
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)  # no flags: --help prints the docstring above and exits
    console = Console()
    show_exercise(console, 3, "exercises/free_queue.py", "FreeKVCacheBlockQueue.remove", FreeKVCacheBlockQueue.remove)
    show_exercise(console, 4, "exercises/allocator.py", "PrefixCachingAllocator.free", PrefixCachingAllocator.free)
    show_code(console, PrefixCachingAllocator.evict)

    console.print(Rule("1. The design doc's worked example, step by step"))
    walkthrough(console)

    console.print(Rule("2. Why a hand-made doubly linked list: removing from the middle (measured)"))
    table = Table("free blocks", "linked list", "list.remove", "deque.remove", title="time to take one block out of the middle")
    for size in (1_000, 10_000, 100_000):
        times = [seconds_per_remove(size, kind) for kind in QUEUES]
        table.add_row(f"{size:,}", *[f"{t * 1e6:8.2f} µs" for t in times])
    console.print(table)
    console.print("Every cache hit on a free block is such a removal. The linked list's cost stays flat; the "
                  "others grow with the queue (the vLLM v1 prefix caching article counts ~8,600 blocks for a 70B model on one H100). The pointers "
                  "live in KVCacheBlock itself, so no wrapper objects are created either.")

    console.print(Rule("3. Newer vLLM: blocks without a hash go to the head, not the tail"))
    for flag in (False, True):
        alloc = design_doc_example(until=6, free_uncached_first=flag)  # NEW
        console.print(f"free_uncached_first={flag!s:5}: request 2's blocks {alloc.block_tables['request 2']}, "
                      f"evictions {alloc.stats.evictions}")
    console.print("A block with no hash (a request's partly filled last block) can never be hit, so keeping it "
                  "in the LRU order only wastes a place. vLLM's BlockPool.free_blocks now puts such blocks at the "
                  "head (vllm/v1/core/block_pool.py); here block 3 of request 0 survives Time 6.")
    requests = multi_turn()
    rates = []
    for flag in (False, True):
        alloc = PrefixCachingAllocator(num_blocks=512, block_size=16, free_uncached_first=flag)
        replay(requests, alloc)
        rates.append(f"hit rate {alloc.stats.hit_rate:.2%}, {alloc.stats.evictions} evictions")
    console.print(f"On the multi-turn chat workload of stage 10 (512 blocks): off: {rates[0]}; on: {rates[1]}. "
                  "Small, because each request leaves at most one hashless block behind. It matters when a "
                  "pool barely holds the prompts in use and replies leave partial blocks: "
                  "python allocator/prefix_caching.py --bench allocator measures 53.8% against 78.4% on such traffic.")
    console.print("A drawing of the pool at Time 5: assets/block_pool.png (python lessons/figures.py).")


if __name__ == "__main__":
    main()
