"""
The decode step with fixed shapes: the forward pass a CUDA graph can capture and replay.

Read engine/batch_attention.py first (a step's inputs packed and grouped anew every step);
engine/model_runner.py runs this file's step, captured as a CUDA graph on a GPU.

A step that only decodes computes one token a request. Its inputs are the same few tensors
every step, only their values change, so they can live in buffers allocated once, and the
whole forward pass can run over fixed shapes: the batch padded up to a size of a ladder,
each row's block table padded to a width of another ladder. A graph captured for one
(size, width) then serves every decode step that fits it.

    decode_sizes, block_widths   the two ladders; padded_to and rung pick a step's rungs
    DecodeBuffers                the inputs, allocated once for the largest size and width;
                                 fill copies a step's requests in, padding the rest
    StaticStep, forward          the padded forward pass: what its attention layers read
                                 (pool_step=), built from the buffers inside the pass

Padding rows never touch a request's K/V: each writes its token to the pool's scratch block
(engine/kv_pool.py; the allocator never hands it out) and reads only that block, context length 1.
A real row reads its own blocks and, past them, its last block again, masked: no real row
ever reads the scratch block, so whatever padding leaves there cannot reach it.

Attention here is one scaled_dot_product_attention over every row: its blocks copied whole
out of the pool through its block table (one index_select, as PagedKVPool.read_blocks does)
and a mask from the context lengths. No grouping by length and no shared-prefix attention:
those are decisions made in Python from the step's data, and a graph replays no Python. So
every row pays for the width, which is why the width has a ladder too.

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


def block_widths(max_blocks: int) -> list[int]:
    """Block-table widths a step's rows are padded to: powers of two, max_blocks the last.
    Each row reads the width's blocks in every layer, so a rung at most twice a step's need.

    >>> block_widths(12)
    [1, 2, 4, 8, 12]
    """
    widths = [1 << i for i in range(max_blocks.bit_length()) if 1 << i < max_blocks]
    return widths + [max_blocks]


def padded_to(ladder: list[int], n: int) -> int | None:
    """The smallest rung that holds n; None above the ladder (the step runs eagerly).

    >>> padded_to([1, 2, 4, 8], 3), padded_to([1, 2, 4, 8], 8), padded_to([1, 2, 4, 8], 9)
    (4, 8, None)
    """
    return next((rung for rung in ladder if rung >= n), None)


# -----------------------------------------------------------------------------
# 2. The buffers


class DecodeBuffers:
    """A decode step's inputs, allocated once for max_size rows of max_blocks blocks; a step
    of `size` rows and `width` blocks uses the first rows and columns.

        input_ids, positions   (max_size,)              each row's one token and its place
        slot_mapping           (max_size,)              the slot its K/V are written to
        block_tables           (max_size, max_blocks)   the blocks its attention reads
        context_lens           (max_size,)              how many of their slots it reads

    For requests a (block table [7, 2], decoding token 5) and b ([3], token 1), block size 4,
    padded to size 4, width 2 (scratch block 9):
        input_ids     [a's token 5, b's token 1, 0, 0]
        positions     [5, 1, 0, 0]
        slot_mapping  [9, 13, 36, 36]       a: block 2 offset 1; b: block 3 offset 1; padding: scratch
        block_tables  [[7, 2], [3, 3], [9, 9], [9, 9]]   b's last block again, masked
        context_lens  [6, 2, 1, 1]
    """

    def __init__(self, pool: PagedKVPool, max_size: int, max_blocks: int):
        self.pool = pool
        device = pool.device
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_size, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_size, max_blocks, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(max_size, dtype=torch.long, device=device)

    def fill(self, plan: StepPlan, block_tables: dict[str, list[int]], size: int, width: int) -> None:
        """Copy a decode-only step's requests into the first `size` rows and `width` columns,
        the rows past them padding (the scratch block, context length 1)."""
        block_size, scratch = self.pool.block_size, self.pool.scratch_block
        ids, positions = [0] * size, [0] * size
        slots, lens = [scratch * block_size] * size, [1] * size
        tables = [[scratch] * width for _ in range(size)]
        for i, s in enumerate(plan.scheduled):
            table = block_tables[s.request.request_id][: s.start // block_size + 1]
            ids[i], positions[i], lens[i] = s.request.token_ids[s.start], s.start, s.end
            slots[i] = table[-1] * block_size + s.start % block_size
            tables[i] = table + table[-1:] * (width - len(table))
        moved = torch.tensor([ids, positions, slots, lens]).to(self.pool.device, non_blocking=True)
        self.input_ids[:size].copy_(moved[0])
        self.positions[:size].copy_(moved[1])
        self.slot_mapping[:size].copy_(moved[2])
        self.context_lens[:size].copy_(moved[3])
        self.block_tables[:size, :width].copy_(torch.tensor(tables).to(self.pool.device, non_blocking=True))


def rung(plan: StepPlan, sizes: list[int], widths: list[int], block_size: int) -> tuple[int, int] | None:
    """The (size, width) a decode-only step is padded to; None if it does not fit the ladders.

    A step of 3 decodes whose longest context is 9 tokens, block size 4: (4, 4): 4 rows of 3
    blocks, padded to 4 blocks.
    """
    size = padded_to(sizes, len(plan.scheduled))
    width = padded_to(widths, -(-max(s.end for s in plan.scheduled) // block_size))
    return None if size is None or width is None else (size, width)


# -----------------------------------------------------------------------------
# 3. The step and its forward pass


@dataclass
class StaticStep:
    """What pool_attention hands its layers' work to (engine/batch_attention.py): rows of one token
    each, every row reading `width` whole blocks.

        slot_mapping  (rows,)                   where each row's new K/V go
        block_ids     (rows x width,)           the blocks each row reads, row after row
        mask          (rows, 1, 1, width x block size)   True: a slot of the row's context
    """

    pool: PagedKVPool
    slot_mapping: torch.Tensor
    block_ids: torch.Tensor
    mask: torch.Tensor

    def attend(self, layer: int, query, key, value, scaling):
        """query (1, heads, rows, dim), key/value (1, kv heads, rows, dim); returns
        (1, rows, heads, dim), as transformers' attention functions do."""
        flat = self.pool.slots(layer)
        # Write first, as pool_attention does: a row's own token is among the keys it reads.
        flat[0, self.slot_mapping] = key[0].transpose(0, 1).to(flat.dtype)
        flat[1, self.slot_mapping] = value[0].transpose(0, 1).to(flat.dtype)
        rows, (_, heads, _, dim), kv_heads = self.slot_mapping.numel(), query.shape, self.pool.num_kv_heads
        # A fresh copy, not read_blocks' buffer: a graph keeps the addresses it was captured
        # with, and that buffer is given back when the eager path grows it.
        kv = self.pool.blocks(layer).index_select(1, self.block_ids)  # (K/V, rows x width, block size, kv heads, dim)
        # Keys and values (rows, kv heads, slots, dim); a kv head's query heads are its queries (no K/V repeated).
        keys, values = kv.view(2, rows, -1, kv_heads, dim).transpose(2, 3).to(query.dtype)
        queries = query[0].transpose(0, 1).reshape(rows, kv_heads, heads // kv_heads, dim)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.mask, scale=scaling)
        return attended.reshape(1, rows, heads, dim), None


def forward(model, buffers: DecodeBuffers, size: int, width: int) -> torch.Tensor:
    """The padded decode step over the buffers' first `size` rows and `width` blocks: logits
    (size, vocab), one row per buffer row, padding included.

    Everything it needs from the buffers (the flat block ids, the mask) is computed here,
    inside the pass, so a graph captured around this call computes it again on each replay
    from whatever the buffers then hold."""
    pool = buffers.pool
    slots = torch.arange(width * pool.block_size, device=pool.device)
    mask = slots[None, :] < buffers.context_lens[:size, None]
    step = StaticStep(pool, buffers.slot_mapping[:size], buffers.block_tables[:size, :width].reshape(-1),
                      mask[:, None, None, :])
    return model(input_ids=buffers.input_ids[None, :size], position_ids=buffers.positions[None, :size],
                 use_cache=False, pool_step=step).logits[0]
