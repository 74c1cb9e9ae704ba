"""
A step with a prompt's chunk in it, padded to fixed shapes: the prefill a CUDA graph can capture.

Read engine/static_decode.py first (the decode step padded the same way); engine/model_runner.py
runs this file's step, captured as a CUDA graph on a GPU.

A step that prefills mixes a prompt's chunk (many tokens of one request) with decodes (one
token each), and its token count changes every step. Padded, it has two shapes: its tokens
padded to a power of two up to MAX_TOKENS (512), and the blocks its requests read, each
request's own, padded to a rung of static_decode's block counts. A step with more tokens, or
whose attention would score more than MAX_SCORES slots a head, runs packed and eagerly
(engine/batch_attention.py), as before.

Its attention is one scaled_dot_product_attention of every token of the step over every slot
the step reads, masked: a token sees a slot only if the slot holds its own request's K/V at a
place no later than its own. That is this course's choice, not the servers': a step of two
chunks scores each chunk's tokens against the other's slots too, and masks them out, where a
varlen kernel (flash attention's, in vLLM) walks each request's slots alone. What it buys is
one operation whose shape is the step's two rungs, so a graph can replay it. vLLM keeps
attention out of its graphs for such steps instead and replays only the layers around it
(PIECEWISE mode, vllm-project/vllm docs/design/cuda_graphs.md); SGLang captures its prefill
steps by token count and runs a step in the smallest captured count that holds it
(python/sglang/srt/model_executor/piecewise_cuda_graph_runner.py), as this file's token ladder does.

    chunk_sizes, chunk_rung   the token ladder, and a step's (tokens, blocks read)
    ChunkBuffers              the inputs, allocated once; fill copies a step in, padding the rest
    ChunkStep, forward        the padded pass: what its attention layers read (pool_step=)

Padding never touches a request's K/V: padding tokens belong to no request (owner -1), write
to the pool's scratch block and see only the padding reads, which stand for the scratch
block as zeros. No token of a request ever sees a slot of another owner, and what the
scratch block holds is never used, so whatever padding leaves there cannot reach a request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_pool import PagedKVPool
from engine.scheduler import StepPlan
from engine.static_decode import padded_to

MAX_TOKENS = 512  # the largest step run padded: vLLM's largest default capture size
# The most (tokens x slots read) a padded step scores a head: 512 tokens over 16,384 slots.
# A step past it would hold a mask and scores of that size in every layer; it runs packed.
MAX_SCORES = 1 << 23
PADDING = -1  # the owner of padding tokens and padding reads


def chunk_sizes(max_tokens: int = MAX_TOKENS) -> list[int]:
    """Token counts a step with a prompt's chunk is padded to: powers of two. Every rung is
    a graph for each rung of blocks read, so the ladder is coarse: a step pays at most twice
    its tokens, in a pass whose cost on a GPU is mostly the launches it saves.

    >>> chunk_sizes(512)
    [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    """
    return [1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens]


def reads_needed(plan: StepPlan, tokens: int, block_size: int) -> int:
    """The blocks a step's requests read, each its own up to its context's end, and one
    for the padding tokens if any."""
    return sum(-(-s.end // block_size) for s in plan.scheduled) + (tokens > plan.num_tokens)


def chunk_rung(plan: StepPlan, counts: list[int], block_size: int) -> tuple[int, int] | None:
    """The (tokens, blocks read) a step is padded to; None if it does not fit the ladders or
    would score more than MAX_SCORES slots a head.

    A step with a chunk of 6 tokens of a request (its context 10) and a decode (context 3),
    block size 4: 7 tokens padded to 8, reading 3 + 1 blocks and one for the padding: (8, 8).
    """
    tokens = padded_to(chunk_sizes(), plan.num_tokens)
    if tokens is None:
        return None
    reads = padded_to(counts, reads_needed(plan, tokens, block_size))
    if reads is None or tokens * reads * block_size > MAX_SCORES:
        return None
    return tokens, reads


class ChunkBuffers:
    """A padded step's inputs, allocated once for max_tokens tokens reading max_reads blocks
    and sampling at most max_rows requests:

        input_ids, positions   (max_tokens,)   each token and its place in its request
        slot_mapping           (max_tokens,)   the slot its K/V are written to
        owners                 (max_tokens,)   the request (its row in the step) it belongs to
        read_blocks            (max_reads,)    the blocks read, each request's in order
        read_owners            (max_reads,)    the request each is read for
        read_starts            (max_reads,)    the place of its first slot in that request
        keep                   (max_rows,)     the step's index of each sampling request's last token

    For request a computing tokens 4..6 of 7 (block table [7, 2]) and b decoding token 1
    ([3]), block size 4, padded to 4 tokens and 4 reads (scratch block 9):
        input_ids     [a's 4, 5, 6, b's 1]
        positions     [4, 5, 6, 1]
        slot_mapping  [8, 9, 10, 13]
        owners        [0, 0, 0, 1]
        read_blocks   [7, 2, 3, 9]      a's two blocks, b's one, one padding read
        read_owners   [0, 0, 1, -1]
        read_starts   [0, 4, 0, 0]
        keep          [2, 3]            a's token 6 and b's token 1 pick the next tokens
    """

    def __init__(self, pool: PagedKVPool, max_tokens: int, max_reads: int, max_rows: int):
        self.pool, self.max_rows = pool, max_rows
        zeros = lambda n: torch.zeros(n, dtype=torch.long, device=pool.device)  # noqa: E731
        self.input_ids, self.positions, self.slot_mapping, self.owners = (zeros(max_tokens) for _ in range(4))
        self.read_blocks, self.read_owners, self.read_starts = (zeros(max_reads) for _ in range(3))
        self.keep = zeros(max_rows)

    def rows(self, tokens: int) -> int:
        """The logits rows a step of `tokens` tokens returns: room for every request that samples."""
        return min(tokens, self.max_rows)

    def fill(self, plan: StepPlan, block_tables: dict[str, list[int]], tokens: int, reads: int) -> None:
        """Copy a step's requests into the first `tokens` tokens and `reads` reads, the rest padding."""
        block_size, scratch = self.pool.block_size, self.pool.scratch_block
        ids, positions, slots, owners = [], [], [], []
        blocks, read_owners, starts, keep = [], [], [], []
        for i, s in enumerate(plan.scheduled):
            table = block_tables[s.request.request_id][: -(-s.end // block_size)]
            ids += s.request.token_ids[s.start : s.end]
            positions += range(s.start, s.end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(s.start, s.end)]
            owners += [i] * (s.end - s.start)
            blocks += table
            read_owners += [i] * len(table)
            starts += range(0, len(table) * block_size, block_size)
            if s.samples:
                keep.append(len(ids) - 1)
        pad = tokens - len(ids)
        ids, positions, owners = ids + [0] * pad, positions + [0] * pad, owners + [PADDING] * pad
        slots += [scratch * block_size] * pad
        pad_reads = reads - len(blocks)
        blocks, read_owners, starts = blocks + [scratch] * pad_reads, read_owners + [PADDING] * pad_reads, \
            starts + [0] * pad_reads
        keep += [0] * (self.rows(tokens) - len(keep))  # rows no request samples: token 0's, dropped
        moved = torch.tensor([ids, positions, slots, owners]).to(self.pool.device, non_blocking=True)
        for buffer, values in zip((self.input_ids, self.positions, self.slot_mapping, self.owners), moved):
            buffer[:tokens].copy_(values)
        read = torch.tensor([blocks, read_owners, starts]).to(self.pool.device, non_blocking=True)
        for buffer, values in zip((self.read_blocks, self.read_owners, self.read_starts), read):
            buffer[:reads].copy_(values)
        self.keep[: len(keep)].copy_(torch.tensor(keep).to(self.pool.device, non_blocking=True))


@dataclass
class ChunkStep:
    """What pool_attention hands its layers' work to (engine/batch_attention.py): the step's
    tokens, each attending over its own request's slots.

        slot_mapping  (tokens,)                 where each token's new K/V go
        read_blocks   (reads,)                  the blocks read
        padding       (reads,)                  True: a padding read (the scratch block)
        mask          (tokens, reads x block size)   True: a slot the token sees
    """

    pool: PagedKVPool
    slot_mapping: torch.Tensor
    read_blocks: torch.Tensor
    padding: torch.Tensor
    mask: torch.Tensor

    def attend(self, layer: int, query, key, value, scaling):
        """query (1, heads, tokens, dim), key/value (1, kv heads, tokens, dim); returns
        (1, tokens, heads, dim), as transformers' attention functions do."""
        self.pool.write_slots(layer, self.slot_mapping, key, value)  # a chunk's tokens see each other's K/V
        kv = self.pool.blocks(layer).index_select(1, self.read_blocks)  # (K/V, reads, block size, kv heads, dim)
        # Every token's scores and weights span every slot read, masked ones at weight 0; 0
        # times a NaN is NaN, so what the scratch block holds is not multiplied at all: its
        # reads are zeros (the padding tokens attend over those, and are dropped).
        kv = kv.masked_fill(self.padding[None, :, None, None, None], 0)
        kv = kv.flatten(1, 2).permute(0, 2, 1, 3).to(query.dtype)  # (K/V, kv heads, slots, dim)
        attended = F.scaled_dot_product_attention(query, kv[0][None], kv[1][None], attn_mask=self.mask[None, None],
                                                  scale=scaling, enable_gqa=True)
        return attended.transpose(1, 2), None


def forward(model, buffers: ChunkBuffers, tokens: int, reads: int) -> torch.Tensor:
    """The padded step over the buffers' first `tokens` tokens and `reads` reads: logits
    (buffers.rows(tokens), vocab), the sampling requests' first, in the step's order.

    The mask is computed here, inside the pass, from the buffers, so a graph captured around
    this call computes it again on each replay from whatever they then hold."""
    pool = buffers.pool
    offsets = torch.arange(pool.block_size, device=pool.device)
    slot_places = (buffers.read_starts[:reads, None] + offsets).flatten()  # each slot's place in its request
    slot_owners = buffers.read_owners[:reads, None].expand(reads, pool.block_size).flatten()
    mine = buffers.owners[:tokens, None] == slot_owners[None, :]
    mask = mine & (slot_places[None, :] <= buffers.positions[:tokens, None])
    step = ChunkStep(pool, buffers.slot_mapping[:tokens], buffers.read_blocks[:reads],
                     buffers.read_owners[:reads] == PADDING, mask)
    return model(input_ids=buffers.input_ids[None, :tokens], position_ids=buffers.positions[None, :tokens],
                 use_cache=False, logits_to_keep=buffers.keep[: buffers.rows(tokens)], pool_step=step).logits[0]
