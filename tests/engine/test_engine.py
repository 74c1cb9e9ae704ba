"""The engine's spec: prefix caching changes how much the model computes, never what it says.

The oracle is plain Hugging Face: model.generate(do_sample=False) on the whole prompt, and a
full forward pass. Most tests use the tiny random model of conftest.py, in float32.
"""


import copy
import math
from dataclasses import fields, replace

import pytest
import torch

from allocator import OutOfBlocksError
from engine import one_request
from engine import Engine, EngineClosedError, EngineConfig
from engine.kv_pool import PagedKVPool
from engine.one_request import greedy_reference
from engine.request import SamplingParams
from engine.sampling import sample
from helpers import EmbeddingCounter, assert_pool_whole, wait_until_idle

PROMPTS = {
    "token ids": list(range(100, 123)),  # 23 tokens: 5 full blocks of 4 and a partial one
    "text": "Prefix caching keeps the key and value tensors of a shared prompt around.",
    "chat": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why reuse the KV cache?"},
    ],
}


# --- exactness against the oracle ----------------------------------------------------------


@pytest.mark.parametrize("kind", PROMPTS)
def test_greedy_equals_hf_generate_cold_and_warm(make_engine, kind):
    engine = make_engine()
    ids = engine.tokenize(PROMPTS[kind])
    expected = greedy_reference(engine.model, ids, max_tokens=10)

    cold = engine.generate(PROMPTS[kind], max_tokens=10)
    predicted = engine.allocator.peek(ids)  # what the allocator will hit for the same prompt now
    warm = engine.generate(PROMPTS[kind], max_tokens=10)

    assert cold.token_ids == warm.token_ids == expected
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == predicted == (len(ids) - 1) // 4 * 4
    assert warm.text == cold.text == engine.tokenizer.decode(expected, skip_special_tokens=True)
    assert warm.prompt_tokens == len(ids) and warm.finish_reason == "length"


