"""
Stage 7: prefix caching on a real model.

Stages 3-6 built the bookkeeping (which block holds which tokens, and under which hash);
stage 2 showed the tensors (a DynamicCache of keys and values per layer). Here they meet, in
engine.Engine. The blocks' ids point into a paged KV pool, one tensor allocated once;
a request runs like this:

    lookup    allocate_with_prefix: hash the prompt's full blocks, take the cached ones
    gather    copy the hit blocks' K/V out of the pool into a fresh DynamicCache
    forward   run the model on the uncached suffix only, with that cache as past_key_values
    write     copy the suffix's new K/V into the request's own blocks, for whoever comes next
    sample    pick the first token: the time to first token (TTFT) ends here

New in this stage (marked # NEW): the gather and write between the allocator and the model.

Read: engine/kv_pool.py (PagedKVPool.write) and engine/one_request.py (gather, run_request), printed when the stage
      starts; this stage runs each request through one_request.generate over an Engine's parts
      (its model, allocator and pool; engine.tokenize checks the prompt). The gather is
      exercise 5: the stage prints PagedKVPool.gather and .tokens_of from exercises/gather_kv.py
      in place of engine/kv_pool.py's; write them first, then read the reference.

Run:  python lessons/07_real_model.py            (SmolLM2-135M; run times: lessons/README.md)
      python lessons/07_real_model.py --tiny     (a random 2-layer model, faster)
"""

import itertools

import torch
from rich.console import Console
from rich.rule import Rule
from rich.table import Table

from benchmarks.measure import Runs, TokenCounter, conclusion, how_much_faster
from commands.demo import DEMO_QUESTIONS, DEMO_SYSTEM_PROMPT
from engine import Engine
from engine.kv_pool import PagedKVPool
from engine.one_request import gather, generate, greedy_reference, run_request
from engine.outputs import Generation
from engine.request import SamplingParams
from lessons import models
from lessons.reading import show_code, show_exercise

SYSTEM = {"role": "system", "content": DEMO_SYSTEM_PROMPT}
MAX_TOKENS = 24
STEPS = ("lookup", "gather", "forward", "write", "sample")
REPEATS = 3  # cold/warm pairs timed: a median, and a spread that says if the machine was busy


def run(engine: Engine, question: str, max_tokens: int) -> Generation:
    """One request through stage 7's path (run_request), alone, over the engine's parts."""
    return generate(engine.parts, f"q{next(REQUEST_IDS)}", engine.tokenize(ask(question)),
                    SamplingParams(max_tokens=max_tokens))


REQUEST_IDS = itertools.count(1)


