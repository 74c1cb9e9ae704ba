"""
The paged KV pool: the K/V memory the allocator's block ids point into.

Read allocator/prefix_caching.py (the allocator: which block holds which tokens) first. The allocator
hands out block ids; this file is the memory they name, and the two ways the engines move
K/V in and out of it:

    slot_ids      a token's place in the pool: its block (from the block table) and offset
    PagedKVPool   the tensors, sized once from the model's shape; gather copies cached
                  blocks into a DynamicCache (stage 7's path), write copies new K/V back;
                  one scratch block beyond the allocator's, for a padded decode step's
                  padding rows (engine/static_decode.py)

Both engines (engine/one_request.py, engine/batch_engine.py) use it; it imports neither.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

# -----------------------------------------------------------------------------
# The pool
#
# The allocator hands out block ids; this is the memory they name. It is allocated once,
# from the model's shape, and never grows: one slot per (block, position in block), and each
# slot holds one token's key and value vectors in every layer. A cached block is just a
# block whose slots were written by an earlier request and not overwritten since.
#
# Neither engine runs attention on the pool itself; both copy out what a step needs.
# One request at a time (engine/one_request.py): a hit is *gathered* from the pool into a fresh
# DynamicCache, the model attends over that, and whatever it computes is *written* back into
# the request's slots, so the blocks that fill are truly there for the next request. Many
# requests (engine/batch_engine.py): every layer copies each request's blocks, whole, into one buffer
# the pool keeps (read_blocks), and attends over that. vLLM's paged-attention kernels read the
# blocks where they lie, with no copy; the copy is the price of running an unmodified Hugging
# Face model with torch's own attention on any device. It costs what transformers' own
# contiguous cache costs for the same step, which copies every context once a step too
# (DynamicCache appends a token with torch.cat): python allocator/prefix_caching.py --bench paged.


def slot_ids(block_table: list[int], block_size: int, start: int, end: int, device=None):
    """Flat slot index of tokens start..end-1: block_table[i // block_size] * block_size + i % block_size.

    >>> slot_ids([7, 2], block_size=4, start=3, end=6).tolist()   # token 3 in block 7; 4, 5 in block 2
    [31, 8, 9]
    """
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_table)[positions // block_size]
    return (blocks * block_size + positions % block_size).to(device)


class PagedKVPool:
    """The K/V tensors behind the allocator's blocks.

        data[layer, 0, block, offset]  the key of one token,   shape (num_kv_heads, head_dim)
        data[layer, 1, block, offset]  the value of that token

    The memory holds one block more than the allocator's, block id num_blocks: the scratch
    block. The allocator never hands it out; a padded decode step (engine/static_decode.py) points
    its padding rows at it, so they write and read there and touch no request's K/V. vLLM's
    BlockPool holds back block 0 the same way, its null_block: a placeholder no request owns
    (vllm/v1/core/block_pool.py).
    `data` is the allocator's blocks only; gather, write, slots and read_blocks see the scratch
    block too (Engine.warm_up runs stage 7's path through it).

    >>> kv = PagedKVPool(num_layers=2, num_kv_heads=1, head_dim=8, num_blocks=4, block_size=4)
    >>> tuple(kv.data.shape), kv.scratch_block
    ((2, 2, 4, 4, 1, 8), 4)
    """
    def __init__(self, *, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype=None, device=None):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self._memory = torch.zeros(
            num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype or torch.float32,
            device=device
        )
        self.data = self._memory[:, :, :num_blocks]  # a view: what the allocator's block ids name
        self._read_buffer: torch.Tensor | None = None  # read_blocks' copies land here

    @staticmethod
    def shape_from_config(config) -> dict:
        """Layers, KV heads and head dim of a transformers model config."""
        text = config.get_text_config()
        if any(kind != "full_attention" for kind in getattr(text, "layer_types", None) or ()):
            raise ValueError(
                f"{text.model_type} has sliding-window layers, whose cache drops old tokens; "
                f"this pool assumes every layer attends to the whole prefix"
            )
        return {
            "num_layers": text.num_hidden_layers,
            "num_kv_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        }

    @property
    def scratch_block(self) -> int:
        """The id of the block after the allocator's, which no request gets (the class docstring)."""
        return self.num_blocks

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def device(self):
        return self.data.device

    @staticmethod
    def bytes_per_block(*, num_layers, num_kv_heads, head_dim, block_size, dtype) -> int:
        """K and V of block_size tokens in every layer: 2 x layers x tokens x heads x dim x bytes.

        >>> import torch   # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims
        >>> PagedKVPool.bytes_per_block(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
        737280
        """
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def gather(self, block_ids: list[int], config):
        """A fresh DynamicCache holding the K/V of `block_ids`, in order.

        One index_select copies the blocks of every layer at once; the per-layer tensors
        handed to the cache are views of that one copy, in the (batch, heads, tokens, dim)
        layout attention expects.
        """
        if not block_ids:
            return DynamicCache(config=config)
        kv = self.tokens_of(block_ids)
        return DynamicCache([(kv[layer, 0], kv[layer, 1]) for layer in range(self.num_layers)], config=config)

    def tokens_of(self, block_ids: list[int]):
        """The K/V of every slot of `block_ids`, token after token, in attention's layout:
        (layers, 2, 1, num_kv_heads, len(block_ids) * block_size, head_dim).

        >>> kv = PagedKVPool(num_layers=2, num_kv_heads=1, head_dim=8, num_blocks=4, block_size=4)
        >>> tuple(kv.tokens_of([3, 1]).shape)
        (2, 2, 1, 1, 8, 8)
        """
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        kv = self._memory.index_select(2, index).flatten(2, 3)  # (layers, 2, tokens, heads, dim)
        return kv.transpose(2, 3).unsqueeze(2)  # (layers, 2, 1, heads, tokens, dim)

    def slots(self, layer: int):
        """Layer `layer` of the pool as (K/V, slot, kv heads, dim): slot = block * block_size + offset,
        the scratch block's slots last."""
        return self._memory[layer].view(2, (self.num_blocks + 1) * self.block_size, self.num_kv_heads, self.head_dim)

    def write_slots(self, layer: int, slot_mapping: torch.Tensor, key, value) -> None:
        """A step's new K/V into their slots of layer `layer`: key and value (1, kv heads,
        tokens, dim), as an attention layer gets them; slot_mapping (tokens,). Every attention
        of the batched path writes first, then reads: a token's own K/V are among what it reads."""
        flat = self.slots(layer)
        flat[0, slot_mapping] = key[0].transpose(0, 1).to(flat.dtype)
        flat[1, slot_mapping] = value[0].transpose(0, 1).to(flat.dtype)

    def blocks(self, layer: int):
        """Layer `layer` of the pool as (K/V, block, offset, kv heads, dim), the scratch block last."""
        return self._memory[layer]

    def read_blocks(self, layer: int, block_ids: torch.Tensor):
        """K and V of layer `layer` in the blocks `block_ids` (a 1-D long tensor on the pool's
        device), one block after another: (K/V, len(block_ids) * block_size, kv heads, dim).

        The copy lands in a buffer the pool keeps for it, grown to the largest read so far and
        overwritten by the next read: use the result before reading again, and read from one
        thread at a time (engine/batch_engine.py's steps hold the engine's lock, so they never overlap). A fresh tensor each
        time can cost more than the copy itself once it is big: memory that large comes straight
        from the operating system, and the first write to each of its pages faults.

        >>> kv = PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=3, block_size=2)
        >>> kv.data[0, 0, :, :, 0, 0] = torch.tensor([[0., 1.], [2., 3.], [4., 5.]])   # keys: block b holds 2b, 2b+1
        >>> kv.read_blocks(0, torch.tensor([2, 0]))[0, :, 0, 0].tolist()   # block 2's keys, then block 0's
        [4.0, 5.0, 0.0, 1.0]
        """
        shape = (2, block_ids.numel(), self.block_size, self.num_kv_heads, self.head_dim)
        size = 2 * block_ids.numel() * self.block_size * self.num_kv_heads * self.head_dim
        if self._read_buffer is None or self._read_buffer.numel() < size:
            self._read_buffer = torch.empty(size, dtype=self.dtype, device=self.device)
        out = self._read_buffer[:size].view(shape)
        torch.index_select(self._memory[layer], 1, block_ids, out=out)
        return out.flatten(1, 2)

    def write(self, cache, block_table: list[int], start: int, end: int) -> None:
        """Copy tokens start..end-1 of a request's DynamicCache into its slots."""
        slots = slot_ids(block_table, self.block_size, start, end, self.device)
        flat = self._memory.view(self.num_layers, 2, -1, self.num_kv_heads, self.head_dim)
        for layer, (keys, values, *_) in enumerate(cache):
            flat[layer, 0, slots] = keys[0, :, start:end].transpose(0, 1)  # (tokens, heads, dim)
            flat[layer, 1, slots] = values[0, :, start:end].transpose(0, 1)

    def __str__(self) -> str:
        total = self._memory.numel() * self._memory.element_size()  # the scratch block included
        return (
            f"paged KV pool: {self.num_blocks} blocks x {self.block_size} slots "
            f"({self.num_blocks * self.block_size:,} tokens) and 1 scratch block, each slot {self.num_layers} layers "
            f"x K,V x {self.num_kv_heads} heads x {self.head_dim} dims; {str(self.dtype).removeprefix('torch.')} "
            f"on {self.device}, {total / 2**20:,.1f} MiB ({total / (self.num_blocks + 1) / 2**10:,.0f} KiB a block)"
        )
