"""
The allocator figures in assets/, drawn with matplotlib from the real allocator's state.

    python lessons/figures.py              # writes assets/block_pool.png and assets/hit_rate_vs_cache_size.png
    python lessons/figures.py --out /tmp   # somewhere else

The notebooks call the same functions to show the figures inline.
"""

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

from allocator import PrefixCachingAllocator, short_hash
from commands.walkthrough import design_doc_example
from lessons.workloads import BLOCK_SIZE, hit_rate_table

ASSETS = Path(__file__).resolve().parents[1] / "assets"
# The rich views' colours: green = in use, yellow = free but cached, grey = free and empty.
COLOURS = {"in use": "#7fc97f", "free, cached": "#fdd866", "free, empty": "#d9d9d9"}
POOL_SIZES = [256, 512, 1024, 2048, 4096, 8192, 16384]  # blocks of 16 tokens


def _state(block) -> str:
    if block.ref_cnt > 0:
        return "in use"
    return "free, cached" if block.block_hash is not None else "free, empty"


def _draw_pool(ax, alloc: PrefixCachingAllocator, title: str) -> None:
    """One row of boxes, one per block, and the free queue drawn as a chain under it."""
    ax.set_title(title, loc="left", fontsize=10)
    for block in alloc.blocks:
        x = block.block_id * 1.1
        ax.add_patch(FancyBboxPatch((x, 1.2), 1, 1, boxstyle="round,pad=0.02", fc=COLOURS[_state(block)], ec="black", lw=0.8))
        ax.text(x + 0.5, 2.05, f"block {block.block_id}", ha="center", va="center", fontsize=7, weight="bold")
        tokens = " ".join(map(str, block.token_ids)) or "empty"
        ax.text(x + 0.5, 1.75, tokens, ha="center", va="center", fontsize=6)
        ax.text(x + 0.5, 1.5, short_hash(block.block_hash)[:4], ha="center", va="center", fontsize=6, family="monospace")
        ax.text(x + 0.5, 1.3, f"ref {block.ref_cnt}", ha="center", va="center", fontsize=6)
    queue = alloc.free_queue.block_ids()
    ax.text(-0.1, 0.45, "free queue\nhead ->", ha="right", va="center", fontsize=7)
    for i, block_id in enumerate(queue):
        x = i * 1.1 + 0.25
        ax.add_patch(FancyBboxPatch((x, 0.25), 0.5, 0.4, boxstyle="round,pad=0.02",
                                    fc=COLOURS[_state(alloc.blocks[block_id])], ec="black", lw=0.6))
        ax.text(x + 0.25, 0.45, str(block_id), ha="center", va="center", fontsize=7)
        if i + 1 < len(queue):
            ax.annotate("", xy=(x + 1.08, 0.45), xytext=(x + 0.52, 0.45), arrowprops={"arrowstyle": "->", "lw": 0.6})
    tables = "   ".join(f"{rid}: {table}" for rid, table in alloc.block_tables.items()) or "no request is running"
    ax.text(0, -0.15, f"block tables:  {tables}", fontsize=7, va="center")
    ax.set_xlim(-1.6, alloc.num_blocks * 1.1)
    ax.set_ylim(-0.4, 2.4)
    ax.axis("off")


def block_pool_figure():
    """The design doc's example at Time 3 (two requests share blocks 0 and 1) and Time 5
    (both finished: every block free, five still cached, in LRU order)."""
    fig, axes = plt.subplots(2, 1, figsize=(9, 4.2))
    _draw_pool(axes[0], design_doc_example(until=3), "Time 3: request 1 hits blocks 0 and 1 of request 0 (ref 2)")
    _draw_pool(axes[1], design_doc_example(until=5), "Time 5: both finished; blocks keep their hash, LRU order in the queue")
    handles = [plt.Rectangle((0, 0), 1, 1, fc=c, ec="black", lw=0.6) for c in COLOURS.values()]
    fig.legend(handles, COLOURS.keys(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("vLLM design doc example: 10 blocks of 4 tokens", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def hit_rate_figure(table: dict[str, list[float]] | None = None):
    """Hit rate vs pool size for each simulated workload (stage 10)."""
    table = table or hit_rate_table(POOL_SIZES)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rates in table.items():
        ax.plot(POOL_SIZES, [100 * r for r in rates], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(POOL_SIZES, [f"{n:,}\n({n * BLOCK_SIZE // 1024}k tok)" for n in POOL_SIZES], fontsize=7)
    ax.set_xlabel(f"cache size: num_blocks (blocks of {BLOCK_SIZE} tokens)")
    ax.set_ylabel("prefix cache hit rate (% of prompt tokens)")
    ax.set_ylim(-3, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Hit rate vs cache size, real allocator, simulated workloads", fontsize=10)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw the allocator figures from the real allocator's state.")
    parser.add_argument("--out", type=Path, default=ASSETS, help=f"folder for the PNG files (default {ASSETS})")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    for name, make in (("block_pool.png", block_pool_figure), ("hit_rate_vs_cache_size.png", hit_rate_figure)):
        fig = make()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        print(f"wrote {out / name} ({(out / name).stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
