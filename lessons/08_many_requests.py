"""
Stage 8: many requests at once. A scheduler, and one forward pass per step for all of them.

Stage 7's engine runs one request at a time. A server has many: sixteen students asking
at once should not wait in line, because one forward pass over sixteen tokens costs little
more than over one (the weights are read once either way). Two files do it:

    engine/scheduler.py     each step, who runs and how many tokens (Scheduler.schedule): one
                     token budget for the step; running requests first, a decode taking one
                     token and a prompt still coming its share of what the decodes leave
                     (shared with the requests waiting behind it: share_tokens); then waiting
                     ones in arrival order, their uncached tokens up to the budget left, the
                     rest in later steps (chunked prefill); when a request finds no free block
                     for its tokens, the most recently admitted one is preempted: its blocks
                     are freed, the full ones stay cached, and it waits at the front
    engine/batch_attention.py  every scheduled token packed into one sequence (build_step); the
                     attention takes each request's K/V from the pool through its block
                     table (pool_attention, registered with transformers' AttentionInterface):
                     no DynamicCache is kept between steps, as stage 7 kept one per request.
                     It still copies: every layer copies each request's blocks, whole, out
                     of the pool into one buffer the pool keeps (PagedKVPool.read_blocks).
                     Requests attend in a few groups of similar context length
                     (group_rows: at most 4 for the decodes, 4 for the prompts' chunks, the
                     padding within 25 %), so one long context does not pad every short one,
                     and decodes sharing a system prompt's blocks read them once
                     (shared_prefix_attention). Scene 2c counts the slots and MiB a decode
                     step attends over and copies. vLLM's kernels copy nothing: flash_attn_varlen_func gets the
                     paged cache and the block table and reads the blocks where they lie
                     (vllm/v1/attention/backends/flash_attn.py).
    engine/model_runner.py  a step's plan in, logits out (ModelRunner.run), as nano-vllm's
                     ModelRunner
    engine/batch_engine.py  the step: schedule (a budget policy's Budget, then the scheduler's
                     plan), run the model, sample, and postprocess: one token per request,
                     the finished ones' blocks freed (BatchRunner.step).

In every layer, the step's new K/V are written into the pool before any request attends.
So a request admitted in the same step as another hits the blocks the other is computing
in that very step: allocate_with_prefix cached them the moment they were allocated.

A long prompt is prefilled in chunks, as vLLM v1 does by default: scene 2 shows it beside
the decodes, and scene 2b the same steps with chunking off, where it waits to run alone.

New in this stage (marked # NEW): a BatchRunner driven one step at a time, its plan, the
scheduler's queues, and Engine.generate_batch.

Read: engine/batch_attention.py: pool_attention, shared_prefix_attention, build_step;
      engine/batch_engine.py: BatchRunner.step, schedule and postprocess; engine/model_runner.py:
      ModelRunner.run (all printed when the stage starts). The scheduler's
      schedule and _preempt are exercise 6: the stage prints them from exercises/scheduler.py
      in place of engine/scheduler.py's; write them first, then read the reference.

Run:  python lessons/08_many_requests.py            (SmolLM2-135M; run times: lessons/README.md)
      python lessons/08_many_requests.py --tiny     (a random 2-layer model, faster)
"""

from types import SimpleNamespace

import torch
from rich.console import Console
from rich.rule import Rule
from rich.table import Table

from benchmarks.measure import Runs, busy_note, how_much_faster
from benchmarks.throughput import TOPICS, questions, run_ours, summary
from commands.demo import DEMO_SYSTEM_PROMPT
from engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, Engine
from engine.batch_attention import attend, build_step, pool_attention, shared_prefix_attention
from engine.batch_engine import BatchRunner
from engine.cpu_threads import cores_used_by_others, cpu_sample
from engine.model_runner import ModelRunner
from engine.one_request import greedy_reference
from engine.request import SamplingParams
from engine.scheduler import Scheduler
from engine.step_budget import (BOUNDS, DEFAULT_TARGET_STEP_MS, FLOOR, GAP_MAX, MIN_CHUNK, STALL, ModelShape, StepBudget,
                                chunk_flops)
from lessons import models
from lessons.batch_views import add_step_row, render_step, run_step, step_history
from lessons.reading import show_code, show_exercise

USERS = ["alice", "bob", "carol", "dave"]
MAX_TOKENS = 16
BUDGET = 512  # max_num_batched_tokens of scenes 1-2 (scene 2d shows what an engine picks by default)
SHARE_BUDGET = 128  # scene 2e: a budget well under the long prompt, so that sharing it shows
SMALL_POOL_EXTRA = 6  # scene 3: blocks beyond the system prompt's, too few for four replies
THROUGHPUT_REQUESTS = 8  # scene 4 (the benchmark runs 16 and 32, 32 tokens each)

# A plain-text prompt (no chat template, so none of it is in the pool), longer than BUDGET.
ERIN = ("Here is a course page and the questions a class sent. Say which week answers each question.\n\n"
        + DEMO_SYSTEM_PROMPT + "\n\nQuestions:\n" + "\n".join(f"- What is {topic}?" for topic in TOPICS))