def test_logits_of_cached_prefix_plus_suffix_equal_a_full_forward(make_engine):
    engine = make_engine()
    shared = list(range(200, 216))  # 4 full blocks
    engine.generate(shared + [7, 8, 9], max_tokens=1)  # leaves the shared blocks in the pool
    prompt = shared + [300, 301, 302, 303, 304]

    alloc = engine.allocator
    num_cached, _ = alloc.allocate_with_prefix("probe", prompt)
    try:
        cache = engine.kv.gather(alloc.block_tables["probe"][: num_cached // 4], engine.model.config)
        with torch.no_grad():
            cached = engine.model(torch.tensor([prompt[num_cached:]]), past_key_values=cache).logits
            full = engine.model(torch.tensor([prompt])).logits
    finally:
        alloc.free("probe")
    assert num_cached == 16
    torch.testing.assert_close(cached[0], full[0, num_cached:], atol=1e-5, rtol=1e-5)


def test_the_model_embeds_only_the_uncached_suffix(make_engine):
    engine = make_engine()
    counter = EmbeddingCounter(engine.model)
    try:
        prompt = list(range(400, 430))  # 30 tokens
        engine.generate(prompt, max_tokens=5)
        cold_count, counter.count = counter.count, 0
        warm = engine.generate(prompt[:28] + [999, 998], max_tokens=5)
    finally:
        counter.handle.remove()
    # The prompt's uncached tokens once, then each generated token but the last.
    assert cold_count == 30 + 4
    assert warm.cached_tokens == 28 and counter.count == 2 + 4


def test_a_multi_turn_chat_reuses_its_history(make_engine):
    engine = make_engine(num_blocks=128)
    system = {"role": "system", "content": "You are a terse assistant for a bike rental shop."}
    turn1 = [system, {"role": "user", "content": "When do you open?"}]
    first = engine.generate(turn1, max_tokens=8)
    turn2 = turn1 + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And on Sundays?"},
    ]
    ids = engine.tokenize(turn2)
    predicted = engine.allocator.peek(ids)
    second = engine.generate(turn2, max_tokens=8)

    assert second.token_ids == greedy_reference(engine.model, ids, max_tokens=8)
    assert second.cached_tokens == predicted
    assert second.cached_tokens >= len(engine.tokenize(turn1)) // 4 * 4  # at least turn 1's full blocks


def test_different_cache_salts_never_share_blocks(make_engine):
    engine = make_engine()
    prompt = list(range(500, 520))
    a = engine.generate(prompt, max_tokens=4, cache_salt="tenant-a")
    b = engine.generate(prompt, max_tokens=4, cache_salt="tenant-b")
    a_again = engine.generate(prompt, max_tokens=4, cache_salt="tenant-a")
    assert (a.cached_tokens, b.cached_tokens, a_again.cached_tokens) == (0, 0, 16)
    assert a.token_ids == b.token_ids == a_again.token_ids == greedy_reference(engine.model, prompt, 4)


def test_a_prompt_of_exactly_whole_blocks_recomputes_its_last_block(make_engine):
    engine = make_engine()
    prompt = list(range(600, 612))  # 3 blocks of 4
    engine.generate(prompt, max_tokens=3)
    warm = engine.generate(prompt, max_tokens=3)
    # The model must run on at least one token to give the next token's logits.
    assert warm.cached_tokens == 8
    assert warm.token_ids == greedy_reference(engine.model, prompt, 3)


def test_a_small_pool_evicts_between_requests_and_stays_exact(make_engine):
    engine = make_engine(num_blocks=12)  # 48 slots: room for about two 20-token requests
    prompts = [[1000 + 50 * p + i for i in range(18)] for p in range(4)]
    for prompt in prompts + prompts:
        assert engine.generate(prompt, max_tokens=4).token_ids == greedy_reference(engine.model, prompt, 4)
    assert engine.allocator.stats.evictions > 0


def test_blocks_filled_while_decoding_are_hit_by_the_next_request(make_engine):
    engine = make_engine()
    prompt = list(range(700, 710))
    first = engine.generate(prompt, max_tokens=8)
    # The first request decoded 7 tokens into its blocks; a prompt that continues its reply hits them.
    follow_up = prompt + first.token_ids[:7] + [42]
    second = engine.generate(follow_up, max_tokens=3)
    assert second.cached_tokens == 16
    assert second.token_ids == greedy_reference(engine.model, follow_up, 3)


def test_the_stop_token_ends_a_reply_with_finish_reason_stop(make_engine):
    engine = make_engine()
    prompt = list(range(800, 810))
    greedy = engine.generate(prompt, max_tokens=6).token_ids
    engine.parts = replace(engine.parts, stop_token_ids=frozenset({greedy[2]}))  # pretend the third token is EOS
    reply = engine.generate(prompt, max_tokens=6)
    assert reply.token_ids == greedy[:3] and reply.finish_reason == "stop"


# --- streaming, several requests, sampling -------------------------------------------------


def test_two_interleaved_streams_share_blocks_by_ref_count(make_engine):
    engine = make_engine()
    shared = list(range(900, 912))
    a_prompt, b_prompt = shared + [1, 2, 3], shared + [4, 5]
    a = engine.stream(a_prompt, max_tokens=6)
    b = engine.stream(b_prompt, max_tokens=6)
    a_tokens, b_tokens = [next(a).token_id], [next(b).token_id]  # both now hold their blocks
    shared_blocks = engine.allocator.block_tables["request-1"][:3]
    assert shared_blocks == engine.allocator.block_tables["request-0"][:3]
    assert [engine.allocator.ref_count(block) for block in shared_blocks] == [2, 2, 2]
    for a_event, b_event in zip(a, b):
        a_tokens.append(a_event.token_id)
        b_tokens.append(b_event.token_id)
    assert a_tokens == greedy_reference(engine.model, a_prompt, 6)
    assert b_tokens == greedy_reference(engine.model, b_prompt, 6)


def test_closing_a_stream_early_gives_its_blocks_back(make_engine):
    engine = make_engine()
    stream = engine.stream(list(range(30)), max_tokens=200)
    next(stream), next(stream)
    stream.close()  # what a server does when the client disconnects
    wait_until_idle(engine)  # the loop frees a cancelled request before its next step


def test_stage_7_gives_a_sampled_token_to_the_allocator_only_when_its_kv_is_computed(make_engine):
    engine = make_engine()
    stream = one_request.run_request(engine.parts, "r", list(range(30)), SamplingParams(max_tokens=20), None, 0.0)
    next(stream), next(stream)
    # Two tokens seen, one fed back: the second joins the allocator only when its K/V is computed.
    assert engine.allocator.num_tokens("r") == 30 + 1
    stream.close()
    assert_pool_whole(engine)


def test_streamed_text_adds_up_to_the_reply(make_engine):
    engine = make_engine()
    events = list(engine.stream(PROMPTS["chat"], max_tokens=12))
    reply = events[-1].generation
    assert "".join(e.text for e in events) == reply.text
    assert [e.token_id for e in events] == reply.token_ids
    assert [e.finish_reason for e in events] == [None] * 11 + ["length"]


def test_sampling_with_a_seed_repeats_and_a_tiny_top_p_is_greedy(make_engine):
    engine = make_engine()
    prompt = list(range(40, 60))
    one = engine.generate(prompt, max_tokens=8, temperature=1.5, seed=7)
    two = engine.generate(prompt, max_tokens=8, temperature=1.5, seed=7)
    assert one.token_ids == two.token_ids
    narrow = engine.generate(prompt, max_tokens=8, temperature=1.5, top_p=1e-6, seed=3)
    assert narrow.token_ids == greedy_reference(engine.model, prompt, 8)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen = {sample(logits, SamplingParams(temperature=1.0, top_p=0.8), torch.Generator().manual_seed(s)) for s in range(200)}
    assert seen == {0, 1}


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-300), SamplingParams(temperature=1e-6),
                                    SamplingParams(temperature=1.0, top_p=1e-300)])
