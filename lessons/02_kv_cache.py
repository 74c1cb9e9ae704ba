"""
Stage 2: the KV cache inside one request.

In stage 1 every step ran the model over the whole sequence again. But in a causal model a
token's keys and values, at every layer, depend only on the tokens up to it: once computed
they never change. So keep them. Each step then runs the model on the one new token, which
attends over the kept keys and values and adds its own. Hugging Face calls the kept tensors
`past_key_values`; a DynamicCache holds, per layer, keys and values of shape
(batch, KV heads, tokens, head dim).

A request now has two phases:
    prefill   the whole prompt in one forward pass, which fills the cache;
              it ends with the first token (time to first token, TTFT)
    decode    one forward pass per new token, over that token alone

New in this stage (marked # NEW): past_key_values, feeding the model only the new token.

Read: this file, generate_with_cache: stage 1's loop with past_key_values (printed when the
      stage starts).

Run:  python lessons/02_kv_cache.py            (SmolLM2-135M; run times: lessons/README.md)
      python lessons/02_kv_cache.py --tiny     (a random 2-layer model, faster)
"""

import importlib
import time

import torch
from rich.console import Console
from rich.rule import Rule
from rich.table import Table
from transformers import DynamicCache

from benchmarks.measure import Runs, TokenCounter, busy_note, conclusion, how_much_faster
from engine.cpu_threads import one_pass
from engine.kv_pool import PagedKVPool
from lessons import models
from lessons.reading import show_code

stage_1 = importlib.import_module("lessons.01_naive_prefill")  # a file name starting with a digit needs importlib
REPEATS = 3  # runs per prompt length: a median, and a spread that says if the machine was busy


def generate_with_cache(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float], DynamicCache]:
    """Greedy tokens, the milliseconds of each step (the first is the prefill), and the cache.

    The same loop as stage 1's generate_naive; the lines marked NEW are the difference.
    """
    cache = DynamicCache(config=model.config)  # NEW: empty; each forward pass appends to it
    new_ids = list(prompt_ids)  # NEW: what the next pass computes: the whole prompt first
    tokens, step_ms = [], []
    with torch.inference_mode():
        for _ in range(max_tokens):
            start = time.perf_counter()
            with one_pass(models.THREADS, model.device, ("cached", len(new_ids).bit_length())):
                logits = model(torch.tensor([new_ids], device=model.device), past_key_values=cache,  # NEW
                               use_cache=True, logits_to_keep=1).logits
            tokens.append(int(logits[0, -1].argmax()))
            step_ms.append((time.perf_counter() - start) * 1e3)
            new_ids = tokens[-1:]  # NEW: from now on, only the token just picked
    return tokens, step_ms, cache


