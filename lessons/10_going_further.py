"""
Stage 10: going further. How much does the cache hit on real traffic shapes, where does LRU
fail, how does SGLang's radix tree compare, what does current vLLM do differently, what
would the cache save on your own traffic, and what becomes of it behind a router?

Sections 1 to 4 run the real PrefixCachingAllocator on simulated workloads
(lessons/workloads.py) and a tiny radix tree (lessons/radix_tree.py). Section 5 runs the
workload analyzer (analyzer/) on request logs shaped like the article's workloads, as text
in lessons/data/ (written by `python -m analyzer.request_logs`), tokenized by SmolLM2's
tokenizer. It is seeded: every run prints the same hit rates. Section 6 starts a second
server of this course (SmolLM2, batching) and measures it only through its URL and the OpenAI
API, as it would a remote deployment (benchmarks/cache_probe.py), then says how to point the
same commands at a real vLLM. Section 7 replays one log as vLLM, SGLang and llama.cpp cache
it (analyzer/caching_models.py) and turns each working set into the GiB of KV cache to buy for
an 8B model, with the flags that give a server that much (analyzer/kv_memory.py). Section 8
puts two more servers behind SGLang's real router (benchmarks/router.py) and replays a few
turns of the multi-turn log under round robin and under cache_aware, after asking what they will do.

New in this stage (marked # NEW): workloads.replay, lru_burst, RadixTree, radix_vs_hash,
the analyzer's read_log, tokenize_log, hit_rate_curve, variable_starts, and cache_probe;
the caching models (LIKE) and memory_to_buy; router, replay_through_router and working_sets.

Read: lessons/radix_tree.py: RadixTree.match_prefix and .insert (printed when the stage
      starts).

Run:  python lessons/10_going_further.py   (sections 6 and 8 run SmolLM2-135M; run times: lessons/README.md)
      python lessons/10_going_further.py --tiny     (a random 2-layer model there, faster: every
                                                    count of cached tokens is the same)
"""

import argparse
import logging
from pathlib import Path

from rich.console import Console
from rich.padding import Padding
from rich.rule import Rule
from rich.table import Table

from analyzer.kv_memory import KNOWN_MODELS, memory_to_buy, server_flags
from analyzer.log_replay import LIKE, hit_rate_curve, tokenize_log
from analyzer.request_logs import EXAMPLE_LOGS, interleave, read_log
from analyzer.workload_analyzer import variable_starts
from benchmarks import cache_probe
from benchmarks.router import Fleet, replay_through_router, router, working_sets
from engine.model_files import load_tokenizer
from lessons import models
from lessons.figures import POOL_SIZES
from lessons.radix_tree import RadixTree
from lessons.reading import show_code
from lessons.words import Words
from lessons.workloads import WORKLOADS, hit_rate_table, lru_burst, radix_vs_hash
from server import create_app, serve_in_background

# What the long-form article on vLLM v1 prefix caching (README, Sources) reports for the
# same kinds of traffic.
LOGS = Path(__file__).resolve().parent / "data"
CONVERSATIONS_AT_ONCE = 8  # section 5's multi-turn log: eight users chatting at the same time
ARTICLE_HIT_RATES = {"chatbot": "92-97%", "multi-turn chat": "80-95%", "RAG": "25-40%", "unique prompts": "0-2%"}
BURSTS = [0, 4, 8, 9, 10, 11, 12, 16]