def test_extreme_temperatures_and_top_p_fall_back_to_greedy_instead_of_nan(params):
    logits = torch.tensor([0.1, 2.0, 0.3, 1.9])
    assert {sample(logits, params, torch.Generator().manual_seed(s)) for s in range(20)} == {1}


# --- the pool ------------------------------------------------------------------------------


def test_the_pool_gives_back_what_was_written_in_block_table_order():
    kv = PagedKVPool(num_layers=2, num_kv_heads=3, head_dim=4, num_blocks=6, block_size=2)
    keys = [torch.randn(1, 3, 5, 4) for _ in range(2)]
    values = [torch.randn(1, 3, 5, 4) for _ in range(2)]
    table = [4, 1, 3]  # 5 tokens: 2 + 2 + 1
    kv.write(list(zip(keys, values)), table, 0, 5)
    cache = kv.gather([4, 1], config=None)
    for layer in range(2):
        assert torch.equal(cache.layers[layer].keys, keys[layer][:, :, :4])
        assert torch.equal(cache.layers[layer].values, values[layer][:, :, :4])


def test_engine_shapes_its_pool_from_the_model(make_engine):
    engine = make_engine(num_blocks=10)
    assert tuple(engine.kv.data.shape) == (2, 2, 10, 4, 2, 16)  # layers, K/V, blocks, slots, KV heads, dim
    assert "10 blocks x 4 slots" in str(engine.kv)


