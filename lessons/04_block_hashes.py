"""
Stage 4: block hashes, the names that let a later request find a block again.

A full block is named by hash(parent hash, its token ids, extra keys). The parent is the
hash of the block before it, so a block's name stands for *every* token up to its end:
exactly what its K/V values depend on (attention looks back at all earlier tokens, and the
position enters through the position encoding). Stage 3's blocks were anonymous; from here
on a full block gets a name the moment it fills.

New in this stage (marked # NEW): hash_block_tokens, compute_block_hashes, extra keys and
cache_salt.

Read: allocator/prefix_caching.py, section 1: block_extra_keys (printed when the stage starts). The
      stage prints exercise 1's hash_block_tokens from exercises/block_hash.py in place of
      the reference's: write it first, then read the reference.

Run:  python lessons/04_block_hashes.py
"""

import argparse
import statistics
import time

from rich.console import Console
from rich.rule import Rule
from rich.table import Table

from allocator import (
    PrefixCachingAllocator,
    block_extra_keys,
    compute_block_hashes,
    hash_block_tokens,
    short_hash,
)
from commands.walkthrough import render_block_table
from lessons.reading import show_code, show_exercise
from lessons.words import Words

BLOCK_SIZE = 4
# One word = one token, so a block of 4 tokens is 4 words (the design doc's own example).
TEXT = "A gentle breeze stirred the leaves as children laughed in the distance"


def blocks_of(token_ids: list[int]) -> list[list[int]]:
    return [token_ids[i : i + BLOCK_SIZE] for i in range(0, len(token_ids), BLOCK_SIZE)]