VLLM_TODAY = [
    ("block 0 is the null block",
     "BlockPool pops block 0 at start-up as a placeholder for blocks a request skips (sliding window, Mamba); "
     "it is never cached or freed, so a pool of 10 has 9 usable blocks. Here all 10 are usable, so the "
     "design doc's block ids hold.", "vllm/v1/core/block_pool.py"),
    ("blocks without a hash go to the head",
     "free_blocks prepends freed blocks that have no hash (prepend_n) and appends cached ones. Here: "
     "free_uncached_first=True, measured in stage 6.", "vllm/v1/core/block_pool.py, kv_cache_utils.py"),
    ("no de-duplication",
     "BlockHashToBlockMap lets one hash name several blocks (stage 6's duplicated blocks) instead of merging "
     "them, because block tables are append-only; it stores a lone block, and a dict only when there are "
     "several, to spare the garbage collector. Here: always a dict.", "vllm/v1/core/block_pool.py"),
    ("hashes live on the request",
     "A request computes its block hashes as its tokens arrive (get_request_block_hasher); the pool only "
     "looks them up. Here the allocator hashes in allocate_with_prefix and append_token.",
     "vllm/v1/core/kv_cache_utils.py"),
    ("one table per KV cache group",
     "Keys are block hash + group id (BlockHashWithGroupId), so hybrid models (full + sliding-window "
     "layers) cache each group apart. Here: one group.", "vllm/v1/core/kv_cache_utils.py"),
    ("a hit trusts the hash",
     "find_longest_cache_hit takes the block its hash names without looking at the tokens: with SHA256 a "
     "collision is not expected in practice. Here a hit also compares the stored token ids (nano-vllm does the "
     "same: BlockManager.can_allocate in nanovllm/engine/block_manager.py, at commit bb823b3 of its main "
     "branch), and a request whose hash matched other tokens caches none of its later blocks.",
     "vllm/v1/core/single_type_kv_cache_manager.py"),
    ("a full pool waits",
     "The scheduler admits a request only when its blocks fit and preempts a running one when a decode step "
     "finds no block; nothing is refused for being busy. Stage 8's scheduler, which every Engine runs, does the "
     "same; stage 7's one-request path refuses with OutOfBlocksError instead.",
     "vllm/v1/core/sched/scheduler.py"),
    ("long prompts in chunks",
     "Chunked prefill is on by default in v1, as in stage 8. vLLM can also cap one request's chunk below the "
     "budget (long_prefill_token_threshold), so one long prompt cannot take a whole step; stage 8 gives a prompt all "
     "of the budget that is left.", "vllm/v1/core/sched/scheduler.py"),
    ("cached_tokens only on request",
     "The OpenAI server fills usage.prompt_tokens_details.cached_tokens only when started with "
     "--enable-prompt-tokens-details (and a hit); this course's server always sends it.",
     "vllm/entrypoints/openai/serving_chat.py, serving_completion.py"),
    ("free in reverse: the same",
     "SingleTypeKVCacheManager.free passes reversed(req_blocks) to free_blocks, as here.",
     "vllm/v1/core/single_type_kv_cache_manager.py"),
]

VLLM_HOWTO = """The same commands against any OpenAI-compatible server (every request goes to the URL you give):
  python server.py --port 5001                                   # this course's server, in a terminal of its own
  python prefix_caching.py --bench cache_probe --url http://127.0.0.1:5001
  python prefix_caching.py --bench server_load --url http://127.0.0.1:5001 --clients 1 16
A real vLLM: prefix caching is on by default in v1 (CacheConfig.enable_prefix_caching, vllm/config/cache.py);
usage carries cached_tokens only when the server is started with --enable-prompt-tokens-details:
  vllm serve MODEL --enable-prompt-tokens-details
  python prefix_caching.py --bench cache_probe --url http://GPU-HOST:8000 --api-key KEY
POST /reset_prefix_cache exists there only with VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/serve/cache/api_router.py,
attach_router); without it both benchmarks open each cold prompt with a fresh first line instead. Predict a pool
before you buy it: python prefix_caching.py --analyze your_requests.jsonl --model MODEL --num-blocks N."""

