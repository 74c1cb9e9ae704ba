"""
The decode step with fixed shapes: the forward pass a CUDA graph can capture and replay.

Read engine/batch_attention.py first (a step's inputs packed and grouped anew every step);
engine/model_runner.py runs this file's step, captured as a CUDA graph on a GPU.

A step that only decodes computes one token a request. Its inputs are the same few tensors
every step, only their values change, so they can live in buffers allocated once, and the
whole forward pass can run over fixed shapes: the batch padded up to a size of a ladder, and
the blocks its rows read, all rows together, padded to a count of another ladder. A graph
captured for one (size, blocks) then serves every decode step that fits it.

    decode_sizes, block_counts   the two ladders; padded_to and rung pick a step's rungs
    DecodeBuffers                the inputs, allocated once for the largest size and count;
                                 fill copies a step's requests in, padding the rest
    StaticStep, forward          the padded forward pass: what its attention layers read
                                 (pool_step=), built from the buffers inside the pass

Each row reads its own blocks and no more: the step's reads are a flat list of (block, row)
pairs, each row's blocks one after another, as a paged attention kernel walks each row's
block table (nano-vllm's nanovllm/layers/attention.py hands flash_attn_with_kvcache the block
tables and each row's context length). One 8,000-token chat among 63 short ones reads its 500
blocks once, not 64 times over. Each pair's block is attended on its own (its slots past the
row's length masked); a row's pairs are then merged by the softmax's maximum and sum, as
vLLM merges the attention of two parts of a context (vllm/v1/attention/ops/merge_attn_states.py). That is a choice made on the GPU from the buffers, so a graph
replays it; grouping rows by length, or sharing a prefix (engine/batch_attention.py), are
decisions made in Python from the step's data, and a graph replays no Python.

Padding never touches a request's K/V: padding rows write their token to the pool's scratch
block (engine/kv_pool.py; the allocator never hands it out) and read only that block, one slot;
padding pairs read the scratch block for a row past the step's last, whose result is dropped.
No real row ever reads the scratch block, so whatever padding leaves there cannot reach it.

References: nano-vllm's nanovllm/engine/model_runner.py (capture_cudagraph: graph_bs and
the graph_vars input_ids, positions, slot_mapping, context_lens, block_tables); vLLM's
capture sizes (vllm/config/vllm.py, _set_cudagraph_sizes: 1, 2, 4, then every 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_pool import PagedKVPool
from engine.scheduler import StepPlan

# -----------------------------------------------------------------------------
# 1. The ladders


def decode_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step is padded to: 1, 2, 4, then every 8, as vLLM's default
    capture sizes, cut at max_num_seqs (itself the last rung, so every step fits one).

    >>> decode_sizes(20), decode_sizes(3)
    ([1, 2, 4, 8, 16, 20], [1, 2, 3])
    """
    sizes = [size for size in [1, 2, 4, *range(8, max_num_seqs + 1, 8)] if size < max_num_seqs]
    return sizes + [max_num_seqs]


def block_counts(max_blocks: int) -> list[int]:
    """How many blocks a step's rows read, all together, padded to: powers of two, max_blocks
    the last. The step copies that many blocks a layer, so a rung at most twice its need.

    >>> block_counts(12)
    [1, 2, 4, 8, 12]
    """
    counts = [1 << i for i in range(max_blocks.bit_length()) if 1 << i < max_blocks]
    return counts + [max_blocks]


def padded_to(ladder: list[int], n: int) -> int | None:
    """The smallest rung that holds n; None above the ladder (the step runs eagerly).

    >>> padded_to([1, 2, 4, 8], 3), padded_to([1, 2, 4, 8], 8), padded_to([1, 2, 4, 8], 9)
    (4, 8, None)
    """
    return next((rung for rung in ladder if rung >= n), None)


# -----------------------------------------------------------------------------
# 2. The buffers