# --- errors teach, and leak nothing --------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        ("", {}, "empty"),
        ([], {}, "non-empty"),
        ([5, -1], {}, r"\[0, 49152\)"),
        ([49152], {}, r"\[0, 49152\)"),
        ([{"role": "user"}], {}, "content"),
        ([1, "two"], {}, "role"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"temperature": -1}, "temperature"),
        ("hi", {"top_p": 0}, "top_p"),
        ("hi", {"temperature": float("inf")}, "finite"),
        ("hi", {"temperature": float("nan")}, "finite"),
        ("hi", {"temperature": True}, "temperature"),
        ("hi", {"seed": 1.5}, "seed"),
        ("hi", {"seed": 2**63}, r"2\*\*63"),
        ("hi", {"seed": -1}, "seed"),
        (list(range(300)), {"max_tokens": 10}, "num_blocks"),  # more than the whole pool
        (list(range(300)), {"max_tokens": 800}, "context"),  # more than the model's 1,024 positions
        ("hi", {"temperature": 10**400}, "too large"),  # an int no float can hold
        ("hi", {"top_p": 10**400}, "too large"),
        ("hi", {"cache_salt": 123}, "cache_salt"),
        ("hi", {"cache_salt": "x" * 129}, "at most 128"),
        ("hi", {"cache_salt": "a/b"}, "'/'"),
        ("hi", {"cache_salt": "\ud800"}, "surrogate"),
        ("hi", {"request_id": 123}, "request_id"),
        ("hi", {"request_id": ""}, "request_id"),
        ("hi", {"stop": 5}, "stop"),
        ("hi", {"stop": ["ok", ""]}, "stop"),
        ("hi", {"stop": ["\ud800"]}, "surrogate"),
        ("hi", {"params": "greedy"}, "SamplingParams"),
        ("hi", {"params": SamplingParams(max_tokens=2), "max_tokens": 3}, "not both"),
        ("bad \ud800 text", {}, "surrogate"),
        ([{"role": "user", "content": "\udfff"}], {}, "surrogate"),
        ([{"role": "robot", "content": "beep"}], {}, "unknown chat role"),
    ],
)
def test_bad_requests_raise_value_error_at_the_call_before_anything_runs(make_engine, prompt, kwargs, match):
    engine = make_engine()
    calls = []
    hook = engine.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            engine.stream(prompt, **kwargs)  # the call itself raises: no next() needed
    finally:
        hook.remove()  # the tiny model is shared by the whole session
    assert calls == [] and engine.allocator.stats.requests == 0


def test_a_request_id_still_running_is_refused_at_the_call(make_engine):
    engine = make_engine()
    running = engine.stream("one", request_id="lesson", max_tokens=200)
    next(running)
    with pytest.raises(ValueError, match="already running"):
        engine.stream("two", request_id="lesson")
    running.close()
    wait_until_idle(engine)
    assert engine.generate("two", request_id="lesson", max_tokens=2).request_id == "lesson"  # free again


def test_a_huge_int_temperature_samples_like_its_float(make_engine):
    engine = make_engine()
    prompt = list(range(40, 50))
    as_int = engine.generate(prompt, max_tokens=4, temperature=2**64, seed=1)
    as_float = engine.generate(prompt, max_tokens=4, temperature=float(2**64), seed=1)
    assert as_int.token_ids == as_float.token_ids


# --- stop strings ---------------------------------------------------------------------------


def test_a_stop_string_ends_the_reply_before_it(make_engine):
    engine = make_engine()
    prompt = PROMPTS["chat"]
    full = engine.generate(prompt, max_tokens=24)
    stop = full.text[10:13]  # three characters from the middle of the greedy reply
    cut = full.text.index(stop)
    reply = engine.generate(prompt, max_tokens=24, stop=["never appears", stop])
    assert reply.text == full.text[:cut] and reply.finish_reason == "stop"
    assert reply.token_ids == full.token_ids[: len(reply.token_ids)] and len(reply.token_ids) < 24


def test_streamed_text_holds_back_what_could_start_a_stop_string(make_engine):
    engine = make_engine()
    prompt = PROMPTS["chat"]
    full = engine.generate(prompt, max_tokens=24)
    # A point where a token ends, so without holding back some event would end right there.
    ends = [len(engine.tokenizer.decode(full.token_ids[:k], skip_special_tokens=True)) for k in range(1, 24)]
    end = next(e for e in ends if e >= 8)
    start_of_stop = full.text[end - 3 : end]
    events = list(engine.stream(prompt, max_tokens=24, stop=start_of_stop + "\u2603"))  # never matches whole
    assert events[-1].generation.text == full.text and events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == full.text
    shown = ""
    for event in events[:-1]:
        shown += event.text
        assert not shown.endswith(start_of_stop), "text that could begin the stop string was sent early"


