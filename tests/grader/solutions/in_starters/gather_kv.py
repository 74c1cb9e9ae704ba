"""A correct exercise 5, written into the starter from the lesson and the starter alone."""

from transformers import DynamicCache

from exercises.given import PoolBase


class PagedKVPool(PoolBase):
    def gather(self, block_ids: list[int], config):
        """A fresh DynamicCache holding the K/V of `block_ids`, in order. No blocks (a cold
        request) give a cache of 0 tokens."""
        kv = self.tokens_of(block_ids)  # (layers, K/V, 1, num_kv_heads, tokens, head_dim)
        pairs = [(layer_kv[0], layer_kv[1]) for layer_kv in kv.unbind(0)]
        return DynamicCache(pairs, config=config)

    def tokens_of(self, block_ids: list[int]):
        """The K/V of every slot of `block_ids`, token after token, in attention's layout.

        self.data is (layers, 2, num_blocks, block_size, num_kv_heads, head_dim); the result is
        (layers, 2, 1, num_kv_heads, len(block_ids) * block_size, head_dim). For example, with
        block_size 4 and block_ids [7, 2]: tokens 0-3 are block 7's slots 0-3, tokens 4-7 block 2's.

        Three moves: pick the blocks (in block_ids order), merge the blocks and slots axes into
        one tokens axis, and put that axis after the heads (plus a batch axis of 1).
        """
        import torch

        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        picked = self.data.index_select(2, index)  # (L, 2, n, bs, H, D), a copy
        n_tokens = index.numel() * self.block_size
        tokens = picked.reshape(self.num_layers, 2, n_tokens, self.num_kv_heads, self.head_dim)
        return tokens.transpose(2, 3).unsqueeze(2)  # (L, 2, 1, H, T, D)