ROUTED_REQUESTS = 6  # section 8: the multi-turn log's first conversation (five turns) and the next one's first
ROUTER_POLICIES = ("round_robin", "cache_aware")
ROUTER_WHY = """A class outgrows one server: run several replicas, each with its own engine and KV pool, and a router
in front that picks a replica for every request. A replica's cache holds only what that replica computed. Round
robin sends request i to replica i mod N: a conversation's turns, each sending its whole history again, land on
a different replica each time, so each replica sees a turn in N, and a turn finds cached only the history that
its replica computed N turns ago. SGLang's router (sglang-router, pinned in requirements.txt) has a cache_aware
policy instead (sgl-model-gateway/src/policies/cache_aware.rs): it keeps an approximate radix tree per model
(policies/tree.rs) of the text of the requests it sent to each worker, characters rather than tokens, so it never
asks a worker what is cached. A request's longest match in the tree goes to the worker that first sent that
text (the node's tenant, set when the node is made), if the match is more than --cache-threshold (0.3) of its
characters, else to the worker with the fewest requests in flight, the first of equals; and when the loads drift
apart, the busiest more than --balance-abs-threshold (64) requests above the idlest and more than
--balance-rel-threshold (1.5) times it, every request goes to the idlest, its text still added to the tree. Every
--eviction-interval-secs (60) the tree drops its least recently used leaves until each worker's text is within
--max-tree-size characters. Affinity first, load only past a threshold: the trade in two numbers."""
ROUTER_MEMORY = """The memory to buy per replica: under round robin every replica sees every conversation, so each
needs a pool for the whole working set, N times over in all; a router that keeps conversations together splits it,
each replica holding the histories of its own users (python prefix_caching.py --analyze on each replica's share
of a log sizes it; analyzer/kv_memory.py turns blocks into GiB)."""