def test_stage_7_on_a_full_pool_raises_out_of_blocks_and_nothing_leaks(make_engine):
    # The engine loop makes such a request wait (test_batching.py); stage 7's path refuses it.
    engine = make_engine(num_blocks=8)
    two = SamplingParams(max_tokens=2)
    holder = one_request.run_request(engine.parts, "holder", list(range(20)), two, None, 0.0)  # 5 blocks
    next(holder)
    with pytest.raises(OutOfBlocksError, match="blocks"):
        one_request.generate(engine.parts, "other", list(range(50, 70)), two)  # 5 more
    assert list(holder)[-1].generation.finish_reason == "length"
    assert_pool_whole(engine)


@pytest.mark.parametrize("fail_at_call", [1, 3], ids=["prefill", "decode"])
def test_a_stage_7_request_failing_midway_frees_its_blocks_and_caches_no_unwritten_slot(make_engine, monkeypatch,
                                                                                       fail_at_call):
    engine = make_engine()
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks; the 4th fills while decoding
    real_forward, calls = one_request.forward, []

    def flaky_forward(model, token_ids, cache):
        calls.append(len(token_ids))
        if len(calls) == fail_at_call:
            raise RuntimeError("the GPU fell over")
        return real_forward(model, token_ids, cache)

    monkeypatch.setattr(one_request, "forward", flaky_forward)
    with pytest.raises(RuntimeError, match="fell over"):
        one_request.generate(engine.parts, "r", prompt, SamplingParams(max_tokens=8))
    assert_pool_whole(engine)

    monkeypatch.undo()
    # Blocks whose K/V were written stay cached; a block cached just before the failure does not.
    # prefill: nothing was written. decode: tokens 0..14 were; the block of tokens 12..15 was
    # cached when token 15 joined, then the forward for token 15 failed.
    expected = greedy_reference(engine.model, prompt, 8)
    assert engine.allocator.peek(prompt + expected[:2] + [5]) == {1: 0, 3: 12}[fail_at_call]
    assert engine.generate(prompt, max_tokens=8).token_ids == expected


def test_a_memory_budget_sizes_the_pool_in_whole_blocks(make_engine):
    # tiny model: 2 layers x K,V x 2 KV heads x 16 dims x 4 bytes = 512 bytes a slot, 2 KiB a block of 4
    assert make_engine(num_blocks=None, kv_memory_gb=100 * 2048 / 2**30).allocator.num_blocks == 100
    assert make_engine(num_blocks=None, kv_memory_gb=100.5 * 2048 / 2**30).allocator.num_blocks == 100
    with pytest.raises(ValueError, match="less than one block"):
        make_engine(num_blocks=None, kv_memory_gb=1e-9)


# Every EngineConfig field, with a value of the wrong type and one of the right type out of range.
WRONG_CONFIG = {
    "block_size": ["16", 0], "num_blocks": [64.0, -1], "kv_memory_gb": ["1", math.inf], "enable_caching": ["False", 0],
    "hash_algo": [b"sha256", "md5"], "free_uncached_first": ["no", None],
    "max_num_seqs": [True, 0], "max_num_batched_tokens": [2048.0, 0], "target_step_ms": ["400", math.nan],
    "enable_chunked_prefill": ["yes", None], "cascade_attention": [1, None], "choose_threads": ["True", None],
    "fair_share": [[], None], "static_decode": ["auto", 0],
}


def test_every_config_field_is_checked_by_type_and_range_when_made():
    assert WRONG_CONFIG.keys() == {f.name for f in fields(EngineConfig)}, "a new field needs its wrong values here"
    for name, values in WRONG_CONFIG.items():
        for value in values:
            with pytest.raises(ValueError, match=f"^{name} must be"):
                EngineConfig(**{name: value})
    EngineConfig(block_size=4, num_blocks=8, static_decode=None, hash_algo="xxhash")  # the right kinds


def test_batching_is_no_option_and_the_error_names_stage_7s_path(tiny_model, tokenizer):
    with pytest.raises(TypeError, match=r"one engine loop .* one_request.generate\(engine.parts"):
        Engine(model=tiny_model, tokenizer=tokenizer, batching=False)


