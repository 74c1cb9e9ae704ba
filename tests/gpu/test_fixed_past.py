"""Stage 7's request over fixed buffers (engine/fixed_past.py), eagerly on a CPU as a GPU runs it
(there replayed as CUDA graphs): the same replies and pool as run_request over a DynamicCache,
padding never read, the rungs each pass is padded to, one request at a time in the buffers,
and the graphs, their calls faked here: each shape captured once and replayed after."""

import pytest
import torch

from engine import fixed_past
from engine.fixed_past import FixedPast, cache_lengths, suffix_lengths
from engine.one_request import generate, greedy_reference, run_request
from engine.request import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.model]

SYSTEM = list(range(300, 340))  # 40 tokens: 10 blocks of 4
PROMPTS = [SYSTEM + [41, 42], SYSTEM + [7] * 9, SYSTEM[:13] + [5, 6], list(range(600, 615)), [9]]


def replies(engine, prompts, max_tokens=6):
    return [generate(engine.parts, f"r{i}", p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]


def test_the_ladders():
    assert suffix_lengths() == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert cache_lengths(8192)[:3] == [16, 32, 64] and cache_lengths(8192)[-1] == 8192 and cache_lengths(16) == [16]


def test_requests_over_fixed_buffers_reply_as_over_a_dynamic_cache(make_engine, tiny_model):
    """MISS then HITs behind one system prompt, a short and a one-token prompt: the same tokens,
    cached counts and pool contents as stage 7's DynamicCache path, and greedy decoding's."""
    plain, fixed = make_engine(num_blocks=64), make_engine(num_blocks=64, static_decode=True)
    assert plain.parts.fixed is None and fixed.parts.fixed is not None and fixed.parts.fixed.graphs is None
    want, got = replies(plain, PROMPTS), replies(fixed, PROMPTS)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.cached_tokens for r in got] == [r.cached_tokens for r in want] and got[1].cached_tokens == 40
    for prompt, reply in zip(PROMPTS, got):
        assert reply.token_ids == greedy_reference(tiny_model, prompt, 6)
    assert torch.allclose(fixed.kv.data, plain.kv.data, rtol=1e-5, atol=3e-5)  # the same K/V written back


def test_each_pass_is_padded_to_its_rungs_and_longer_ones_run_at_their_own_shape(make_engine, monkeypatch):
    engine = make_engine(num_blocks=256, static_decode=True)
    shapes = []
    real = fixed_past.forward
    monkeypatch.setattr(fixed_past, "forward", lambda model, buffers, size, length, causal=False:
                        shapes.append((size, length, causal)) or real(model, buffers, size, length, causal))
    generate(engine.parts, "a", SYSTEM + [41, 42], SamplingParams(max_tokens=3))  # 42 new: 64 tokens over 64 slots
    generate(engine.parts, "b", SYSTEM + [7] * 9, SamplingParams(max_tokens=2))  # 40 cached, 9 new: 16 over 64
    long = list(range(1000, 1600))  # 600 new tokens from nothing: above the ladder (512), its own shape, causal
    generate(engine.parts, "c", long, SamplingParams(max_tokens=2))
    behind = long[:400] + list(range(2000, 2600))  # 400 cached (100 blocks), 600 new: its own shape, masked
    reply = generate(engine.parts, "d", behind, SamplingParams(max_tokens=2))
    assert reply.cached_tokens == 400 and reply.token_ids == greedy_reference(engine.model, behind, 2)
    # A pass from slot 0 as long as its slots runs plain causal (without graphs, as here; a graph
    # holds the masked pass), the others masked.
    assert shapes == [(64, 64, True), (1, 64, False), (1, 64, False), (16, 64, False), (1, 64, False),
                      (600, 600, True), (1, 1024, False), (600, 1000, False), (1, 1024, False)]


