"""
Stage 7's request with fixed shapes: its past_key_values in buffers allocated once, its passes
padded to a ladder, what a CUDA graph can capture and replay.

Read engine/one_request.py first (run_request: gather, forward, write), then
engine/static_decode.py (the batched decode step with fixed shapes) and engine/cuda_graphs.py.

On a GPU a small model's pass costs its kernel launches, hundreds of them, whatever its length:
on an H200 one decode token of stage 7's path took 19.4 ms, the batched decode step replayed as
a graph 3.8 (docs/measured.md, On a GPU). A graph needs fixed addresses and shapes, and stage
7's past_key_values is a DynamicCache that grows by a token each pass. So where the engine keeps
a FixedBuffers (on a GPU; forced on a CPU for the tests), one_request.gather hands run_request a
FixedPast instead: the same request, its hit blocks copied into buffers of the model's whole
length, and one_request.forward runs the FixedPast's pass:

    the new tokens       padded to a rung of suffix_lengths (1, 2, 4, ... 512), their positions after
                         the cached ones; padding sits after the real tokens, so no real token reads it
    attention            over the first L slots of the buffers (L a rung of cache_lengths, at least the
                         context), each token its slots up to its own position: the past_key_values a
                         DynamicCache would hold, and the slots after them masked
    the logits           of the last real token only (logits_to_keep)

Each (tokens, L) is captured once as a CUDA graph and replayed after (engine/cuda_graphs.py):
Engine.warm_up captures every pass of a request up to START_SLOTS tokens and every decode
token (capture_at_start, its time logged), the others when they first come; a pass above the
ladders runs the same attention eagerly at its own shape. A single StaticCache
of the model's whole length would make every pass attend over all of it; the ladder of L keeps
a pass within twice its context and padding. PagedKVPool.write copies the new K/V from the buffers into the
pool, as it does from a DynamicCache (FixedPast yields each layer's K and V in its layout).

One request holds the buffers at a time: while one FixedPast is alive, gather gives another
request a DynamicCache (run_request's steps hold the engine's lock, but a request's tokens
interleave with another's between them).

References: transformers' StaticCache (cache_utils.py: fixed-size K/V per layer, made for
torch.compile's CUDA graphs); vLLM's capture sizes (vllm/config/vllm.py, _set_cudagraph_sizes).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from engine.batch_attention import use_pool_attention
from engine.cuda_graphs import Graphs
from engine.kv_pool import PagedKVPool
from engine.static_decode import padded_to

MAX_SUFFIX = 512  # the longest pass padded and graphed; a longer prefill runs at its own shape
START_SLOTS = 1024  # graphs captured before any request: every pass of a request this long, and every decode


def suffix_lengths(max_suffix: int = MAX_SUFFIX) -> list[int]:
    """New tokens a pass is padded to: powers of two up to max_suffix.

    >>> suffix_lengths(16)
    [1, 2, 4, 8, 16]
    """
    return [1 << i for i in range(max_suffix.bit_length()) if 1 << i <= max_suffix]


def cache_lengths(max_len: int) -> list[int]:
    """Slots a pass attends over: powers of two from 16, max_len the last.

    >>> cache_lengths(100)
    [16, 32, 64, 100]
    """
    return [1 << i for i in range(4, max_len.bit_length()) if 1 << i < max_len] + [max_len]


class FixedBuffers:
    """One request's K/V and a pass's inputs, allocated once (by the first request), and the
    graphs of its passes.

        kv          (layers, K/V, max_len, kv heads, dim)   token t's K/V at slot t
        input_ids   (max_len,)      a pass's tokens, padded
        positions   (max_len,)      their places in the request
        last        (1,)            the last real token's index in the pass: its logits are kept

    graphs: on a GPU, the padded pass per (tokens, L); None on a CPU (the pass runs eagerly).
    """

    def __init__(self, model, pool: PagedKVPool, max_len: int, graphs: bool):
        self.model, self.pool, self.max_len = model, pool, max_len
        self.kv = self.input_ids = self.positions = self.last = None  # allocated by the first request (allocate)
        self.suffixes, self.lengths = suffix_lengths(), cache_lengths(max_len)
        self.graphs = Graphs(lambda size, length: forward(model, self, size, length), 1,
                             "stage 7's pass of (tokens, slots)") if graphs else None
        self.holder: weakref.ref | None = None  # the FixedPast using the buffers
        use_pool_attention(model)

    def allocate(self) -> None:
        """The buffers, the first time a request (or the warm-up) needs them: an engine that
        serves only through its loop (server.py) never holds K/V of the model's length twice."""
        if self.kv is not None:
            return
        pool, device = self.pool, self.pool.device
        self.kv = torch.zeros(pool.num_layers, 2, self.max_len, pool.num_kv_heads, pool.head_dim, dtype=pool.dtype,
                              device=device)
        self.input_ids = torch.zeros(self.max_len, dtype=torch.long, device=device)  # a pass above the ladder too
        self.positions = torch.zeros(self.max_len, dtype=torch.long, device=device)
        self.last = torch.zeros(1, dtype=torch.long, device=device)

    def fill(self, block_ids: list[int]) -> FixedPast | None:
        """The buffers holding `block_ids`' K/V at slots 0.., for a new request; None while
        another request's FixedPast still holds them."""
        if self.holder is not None and self.holder() is not None:
            return None
        num_cached = len(block_ids) * self.pool.block_size
        if num_cached > self.max_len:
            return None
        self.allocate()
        if block_ids:  # (layers, K/V, 1, kv heads, tokens, dim) -> (layers, K/V, tokens, kv heads, dim)
            self.kv[:, :, :num_cached].copy_(self.pool.tokens_of(block_ids)[:, :, 0].transpose(2, 3))
        past = FixedPast(self, num_cached)
        self.holder = weakref.ref(past)
        return past

    def figures(self) -> dict | None:
        return None if self.graphs is None else self.graphs.figures()

    def capture_at_start(self, up_to: int | None = None) -> int:
        """Capture, before any request, every pass a request within `up_to` tokens (default
        START_SLOTS) can run, (tokens, slots) for each rung of slots up to the one that holds
        `up_to` and each rung of tokens up to that, and the decode token (1, slots) at every rung of slots. Returns how
        many were captured. The passes run over whatever the buffers hold (each request writes
        its own K/V over them); nothing here reads the pool."""
        if self.graphs is None or (self.holder is not None and self.holder() is not None):
            return 0
        up_to = START_SLOTS if up_to is None else up_to
        self.allocate()
        most = padded_to(self.lengths, up_to) or self.lengths[-1]  # the slots a request of up_to tokens may attend
        shapes = [(size, length) for length in self.lengths if length <= most
                  for size in self.suffixes if size <= length] + [(1, length) for length in self.lengths]
        before = len(self.graphs.captures)
        with torch.inference_mode():  # as every request's passes run: the buffers are inference tensors
            self.last.zero_()
            for shape in dict.fromkeys(shapes):
                if not self.graphs.has(*shape):
                    self.graphs.try_capture(*shape)
        return len(self.graphs.captures) - before


