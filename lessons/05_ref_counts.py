"""
Stage 5: sharing blocks with ref counts.

With names (stage 4) a new request can find blocks that an earlier one filled. Several
running requests may then point at the same physical block, so a block cannot simply be
"free" or "taken": it carries a ref count, the number of running requests whose block
table holds it. A block whose ref count drops to 0 goes to the free queue but keeps its
hash and its K/V: until it is reused for something else, a later request can still hit it.

New in this stage (marked # NEW): allocate_with_prefix hitting cached blocks, ref_count,
and blocks that are free and cached at the same time.

Read: allocator/prefix_caching.py, section 3: PrefixCachingAllocator.touch (printed when the stage
      starts). allocate_with_prefix is exercise 2: the stage prints it from
      exercises/allocator.py in place of the reference's: write it first, then read the reference.

Run:  python lessons/05_ref_counts.py
"""

import argparse

from rich.columns import Columns
from rich.console import Console
from rich.rule import Rule
from rich.table import Table

from allocator import PrefixCachingAllocator
from commands.walkthrough import render_block_table, render_free_queue
from lessons.reading import show_code, show_exercise
from lessons.words import Words

BLOCK_SIZE = 4
SYSTEM = "You are a helpful assistant . Answer in one short sentence and say so if unsure"  # 16 words: 4 full blocks
QUESTIONS = {
    "alice": ". What is the capital of France ?",
    "bob": ". Why is the sky blue ?",
    "carol": ". Who wrote Hamlet ?",
    "dave": ". How far is the Moon ?",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)  # no flags: --help prints the docstring above and exits
    console = Console()
    show_exercise(console, 2, "exercises/allocator.py", "PrefixCachingAllocator.allocate_with_prefix",
                  PrefixCachingAllocator.allocate_with_prefix)
    show_code(console, PrefixCachingAllocator.touch)
    vocab = Words()
    system = vocab.encode(SYSTEM)
    system_blocks = len(system) // BLOCK_SIZE
    alloc = PrefixCachingAllocator(num_blocks=24, block_size=BLOCK_SIZE)

    history = Table("event", "ref counts, blocks 0-3", "cached tokens", "in use", "free (cached)",
                    title="the system prompt's blocks as requests come and go")

    def record(event: str, cached: int | str = "") -> None:
        refs = [alloc.ref_count(b) for b in range(system_blocks)]  # NEW
        free_cached = sum(1 for b in alloc.free_queue if b.block_hash is not None)
        history.add_row(event, str(refs), str(cached), str(alloc.num_blocks_in_use),
                        f"{alloc.num_free_blocks} ({free_cached})")

    console.print(Rule(f"1. Four users, one system prompt of {len(system)} tokens ({system_blocks} blocks)"))
    prompt_tokens = 0
    for user, question in QUESTIONS.items():
        prompt = system + vocab.encode(question)
        prompt_tokens += len(prompt)
        hit = alloc.allocate_with_prefix(user, prompt)  # NEW: the later ones hit the system prompt
        record(f"{user} arrives", hit.num_cached_tokens)
    console.print(Columns([render_block_table(alloc, user, vocab.word) for user in ("alice", "bob")]))
    console.print("Logical blocks 0-3 of every user map to the same physical blocks 0-3; only the question "
                  "blocks are their own.")

    shared_blocks = alloc.num_blocks_in_use
    unshared_blocks = sum(len(table) for table in alloc.block_tables.values())
    console.print(f"Blocks in use: {shared_blocks} shared vs {unshared_blocks} if each user had a private copy "
                  f"({1 - shared_blocks / unshared_blocks:.0%} less KV memory).")
    computed = prompt_tokens - alloc.stats.hit_tokens
    console.print(f"Prompt tokens to prefill: {computed} of {prompt_tokens} "
                  f"({alloc.stats.hit_tokens / prompt_tokens:.0%} of the prefill skipped).")

    console.print(Rule("2. Users leave: ref counts go down; at 0 a block is free but keeps its hash"))
    for user in QUESTIONS:
        alloc.free(user)
        record(f"{user} finishes")
    console.print(render_free_queue(alloc))
    console.print("Each request's blocks joined the tail last block first; the system prompt's blocks, freed "
                  "last, sit at the very end: the last to be reused.")

    console.print(Rule("3. A fifth user after everyone left still hits the system prompt"))
    hit = alloc.allocate_with_prefix("erin", system + vocab.encode(". Is water wet ?"))
    record("erin arrives", hit.num_cached_tokens)
    console.print(history)
    console.print(f"erin hits {hit.num_cached_tokens} tokens: blocks 0-3 were taken back out of the free queue "
                  "(ref count 0 -> 1) before they could be reused for anything else. That 'touch' is stage 6.")

    console.print(Rule("4. The cap: at least one prompt token is always computed"))
    same = alloc.allocate_with_prefix("frank", system)  # the prompt IS the system prompt, 4 full blocks
    console.print(f"A prompt of exactly the {len(system)} system tokens hits {same.num_cached_tokens}, not "
                  f"{len(system)}: the model must run on at least one token to produce the next token's "
                  f"logits, so the last full block is computed again ({same.num_new_tokens} new tokens).")


if __name__ == "__main__":
    main()