def main(argv: list[str] | None = None) -> None:
    args = models.parse_args("Stage 2: past_key_values, prefill and decode, measured", argv)
    console = Console()
    show_code(console, generate_with_cache)
    model, tokenizer = models.load(args)
    console.print(models.describe(model, args))
    generate_with_cache(model, stage_1.long_prompt(tokenizer, 16), 2)  # warm-up: one-time setup costs

    console.print(Rule("1. The question of stage 1, now with a KV cache"))
    prompt_ids = tokenizer.apply_chat_template(stage_1.QUESTION, add_generation_prompt=True, return_dict=False)
    n = stage_1.REPLY_TOKENS
    with TokenCounter(model.get_input_embeddings()) as with_cache:
        tokens, step_ms, cache = generate_with_cache(model, prompt_ids, n)
    table = Table("step", "the model runs over", "the cache then holds", "ms", "token picked")
    for i, (token, ms) in enumerate(zip(tokens, step_ms)):
        ran = f"{len(prompt_ids)} tokens (prefill)" if i == 0 else "1 token (decode)"
        table.add_row(str(i + 1), ran, f"{len(prompt_ids) + i} tokens", f"{ms:,.0f}", repr(tokenizer.decode([token])))
    console.print(table)
    with TokenCounter(model.get_input_embeddings()) as without_cache:
        naive_tokens, naive_ms = stage_1.generate_naive(model, prompt_ids, n)
    if tokens != naive_tokens:
        raise SystemExit(f"the cache changed the output: {tokens} with it, {naive_tokens} without")
    decode_steps, naive_steps = Runs(step_ms[1:]), Runs(naive_ms)
    console.print(f"Reply: {tokenizer.decode(tokens)!r}. [bold green]The same {n} tokens with and without the "
                  f"cache[/] (stage 1's loop, rerun here). Counted: the model embedded {with_cache.tokens} tokens "
                  f"with the cache (the prompt once, then 1 a step) and {without_cache.tokens} without. The last "
                  f"token's K/V is never computed: nothing reads it, so the cache ends at "
                  f"{cache.get_seq_length()} = {len(prompt_ids)} + {n} - 1 tokens.")
    console.print(f"Timed: a step after the prefill took {decode_steps} with the cache, a step without it "
                  f"{naive_steps} (medians of {n - 1} and {n} steps): {how_much_faster(decode_steps, naive_steps)}. "
                  f"{busy_note(decode_steps, naive_steps)}")

    console.print(Rule("2. What the cache holds: keys and values, per layer"))
    layers = cache.layers
    table = Table("layer", "keys (batch, KV heads, tokens, head dim)", "values")
    for i in sorted({0, 1, len(layers) - 1}):
        table.add_row(str(i), str(tuple(layers[i].keys.shape)), str(tuple(layers[i].values.shape)))
    console.print(table)
    config = model.config.get_text_config()
    shape = PagedKVPool.shape_from_config(model.config)
    per_token = PagedKVPool.bytes_per_block(**shape, block_size=1, dtype=model.dtype)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    console.print(
        f"{len(layers)} layers x K and V x {shape['num_kv_heads']} KV heads x {shape['head_dim']} dims x "
        f"{model.dtype.itemsize} bytes = [bold]{per_token / 1024:,.1f} KiB per token[/]; this request's "
        f"{cache.get_seq_length()} tokens hold {held / 1024:,.0f} KiB. The model has {config.num_attention_heads} "
        f"query heads but only {shape['num_kv_heads']} KV heads (grouped-query attention): each KV head serves "
        f"{config.num_attention_heads // shape['num_kv_heads']} query heads, and the cache is that much smaller."
    )

    console.print(Rule(f"3. Prefill vs decode, as the prompt grows ({REPEATS} runs of {stage_1.NEW_TOKENS} new "
                       f"tokens each)"))
    table = Table("prompt tokens", "prefill ms (TTFT)", "prefill ms per prompt token", "decode ms per new token",
                  "a new token: prefill (stage 1) / decode", "slowest / fastest")
    prefill, decode = {}, {}
    for length in stage_1.PROMPT_LENGTHS:
        prompt = stage_1.long_prompt(tokenizer, length)
        runs = [generate_with_cache(model, prompt, stage_1.NEW_TOKENS)[1] for _ in range(REPEATS)]
        prefill[length] = Runs([step_ms[0] for step_ms in runs])
        decode[length] = Runs([ms for step_ms in runs for ms in step_ms[1:]])
        table.add_row(f"{length:,}", f"{prefill[length].median:,.0f}", f"{prefill[length].median / length:.2f}",
                      f"{decode[length].median:,.0f}", f"{prefill[length].median / decode[length].median:,.0f}x",
                      f"{max(prefill[length].spread, decode[length].spread):.1f}x")
    console.print(table)
    long = stage_1.PROMPT_LENGTHS[-1]
    per_prompt_token = Runs([ms / long for ms in prefill[long].ms])
    console.print(
        f"Without the cache every new token costs about one prefill of the sequence (stage 1 measured it). "
        f"After {long:,} prompt tokens, timed here (medians of {REPEATS} prefills and "
        f"{len(decode[long].ms)} decode steps): a new token costs {decode[long]} with the cache instead of "
        f"{prefill[long]}, {how_much_faster(decode[long], prefill[long])}."
    )
    console.print(conclusion(
        f"Per token, prefill is the cheaper phase ({per_prompt_token.median:.2f} ms a prompt token against "
        f"{decode[long]} a decode step): its tokens go through each weight matrix together, while a decode step "
        f"reads every weight to compute a single token.",
        per_prompt_token, decode[long], *prefill.values(), *decode.values()))
    console.print(
        "What the cache cannot save is the prefill itself: every request pays it, even one whose prompt starts "
        "with the same system prompt as the last. Keeping K/V across requests is prefix caching (stages 3-7)."
    )

if __name__ == "__main__":
    main()