class FixedPast:
    """What run_request gets as past_key_values where the engine keeps FixedBuffers: its
    request's K/V so far (`length` tokens) in the buffers."""

    def __init__(self, buffers: FixedBuffers, length: int):
        self.buffers, self.length = buffers, length

    def forward(self, model, token_ids: list[int]) -> torch.Tensor:
        """The logits of the last of token_ids (vocab,), their K/V in the buffers after this
        request's; what one_request.forward returns for a DynamicCache."""
        buffers, n, start = self.buffers, len(token_ids), self.length
        if start + n > buffers.max_len:
            raise ValueError(f"{start + n} tokens do not fit the fixed buffers' {buffers.max_len}")
        size = padded_to(buffers.suffixes, n)
        length = None if size is None else padded_to(buffers.lengths, start + size)
        graphed = length is not None and buffers.graphs is not None
        if length is None:  # above the ladders: this pass at its own shape
            size, length = n, start + n
        device = buffers.input_ids.device
        moved = torch.tensor([token_ids + [0] * (size - n), list(range(start, start + size))]).to(device)
        buffers.input_ids[:size].copy_(moved[0])
        buffers.positions[:size].copy_(moved[1])
        buffers.last.fill_(n - 1)
        graphs = buffers.graphs
        if graphed and (graphs.has(size, length) or graphs.try_capture(size, length)):
            logits = graphs.replay(size, length)[0]
        else:  # a long pass from nothing (a cold prompt): plain causal attention, no mask to build
            logits = forward(model, buffers, size, length, causal=start == 0 and length == size)[0]
        self.length += n
        return logits.clone()  # the shared logits buffer is written over by the next replay

    def __iter__(self):
        """Each layer's (keys, values) as a DynamicCache layer holds them, (1, kv heads, slots,
        dim), views of the buffers: what PagedKVPool.write reads the new tokens' K/V from."""
        for layer in self.buffers.kv:
            yield layer[0].transpose(0, 1)[None], layer[1].transpose(0, 1)[None]