def same_step_hit(console: Console, engine: Engine, prompts: dict[str, list[int]]) -> tuple[BatchRunner, list]:
    """Scene 1: four requests behind one system prompt, admitted in one step."""
    alloc, kv = engine.allocator, engine.kv
    runner = BatchRunner(engine.parts, max_num_batched_tokens=BUDGET)  # NEW
    cold = [alloc.peek(ids) for ids in prompts.values()]
    requests = [runner.add(user, ids, SamplingParams(max_tokens=MAX_TOKENS), None) for user, ids in prompts.items()]
    first_block = 0  # the pool is fresh: alice's first block will be block 0
    before = kv.data[:, :, first_block].abs().sum().item()
    record = run_step(runner, 1)  # NEW: schedule, one forward pass, sample
    after = kv.data[:, :, first_block].abs().sum().item()
    console.print(render_step(record, runner))

    hits = {s.request.request_id: s.start for s in record.scheduled}  # NEW: where each one's computing began
    lengths = [len(ids) for ids in prompts.values()]
    shared = runner.scheduler.shared_blocks()  # NEW
    others = [hits[user] for user in USERS[1:]]
    found = (f"each found {others[0]} tokens" if len(set(others)) == 1
             else f"found {', '.join(map(str, others[:-1]))} and {others[-1]} tokens")
    console.print(
        f"Before the step the pool was cold: peek found {cold} cached tokens for the four prompts. Yet in "
        f"step 1 alice computed all {lengths[0]} tokens of hers, and bob, carol and dave {found} in the pool: "
        f"the blocks alice was computing in that very step. allocate_with_prefix cached them when alice "
        f"allocated them, so the others' "
        f"lookups found them; pool_attention wrote the step's K/V in every layer before anyone attended, so "
        f"what they read was there. Block {first_block}'s K/V summed to {before:g} before the step (never "
        f"written) and {after:,.1f} after. {len(shared)} blocks have ref count "
        f"{max((len(h) for h in shared.values()), default=0)}."
    )
    console.print(
        f"The batch: {record.num_tokens:,} tokens in one forward pass. The step's token budget is {BUDGET} "
        f"(max_num_batched_tokens), and it counts only uncached tokens: without the hit, four prompts would "
        f"be {sum(lengths):,} tokens, one prompt a step."
    )
    return runner, requests


def decode_steps(console: Console, engine: Engine, runner: BatchRunner, requests: list) -> tuple[list, list[Runs]]:
    """Scene 2: the four decode together; a long uncached prompt arrives and is prefilled in
    chunks beside them."""
    erin_ids = engine.tokenize(ERIN)
    requests.append(runner.add("erin", erin_ids, SamplingParams(max_tokens=MAX_TOKENS), None))  # NEW
    block_size = engine.allocator.block_size
    console.print(f"erin arrives after step 1 with a plain-text prompt of {len(erin_ids):,} tokens, none of them "
                  f"in the pool: more than the budget of {BUDGET} tokens a step.")
    history = step_history("every step of scenes 1-2 after the first: one row each")
    records, findable = [], []  # findable: erin's tokens a new request could hit, after each of her chunks
    while runner.scheduler.has_work():  # NEW
        record = run_step(runner, len(records) + 2)
        records.append(record)
        add_step_row(history, record)
        chunk = next((s for s in record.prefills() if s.request.request_id == "erin"), None)
        if chunk is not None:
            findable.append((record.number, chunk.end, engine.allocator.peek(erin_ids + [0])))  # NEW
            console.print(render_step(record, runner))
    console.print(history)

    chunks = [r for r in records if any(s.request.request_id == "erin" for s in r.prefills())]
    together = [r for r in records if len(r.decodes()) > 1 and not r.prefills()]
    alone = [r for r in records if not r.prefills() and len(r.decodes()) == 1]
    decoders = max(len(r.decodes()) for r in together)
    together, alone, chunk_ms = Runs([r.ms for r in together]), Runs([r.ms for r in alone]), Runs([r.ms for r in chunks])
    console.print(
        f"erin's prompt came in {len(chunks)} chunks, in steps {chunks[0].number}-{chunks[-1].number}, each beside "
        f"the four decodes: a step's budget of {BUDGET} tokens goes to the running requests first (one token "
        f"each), and what is left to the next chunk of her prompt. The four decoded in every step of her prompt, and her prompt did not wait for them to finish; those steps were longer, as the times below show."
    )
    grown = ", ".join(f"after step {number}: {computed:,} computed, {hit:,} findable ({hit // block_size} blocks)"
                      for number, computed, hit in findable)
    console.print(
        f"Her blocks were cached chunk by chunk ({grown}): a step takes slots only for the tokens it schedules, "
        f"so another request finds a block from the step that writes its K/V on, never earlier. (The last, "
        f"partial block is never cached, and a hit always leaves the last token to compute.)"
    )
    console.print(
        f"Decode steps: one token per running request, all in one forward pass. Up to {decoders} together "
        f"(the four and erin): {together} (median of {len(together.ms)} steps here); erin alone at the end: 1 "
        f"token a step, {alone} (median of {len(alone.ms)}; her context is {len(erin_ids):,}+ tokens, theirs "
        f"{min(len(r.prompt_ids) for r in requests[:len(USERS)]):,}+). A step with a chunk of hers: {chunk_ms} "
        f"(median of {len(chunk_ms.ms)}). The budget sets that price: a bigger one finishes a long prompt in "
        f"fewer steps, and makes each of those steps longer for the requests decoding beside it. "
        f"{busy_note(together, alone)}".strip()
    )
    replies = runner.run(requests)
    bob = replies[1]
    if bob.token_ids != greedy_reference(engine.model, requests[1].prompt_ids, MAX_TOKENS):
        raise SystemExit("bob's reply differs from model.generate on his prompt alone")
    console.print(f"bob's reply {bob.text!r}: [bold green]exactness ok: the same {len(bob.token_ids)} tokens as "
                  f"model.generate on his prompt alone[/], though he read blocks computed in his own first step.")
    return replies, [together, alone]


