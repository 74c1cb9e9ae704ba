"""Chunked prefill changes when a prompt's tokens are computed, never what the model says:
every request's greedy tokens equal plain Hugging Face generate on its prompt alone, at any
budget, with chunks that end inside a block or on its edge, several requests' chunks in one
step, a request preempted part-way through its prompt, and a prefix hit that ends inside a
chunk. The real default model in float32 for fixed cases; random cases on the tiny model in
float64, where summation order cannot flip a near-tie between two tokens.
"""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine
from engine.batch_engine import BatchRunner
from engine.one_request import greedy_reference
from engine.request import SamplingParams
from helpers import assert_pool_whole

TEXT = ("Prefix caching keeps the keys and values of a prompt in blocks, so that the next request "
        "which starts with the same tokens can skip computing them again and go straight to its own part.")


def real_prompts(tokenizer) -> list[list[int]]:
    first = tokenizer.encode(TEXT)  # 37 tokens
    return [
        first,
        first[:32] + tokenizer.encode(" A second question reuses two blocks of the first."),  # hit ends mid-chunk
        tokenizer.encode("A short one."),
    ]


@pytest.mark.parametrize("budget", [3, 7, 16, 40])  # 16: chunks on block edges; the others inside blocks
def test_chunked_prefill_on_the_real_model_equals_generate_on_each_prompt_alone(smollm, budget):
    prompts = real_prompts(smollm.tokenizer)
    expected = [greedy_reference(smollm.model, p, 5) for p in prompts]
    assert smollm.allocator.reset_prefix_cache()  # cold: nothing left by an earlier test
    runner = BatchRunner(smollm.parts, max_num_seqs=3, max_num_batched_tokens=budget)
    requests = [runner.add(f"r{i}", p, SamplingParams(max_tokens=5), None) for i, p in enumerate(prompts)]
    chunks, shared_steps = [], []
    while runner.scheduler.has_work():
        runner.step()
        scheduled = runner.last_plan.scheduled
        chunks += [(s.request.request_id, s.start, s.end) for s in scheduled if s.is_prefill]
        shared_steps.append(sum(s.is_prefill for s in scheduled) > 1)
    assert [r.reply.token_ids for r in requests] == expected
    assert_pool_whole(smollm)
    if budget < len(prompts[0]):
        assert any(end < len(prompts[0]) for rid, _, end in chunks if rid == "r0"), "r0 was chunked"
    else:  # r0 whole, then r1 admitted in the same step: it hits r0's 2 blocks written in it, and its chunk stops at 40
        assert chunks[:2] == [("r0", 0, 37), ("r1", 32, 35)] and shared_steps[0]
    assert requests[1].num_cached_tokens == 32  # r0's first two blocks, written before or while r1 came in


def test_a_request_preempted_part_way_through_its_prompt_resumes_exactly(smollm):
    # 80 slots. The runner below brings its own budget: a fixed one here spares the engine's calibration.
    engine = Engine(model=smollm.model, tokenizer=smollm.tokenizer, num_blocks=5, max_num_batched_tokens=2048)
    long_ids = smollm.tokenizer.encode(TEXT)  # 37 tokens
    other_ids = smollm.tokenizer.encode("Count to twenty: one, two, three, four, five, six, seven, eight, nine, ten, "
                                        "eleven, twelve,")  # 28 tokens
    runner = BatchRunner(engine.parts, max_num_seqs=2, max_num_batched_tokens=4)
    mid_prompt = []
    preempt = runner.scheduler._preempt

    def record(request):
        mid_prompt.append(request.num_computed_tokens < len(request.prompt_ids))
        preempt(request)

    runner.scheduler._preempt = record
    # other decodes 30 tokens while long's prompt comes in 3 tokens a step: the pool (5 blocks
    # of 16) runs out before long's prompt is done, and long, admitted last, is preempted.
    requests = [runner.add("other", other_ids, SamplingParams(max_tokens=30), None),
                runner.add("long", long_ids, SamplingParams(max_tokens=4), None)]
    replies = runner.run(requests)
    assert True in mid_prompt, "long should be preempted while its prompt was still prefilling"
    assert replies[0].token_ids == greedy_reference(engine.model, other_ids, 30)
    assert replies[1].token_ids == greedy_reference(engine.model, long_ids, 4)
    assert_pool_whole(engine)


# --- random budgets and chunk shapes on the tiny model, in float64 -------------------------------


@pytest.fixture(scope="module")
def tiny_float64(tiny_model):
    return copy.deepcopy(tiny_model).to(torch.float64)


PIECES = [list(range(100, 113)), list(range(100, 108)) + [7, 8], [5] * 9, list(range(300, 321)), [42]]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.tuples(st.integers(0, len(PIECES) - 1), st.lists(st.integers(0, 500), max_size=6)),
                      min_size=1, max_size=5),
       max_seqs=st.integers(1, 4), extra=st.integers(0, 30), block_size=st.sampled_from([1, 4, 16]),
       num_blocks=st.integers(40, 80), chunked=st.booleans())
def test_random_budgets_and_chunks_equal_generate_on_each_prompt_alone(
        tiny_float64, tokenizer, picks, max_seqs, extra, block_size, num_blocks, chunked):
    if num_blocks * block_size < 48:
        num_blocks = -(-48 // block_size)  # every prompt fits with its reply
    # The runner below brings its own budget: the engine's own (a fixed one, not calibrated) never runs.
    engine = Engine(model=tiny_float64, tokenizer=tokenizer, block_size=block_size, num_blocks=num_blocks,
                    max_num_batched_tokens=2048)
    prompts = [PIECES[i] + tail for i, tail in picks]
    runner = BatchRunner(engine.parts, max_num_seqs=max_seqs, max_num_batched_tokens=max_seqs + extra,
                         enable_chunked_prefill=chunked)
    requests = [runner.add(f"r{i}", p, SamplingParams(max_tokens=4), None) for i, p in enumerate(prompts)]
    replies = runner.run(requests)
    for prompt, reply in zip(prompts, replies):
        assert reply.token_ids == greedy_reference(tiny_float64, prompt, 4)
    assert_pool_whole(engine)