class DecodeBuffers:
    """A decode step's inputs, allocated once for max_size rows reading max_reads blocks in
    all; a step of `size` rows and `reads` blocks uses the first entries of each.

        input_ids, positions   (max_size,)    each row's one token and its place
        slot_mapping           (max_size,)    the slot its K/V are written to
        read_blocks            (max_reads,)   the blocks the rows read, each row's in order
        read_rows              (max_reads,)   the row each of them is read for
        read_lens              (max_reads,)   how many of its slots that row reads (1 to block size)

    For requests a (block table [7, 2], decoding token 5) and b ([3], token 1), block size 4,
    padded to size 4 and 8 reads (scratch block 9):
        input_ids     [a's token 5, b's token 1, 0, 0]
        positions     [5, 1, 0, 0]
        slot_mapping  [9, 13, 36, 36]             a: block 2 offset 1; b: block 3 offset 1; padding: scratch
        read_blocks   [7, 2, 3, 9, 9, 9, 9, 9]    a's two blocks, b's one, then padding
        read_rows     [0, 0, 1, 2, 3, 4, 4, 4]    padding rows 2 and 3 read the scratch block; row 4
                                                  is no row of the step: what it reads is dropped
        read_lens     [4, 2, 2, 1, 1, 1, 1, 1]
    """

    def __init__(self, pool: PagedKVPool, max_size: int, max_reads: int):
        self.pool = pool
        device = pool.device
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_size, dtype=torch.long, device=device)
        self.read_blocks = torch.zeros(max_reads, dtype=torch.long, device=device)
        self.read_rows = torch.zeros(max_reads, dtype=torch.long, device=device)
        self.read_lens = torch.ones(max_reads, dtype=torch.long, device=device)

    def fill(self, plan: StepPlan, block_tables: dict[str, list[int]], size: int, reads: int) -> None:
        """Copy a decode-only step's requests into the first `size` rows and `reads` reads, the
        rest padding (the scratch block, one slot)."""
        block_size, scratch = self.pool.block_size, self.pool.scratch_block
        ids, positions, slots = [0] * size, [0] * size, [scratch * block_size] * size
        blocks, rows, lens = [], [], []
        for i, s in enumerate(plan.scheduled):
            table = block_tables[s.request.request_id][: s.start // block_size + 1]
            ids[i], positions[i] = s.request.token_ids[s.start], s.start
            slots[i] = table[-1] * block_size + s.start % block_size
            blocks += table
            rows += [i] * len(table)
            lens += [block_size] * (len(table) - 1) + [s.end - (len(table) - 1) * block_size]
        pad = reads - len(blocks)
        padding_rows = list(range(len(plan.scheduled), size))
        blocks += [scratch] * pad
        rows += padding_rows + [size] * (pad - len(padding_rows))
        lens += [1] * pad
        moved = torch.tensor([ids, positions, slots]).to(self.pool.device, non_blocking=True)
        self.input_ids[:size].copy_(moved[0])
        self.positions[:size].copy_(moved[1])
        self.slot_mapping[:size].copy_(moved[2])
        read = torch.tensor([blocks, rows, lens]).to(self.pool.device, non_blocking=True)
        self.read_blocks[:reads].copy_(read[0])
        self.read_rows[:reads].copy_(read[1])
        self.read_lens[:reads].copy_(read[2])


def reads_needed(plan: StepPlan, size: int, block_size: int) -> int:
    """The blocks a decode-only step's rows read, each row its own, and one for each padding row."""
    return sum(-(-s.end // block_size) for s in plan.scheduled) + size - len(plan.scheduled)


def rung(plan: StepPlan, sizes: list[int], counts: list[int], block_size: int) -> tuple[int, int] | None:
    """The (size, reads) a decode-only step is padded to; None if it does not fit the ladders.

    A step of 3 decodes with contexts of 9, 2 and 5 tokens, block size 4: (4, 8): 4 rows, the
    3 + 1 + 2 blocks they read and one for the padding row, padded to 8.
    """
    size = padded_to(sizes, len(plan.scheduled))
    if size is None:
        return None
    reads = padded_to(counts, reads_needed(plan, size, block_size))
    return None if reads is None else (size, reads)


# -----------------------------------------------------------------------------
# 3. The step and its forward pass


@dataclass
class StaticStep:
    """What pool_attention hands its layers' work to (engine/batch_attention.py): rows of one token
    each, every row reading its own blocks.

        slot_mapping  (rows,)                  where each row's new K/V go
        read_blocks   (reads,)                 the blocks read, each row's in order
        read_rows     (reads,)                 the row each is read for (rows: a dropped row)
        mask          (reads, 1, 1, block size)   True: a slot its row reads
    """

    pool: PagedKVPool
    slot_mapping: torch.Tensor
    read_blocks: torch.Tensor
    read_rows: torch.Tensor
    mask: torch.Tensor

    def attend(self, layer: int, query, key, value, scaling):
        """query (1, heads, rows, dim), key/value (1, kv heads, rows, dim); returns
        (1, rows, heads, dim), as transformers' attention functions do."""
        self.pool.write_slots(layer, self.slot_mapping, key, value)  # first: a row's own token is among its keys
        rows, (_, heads, _, dim), kv_heads = self.slot_mapping.numel(), query.shape, self.pool.num_kv_heads
        # A fresh copy, not read_blocks' buffer: a graph keeps the addresses it was captured
        # with, and that buffer is given back when the eager path grows it.
        kv = self.pool.blocks(layer).index_select(1, self.read_blocks)  # (K/V, reads, block size, kv heads, dim)
        keys, values = kv.transpose(2, 3).to(query.dtype)  # (reads, kv heads, block size, dim) each
        # Each read's queries: its row's, a kv head's query heads together (no K/V repeated).
        # The dropped row reads row 0's queries; nothing of it is kept.
        queries = query[0].transpose(0, 1).reshape(rows, kv_heads, heads // kv_heads, dim)
        mine = queries.index_select(0, self.read_rows.clamp(max=rows - 1))
        scores = (mine @ keys.transpose(2, 3)).float().masked_fill(~self.mask, float("-inf")) * scaling
        # Each block attended on its own, then a row's blocks merged: every block's weights
        # scaled by the row's largest score, their sums and weighted values added up by row.
        top = scores.amax(-1)  # (reads, kv heads, group): each read has a slot, so finite
        rows_top = top.new_full((rows + 1, *top.shape[1:]), float("-inf"))
        rows_top.scatter_reduce_(0, self.read_rows[:, None, None].expand_as(top), top, "amax")
        weights = torch.exp(scores - rows_top.index_select(0, self.read_rows)[..., None])
        sums = top.new_zeros(rows + 1, *top.shape[1:]).index_add_(0, self.read_rows, weights.sum(-1))
        parts = (weights.to(values.dtype) @ values).float()  # (reads, kv heads, group, dim)
        total = parts.new_zeros(rows + 1, *parts.shape[1:]).index_add_(0, self.read_rows, parts)
        attended = (total[:rows] / sums[:rows, ..., None]).to(query.dtype)
        return attended.reshape(1, rows, heads, dim), None


def forward(model, buffers: DecodeBuffers, size: int, reads: int) -> torch.Tensor:
    """The padded decode step over the buffers' first `size` rows and `reads` reads: logits
    (size, vocab), one row per buffer row, padding included.

    Everything it needs from the buffers (the mask) is computed here, inside the pass, so a
    graph captured around this call computes it again on each replay from whatever the
    buffers then hold."""
    pool = buffers.pool
    offsets = torch.arange(pool.block_size, device=pool.device)
    mask = offsets[None, :] < buffers.read_lens[:reads, None]
    step = StaticStep(pool, buffers.slot_mapping[:size], buffers.read_blocks[:reads], buffers.read_rows[:reads],
                      mask[:, None, None, :])
    return model(input_ids=buffers.input_ids[None, :size], position_ids=buffers.positions[None, :size],
                 use_cache=False, pool_step=step).logits[0]