def ask(question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": question}]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two prompts agree on from the start.

    >>> common_prefix([5, 6, 7, 8], [5, 6, 9])
    2
    """
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def show_what_is_shared(console: Console, engine: Engine) -> None:
    """Count what the demo's prompts share, token by token, and which whole blocks of it can hit."""
    block_size, tokenizer = engine.allocator.block_size, engine.tokenizer
    system_turn = len(tokenizer.apply_chat_template([SYSTEM], return_dict=False))  # no assistant turn opened
    prompts = [engine.tokenize(ask(question)) for question in DEMO_QUESTIONS]
    in_all = min(common_prefix(prompts[0], p) for p in prompts[1:])
    start = in_all // block_size * block_size  # the first block not shared by every prompt
    end = start + block_size  # ... and where it ends
    first = "first token" if end - in_all == 1 else f"first {end - in_all} tokens"
    full_blocks, over = divmod(system_turn, block_size)
    console.print(
        f"The system turn is {system_turn} tokens with the chat template: {full_blocks} full blocks of "
        f"{block_size} and {over} tokens over. Every prompt goes on with the {in_all - system_turn} tokens that "
        f"open the user's turn ({tokenizer.decode(prompts[0][system_turn:in_all])!r}), so all {len(prompts)} demo "
        f"prompts agree on their first {in_all} tokens. The block of tokens {start}-{end - 1} ends with the "
        f"question's {first}, and a block hits only if every token matches:"
    )
    table = Table("question", "tokens in common with an earlier one", "cached_tokens: its whole blocks")
    for i, (question, prompt) in enumerate(zip(DEMO_QUESTIONS, prompts)):
        common = max((common_prefix(prompt, earlier) for earlier in prompts[:i]), default=0)
        hit_blocks = common // block_size
        table.add_row(f"{i + 1}. {question}", str(common), f"{hit_blocks} x {block_size} = {hit_blocks * block_size}")
    console.print(table)
    console.print(f"A question whose {first} {'matches' if first == 'first token' else 'match'} an earlier "
                  f"question's fills that block the same way and hits it; any other stops a block short. The demo "
                  f"(python prefix_caching.py --demo) asks these five, in this order.")


def timing_table(runs: dict[str, list[Generation]]):
    """One column per request; rows: TTFT and the five steps of the prefill, medians over runs."""
    medians = {name: {step: Runs([getattr(r.prefill, f"{step}_ms") for r in rs]).median for step in STEPS}
               for name, rs in runs.items()}
    ttft = {name: Runs([r.ttft_ms for r in rs]) for name, rs in runs.items()}
    num_runs = len(next(iter(runs.values())))
    table = Table("", *runs, title=f"where the time to first token went (ms, median of {num_runs} runs)",
                  title_justify="left")
    table.add_row("[bold]TTFT", *(f"[bold]{t.median:,.1f}" for t in ttft.values()))
    for step in STEPS:
        table.add_row(f"  {step}", *(f"{medians[name][step]:,.1f}" for name in runs))
    if all(r.prefill.gpu_ms for rs in runs.values() for r in rs):  # on a GPU: its own clock, CUDA events
        for step in STEPS:
            table.add_row(f"  {step}, GPU clock", *(f"{Runs([r.prefill.gpu_ms[step] for r in rs]).median:,.1f}"
                                                    for rs in runs.values()))
    table.add_row("TTFT slowest / fastest", *(f"{t.spread:.1f}x" for t in ttft.values()))
    return table


def show_one_gather(console: Console, engine: Engine, prompt_ids: list[int]) -> None:
    """The engine's prefill, one step at a time, with the tensors it moves; then the logits
    of (gathered prefix + computed suffix) against one full forward pass over the prompt."""
    alloc, kv, model = engine.allocator, engine.kv, engine.model
    block_size = alloc.block_size
    num_cached, num_new = alloc.allocate_with_prefix("look", prompt_ids)  # NEW: the lookup
    table = alloc.block_tables["look"]
    hit_blocks = table[: num_cached // block_size]
    console.print(f"lookup: {len(prompt_ids)} prompt tokens, {num_cached} cached in blocks {hit_blocks}, "
                  f"{num_new} to compute in new blocks {table[len(hit_blocks):]}")
    try:
        with torch.inference_mode():
            cache = kv.gather(hit_blocks, model.config)  # NEW: pool -> DynamicCache
            shapes = Table("tensor", "shape", "what it is")
            shapes.add_row("engine.kv.data", str(tuple(kv.data.shape)),
                           "the pool: (layers, K/V, blocks, slots per block, KV heads, head dim)")
            shapes.add_row(f"its blocks {hit_blocks[0]}..{hit_blocks[-1]}", f"{len(hit_blocks)} x {block_size} slots",
                           "index_select on the blocks axis, in block-table order")
            shapes.add_row("cache.layers[0].keys", str(tuple(cache.layers[0].keys.shape)),
                           f"(batch, KV heads, tokens, head dim): {num_cached} tokens, as if just computed")
            shapes.add_row("len(cache.layers)", str(len(cache.layers)), "one keys/values pair per layer")
            console.print(shapes)
            position = block_size + 3  # any cached token: this one sits in the second block, at slot 3
            in_pool = kv.data[0, 0, table[position // block_size], position % block_size]  # (KV heads, head dim)
            same = torch.equal(cache.layers[0].keys[0, :, position], in_pool)
            block, slot = table[position // block_size], position % block_size
            console.print(f"Token {position} lives in block table[{position} // {block_size}] = {block}, slot "
                          f"{position} % {block_size} = {slot}; its layer-0 key in the cache equals the pool's: {same}")

            suffix = torch.tensor([prompt_ids[num_cached:]], device=model.device)
            cached_logits = model(suffix, past_key_values=cache, use_cache=True).logits[0]  # NEW: the suffix only
            kv.write(cache, table, num_cached, len(prompt_ids))  # NEW: its K/V into its blocks
            full_logits = model(torch.tensor([prompt_ids], device=model.device)).logits[0, num_cached:]
    finally:
        alloc.free("look")
    diff = (cached_logits - full_logits).abs().max().item()
    if not torch.allclose(cached_logits, full_logits, rtol=1e-4, atol=1e-4):
        raise SystemExit(f"the logits of the cached prefix + suffix differ from a full forward pass by {diff:.2e}")
    console.print(f"Logits of the {num_new} suffix positions, cached prefix + suffix vs one full forward pass over "
                  f"all {len(prompt_ids)} tokens: largest difference {diff:.1e}"
                  f"{' (bit for bit the same)' if diff == 0 else ' (float rounding: the sums ran in another order)'}. "
                  f"[bold green]exactness ok: logits allclose to a full forward[/]")


def main(argv: list[str] | None = None) -> None:
    args = models.parse_args("Stage 7: prefix caching on a real model, cold vs warm", argv, engine=True)
    console = Console()
    for name in ("gather", "tokens_of"):
        show_exercise(console, 5, "exercises/gather_kv.py", f"PagedKVPool.{name}", getattr(PagedKVPool, name))
    show_code(console, PagedKVPool.write, gather, run_request)
    engine = models.make_engine(args)
    console.print(models.describe(engine.model, args))
    console.print(str(engine.kv))
    engine.warm_up()

    console.print(Rule("1. Two questions behind one long system prompt: cold, then warm"))
    show_what_is_shared(console, engine)
    embedding = engine.model.get_input_embeddings()
    with TokenCounter(embedding) as cold_work:
        cold = run(engine, DEMO_QUESTIONS[0], MAX_TOKENS)
    with TokenCounter(embedding) as warm_work:
        warm = run(engine, DEMO_QUESTIONS[1], MAX_TOKENS)
    counts = Table("counted", "cold: question 1", "warm: question 2", title="what each request cost, counted",
                   title_justify="left")
    counts.add_row("prompt tokens", str(cold.prompt_tokens), str(warm.prompt_tokens))
    counts.add_row("K/V taken from the pool (cached_tokens)", str(cold.cached_tokens), str(warm.cached_tokens))
    counts.add_row("K/V computed by the model", str(cold.computed_prompt_tokens), str(warm.computed_prompt_tokens))
    counts.add_row(f"tokens the model embedded (prompt + {MAX_TOKENS - 1} decode steps)",
                   str(cold_work.tokens), str(warm_work.tokens))
    console.print(counts)
    console.print(
        f"The warm request took {warm.cached_tokens} of its {warm.prompt_tokens} prompt tokens from the pool "
        f"(cached_tokens={warm.cached_tokens}) and ran the model on {warm.computed_prompt_tokens}: its first forward "
        f"pass embedded {warm.computed_prompt_tokens} tokens where the cold one embedded {cold.prompt_tokens}."
    )

    runs = {"cold: question 1": [cold], "warm: question 2": [warm]}
    for _ in range(REPEATS - 1):  # the first token only: TTFT is all that is timed
        engine.allocator.reset_prefix_cache()  # so the cold request is cold again
        runs["cold: question 1"].append(run(engine, DEMO_QUESTIONS[0], 1))
        runs["warm: question 2"].append(run(engine, DEMO_QUESTIONS[1], 1))
    console.print(timing_table(runs))
    colds, warms = runs.values()
    cold_ttft, warm_ttft = Runs([r.ttft_ms for r in colds]), Runs([r.ttft_ms for r in warms])
    cold_forward = Runs([r.prefill.forward_ms for r in colds])
    warm_gather = Runs([r.prefill.gather_ms for r in warms])
    console.print(f"Timed here (medians of {REPEATS} runs, the pool emptied before each cold one): TTFT "
                  f"{cold_ttft} cold, {warm_ttft} warm: {how_much_faster(warm_ttft, cold_ttft)}.")
    console.print(conclusion(
        f"The time moved from forward to gather: copying {warm.cached_tokens} tokens' K/V out of the pool took "
        f"{warm_gather}, computing the cold prompt's took {cold_forward} "
        f"({cold_forward.median / warm_gather.median:,.0f}x as long).",
        warm_gather, cold_forward, cold_ttft, warm_ttft))

    console.print(Rule("2. The gather, step by step (question 3)"))
    show_one_gather(console, engine, engine.tokenize(ask(DEMO_QUESTIONS[2])))

    console.print(Rule("3. The reply is exactly what plain generation gives"))
    prompt_ids = engine.tokenize(ask(DEMO_QUESTIONS[1]))
    plain_tokens = greedy_reference(engine.model, prompt_ids, MAX_TOKENS)  # plain model.generate (engine/one_request.py)
    if warm.token_ids != plain_tokens:
        raise SystemExit(f"the warm reply differs from model.generate: {warm.token_ids} vs {plain_tokens}")
    console.print(f"Warm reply: {warm.text!r}\n[bold green]exactness ok: the same {len(plain_tokens)} tokens as "
                  f"model.generate[/] on the whole prompt, without any cache across requests (greedy).")
    console.print("\nExercise 5: write the gather yourself in exercises/gather_kv.py (exercises/README.md).")


if __name__ == "__main__":
    main()
