"""A correct exercise 5: advanced indexing and permute."""

import torch
from transformers import DynamicCache

from exercises.given import PoolBase


class PagedKVPool(PoolBase):
    def gather(self, block_ids, config):
        if len(block_ids) == 0:
            return DynamicCache(config=config)
        kv = self.tokens_of(block_ids)
        return DynamicCache(list(zip(kv[:, 0], kv[:, 1])), config=config)

    def tokens_of(self, block_ids):
        picked = self.data[:, :, torch.as_tensor(block_ids, device=self.device)]  # (L, 2, n, bs, H, D)
        layers, _, n, bs, heads, dim = picked.shape
        return picked.reshape(layers, 2, n * bs, heads, dim).permute(0, 1, 3, 2, 4).unsqueeze(2)
