"""How much does the allocator cost, and what does the order of the free queue buy? One command.

    python prefix_caching.py --bench allocator [--json out.json] [--quick]

1. Hash chain cost: SHA256 and xxhash, in nanoseconds per prompt token.
2. Miss overhead: allocate + free of prompts that never hit, caching on vs off. The
   difference, per prompt token, is what prefix caching costs a workload it cannot help
   (vLLM's design doc quoted about 75 ns per token for its SHA256 in December 2025, PR #29261).
3. Hit-heavy throughput: requests that hit cached blocks sitting in the middle of the free
   queue, on a 1,000-block and a 100,000-block pool. With an O(1) queue the big pool is about
   as fast as the small one; the same traffic on a list-based queue (list.remove is O(n)) is
   shown beside it.
4. Where freed blocks go: the hit rate of the same tight-pool traffic when freed blocks that
   hold no hash (a request's partly filled last block) join the tail of the free queue, as in
   the design doc, or its head, as vLLM's BlockPool.free_blocks does now
   (`free_uncached_first=True`). Counts, not times: the same on every machine.

Timings are the best of several repeats (the least disturbed by other work on the machine).
The two figures with a target get a verdict; a miss says whether the machine was busy
(benchmarks/measure.py: the repeats of one measurement far apart) or what else can explain it.
"""

from __future__ import annotations

import argparse
import platform
import random
import time

from allocator import FreeKVCacheBlockQueue, PrefixCachingAllocator, compute_block_hashes
from benchmarks import save_json
from benchmarks.measure import Runs, busy_note

BLOCK_SIZE = 16
MAX_MISS_OVERHEAD_NS = 100  # per prompt token: what caching may cost a workload it cannot help
MIN_RATIO_100K_TO_1K = 0.6  # hit-heavy throughput on a 100x bigger pool: O(1) means about the same