class RequestStep:
    """What pool_attention hands a layer's work to (engine/batch_attention.py): the pass's tokens
    write their K/V at their positions, then attend over the first `length` slots.

        positions  (tokens,)                      where each token's K/V go, and how far it reads
        mask       (group x tokens, length)       True: a slot the token reads (up to its position);
                   None: the pass starts at slot 0 and is as long as `length`, plain causal
    """

    def __init__(self, buffers: FixedBuffers, positions: torch.Tensor, length: int, mask: torch.Tensor | None):
        self.buffers, self.positions, self.length, self.mask = buffers, positions, length, mask

    def attend(self, layer: int, query, key, value, scaling):
        """query (1, heads, tokens, dim), key/value (1, kv heads, tokens, dim); returns (1,
        tokens, heads, dim), as transformers' attention functions do."""
        kv = self.buffers.kv[layer]
        kv[0, self.positions] = key[0].transpose(0, 1).to(kv.dtype)
        kv[1, self.positions] = value[0].transpose(0, 1).to(kv.dtype)
        (_, heads, tokens, dim), kv_heads = query.shape, kv.shape[2]
        keys, values = kv[:, : self.length].transpose(1, 2).to(query.dtype)  # (kv heads, length, dim) each
        if self.mask is None:  # no mask of tokens x length to build: a kernel that knows causal (flash on a GPU)
            attended = F.scaled_dot_product_attention(query, keys[None], values[None], is_causal=True, scale=scaling,
                                                      enable_gqa=True)
            return attended.transpose(1, 2), None
        # A kv head's query heads together, as one batch of queries (no K/V repeated).
        queries = query[0].reshape(kv_heads, heads // kv_heads * tokens, dim)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.mask, scale=scaling)
        return attended.reshape(heads, tokens, dim).transpose(0, 1)[None], None


def forward(model, buffers: FixedBuffers, size: int, length: int, causal: bool = False) -> torch.Tensor:
    """The padded pass over the buffers' first `size` tokens, attending over `length` slots:
    the logits of the last real token (1, vocab). The mask is computed here, inside the pass,
    so a graph captured around this call computes it again from what the buffers then hold.
    causal: the pass fills slots 0..length-1 (size == length), plain causal attention, no mask."""
    positions = buffers.positions[:size]
    mask = None
    if not causal:
        group = model.config.get_text_config().num_attention_heads // buffers.pool.num_kv_heads
        slots = torch.arange(length, device=positions.device)
        mask = (slots[None, :] <= positions[:, None]).repeat(group, 1)
    step = RequestStep(buffers, positions, length, mask)
    return model(input_ids=buffers.input_ids[None, :size], position_ids=positions[None], use_cache=False,
                 pool_step=step, logits_to_keep=buffers.last).logits[0]