def chunking_off(console: Console, engine: Engine, prompts: dict[str, list[int]], chunked: list) -> None:
    """Scene 2, again, with chunked prefill off: erin's prompt runs whole, in a step of its own."""
    assert engine.allocator.reset_prefix_cache()  # cold again, as in scene 1
    runner = BatchRunner(engine.parts, max_num_batched_tokens=BUDGET, enable_chunked_prefill=False)  # NEW
    requests = [runner.add(user, ids, SamplingParams(max_tokens=MAX_TOKENS), None) for user, ids in prompts.items()]
    run_step(runner, 1)
    erin_ids = engine.tokenize(ERIN)
    requests.append(runner.add("erin", erin_ids, SamplingParams(max_tokens=MAX_TOKENS), None))
    history = step_history("the same steps with enable_chunked_prefill=False")
    records = []
    while runner.scheduler.has_work():
        record = run_step(runner, len(records) + 2)
        records.append(record)
        add_step_row(history, record)
    console.print(history)
    erin_step = next(r for r in records if "erin" in r.admitted)
    left = BUDGET - len(records[0].decodes())
    replies = runner.run(requests)
    same = sum(a.token_ids == b.token_ids for a, b in zip(replies, chunked))
    console.print(
        f"erin waited {erin_step.number - 2} steps. Her {len(erin_ids):,} uncached tokens exceed the budget "
        f"left after the decodes in step 2 ({BUDGET} - {len(records[0].decodes())} = {left}), and with chunking "
        f"off a prompt is never cut into pieces: she waits for a step of her own, which comes only when nobody "
        f"else runs. She ran alone, whole, {erin_step.num_tokens:,} tokens in step {erin_step.number}, above the "
        f"budget, {erin_step.ms:,.0f} ms. Every reply is the same as with chunking: {same} of {len(replies)}."
    )


