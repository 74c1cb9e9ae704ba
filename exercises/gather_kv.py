"""
Exercise 5: gather cached K/V from the block pool into past_key_values (stage 7).

A request that hits cached blocks finds their keys and values in the paged pool,

    self.data[layer, 0, block, slot]   the key of one token, shape (num_kv_heads, head_dim)
    self.data[layer, 1, block, slot]   the value of that token

but the model reads them from past_key_values: a DynamicCache holding, for each layer, a
keys tensor and a values tensor of shape (batch=1, num_kv_heads, tokens, head_dim), the
tokens in prompt order. Token p of the prompt sits in block block_ids[p // block_size], at
slot p % block_size: the block table can point anywhere in the pool, in any order.

The constructor (self.data, self.dtype, self.device) comes from exercises/given.py. Write the
two parts marked TODO, with tensor operations only: no Python loop over tokens or blocks (a
real prefix has thousands of tokens in hundreds of blocks, and one index picks them all), and
no copy of the whole pool. The grader times your gather from outside your process, with each
line of Python in your file costing 10 µs, so that a loop over the blocks shows: each block of
4,096 must cost less than 10 times what one costs kv_pool's gather, all 4,096 less than 20
times what they cost it, and 4 blocks must take as long from a pool of 16,384 blocks as from
one of 16.
The gathered K/V keep the pool's dtype (a bfloat16 pool gives bfloat16 keys) and its device.

Finish line:
    EXERCISE_IMPL=starter python -m pytest tests/exercises/test_ex5_gather_kv.py
is green: on the tiny model, the logits of a cached prefix + suffix equal a full forward
pass, and an engine running on your gather replies exactly what model.generate does.
"""

from transformers import DynamicCache

from exercises.given import PoolBase


class PagedKVPool(PoolBase):
    def gather(self, block_ids: list[int], config):
        """A fresh DynamicCache holding the K/V of `block_ids`, in order. No blocks (a cold
        request) give a cache of 0 tokens."""
        kv = self.tokens_of(block_ids)  # (layers, K/V, 1, num_kv_heads, tokens, head_dim)
        # TODO exercise 5b: the cache the model reads as past_key_values. It must hold, for
        # every layer, that layer's keys and values, each (batch=1, num_kv_heads, tokens,
        # head_dim), the same tokens in the same order in every layer, and nothing else.
        # transformers' DynamicCache takes such tensors when it is built (its docstring says
        # how; pass config=config so it knows the model's layers). Check what you built on
        # the shapes `python lessons/07_real_model.py --tiny` prints.
        raise NotImplementedError("exercise 5b: the DynamicCache in PagedKVPool.gather is not built yet (exercises/gather_kv.py)")

    def tokens_of(self, block_ids: list[int]):
        """The K/V of every slot of `block_ids`, token after token, in attention's layout.

        self.data is (layers, 2, num_blocks, block_size, num_kv_heads, head_dim); the result is
        (layers, 2, 1, num_kv_heads, len(block_ids) * block_size, head_dim). For example, with
        block_size 4 and block_ids [7, 2]: tokens 0-3 are block 7's slots 0-3, tokens 4-7 block 2's.

        Three moves: pick the blocks (in block_ids order), merge the blocks and slots axes into
        one tokens axis, and put that axis after the heads (plus a batch axis of 1).
        """
        # TODO exercise 5a
        raise NotImplementedError("exercise 5a: PagedKVPool.tokens_of is not written yet (exercises/gather_kv.py)")