def test_padding_is_never_read(make_engine, tiny_model):
    """The buffers' slots past the request filled with keys and values far larger than any the
    model makes before each pass: the padded pass reads none of them (a masked slot's weight is
    exactly 0), and the reply is greedy decoding's. (Not NaN: 0 x NaN is NaN, and a slot there
    only ever holds K/V a pass computed, always finite.)"""
    engine = make_engine(num_blocks=64, static_decode=True)
    buffers, real = engine.parts.fixed, FixedPast.forward

    def poisoned(self, model, token_ids):
        buffers.kv[:, :, self.length:] = 1000.0
        return real(self, model, token_ids)

    FixedPast.forward = poisoned
    try:
        reply = generate(engine.parts, "a", SYSTEM[:11], SamplingParams(max_tokens=5))
    finally:
        FixedPast.forward = real
    assert reply.token_ids == greedy_reference(tiny_model, SYSTEM[:11], 5)


def test_one_request_at_a_time_holds_the_buffers_the_other_gets_a_dynamic_cache(make_engine, tiny_model):
    """Two of stage 7's requests interleaved token by token (as two callers' threads may): the
    first holds the buffers to its end, the second runs over a DynamicCache meanwhile, both
    exact; once both end, the next request gets the buffers again."""
    engine = make_engine(num_blocks=64, static_decode=True)
    params = SamplingParams(max_tokens=5)
    first = run_request(engine.parts, "first", PROMPTS[0], params, None, 0.0)
    second = run_request(engine.parts, "second", PROMPTS[3], params, None, 0.0)
    a, b = list(zip(first, second))[-1]
    assert a.generation.token_ids == greedy_reference(tiny_model, PROMPTS[0], 5)
    assert b.generation.token_ids == greedy_reference(tiny_model, PROMPTS[3], 5)
    del first, second
    assert isinstance(engine.parts.fixed.fill([]), FixedPast)


def test_each_shape_is_captured_once_and_replayed_after(make_engine, monkeypatch, fake_graphs):
    """With torch's graph calls faked: a new (tokens, slots) runs a warm-up pass and a captured
    one, a later pass of it only replays, and the reply takes the replayed logits."""
    engine = make_engine(num_blocks=64, static_decode=True)
    buffers = engine.parts.fixed
    buffers.graphs = fixed_past.Graphs(lambda size, length: fixed_past.forward(engine.model, buffers, size, length), 1,
                                       "stage 7's pass")
    passes = []
    real = fixed_past.forward
    monkeypatch.setattr(fixed_past, "forward", lambda *args, **kwargs: passes.append(args[2:]) or real(*args, **kwargs))
    generate(engine.parts, "a", SYSTEM[:9], SamplingParams(max_tokens=4))  # 9 new: (16, 16); decodes (1, 16)
    assert [shape for shape, _ in buffers.graphs.captures] == [(16, 16), (1, 16)]
    assert passes == [(16, 16), (16, 16), (1, 16), (1, 16)]  # warm-up and capture of each, no pass for a replay
    assert [graph.replays for graph in fake_graphs] == [1, 3]


def test_warm_up_captures_every_pass_of_a_short_request_and_every_decode(make_engine, monkeypatch, caplog,
                                                                             fake_graphs):
    """With torch's graph calls faked, an engine whose stage 7 runs graphs: warm_up captures
    each (tokens, slots) with slots up to START_SLOTS and each decode (1, slots), says how long
    it took, and a request within those then captures nothing while it runs."""
    monkeypatch.setattr(fixed_past, "START_SLOTS", 64)
    engine = make_engine(num_blocks=64, static_decode=True)  # 256 slots: slots of 16, 32, 64, 128, 256
    buffers = engine.parts.fixed
    buffers.graphs = fixed_past.Graphs(lambda size, length: fixed_past.forward(engine.model, buffers, size, length), 1,
                                       "stage 7's pass")
    with caplog.at_level("INFO", logger="engine"):
        engine.warm_up()
    shapes = [shape for shape, _ in buffers.graphs.captures]
    want = [(s, n) for n in (16, 32, 64) for s in (1, 2, 4, 8, 16, 32, 64) if s <= n] + [(1, 128), (1, 256)]
    assert sorted(shapes) == sorted(want)
    assert any(f"captured {len(want)} shapes of stage 7's pass" in r.getMessage() for r in caplog.records)
    assert engine.allocator.num_free_blocks == 64 and engine.allocator.num_cached_blocks == 0
    reply = generate(engine.parts, "a", SYSTEM[:30], SamplingParams(max_tokens=3))  # 30 tokens: (32, 32), decodes
    assert len(buffers.graphs.captures) == len(want) and reply.cached_tokens == 0