def what_a_step_reads(console: Console, engine: Engine, prompts: dict[str, list[int]]) -> None:
    """Scene 2c: the pool slots one decode step's attention reads, three ways; and the merge
    that lets requests sharing a prefix read it once, on numbers small enough to check."""
    assert engine.allocator.reset_prefix_cache()
    runner = BatchRunner(engine.parts, max_num_batched_tokens=2048)
    requests = [runner.add(user, ids, SamplingParams(max_tokens=4), None) for user, ids in prompts.items()]
    requests.append(runner.add("erin", engine.tokenize(ERIN), SamplingParams(max_tokens=4), None))
    runner.step()  # the five prompts, in one step
    runner.step()  # five decodes: the four behind the system prompt, and erin
    plan, alloc = runner.last_plan, engine.allocator
    tables = {s.request.request_id: list(alloc.block_tables[s.request.request_id]) for s in plan.scheduled}
    one_group = len(plan.scheduled) * max(s.end for s in plan.scheduled)  # every context padded to the longest
    grouped = build_step(plan, engine.kv, tables, engine.device, cascade=False)  # NEW: groups of similar length
    cascade = build_step(plan, engine.kv, tables, engine.device, cascade=True)  # NEW: the shared prefix once
    kv = engine.kv
    per_slot = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * kv.dtype.itemsize  # K and V, every layer
    table = Table("how the step attends", "slots read a layer", "slots copied a layer", "K/V copied a step",
                  title=f"one decode step: {', '.join(f'{s.request.request_id} {s.end:,}' for s in plan.scheduled)} "
                        f"tokens of context", title_justify="left")
    whole_blocks = len(plan.scheduled) * -(-max(s.end for s in plan.scheduled) // kv.block_size) * kv.block_size
    for name, slots, copied in [("every request padded to the longest context", one_group, whole_blocks),
                                ("groups of similar context length (group_rows)", grouped.slots_read,
                                 grouped.slots_copied),
                                ("the same, shared prefix read once (cascade)", cascade.slots_read,
                                 cascade.slots_copied),
                                ("what the contexts hold", cascade.slots_needed, None)]:
        table.add_row(name, f"{slots:,}", "" if copied is None else f"{copied:,}",
                      "" if copied is None else f"{copied * per_slot / 2**20:,.1f} MiB")
    console.print(table)
    longest = max(s.end for s in plan.scheduled)  # erin's context: a group of her own
    four = [s.end for s in plan.scheduled if s.end < longest]
    console.print(
        f"In every layer the step copies the blocks it reads out of the pool, whole (the last one part-filled), "
        f"into one buffer the pool keeps for that, and attends over the copy. Padded to erin's context, the four "
        f"short requests would read {one_group - cascade.slots_needed:,} slots they do not have; grouped by "
        f"length they read {grouped.slots_read - longest:,} (their {sum(four):,} tokens of context, each padded "
        f"to the longest of the four, {max(four):,}) and erin her {longest:,}; "
        f"and the four share the system prompt's blocks, so with cascade attention those are read once, not four "
        f"times. Copying whole blocks with one index_select a group, into memory written before, costs what "
        f"transformers' contiguous DynamicCache costs for the same step (it copies every context once a step "
        f"too, when torch.cat appends the new token): python prefix_caching.py --bench paged times both. "
        f"(vLLM's kernels copy nothing: flash_attn_varlen_func gets the paged cache and the block table "
        f"and reads the blocks where they lie, in vllm/v1/attention/backends/flash_attn.py.)"
    )
    runner.run(requests)

    # The merge, on numbers you can check by hand: two queries, a shared block of two keys, and a
    # key of each one's own. Attention over [shared, own] in one softmax, and the same in two parts.
    torch.manual_seed(0)
    q = torch.randn(2, 1, 1, 4)  # (queries, kv heads, heads per kv head, dim)
    shared_k, shared_v = torch.randn(2, 1, 4), torch.randn(2, 1, 4)  # (keys, kv heads, dim): one copy for both
    own_k, own_v = torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4)  # (queries, keys, kv heads, dim)
    whole = [torch.softmax(torch.cat([shared_k[:, 0] @ q[i, 0, 0], own_k[i, :, 0] @ q[i, 0, 0]]) / 2, 0)
             @ torch.cat([shared_v[:, 0], own_v[i, :, 0]]) for i in range(2)]
    out_shared, lse_shared = attend(q, shared_k, shared_v, scale=0.5)  # NEW: the shared keys, once for both
    out_own, lse_own = attend(q, own_k, own_v, scale=0.5)  # NEW: each query's own keys
    w_shared, w_own = lse_shared.exp(), lse_own.exp()  # NEW: each part's share of the softmax's sum
    merged = (out_shared * w_shared + out_own * w_own) / (w_shared + w_own)  # NEW
    diff = max((merged[i, 0, 0] - whole[i]).abs().max().item() for i in range(2))
    show = lambda v: "(" + ", ".join(f"{x:.4f}" for x in v.tolist()) + ")"  # noqa: E731
    console.print(
        f"The merge, small: two queries, a shared block of two keys and one key each of their own (dim 4, scale "
        f"0.5). One softmax over the shared keys and its own together gives query 0 {show(whole[0])}. In two parts: "
        f"attention over the shared keys alone (computed once for both queries) and over its own key alone, each "
        f"with lse, the log of the sum of its exp(scores): {lse_shared[0, 0, 0, 0]:.4f} and "
        f"{lse_own[0, 0, 0, 0]:.4f}; then "
        f"out = (e^lse_shared x out_shared + e^lse_own x out_own) / (e^lse_shared + e^lse_own) = "
        f"{show(merged[0, 0, 0])}. Largest difference over both queries: {diff:.1e}. "
        f"shared_prefix_attention in engine/batch_attention.py does this for every layer of a step."
    )