def unchained(block: list[int]) -> str:
    """The name a block would get if the chain were left out: its own tokens only."""
    return short_hash(hash_block_tokens(None, block))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)  # no flags: --help prints the docstring above and exits
    console = Console()
    show_exercise(console, 1, "exercises/block_hash.py", "hash_block_tokens", hash_block_tokens)
    show_code(console, block_extra_keys)
    vocab = Words()
    prompt = vocab.encode(TEXT)

    console.print(Rule("1. Each full block is hashed together with its parent's hash"))
    hashes = compute_block_hashes(prompt, BLOCK_SIZE)  # NEW
    table = Table("block", "tokens", "parent hash", "block hash")
    parent = None
    for i, (block, block_hash) in enumerate(zip(blocks_of(prompt), hashes)):
        assert block_hash == hash_block_tokens(parent, block)  # NEW: the chain, one link at a time
        table.add_row(str(i), vocab.decode(block), short_hash(parent) if parent else "(none)", short_hash(block_hash))
        parent = block_hash
    console.print(table)
    console.print("A word's token id is made from the word itself (lessons/words.py), as a real tokenizer's "
                  "vocabulary gives a word one id everywhere: so these names are the same in every stage and every "
                  f"run. 'A gentle breeze stirred' at the start of a prompt is always {short_hash(hashes[0])}.")

    console.print(Rule("2. Why the chain: the same words at another position are another block"))
    moved = vocab.encode("the leaves as children A gentle breeze stirred laughed in the distance")
    table = Table("prompt", "block", "tokens", "hash without chain", "chained hash")
    moved_hashes = compute_block_hashes(moved, BLOCK_SIZE)
    table.add_row("original", "1", vocab.decode(prompt[4:8]), unchained(prompt[4:8]), short_hash(hashes[1]))
    table.add_row("reordered", "0", vocab.decode(moved[0:4]), unchained(moved[0:4]), short_hash(moved_hashes[0]))
    console.print(table)
    console.print("Without the chain both rows get one name, and the reordered prompt would reuse K/V that was "
                  "computed after 'A gentle breeze stirred': wrong values, silently. With it they differ.")
    alloc = PrefixCachingAllocator(num_blocks=16, block_size=BLOCK_SIZE)
    alloc.allocate_with_prefix("original", prompt)
    changed = vocab.encode("A gentle breeze stirred the rain as children laughed in the distance")
    word = next(i for i, (a, b) in enumerate(zip(prompt, changed)) if a != b)  # counted from 0
    console.print(f"A prompt that differs only in word {word + 1} of {len(changed)} ({vocab.word(changed[word])!r} for "
                  f"{vocab.word(prompt[word])!r}, in block {word // BLOCK_SIZE}) hits {alloc.peek(changed)} tokens: "
                  f"block 2 holds the same words, but its parent differs, so the lookup stops at the first miss.")

    console.print(Rule("3. Only full blocks get a hash"))
    ten = prompt[:10]
    console.print(f"{len(ten)} tokens -> {len(compute_block_hashes(ten, BLOCK_SIZE))} hashes; the last 2 tokens wait "
                  "until their block fills (a partial block's content, and so its name, still changes).")
    fresh = PrefixCachingAllocator(num_blocks=16, block_size=BLOCK_SIZE)
    fresh.allocate_with_prefix("ten tokens", ten)
    console.print(render_block_table(fresh, "ten tokens", vocab.word))

    console.print(Rule("4. Extra keys: anything else that changes K/V (a LoRA adapter) goes into every block"))
    lora = compute_block_hashes(prompt, BLOCK_SIZE, extra_keys=("lora:sql-adapter",))  # NEW
    salted = compute_block_hashes(prompt, BLOCK_SIZE, cache_salt="tenant-a")  # NEW
    table = Table("block", "plain", "extra_keys=(lora,)", "cache_salt='tenant-a'")
    for i in range(len(hashes)):
        table.add_row(str(i), short_hash(hashes[i]), short_hash(lora[i]), short_hash(salted[i]))
    console.print(table)
    console.print("Every column differs from 'plain' in every block. The salt is hashed into block 0 only; block 1 "
                  "differs through the chain. Check: hash_block_tokens(salted[0], block 1 tokens) == salted[1] is "
                  f"{hash_block_tokens(salted[0], prompt[4:8]) == salted[1]}.")
    alloc.allocate_with_prefix("tenant a", prompt, cache_salt="tenant-a")
    follow_up = prompt + vocab.encode("Paris")  # one word more, so that every full block can hit
    console.print(f"Tenant a has sent the prompt. Tenant b sends it plus one word, 'Paris' (a word more, because a "
                  f"prompt that ends exactly where a block ends computes that block again: stage 5 shows why): hits "
                  f"{alloc.peek(follow_up, cache_salt='tenant-b')} tokens. Tenant a does the same: "
                  f"{alloc.peek(follow_up, cache_salt='tenant-a')}. (Stage 9 shows the timing leak this closes.)")

    console.print(Rule("5. What hashing costs (measured here)"))
    long_prompt = list(range(65_536))
    for algo in ("sha256", "xxhash"):
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            compute_block_hashes(long_prompt, 16, algo=algo)
            runs.append((time.perf_counter() - start) / len(long_prompt) * 1e9)
        console.print(f"  {algo:7s} {statistics.median(runs):6.0f} ns per token (median of 3 runs; 64k tokens, "
                      f"blocks of 16)")
    console.print("Much of either number is the Python around the digest, so xxhash gains less than it does "
                  "in C. vLLM's design doc (docs/design/prefix_caching.md) quoted 100-200 ns per token for SHA256 "
                  "when SHA256 was added (v0.8.3), then about 75 ns (PR #29261, December 2025); since PR #28784 "
                  "(January 2026) it quotes no figure. Measure your own, as above. SHA256 is the safe default when "
                  "tenants share a server: a collision would hand one prompt another's K/V.")

    console.print(Rule("6. Same idea, other choices"))
    table = Table("who", "what is hashed", "first block's parent")
    table.add_row("this course", "length-prefixed bytes of (parent, tokens, extra keys); SHA256 or 128-bit xxh3",
                  "a fixed constant: same hash in every process")
    table.add_row("vLLM v1", "(parent, tokens tuple, extra keys) pickled or CBOR-encoded, then SHA256 "
                  "(default) or xxhash", "NONE_HASH (init_none_hash): 32 random bytes per process unless "
                  "PYTHONHASHSEED is set, up to the 0.1x releases; vLLM 0.33 fixes it for sha256 and keeps it "
                  "random for xxhash. Check the version you run.")
    table.add_row("nano-vllm", "64-bit xxhash of (parent, token bytes); no extra keys", "none (-1)")
    table.add_row("vLLM v1 article", "SHA256 of (parent, block index, tokens): the index repeats what the chain "
                  "already says", "32 zero bytes")
    console.print(table)
    console.print("vLLM: hash_block_tokens and init_none_hash in vllm/v1/core/kv_cache_utils.py; the "
                  "--prefix-caching-hash-algo choices in vllm/config/cache.py. nano-vllm: BlockManager.compute_hash "
                  "in nanovllm/engine/block_manager.py (at commit bb823b3 of its main branch).")


if __name__ == "__main__":
    main()