def best_of(repeats: int, fn) -> float:
    """Smallest wall time of `repeats` calls, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def hash_cost_ns_per_token(algo: str, num_tokens: int, repeats: int) -> float:
    tokens = [random.randrange(50_000) for _ in range(num_tokens)]
    seconds = best_of(repeats, lambda: compute_block_hashes(tokens, BLOCK_SIZE, algo=algo))
    return seconds / num_tokens * 1e9


def miss_overhead_ns_per_token(num_requests: int, prompt_len: int, repeats: int) -> dict:
    """allocate + free of never-repeating prompts, caching on vs off, interleaved."""
    prompts = [[random.randrange(50_000) for _ in range(prompt_len)] for _ in range(num_requests)]
    num_blocks = 4 * prompt_len // BLOCK_SIZE  # room to churn, so freed cached blocks get evicted

    def run(enable_caching: bool) -> None:
        alloc = PrefixCachingAllocator(num_blocks, BLOCK_SIZE, enable_caching=enable_caching)
        for i, prompt in enumerate(prompts):
            alloc.allocate_with_prefix(str(i), prompt)
            alloc.free(str(i))
        assert alloc.stats.hit_tokens == 0

    on, off = [], []
    for _ in range(repeats):  # interleaved, so drift in machine speed hits both alike
        on.append(best_of(1, lambda: run(True)))
        off.append(best_of(1, lambda: run(False)))
    tokens = num_requests * prompt_len
    return {
        "caching_on_ns_per_token": min(on) / tokens * 1e9,
        "caching_off_ns_per_token": min(off) / tokens * 1e9,
        "overhead_ns_per_token": (min(on) - min(off)) / tokens * 1e9,
        "runs_ms": {"on": [t * 1e3 for t in on], "off": [t * 1e3 for t in off]},  # for the busy rule
    }


class ListFreeQueue(FreeKVCacheBlockQueue):
    """The naive alternative: a Python list, where removing from the middle is O(n)."""

    def __init__(self, blocks):
        self.items = list(blocks)

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    def append(self, block):
        self.items.append(block)

    def appendleft(self, block):
        self.items.insert(0, block)

    def remove(self, block):
        self.items.remove(block)

    def popleft(self):
        return self.items.pop(0)


def hit_heavy_requests_per_second(num_blocks: int, num_requests: int, queue: str = "linked") -> float:
    """Fill the pool with cached, free prompts; then replay old ones picked at random.

    Each request is 8 cached blocks + 1 token: 8 hits removed from the middle of the free
    queue, 1 new block popped from the head (evicting it), then freed again.
    """
    rng = random.Random(0)
    alloc = PrefixCachingAllocator(num_blocks, BLOCK_SIZE)
    if queue == "list":
        alloc.free_queue = ListFreeQueue(alloc.blocks)
    prompt_blocks = 8
    num_prompts = num_blocks // (prompt_blocks + 1)
    prompts = [[rng.randrange(50_000) for _ in range(prompt_blocks * BLOCK_SIZE)] for _ in range(num_prompts)]
    for i, prompt in enumerate(prompts):  # warm up: every prompt cached, all blocks free
        alloc.allocate_with_prefix("warm", prompt + [0])
        alloc.free("warm")
    # Replay only the newer half: the older ones are evicted as the replays churn the head.
    picks = [prompts[rng.randrange(num_prompts // 2, num_prompts)] + [1] for _ in range(num_requests)]
    hits_before, queried_before = alloc.stats.hit_tokens, alloc.stats.queried_tokens
    start = time.perf_counter()
    for prompt in picks:
        alloc.allocate_with_prefix("r", prompt)
        alloc.free("r")
    elapsed = time.perf_counter() - start
    hit_rate = (alloc.stats.hit_tokens - hits_before) / (alloc.stats.queried_tokens - queried_before)
    assert hit_rate > 0.9, f"the benchmark must measure hits, got a hit rate of {hit_rate:.0%}"
    return num_requests / elapsed


def free_order_hit_rates(num_requests: int, num_blocks: int = 1_000, num_prompts: int = 400) -> dict:
    """Hit rate with hashless freed blocks at the tail (the design doc) or the head (vLLM now).

    Each prompt is 2.5 blocks and its reply adds 4 tokens: 3 blocks a request, 2 of them cached
    and 1 that never can be (the best hit rate is 32 of 40 tokens, 80%). 400 such prompts, picked
    at random, need 800 cached blocks; the pool has 1,000. At the tail, every freed partial
    block pushes a cached block toward eviction; at the head, it is the next block reused.
    """
    rates = {}
    for head in (False, True):
        rng = random.Random(0)
        prompts = [[rng.randrange(50_000) for _ in range(BLOCK_SIZE * 5 // 2)] for _ in range(num_prompts)]
        alloc = PrefixCachingAllocator(num_blocks, BLOCK_SIZE, free_uncached_first=head)
        for _ in range(num_requests):
            alloc.allocate_with_prefix("r", prompts[rng.randrange(num_prompts)])
            for token in (11, 12, 13, 14):
                alloc.append_token("r", token)
            alloc.free("r")
        rates["head" if head else "tail"] = {"hit_rate": alloc.stats.hit_rate, "evictions": alloc.stats.evictions}
    return rates


def verdicts(results: dict) -> list[str]:
    """One line per figure that has a target: met, or missed and what may explain it.

    >>> quiet = {"on": [60.0, 61.0], "off": [50.0, 50.5]}
    >>> verdicts({"miss": {"overhead_ns_per_token": 84, "runs_ms": quiet}, "hit_heavy": {"ratio_100k_to_1k": 0.9}})
    ['miss overhead 84 ns/token: meets the target (<= 100).', '100k / 1k throughput 0.90: meets the target (>= 0.6).']
    """
    miss, ratio = results["miss"], results["hit_heavy"]["ratio_100k_to_1k"]
    lines = []
    overhead = miss["overhead_ns_per_token"]
    if overhead <= MAX_MISS_OVERHEAD_NS:
        lines.append(f"miss overhead {overhead:.0f} ns/token: meets the target (<= {MAX_MISS_OVERHEAD_NS}).")
    else:
        busy = busy_note(*(Runs(ms) for ms in miss["runs_ms"].values()))
        lines.append(
            f"miss overhead {overhead:.0f} ns/token: misses the target (<= {MAX_MISS_OVERHEAD_NS}). "
            + ("--quick runs are short and noisy: run it without --quick. " if results.get("quick") else "")
            + (f"{busy} Run it again when the machine is quiet." if busy else
               "Its repeats agreed with each other, so either other work ran steadily through all of them (look at "
               "top) or this CPU is slower than the one the target was set on (a 2-core AMD EPYC VM): the target "
               "is a time, and the same code takes longer on a slower machine.")
        )
    if ratio >= MIN_RATIO_100K_TO_1K:
        lines.append(f"100k / 1k throughput {ratio:.2f}: meets the target (>= {MIN_RATIO_100K_TO_1K}).")
    else:
        lines.append(
            f"100k / 1k throughput {ratio:.2f}: misses the target (>= {MIN_RATIO_100K_TO_1K}). It is the ratio of "
            f"two single runs, so other work during one of them moves it: run it again. If it misses on a quiet "
            f"machine too, the big pool is slower per request: look for an O(n) step (a list.remove, a scan).")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="prefix_caching.py --bench allocator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="smaller runs (for tests); numbers are noisier")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    random.seed(0)
    scale = 0.1 if args.quick else 1.0
    repeats = 2 if args.quick else 5
    console = Console()
    console.print(f"[bold]allocator benchmark[/] on {platform.processor() or platform.machine()}, "
                  f"Python {platform.python_version()}, block size {BLOCK_SIZE}")

    results: dict = {"machine": platform.platform(), "block_size": BLOCK_SIZE, "quick": args.quick}
    results["sha256_ns_per_token"] = hash_cost_ns_per_token("sha256", int(65_536 * scale), repeats)
    results["xxhash_ns_per_token"] = hash_cost_ns_per_token("xxhash", int(65_536 * scale), repeats)
    results["miss"] = miss_overhead_ns_per_token(int(200 * scale) or 1, 1024, repeats)
    requests = int(20_000 * scale)
    small = hit_heavy_requests_per_second(1_000, requests)
    large = hit_heavy_requests_per_second(100_000, requests)
    list_large = hit_heavy_requests_per_second(100_000, max(requests // 100, 20), queue="list")
    results["hit_heavy"] = {
        "pool_1k_req_per_s": small,
        "pool_100k_req_per_s": large,
        "ratio_100k_to_1k": large / small,
        "list_queue_pool_100k_req_per_s": list_large,
        "list_queue_ratio_to_1k": list_large / small,
    }
    results["free_order"] = free_order_hit_rates(int(20_000 * scale))

    table = Table(title="allocator costs")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    miss = results["miss"]
    hit = results["hit_heavy"]
    table.add_row("SHA256 hash chain", f"{results['sha256_ns_per_token']:.0f} ns/token", "")
    table.add_row("xxhash (xxh3-128) hash chain", f"{results['xxhash_ns_per_token']:.0f} ns/token", "")
    table.add_row("allocate+free, caching off", f"{miss['caching_off_ns_per_token']:.0f} ns/token", "")
    table.add_row("allocate+free, caching on, 0% hits", f"{miss['caching_on_ns_per_token']:.0f} ns/token", "")
    table.add_row("[bold]miss overhead of caching", f"[bold]{miss['overhead_ns_per_token']:.0f} ns/token",
                  f"<= {MAX_MISS_OVERHEAD_NS}")
    table.add_row("hit-heavy, 1,000 blocks", f"{small:,.0f} req/s", "")
    table.add_row("hit-heavy, 100,000 blocks", f"{large:,.0f} req/s", "")
    table.add_row("[bold]100k / 1k throughput", f"[bold]{hit['ratio_100k_to_1k']:.2f}", f">= {MIN_RATIO_100K_TO_1K}")
    table.add_row("list-based queue, 100,000 blocks", f"{list_large:,.0f} req/s", "")
    table.add_row("list queue 100k / linked 1k", f"{hit['list_queue_ratio_to_1k']:.3f}", "(why O(1) matters)")
    order = results["free_order"]
    table.add_row("tight pool hit rate, hashless to tail", f"{order['tail']['hit_rate']:.1%}", "(the design doc)")
    table.add_row("[bold]tight pool hit rate, hashless to head", f"[bold]{order['head']['hit_rate']:.1%}",
                  "(free_uncached_first)")
    console.print(table)
    for line in verdicts(results):
        console.print(line)
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