def main(argv: list[str] | None = None) -> None:
    args = models.parse_args(__doc__, argv, engine=True, formatter_class=argparse.RawDescriptionHelpFormatter)
    console = Console()
    show_code(console, RadixTree.match_prefix, RadixTree.insert)

    console.print(Rule("1. Hit rate vs cache size, per workload (real allocator, blocks of 16 tokens)"))
    rates = hit_rate_table(POOL_SIZES)  # NEW
    table = Table("workload", *[f"{n:,}" for n in POOL_SIZES], "article", title="hit rate by num_blocks")
    for name, row in rates.items():
        table.add_row(name, *[f"{r:.0%}" for r in row], ARTICLE_HIT_RATES[name])
    console.print(table)
    console.print("chatbot: the hot set is one 512-token prompt (32 blocks), so any size hits; the ceiling is "
                  "512 / the average prompt (581 tokens here). Multi-turn and RAG grow with the cache until their "
                  "working set (every live conversation, every popular document) fits. Unique prompts never hit. "
                  "The article counts prefix blocks found, we count prompt tokens; our RAG draws from only 100 "
                  "documents, so a big cache holds them all. Plot: assets/hit_rate_vs_cache_size.png "
                  "(python lessons/figures.py).")

    console.print(Rule("2. LRU's weakness: a burst of unique requests evicts a hot system prompt"))
    table = Table("unique requests in the burst", "burst tokens", "next chatbot request hits",
                  title="20 chatbot requests, then a burst, then one more (256 blocks)")
    for k, tokens, hit in lru_burst(BURSTS):  # NEW
        table.add_row(str(k), f"{tokens:,}", f"{hit} of 512", style="red" if hit < 512 else "")
    console.print(table)
    console.print("The system prompt served 20 requests, but LRU only knows *when* a block was last used, not "
                  "how often. Once the burst needs more blocks than the rest of the free queue holds, it eats "
                  "the prompt from its end (freed in reverse, the last block goes first) down to nothing. A "
                  "frequency-aware policy (LFU, ARC) or a pinned prefix would keep it; vLLM keeps plain LRU "
                  "(FreeKVCacheBlockQueue in vllm/v1/core/kv_cache_utils.py).")

    console.print(Rule("3. A radix tree (SGLang's RadixAttention) beside the hash table"))
    vocab, tree = Words(), RadixTree()  # NEW
    for text in ("You are a helpful assistant . What is 2 + 2 ?",
                 "You are a helpful assistant . What is the capital of France ?",
                 "You are a helpful assistant . Name three colours ."):
        tree.insert(vocab.encode(text))
    console.print(tree.render(vocab.word))
    probe = vocab.encode("You are a helpful assistant . What is the time ?")
    console.print(f"'...What is the time ?' matches {tree.match_prefix(probe)} tokens in the tree; with blocks of "
                  f"4 tokens the hash table can reuse only {tree.match_prefix(probe) // 4 * 4}.")
    table = Table("workload", "hash table hits", "radix tree hits", "radix, whole blocks only", "agree per request")
    for name, make in WORKLOADS.items():
        result = radix_vs_hash(make())  # NEW
        table.add_row(name, f"{sum(result.hash_table):,}", f"{sum(result.radix_tokens):,}",
                      f"{sum(result.radix_blocks):,}", "yes" if result.hash_table == result.radix_blocks else "NO")
    console.print(table)
    console.print("Same workloads, a pool big enough that nothing is evicted. Rounded down to whole blocks the two "
                  "agree on every request: the chained hash and the tree store the same prefixes. The tree also "
                  "reuses the partly shared block at the end of each prefix (token granularity, as SGLang's "
                  "RadixCache has it with a page size of 1: python/sglang/srt/mem_cache/radix_cache.py); "
                  "vLLM cannot, since a block's K/V is one unit of memory. The "
                  "price: a tree walk and node splits instead of one dict probe per block.")

    console.print(Rule("4. What current vLLM does differently (checked in its source)"))
    for what, how, where in VLLM_TODAY:
        console.print(f"[bold]{what}[/]  [dim]{where}[/]", Padding(how, (0, 0, 0, 2)))

    console.print(Rule("5. Your own traffic: the workload analyzer on logs shaped like the article's workloads"))
    console.print("The article: the long write-up on vLLM v1 prefix caching this course started from; its table gives "
                  "a range of hit rates for each kind of workload.")
    tokenizer = load_tokenizer()
    table = Table("log (lessons/data)", "requests", "prompt tokens", "hit rate, a pool for the whole log",
                  "working set", "the article",
                  title="python prefix_caching.py --analyze LOG, blocks of 16, vLLM's pool")
    for name, (_, article) in EXAMPLE_LOGS.items():
        requests = interleave(read_log(LOGS / name), CONVERSATIONS_AT_ONCE)  # NEW
        prompts = tokenize_log(requests, tokenizer)  # NEW
        curve = hit_rate_curve(prompts, [r.cache_salt for r in requests], block_size=16)  # NEW
        most = curve.replays[-1]
        table.add_row(name.split(".")[0], f"{len(requests):,}", f"{most.prompt_tokens:,}", f"{most.hit_rate:.0%}",
                      f"{curve.working_set:,} blocks", article)
        if name.startswith("chatbot_with"):
            stamped = variable_starts(requests, tokenizer)[0]  # NEW
    console.print(table)
    console.print("Each log is text in OpenAI's request bodies (multi-turn chat: ShareGPT conversations, eight at a "
                  "time), tokenized with SmolLM2's chat template, then replayed one request after another. The "
                  "shapes follow the article's table; the hit rates are what the replay finds. Five of six land in "
                  "the article's ranges; how many documents RAG retrieves from and how many files code completion "
                  "edits are ours (the article gives neither): with fewer, more come back and the hit rate rises. "
                  "Multi-turn chat falls short of 80-95% because a log has no replies being decoded: a server caches "
                  "the blocks an answer fills, and the next turn, which sends the answer back, hits them; the replay "
                  "caches prompts only, so each turn computes the last answer again.")
    console.print(f"The analyzer's warning on chatbot_with_timestamp: {stamped.requests} prompts start alike but for "
                  f"numbers, first at character {stamped.position} ({stamped.examples[0]!r} against "
                  f"{stamped.examples[1]!r}). The same 500 words follow, but every block after the timestamp is named "
                  f"by it, so about {stamped.tokens_after} tokens are computed again per request: the chatbot's hit "
                  f"rate falls to the one block before it. Put what changes at the end of the prompt.")
    console.print("Run it on your own traffic: python prefix_caching.py --analyze requests.jsonl --plot curve.png "
                  "(--model for your model's tokenizer, --num-blocks for your pool: vLLM prints its KV cache size in "
                  "tokens at start-up; divide by the block size).")

    console.print(Rule("6. A deployment measured from outside: the OpenAI API only"))
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no access log line per request
    engine = models.make_engine(args)  # SmolLM2-135M-Instruct (or --tiny's), as python server.py serves it
    engine.warm_up()
    url, server = serve_in_background(create_app(engine))  # NEW: from here on, only its URL is used
    console.print(f"A second server of this course listens on {url}; the probe knows nothing else about it.")
    results = cache_probe.main(["--url", url, "--repeats", "3", "--seed", "0"])  # NEW
    server.shutdown()
    hits = {kind: [replies[name]["cached_tokens"] for name in cache_probe.NAMES]
            for kind, replies in results["side_channel"].items()}
    right = cache_probe.NAMES.index(cache_probe.VICTIM)
    wrong = sorted({hit for i, hit in enumerate(hits["open"]) if i != right})
    console.print(
        f"Why a wrong guess shows cached tokens too: the letters of one experiment all begin with the same "
        f"fresh first line, and the name comes after it, so the whole blocks before the name are alike in every "
        f"letter. With no salt, tenant B's wrong guesses find those {' or '.join(map(str, wrong))} tokens in "
        f"tenant A's letter, and the right guess finds {hits['open'][right]}: the letter's whole blocks before its "
        f"last token. With a salt per tenant, his first guess ({cache_probe.NAMES[0]}) finds {hits['salted'][0]}: "
        f"tenant A's blocks are named with her salt. His later guesses find "
        f"{' or '.join(map(str, sorted(set(hits['salted'][1:]))))}: the blocks before the name that his own first "
        f"guess cached under his salt. A salt keeps one tenant's blocks from another, not from himself, and the "
        f"right guess finds no more than the wrong ones."
    )
    console.print(VLLM_HOWTO, soft_wrap=True, highlight=False, markup=False)

    console.print(Rule("7. The memory to buy: three servers' caches, one log, GiB for an 8B model"))
    requests = interleave(read_log(LOGS / "multi_turn.jsonl.xz"), CONVERSATIONS_AT_ONCE)
    prompts, salts = tokenize_log(requests, tokenizer), [r.cache_salt for r in requests]
    shape = KNOWN_MODELS["Llama-3.1-8B"]  # NEW: 32 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes a token
    table = Table("caching model", "hit rate, never evicting", "working set", "the cache", "+ 16 running x 4,096",
                  "KV to buy", title=f"multi_turn, blocks of 16, sized for {shape.name} "
                                     f"({shape.bytes_per_block(16) / 2**20:.0f} MiB a block)")
    flags = {}
    for like, server in (("vllm", "vLLM"), ("sglang", "SGLang"), ("llamacpp", "llama.cpp")):
        curve = hit_rate_curve(prompts, salts, block_size=16, model=LIKE[like])  # NEW: --like
        m = memory_to_buy(shape, 16, curve.working_set, concurrency=16, context=4096)  # NEW
        table.add_row(like, f"{curve.replays[-1].hit_rate:.1%}", f"{curve.working_set:,} blocks",
                      f"{m.gib(m.cache_blocks):.2f} GiB", f"{m.gib(m.running_blocks):.2f} GiB", f"{m.gib():.2f} GiB")
        flags[server] = server_flags(m)[server]  # each server sized by its own cache's working set
    console.print(table)
    console.print("The same 40 conversations, eight at a time, replayed through each server's cache, one request "
                  "at a time. SGLang's tree matches token by token, so it also reuses the partly shared block at the "
                  "end of each prefix; llama.cpp keeps one sequence per slot and cuts the rest of a slot's sequence "
                  "away when a request shares only part of it (eight users take turns on four slots), while its "
                  "prompt cache (host memory, --cache-ram) brings whole sequences back. The cache is the small part: "
                  "16 requests of 4,096 tokens hold 8 GiB of their own. Counted in SmolLM2's tokens; give the "
                  "analyzer --model for your model's tokenizer:")
    console.print("  python prefix_caching.py --analyze LOG --like sglang --kv-model Llama-3.1-8B --concurrency 16 "
                  "--context 4096", soft_wrap=True, highlight=False, markup=False)
    console.print("The flags that give each server its own working set (its row above) and the 16 running requests:")
    for server_name, line in flags.items():
        console.print(f"  {server_name}: {line}", soft_wrap=True, highlight=False, markup=False)

    console.print(Rule("8. Beyond one machine: replicas behind SGLang's router"))
    console.print(ROUTER_WHY)
    requests = read_log(LOGS / "multi_turn.jsonl.xz")[:ROUTED_REQUESTS]  # one conversation's turns, then the next's
    console.print(f"Predict, then read on: two replicas (two servers of this course, each with its own pool) behind "
                  f"the router, the first {ROUTED_REQUESTS} requests of the multi-turn log one after another: a "
                  f"conversation's {ROUTED_REQUESTS - 1} turns, each sending the history again, then the next "
                  f"conversation's first turn, which shares only the system prompt. Under round robin, which turns "
                  f"find their history cached? Under cache_aware, where does the second conversation go?")
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)  # the router's HTTP/2 probe of each replica: a 505
    # NEW: two replicas, two pools (--tiny's model with room for the log's longest turn here, 1,042 tokens)
    engines = [models.make_engine(args, tiny_context=2048) for _ in range(2)]
    servers = []
    for replica in engines:
        replica.warm_up()
        servers.append(serve_in_background(create_app(replica)))
    urls = tuple(url for url, _ in servers)
    table = Table("request", *[f"{policy}: replica, cached / prompt" for policy in ROUTER_POLICIES],
                  title="the same requests through SGLang's router, caches emptied between the runs")
    columns = {}
    for policy in ROUTER_POLICIES:
        for replica in engines:
            replica.reset_prefix_cache()  # the engine's: /health shows it at once
        with router(urls, policy) as url:  # NEW: the real router, in a process of its own
            columns[policy] = replay_through_router(Fleet(url, urls, policy), requests)  # NEW
    for server_ in servers:
        server_[1].shutdown()
    for k, request in enumerate(requests):
        table.add_row(request.where, *[f"{columns[p][k].replica}, {columns[p][k].cached_tokens:,} / "
                                       f"{columns[p][k].prompt_tokens:,}" for p in ROUTER_POLICIES])
    console.print(table)
    rates = {p: sum(r.cached_tokens for r in rows) / sum(r.prompt_tokens for r in rows) for p, rows in columns.items()}
    console.print(f"Hit rate: round_robin {rates['round_robin']:.0%}, cache_aware {rates['cache_aware']:.0%}. Round "
                  f"robin sent the turns to the replicas in turn, so each turn found only what the turn two before it "
                  f"left on its replica, and computed the last exchange again; cache_aware kept the conversation on "
                  f"one replica, and sent the next conversation there too, since its text matches the system prompt "
                  f"there (more than --cache-threshold 0.3 of its characters) and no replica was busier than the "
                  f"other by --balance-abs-threshold 64 requests. Affinity won; the other replica idled.")
    prompts, salts = tokenize_log(requests, tokenizer), [r.cache_salt for r in requests]
    for policy in ROUTER_POLICIES:
        sets = sorted(working_sets(columns[policy], 2, prompts, salts, block_size=16), reverse=True)  # NEW
        console.print(f"{policy}: each replica's working set (the analyzer's replay of the requests it got) "
                      f"{' and '.join(f'{w:,}' for w in sets)} blocks of 16, "
                      f"{' and '.join(f'{shape.bytes_per_block(16) * w / 2**30:.2f}' for w in sets)} GiB for "
                      f"{shape.name}")
    console.print(ROUTER_MEMORY)
    console.print("Measured on the whole log with 2 and 3 replicas (docs/fleet.md): "
                  "python prefix_caching.py --bench router", soft_wrap=True, highlight=False, markup=False)


if __name__ == "__main__":
    main()