def test_engine_arguments_are_checked(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="both"):
        Engine(model=tiny_model)
    with pytest.raises(TypeError, match="unknown option 'block_sise'; an Engine takes block_size"):
        Engine(model=tiny_model, tokenizer=tokenizer, block_sise=4)
    with pytest.raises(ValueError, match="target_step_ms must be a number"):
        Engine(model=tiny_model, tokenizer=tokenizer, config=EngineConfig(), target_step_ms=-5)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(max_num_batched_tokens=512, target_step_ms=100)
    with pytest.raises(ValueError, match="model.to"):
        Engine(model=tiny_model, tokenizer=tokenizer, dtype="bf16")
    with pytest.raises(ValueError, match="not both"):
        Engine(model=tiny_model, tokenizer=tokenizer, num_blocks=4, kv_memory_gb=1)
    with pytest.raises(ValueError, match="dtype must be one of"):
        Engine("anything", dtype="float8")


def test_messages_a_chat_template_refuses_are_a_value_error_naming_the_prompt(tiny_model, tokenizer):
    """Some models' templates raise on roles they do not take (a system turn, roles out of
    order): that is the caller's input, refused like any other, before anything runs."""
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'developer' %}"
                            "{{ raise_exception('no developer turns here') }}{% endif %}{{ m['content'] }}{% endfor %}")
    engine = Engine(model=tiny_model, tokenizer=strict, block_size=4, num_blocks=16)
    ok = [{"role": "user", "content": "Hi"}]
    refused = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="chat template refused the messages: no developer turns here"):
        engine.generate(refused, max_tokens=2)
    with pytest.raises(ValueError, match="refused prompt 1: no developer turns here"):
        engine.generate_batch([ok, refused], max_tokens=2)
    assert_pool_whole(engine)
    assert engine.generate(ok, max_tokens=2).finish_reason == "length"


def test_a_model_that_cannot_be_loaded_names_the_offline_default():
    with pytest.raises(OSError, match="SmolLM2-135M-Instruct"):
        Engine("/no/such/model-dir")


# --- the real default model ----------------------------------------------------------------


def test_default_model_answers_like_hf_generate_and_a_warm_request_hits(smollm):
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    ids = smollm.tokenize(messages)
    cold = smollm.generate(messages, max_tokens=12)
    assert cold.token_ids == greedy_reference(smollm.model, ids, 12)
    assert "Paris" in cold.text

    messages[-1]["content"] = "What is the capital of Italy?"
    warm_ids = smollm.tokenize(messages)
    shared = next(i for i, (a, b) in enumerate(zip(ids, warm_ids)) if a != b)  # up to "France"/"Italy"
    warm = smollm.generate(messages, max_tokens=12)
    assert warm.cached_tokens == shared // 16 * 16 > 0  # every full block before the first difference
    assert warm.token_ids == greedy_reference(smollm.model, warm_ids, 12)


# --- the demo and the benchmark, run on the tiny model -------------------------------------




def test_a_sampling_argument_with_a_wrong_name_is_a_type_error_naming_the_right_ones(make_engine):
    engine = make_engine()
    with pytest.raises(TypeError, match="unknown argument 'max_new_tokens'; a request's sampling takes max_tokens"):
        engine.generate("hi", max_new_tokens=3)
    assert engine.allocator.stats.requests == 0


def test_a_closed_engine_refuses_every_call_and_one_config_makes_the_same_engine(tiny_model, tokenizer):
    config = EngineConfig(block_size=4, num_blocks=32, max_num_batched_tokens=64)
    engine = Engine(model=tiny_model, tokenizer=tokenizer, config=config)
    by_keywords = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=32, max_num_batched_tokens=64)
    assert engine.config == by_keywords.config and engine.scheduler_options["max_num_batched_tokens"] == 64
    params = SamplingParams(max_tokens=4)
    assert engine.generate([1, 2, 3], params).token_ids == by_keywords.generate([1, 2, 3], max_tokens=4).token_ids
    engine.close()
    assert engine.closed
    for call in (lambda: engine.generate([1, 2, 3], params), lambda: engine.generate_batch([[1, 2]]),
                 lambda: engine.allocator):
        with pytest.raises(EngineClosedError, match="make a new one"):
            call()
