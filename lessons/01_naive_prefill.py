"""
Stage 1: generating text with no KV cache at all.

A causal language model reads a sequence of tokens and scores every possible next token.
To generate, take the scores (logits) at the last position, pick the best token, append it,
and run the model again. Without a cache, "again" means over the *whole* sequence: the
prompt and every token generated so far go through all the layers once more, for every
single new token. This stage measures what that costs.

New in this stage: everything; it is the baseline the later stages improve on. Stage 2
keeps each token's keys and values (a KV cache) so a token is computed once per request;
stage 7 keeps them across requests (prefix caching).

Read: this file, generate_naive: the loop every later stage improves on (printed when the
      stage starts).

Run:  python lessons/01_naive_prefill.py            (SmolLM2-135M; run times: lessons/README.md)
      python lessons/01_naive_prefill.py --tiny     (a random 2-layer model, faster)
"""

import time

import torch
from rich.console import Console
from rich.rule import Rule
from rich.table import Table

from benchmarks.measure import Runs, TokenCounter, conclusion
from commands.demo import DEMO_SYSTEM_PROMPT
from engine.cpu_threads import one_pass
from lessons import models
from lessons.reading import show_code

QUESTION = [{"role": "user", "content": "What does the processor of a computer do?"}]
REPLY_TOKENS = 8
PROMPT_LENGTHS = (64, 256, 1024)
NEW_TOKENS = 4  # per prompt length: enough for a median, few enough to run in seconds


def generate_naive(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens, and the milliseconds each one took, rerunning the whole sequence every step.

    Only the last position's logits are kept (logits_to_keep=1), as every engine does: the
    cost that remains is the transformer itself, over every token so far.
    """
    ids = list(prompt_ids)
    step_ms = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            start = time.perf_counter()
            with one_pass(models.THREADS, model.device, ("naive", len(ids).bit_length())):  # engine/cpu_threads.py
                logits = model(torch.tensor([ids], device=model.device), use_cache=False, logits_to_keep=1).logits
            ids.append(int(logits[0, -1].argmax()))  # int() waits for the device, so the time is complete
            step_ms.append((time.perf_counter() - start) * 1e3)
    return ids[len(prompt_ids) :], step_ms


def tokens_run_over(prompt_len: int, new_tokens: int) -> int:
    """Tokens the model runs over to generate new_tokens without a cache: step i sees prompt + i.

    >>> tokens_run_over(64, 4)   # 64 + 65 + 66 + 67
    262
    """
    return sum(prompt_len + i for i in range(new_tokens))


def long_prompt(tokenizer, n: int) -> list[int]:
    """n token ids of real text (the demo's system prompt, repeated as often as needed)."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(DEMO_SYSTEM_PROMPT + "\n\n")
    return ids[:n]


def main(argv: list[str] | None = None) -> None:
    args = models.parse_args("Stage 1: generation without a KV cache, measured", argv)
    console = Console()
    show_code(console, generate_naive)
    model, tokenizer = models.load(args)
    console.print(models.describe(model, args))
    generate_naive(model, long_prompt(tokenizer, 16), 1)  # warm-up: the first pass pays one-time setup

    console.print(Rule("1. One token per forward pass, over the whole sequence"))
    prompt_ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    with TokenCounter(model.get_input_embeddings()) as embedded:
        tokens, step_ms = generate_naive(model, prompt_ids, REPLY_TOKENS)
    table = Table("step", "the model runs over", "ms", "token picked")
    for i, (token, ms) in enumerate(zip(tokens, step_ms)):
        table.add_row(str(i + 1), f"{len(prompt_ids) + i} tokens", f"{ms:,.0f}", repr(tokenizer.decode([token])))
    console.print(table)
    console.print(f"Reply so far: {tokenizer.decode(tokens)!r}. Every step recomputed the "
                  f"{len(prompt_ids)}-token prompt from scratch, to produce one token: for {REPLY_TOKENS} tokens "
                  f"the model embedded {embedded.tokens:,} tokens in {embedded.passes} passes (counted by a hook "
                  f"on its embedding layer).")

    console.print(Rule(f"2. The cost of each new token grows with the prompt ({NEW_TOKENS} new tokens each)"))
    table = Table("prompt tokens", f"tokens embedded for {NEW_TOKENS} new (counted)",
                  "each token once (a KV cache)", "ms per new token (median)", "slowest / fastest")
    per_token, work = {}, {}
    for n in PROMPT_LENGTHS:
        with TokenCounter(model.get_input_embeddings()) as embedded:  # the work, counted
            _, step_ms = generate_naive(model, long_prompt(tokenizer, n), NEW_TOKENS)
        per_token[n], work[n] = Runs(step_ms), embedded.tokens  # each step: one run over about n tokens
        table.add_row(f"{n:,}", f"{work[n]:,}", f"{n + NEW_TOKENS - 1:,}",
                      f"{per_token[n].median:,.0f}", f"{per_token[n].spread:.1f}x")
    console.print(table)
    short, long = PROMPT_LENGTHS[0], PROMPT_LENGTHS[-1]
    more_work = work[long] / work[short]
    more_time = per_token[long].median / per_token[short].median
    console.print(f"Counted: after {long:,} prompt tokens the model ran over {more_work:.1f}x the tokens it ran over "
                  f"after {short}. Timed here (median of {NEW_TOKENS} passes each): {per_token[short]} a new token "
                  f"after {short}, {per_token[long]} after {long:,}.")
    console.print(conclusion(
        f"{more_time:.1f}x the time for {more_work:.1f}x the tokens: without a cache, the work for each new token is "
        f"a full prefill of everything before it."
        + (" Less than in proportion, because part of every pass costs the same at any length (reading all the "
           "weights)." if more_time < more_work else ""),
        per_token[short], per_token[long], *per_token.values()))

    console.print(Rule("3. Over a whole reply the waste is quadratic"))
    reply = 500
    console.print(f"A {reply}-token answer to the {long:,}-token prompt, without a cache, runs the model over "
                  f"{tokens_run_over(long, reply):,} tokens (prompt x steps, plus the growing reply); computing "
                  f"each token once would be {long + reply - 1:,}. That is {tokens_run_over(long, reply) / (long + reply - 1):,.0f}x "
                  f"the work (counted, not measured). Stage 2 keeps every token's keys and values so each is computed once.")


if __name__ == "__main__":
    main()