def step_time_budget(console: Console, engine: Engine, prompts: dict[str, list[int]]) -> None:
    """Scene 2d: scene 2 again, each step's budget picked from a target step time instead of a
    fixed BUDGET (engine/step_budget.py, what Engine() and python server.py run)."""
    assert engine.allocator.reset_prefix_cache()
    target_ms, cap = DEFAULT_TARGET_STEP_MS, DEFAULT_MAX_NUM_BATCHED_TOKENS  # the engine's defaults
    budget = StepBudget(ModelShape.of(engine.model), target_ms, cap)  # NEW: a time, and a hard cap
    runner = BatchRunner(engine.parts, step_budget=budget, max_num_batched_tokens=cap)  # NEW
    requests = [runner.add(user, ids, SamplingParams(max_tokens=MAX_TOKENS), None) for user, ids in prompts.items()]
    # The four prompts (in as many steps as their budgets take: the first step, with nothing
    # timed yet, gets FIRST_CHUNK tokens; an Engine times two passes when it starts instead,
    # StepBudget.calibrate), then four decode steps: what a step costs is learned from them.
    number = 0
    while runner.scheduler.waiting or any(r.num_prefill_left for r in runner.scheduler.running):
        number += 1
        run_step(runner, number)
    decode_numbers = range(number + 1, number + 5)
    decoding = Runs([run_step(runner, n).ms for n in decode_numbers])
    erin_ids = engine.tokenize(ERIN)
    requests.append(runner.add("erin", erin_ids, SamplingParams(max_tokens=MAX_TOKENS), None))
    table = Table("step", "budget", "decodes", "erin's chunk", "predicted", "took", title_justify="left",
                  title=f"erin's {len(erin_ids):,} tokens beside the four decodes, a target of {target_ms:g} ms a step")
    number, chunks, sizes = decode_numbers[-1] + 1, [], []
    while any(r.request_id == "erin" for r in runner.scheduler.waiting) or any(
            r.request_id == "erin" and r.num_prefill_left for r in runner.scheduler.running):
        record = run_step(runner, number)
        chunk = next(s for s in record.scheduled if s.request.request_id == "erin")
        chunks.append(record)
        sizes.append(chunk.end - chunk.start)
        predicted = budget.predicted  # NEW: what the costs learned before the step said it would take
        table.add_row(str(number), f"{budget.last:,}", str(len(record.scheduled) - 1), f"{chunk.start:,}-{chunk.end:,}",
                      "-" if predicted is None else f"{predicted * 1e3:,.0f} ms", f"{record.ms:,.0f} ms")
        number += 1
    console.print(table)
    # The costs as they stood for her last chunk: the decode-only steps after it would leave
    # a fit of alike steps, which cannot tell the fixed part from the part per token.
    threads = runner.thread_count(chosen=True)  # the count the latest step ran with: its costs are known
    fixed, per_flop = budget.costs.fit(threads)
    runner.run(requests)
    per_token = per_flop * 2 * budget.shape.body_params
    timed = budget.attention != budget.shape.attention  # the engine timed its attention when made (AttentionCosts)
    attention = (f"timed when the engine started: a key attended to costs {budget.attention.per_pair * per_flop * 1e9:,.2f}"
                 f" ns, a key read {budget.attention.per_key * per_flop * 1e6:,.1f} us" if timed else
                 "as counted: a key attended to costs its multiply-adds, reading it nothing")
    whole = fixed + per_flop * chunk_flops(budget.shape, 0, len(erin_ids))
    # Her chunks beside the four's decodes, which the bound is about; once the four have
    # finished she steps alone, and those steps (a target's worth each) say nothing of it.
    beside = Runs([r.ms for r in chunks if len(r.scheduled) > 1] or [chunks[0].ms])  # her first: beside them
    after = [r.ms for r in chunks if len(r.scheduled) == 1]
    shrink = (f" Her chunks shrink as she goes ({sizes[0]} tokens first, {sizes[-2]} before the last): each of her "
              f"tokens attends to every one before it." if len(sizes) > 2 and sizes[-2] < sizes[0] else "")
    console.print(
        f"What a step costs here, learned from the steps run (StepCosts: the median step of each size over "
        f"minutes, so a busy minute does not move it): {fixed * 1e3:,.0f} ms whatever its size, and "
        f"{per_token * 1e3:,.1f} ms a token through the weights, plus its attention: each key it attends to, and "
        f"each key of its context read from the pool, every step ({attention}; step_flops counts them all). With a fixed budget of {cap:,} tokens a step, erin's whole prompt would be one step of about "
        f"{whole * 1e3:,.0f} ms by the same costs, and each of the four would wait that long for its next token. With "
        f"a target of {target_ms:g} ms, a step gives her as many tokens as keep it within the target and within "
        f"{STALL:g} times the four's own step ({decoding} alone, steps {decode_numbers[0]}-{decode_numbers[-1]}), "
        f"never fewer than fit in as long as theirs, and never so few that the step's fixed cost is more than "
        f"1/{FLOOR + 1:g} of it (FLOOR; up to a gap of {GAP_MAX:g} times theirs): so a step beside them should take "
        f"at most {GAP_MAX:g} times theirs. {len(chunks)} chunk{'s' if len(chunks) > 1 else ''}; {len(beside.ms)} beside the four's decodes, in "
        f"steps of {beside} (median, {beside.median / decoding.median:.1f}x theirs; the longest "
        f"{max(beside.ms):,.0f} ms, {max(beside.ms) / decoding.median:.1f}x)"
        f"{f', and {len(after)} alone after they finished' if after else ''}.{shrink} This is Sarathi-Serve's stall-free batching "
        f"(Agrawal et al., OSDI 2024): the chunk is sized from a latency target. vLLM's budget is a fixed "
        f"number of tokens instead, 2,048 for `vllm serve` (8,192 on a GPU with 70 GiB or more: get_batch_defaults "
        f"in vllm/engine/arg_utils.py), sized for a GPU, where 2,048 tokens take milliseconds. "
        f"Engine() and python server.py use a target ({DEFAULT_TARGET_STEP_MS:g} ms unless "
        f"--target-step-ms is given); --max-num-batched-tokens N makes the budget N every step, as in vLLM, and the "
        f"scenes above pass one so their plans are the same on every machine. {busy_note(decoding, beside)}".strip()
    )


def preemption(console: Console, engine: Engine, prompts: dict[str, list[int]], big_pool: list) -> None:
    """Scene 3: the same four in a pool too small for their replies."""
    block_size = engine.allocator.block_size
    system_blocks = len(engine.tokenize([{"role": "system", "content": DEMO_SYSTEM_PROMPT}])) // block_size
    small = Engine(model=engine.model, tokenizer=engine.tokenizer, block_size=block_size,
                   num_blocks=system_blocks + SMALL_POOL_EXTRA)
    runner = BatchRunner(small.parts)
    requests = [runner.add(user, ids, SamplingParams(max_tokens=MAX_TOKENS), None) for user, ids in prompts.items()]
    console.print(f"A pool of {small.allocator.num_blocks} blocks: the system prompt's {system_blocks} and "
                  f"{SMALL_POOL_EXTRA} more. Four prompts fit; four replies of {MAX_TOKENS} tokens do not.")
    history = step_history("every step in the small pool")
    resumes = []  # (request, step, tokens it held, hit on its return, recomputed)
    held: dict[str, tuple[int, int]] = {}
    number = 0
    while runner.scheduler.has_work():
        number += 1
        record = run_step(runner, number)
        add_step_row(history, record)
        for r in record.preempted:  # NEW: taken out to make room
            held[r.request_id] = (number, record.held[r.request_id])
        for s in record.prefills():
            rid = s.request.request_id
            if rid in held:
                preempted_at, tokens = held.pop(rid)
                resumes.append((rid, preempted_at, number, tokens, s.start, s.end - s.start))
        if record.preempted or any(r[2] == number for r in resumes):
            console.print(render_step(record, runner))
    console.print(history)

    table = Table("request", "preempted in step", "tokens it had computed", "back in step", "found in the pool",
                  "evicted while it waited", "recomputed", title="preempted and resumed: recompute, as vLLM v1 does",
                  title_justify="left")
    for rid, preempted_at, back, tokens, hit, recomputed in resumes:
        # its full blocks stayed cached when it left; these were reused since
        evicted = tokens // block_size * block_size - hit
        table.add_row(rid, str(preempted_at), f"{tokens:,}", str(back), f"{hit:,}", f"{evicted:,}", f"{recomputed:,}")
    console.print(table)
    replies = runner.run(requests)
    same = sum(r.token_ids == b.token_ids for r, b in zip(replies, big_pool))
    total = sum(tokens + 1 for *_, tokens, _, _ in resumes)  # what they had computed, and the token sampled last
    redone = sum(recomputed for *_, recomputed in resumes)
    lost = sum(tokens // block_size * block_size - hit for *_, tokens, hit, _ in resumes)  # blocks taken meanwhile
    partial = sum(tokens % block_size for *_, tokens, _, _ in resumes)  # a partial last block is never cached
    if redone != lost + partial + len(resumes):
        raise SystemExit(f"recomputed {redone} tokens, not {lost} lost + {partial} partial + {len(resumes)} sampled")
    n = runner.scheduler.num_preemptions
    console.print(
        f"{n} preemption{'s' if n != 1 else ''}, no request refused. Coming back, the preempted requests "
        f"recomputed {redone:,} of their {total:,} tokens: {lost:,} in blocks the others took while they waited, "
        f"{partial:,} in a partial last block (never cached), and {len(resumes)} the token each had sampled in "
        f"its last step before it was preempted. A sampled token's K/V is computed in the step after it is "
        f"sampled, and for a preempted request that step never came. The rest they found in the pool: a "
        f"preempted request's full blocks stay cached. The replies are the same tokens as in the big pool of "
        f"scenes 1-2: {same} of {len(replies)}. The pool is whole again: {small.allocator.num_free_blocks} of "
        f"{small.allocator.num_blocks} blocks free."
    )


def throughput(console: Console, engine: Engine, step_times: list[Runs]) -> None:
    """Scene 4: one after another, batched without caching, batched with it, each timed once.
    Whether the machine was busy: the spread of step_times (repeated steps of scene 2), and
    how many cores other programs kept busy during each of the three (from /proc/stat)."""
    budget = ({"max_num_batched_tokens": engine.scheduler_options["max_num_batched_tokens"]}
              if engine.target_step_ms is None else {"target_step_ms": engine.target_step_ms})  # (c)'s
    off = Engine(model=engine.model, tokenizer=engine.tokenizer, block_size=engine.allocator.block_size,
                 num_blocks=engine.allocator.num_blocks, enable_caching=False, **budget)
    prompts = [engine.tokenize(q) for q in questions(THROUGHPUT_REQUESTS)]
    ways = [("(a) one after another", engine, False), ("(b) batched, caching off", off, True),
            ("(c) batched, caching on", engine, True)]
    rows, counts, others, reference = [], [], {}, None
    for name, which, batched in ways:
        before = cpu_sample()  # timed once: what other programs did meanwhile says if the time holds
        run = run_ours(which, prompts, MAX_TOKENS, batched)  # NEW: generate_batch
        others[name.split()[0]] = cores_used_by_others(before, cpu_sample())
        reference = reference or run.outputs
        rows.append(summary(name, run.seconds, run.outputs, run.ttfts_ms, reference))
        # Passes and tokens as the engine's loop planned them: on a GPU a decode step replayed as a
        # CUDA graph runs no Python of the model, so a hook on it would miss those passes.
        counts.append(SimpleNamespace(passes=len(run.steps), tokens=sum(step.tokens for step in run.steps)))

    table = Table(title=f"{len(prompts)} requests behind one system prompt, {MAX_TOKENS} new tokens each",
                  title_justify="left")
    for column in ("way", "forward passes", "tokens embedded", "seconds", "requests/s", "output tokens/s",
                   "TTFT p50 ms", "same tokens as (a)"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for row, c in zip(rows, counts):
        table.add_row(row["name"], f"{c.passes:,}", f"{c.tokens:,}", f"{row['seconds']:.2f}",
                      f"{row['requests_per_s']:.2f}", f"{row['output_tokens_per_s']:.1f}",
                      f"{row['ttft_p50_ms']:,.0f}", f"{row['same_tokens_as_a']} of {row['requests']}")
    console.print(table)
    a, b, c = counts
    ta, tb, tc = (Runs([row["seconds"] * 1e3]) for row in rows)
    console.print(
        f"Counts first. Batching ran the {len(prompts)} requests in {c.passes} forward passes instead of "
        f"{a.passes}: every step, one pass for all. Caching decides how many tokens those passes compute: "
        f"{c.tokens:,} with it against {b.tokens:,} without ({b.tokens / c.tokens:.1f}x), because the system "
        f"prompt was computed once. (a) caches too, so it embeds as few tokens as (c), but one request at a "
        f"time: {a.passes} passes. Then time, measured once each in this run: (c) against (a), "
        f"{how_much_faster(tc, ta)}; against (b), {how_much_faster(tc, tb)}. The three follow one thread policy: "
        f"every forward pass of each, one request's or a batched step's, takes its thread count from "
        f"cpu_threads.one_pass (torch's, or one while other programs keep the cores busy), so none of them is "
        f"slowed by threads waiting for busy cores while another is spared. "
        f"{busy_note(*step_times, others=others)}".strip()
    )


def arrivals_behind_a_long_prompt(console: Console, engine: Engine, prompts: dict[str, list[int]]) -> None:
    """Scene 2e: a short request arrives while a long prompt is coming in chunks; then two
    tenants, one far ahead of the other, under fair_share."""
    assert engine.allocator.reset_prefix_cache()
    budget = SHARE_BUDGET
    runner = BatchRunner(engine.parts, max_num_batched_tokens=budget)
    erin_ids = engine.tokenize(ERIN)
    erin = runner.add("erin", erin_ids, SamplingParams(max_tokens=MAX_TOKENS), None)
    first = run_step(runner, 1)
    frank_ids = engine.tokenize([{"role": "user", "content": "What is a block hash?"}])
    frank = runner.add("frank", frank_ids, SamplingParams(max_tokens=MAX_TOKENS), None)  # NEW: arrives now
    history = step_history(f"erin's prompt, and frank arriving after step 1 (a budget of {budget} tokens)")
    add_step_row(history, first)
    second = run_step(runner, 2)
    add_step_row(history, second)
    console.print(history)
    step2 = {s.request.request_id: s.end - s.start for s in second.scheduled}
    erin_left = len(erin_ids) - budget
    frank_in = len(frank.output_ids) > 0  # he sampled in step 2: his whole prompt was in it
    console.print(
        f"Step 1 gave erin's {len(erin_ids):,}-token prompt the whole budget of {budget}: nobody else wanted "
        f"any. Before step 2, frank was waiting with {len(frank_ids)} uncached tokens and erin had {erin_left:,} "
        f"left. A prompt still prefilling takes only its share of what the decodes leave (Scheduler.schedule, "
        f"share_tokens): the {budget} tokens shared between the two, smallest need first, each at most an equal "
        f"share of what is left. frank got {step2.get('frank', 0)} and erin {step2.get('erin', 0)}"
        + (f", and frank sampled his first token at the end of step 2." if frank_in else ".")
        + f" Under the older rule the running prompt came first and took all it could, and frank would have "
        f"waited for the last of erin's tokens: {-(-erin_left // budget)} more steps of {budget}. (vLLM v1 "
        f"caps one prompt's chunk at a fixed number instead, long_prefill_token_threshold in "
        f"vllm/v1/core/sched/scheduler.py; Sarathi-Serve's stall-free batching is the idea behind both.) A "
        f"request whose next block is one a prefilling prompt is about to write waits for it instead "
        f"(Scheduler._hit_coming): admitted now, it would compute that prefix a second time. Engine()'s "
        f"default budget (scene 2d's) goes further for a newcomer: the prompts already prefilling yield its "
        f"first step to it (a cap of 0 in the Budget), at most FLOOR fixed costs of steps in a row, so frank "
        f"would wait only for the step running when he came, then his own."
    )
    runner.run([erin, frank])

    # NEW: fair shares. fair_share reads the queue least-served tenant first (the Virtual Token Counter).
    assert engine.allocator.reset_prefix_cache()
    fair = BatchRunner(engine.parts, max_num_batched_tokens=BUDGET, max_num_seqs=2, fair_share=True)
    heavy = [fair.add(f"heavy-{i}", erin_ids[i * 50:], SamplingParams(max_tokens=2), None, tenant="heavy")
             for i in range(2)]
    run_step(fair, 1)
    student = fair.add("student", prompts["bob"], SamplingParams(max_tokens=2), None, tenant="student")
    served = dict(fair.scheduler.served)
    step2 = run_step(fair, 2)
    admitted = sorted(step2.admitted)
    fair.run([*heavy, student])
    console.print(
        f"Under fair_share (the Engine's default) the scheduler counts the tokens it computes for each tenant, "
        f"as the Virtual Token Counter does (Sheng et al., \"Fairness in Serving Large Language Models\", OSDI "
        f"2024). Two of heavy's prompts came first; max_num_seqs is 2 here. After step 1 heavy had been served "
        f"{served['heavy']:,} tokens, and student, arriving then, was lifted to the least-served active tenant's "
        f"count, {served['student']:,} (time away is not credit). In step 2 heavy-0's next chunk was counted "
        f"first, so when the queue was read for the one free place, student was the least served: admitted "
        f"{admitted}, while heavy-1, which had arrived before student, waited. engine/step_budget.py goes one "
        f"further while a tenant within FAIR_SLACK tokens of the least served is decoding: the prompts of a "
        f"tenant further ahead get only what keeps that step within FAIR_STALL times the decodes' own (scene "
        f"2d's budget), and never fewer than {MIN_CHUNK} tokens, so its prompt still finishes. An Engine counts "
        f"what a token costs, not only how many: each key it attends to too (Scheduler's key_cost, from the "
        f"model's sizes), so a stream that re-reads a long context pays for it; this runner, made without one, "
        f"counts tokens. Like VTC's, the bound is on what was served: it says who goes first, not how long "
        f"anyone waits."
    )


def bounds(console: Console) -> None:
    """Every bound the default budget policy keeps (step_budget.BOUNDS), and where it shows."""
    table = Table("who waits", "the default policy holds it to", "measured by", title_justify="left",
                  title="What Engine() and python server.py promise, from a target step time (step_budget.BOUNDS)")
    for bound in BOUNDS:
        table.add_row(bound.scene, bound.rule, bound.shown)
    console.print(table)
    console.print(
        "A step costs a fixed part plus a part a token, so a prompt cut into smaller chunks pays the fixed part "
        "more often, while the streams beside it wait less: the two excesses multiply to about 1, and cannot both "
        "be small. Alone, the prompt's bound holds; beside streams, the floor holds until their gap reaches "
        f"GAP_MAX ({GAP_MAX:g}) times their step, and from there the gap wins. docs/serving.md sets "
        "what each benchmark found beside each row."
    )


def main(argv: list[str] | None = None) -> None:
    args = models.parse_args("Stage 8: many requests at once, one forward pass per step", argv, engine=True)
    console = Console()
    for name in ("schedule", "_preempt"):
        show_exercise(console, 6, "exercises/scheduler.py", f"Scheduler.{name}", getattr(Scheduler, name))
    show_code(console, pool_attention, shared_prefix_attention, build_step, BatchRunner.step, BatchRunner.schedule,
              ModelRunner.run, BatchRunner.postprocess)
    # A fixed budget for scene 4's generate_batch: its counts (forward passes) are then the same
    # on every machine. Scene 2d shows the budget a batching engine picks by default instead.
    engine = models.make_engine(args, max_num_batched_tokens=2048)
    console.print(models.describe(engine.model, args))
    engine.warm_up()
    prompts = {user: engine.tokenize(chat) for user, chat in zip(USERS, questions(len(USERS)))}

    console.print(Rule("1. Four requests behind one system prompt, admitted in one step"))
    runner, requests = same_step_hit(console, engine, prompts)
    console.print(Rule("2. Decode steps: one token each, one forward pass; a long prompt comes in chunks"))
    replies, step_times = decode_steps(console, engine, runner, requests)
    console.print(Rule("2b. The same with chunked prefill off: the long prompt waits"))
    chunking_off(console, engine, prompts, replies)
    console.print(Rule("2c. What a decode step reads, and a shared prefix read once"))
    what_a_step_reads(console, engine, prompts)
    console.print(Rule("2d. A budget from a target step time: a long prompt without a stall"))
    step_time_budget(console, engine, prompts)
    console.print(Rule("2e. A short request behind a long prompt; fair shares between tenants"))
    arrivals_behind_a_long_prompt(console, engine, prompts)
    bounds(console)
    console.print(Rule("3. A small pool: preemption, and the return from the cache"))
    preemption(console, engine, prompts, replies)
    console.print(Rule("4. Throughput: one after another, batched, batched with caching"))
    throughput(console, engine, step_times)
    console.print("\nExercise 6: the scheduler's shares, admission and preemption, in exercises/scheduler.py "
                  "(exercises/README.md).")


if __name__ == "__main__":
    main()
