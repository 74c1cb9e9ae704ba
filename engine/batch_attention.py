"""
Attention on the paged pool: how one forward pass serves many requests at once.

Read engine/kv_pool.py (the pool) and engine/scheduler.py (what a step schedules) first; engine/batch_engine.py
runs a step with what this file builds.

    1. pool attention    an attention function registered with transformers'
                         AttentionInterface. The model stays an unmodified Hugging Face model;
                         only the function its attention layers call changes. Decodes that
                         share a prefix's blocks may attend over it once (shared_prefix_attention).
    2. groups            who attends with whom: requests of similar context length (group_rows)
    3. shared prefixes   where reading a shared prefix once pays, counted (decode_groups)
    4. one step          the scheduled tokens of every request packed into one sequence:
                         input ids, their positions, the slot each token's K/V goes to, and
                         the groups over their slots (build_step)

In every layer, the step's new K/V are written into their slots first; only then does any
request attend, over its blocks copied whole out of the pool into a buffer the pool keeps for
that (PagedKVPool.read_blocks): one index_select of block ids a group, no slot-by-slot gather,
no fresh memory each layer. Decodes attend with the query heads that share a kv head stacked
as that head's queries, so K and V are never repeated for grouped-query attention. Since the
writes come first, a request admitted in the same step as another can hit the blocks the
other computes in that very step, as in vLLM.

Shared-prefix (cascade) attention is allowed by default (build_step's cascade=True; the
engine's cascade_attention) and used only where the step's counted work says it pays. vLLM
weighs it too (use_cascade_attention in vllm/v1/attention/backends/flash_attn.py) but since
March 2026 leaves it off unless asked (disable_cascade_attn=True in vllm/config/model.py,
vllm-project/vllm pull request 36318: opt-in, to avoid potential numerical issues). Here it
stays on: its results are checked against attention without it (tests/engine/test_shared_prefix.py,
tests/engine/test_batching.py), and on this course's CPU path it makes the decode steps of many
chats behind one system prompt much faster, while the decision keeps every other step as
fast as without it (python prefix_caching.py --bench attention measures both).

References: vLLM's attention metadata (slot_mapping, block tables) and its cascade attention
(vllm/v1/attention/backends/flash_attn.py: cascade_attention, merge_attn_states,
use_cascade_attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from engine.kv_pool import slot_ids
from engine.scheduler import StepPlan

# -----------------------------------------------------------------------------
# 1. Pool attention
#
# Registered under its own name; when a forward pass carries no `pool_step` (engine/one_request.py's
# path, or plain model.generate) it is exactly transformers' sdpa.

POOL_ATTENTION = "prefix_caching_pool"


def pool_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, pool_step=None, **kwargs):
    """query (1, heads, T, dim) for the T packed tokens of the step; key/value (1, kv heads, T, dim).

    Returns (1, T, heads, dim), as transformers' attention functions do.
    """
    if pool_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if not isinstance(pool_step, StepInputs):  # a step that attends in its own way (static_decode.StaticStep)
        return pool_step.attend(module.layer_idx, query, key, value, scaling)
    step: StepInputs = pool_step
    pool, layer = step.pool, module.layer_idx
    # Write first: every new key and value of the step lands in its slot before anyone reads.
    pool.write_slots(layer, step.slot_mapping, key, value)
    # Then read: each request's context, block by block through its block table, a group at a time.
    packed = query[0].transpose(0, 1)  # (T, heads, dim)
    out = packed.new_empty(packed.shape)
    for group in step.groups:
        if group.prefix_blocks is not None:
            out[group.token_index] = shared_prefix_attention(packed[group.query_index[:, 0]], pool, layer, group,
                                                             scaling)
            continue
        rows, blocks = group.context_blocks.shape
        kv = pool.read_blocks(layer, group.context_blocks.view(-1)).to(packed.dtype)  # (2, rows x slots, heads, dim)
        keys, values = kv.view(2, rows, blocks * pool.block_size, *kv.shape[2:]).transpose(2, 3)  # (rows, kv heads,
        #                                                                              slots, dim): views, no copy
        if group.query_index.shape[1] == 1:  # decodes: a kv head's query heads are its queries (no K/V repeated)
            heads, dim = packed.shape[1:]
            queries = packed[group.query_index[:, 0]].view(rows, keys.shape[1], -1, dim)
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, scale=scaling)
            out[group.token_index] = attended.reshape(rows, heads, dim)
            continue
        queries = packed[group.query_index].transpose(1, 2)  # (rows, heads, queries, dim)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, scale=scaling,
                                                  enable_gqa=True)
        out[group.token_index] = attended.transpose(1, 2)[group.token_row, group.token_query]  # packed order
    return out.unsqueeze(0), None


def attend(queries, keys, values, scale, valid=None):
    """Attention of queries (n, kv heads, g, dim) over keys and values (n, keys, kv heads, dim),
    or (keys, kv heads, dim) shared by all n; valid (n, keys) masks out padding. Returns the
    output (n, kv heads, g, dim) and the log-sum-exp of each query's scores (n, kv heads, g, 1).

    One batched matmul over the kv heads: permuting the keys head first is a view, not a copy,
    where they lie head first already (shared_prefix_attention puts them so); otherwise the
    matmul copies them into that order.
    """
    n, kv_heads, g, dim = queries.shape
    q = queries.transpose(0, 1)  # (kv heads, n, g, dim)
    if keys.dim() == 3:  # one set of keys for all: a kv head's n x g queries are one matrix
        q = q.reshape(kv_heads, n * g, dim)
        k, v = keys.permute(1, 0, 2), values.permute(1, 0, 2)  # (kv heads, keys, dim)
    else:
        k, v = keys.permute(2, 0, 1, 3), values.permute(2, 0, 1, 3)  # (kv heads, n, keys, dim)
    scores = q @ k.transpose(-1, -2) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    out = (scores - lse).exp() @ v
    return out.view(kv_heads, n, g, dim).transpose(0, 1), lse.view(kv_heads, n, g, 1).transpose(0, 1)


def shared_prefix_attention(query, pool, layer: int, group: AttentionGroup, scaling):
    """Decodes that share their first blocks (a system prompt): attention over the shared
    prefix computed once for all their queries, over each one's own part apart, and the two
    merged by their log-sum-exp, as vLLM's cascade attention does (cascade_attention and
    merge_attn_states in vllm/v1/attention/backends/flash_attn.py; there one prefix common to
    every request of the batch, here one for each group that decode_groups finds worth it).
    The same numbers as one attention over the whole context, up to rounding:
        softmax over [prefix, own] = (e^lse_p * out_p + e^lse_o * out_o) / (e^lse_p + e^lse_o)

    query (n, heads, dim), one per decode; returns (n, heads, dim).
    """
    n, heads, dim = query.shape
    kv_heads = pool.num_kv_heads
    q = query.view(n, kv_heads, heads // kv_heads, dim)
    scale = dim ** -0.5 if scaling is None else scaling
    # The prefix's blocks and every decode's own blocks in one read.
    num_prefix = group.prefix_blocks.numel() * pool.block_size
    kv = pool.read_blocks(layer, torch.cat([group.prefix_blocks, group.context_blocks.view(-1)])).to(q.dtype)
    prefix_k, prefix_v = kv[:, :num_prefix]  # (prefix, kv heads, dim): read once for all n
    # Each kv head's own keys and values side by side, in one copy of K and V together: attend's
    # matmuls then read them in place (given them slot first, they would copy K and V apart).
    own = kv[:, num_prefix:].view(2, n, -1, kv_heads, dim).permute(0, 3, 1, 2, 4).contiguous()  # (K/V, kv heads,
    own_k, own_v = own.permute(0, 2, 3, 1, 4)  # views in attend's order: (n, own, kv heads, dim)       n, own, dim)
    out_p, lse_p = attend(q, prefix_k, prefix_v, scale)
    out_o, lse_o = attend(q, own_k, own_v, scale, valid=group.mask[:, 0, 0, :])
    top = torch.maximum(lse_p, lse_o)
    w_p, w_o = (lse_p - top).exp(), (lse_o - top).exp()
    return ((out_p * w_p + out_o * w_o) / (w_p + w_o)).reshape(n, heads, dim)


AttentionInterface.register(POOL_ATTENTION, pool_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(POOL_ATTENTION, sdpa_mask)  # the one-request path's masks


def use_pool_attention(model) -> None:
    """Point the model's attention layers at pool_attention (sdpa when no step is given)."""
    if model.config._attn_implementation != POOL_ATTENTION:
        model.set_attn_implementation(POOL_ATTENTION)


# -----------------------------------------------------------------------------
# 2. Groups
#
# Attention runs in a few groups, each one scaled_dot_product_attention call over its
# requests' contexts padded to the longest in the group. One group for everyone would make
# every request pay for the longest context (one 2,000-token request among short ones makes
# every decode read 2,000 slots); one call per request makes many small operations, each
# with a fixed cost. So the decodes are sorted by context and cut into as few groups as keep
# the padding within PADDING (25 %) of the work, at most MAX_GROUPS, and so are the prompts'
# chunks; decodes sharing a long prefix's blocks may form up to MAX_GROUPS groups of their own
# (section 3). At most 3 x MAX_GROUPS groups a layer, whatever the number of requests.

MAX_GROUPS = 4
PADDING = 1.25


@dataclass
class Row:
    """One request in a step: its tokens [start, end) are packed from `first` on."""

    first: int
    start: int
    end: int
    table: list[int] = None  # its block table: where its prefix is shared, the same ids

    @property
    def num_queries(self) -> int:
        return self.end - self.start


def group_rows(rows: list[Row], max_groups: int = MAX_GROUPS) -> list[list[Row]]:
    """Rows cut into the fewest groups whose padded work is within PADDING of the work itself,
    at most max_groups (then the cut with the least padded work). Rows are sorted by
    context; a group's work is its rows x longest context x most queries.

    >>> rows = [Row(0, n - 1, n, None) for n in (100, 2000, 110, 105)]   # four decodes
    >>> [[r.end for r in g] for g in group_rows(rows, 2)]   # the long one apart: 3 x 110 + 2,000 slots
    [[100, 105, 110], [2000]]
    """
    rows = sorted(rows, key=lambda r: (r.end, r.num_queries))
    n = len(rows)
    best = [[0.0] + [float("inf")] * n]  # best[k][j]: least cost of rows[:j] in k groups
    cut = [[0] * (n + 1)]
    for k in range(1, min(max_groups, n) + 1):
        best.append([float("inf")] * (n + 1))
        cut.append([0] * (n + 1))
        for j in range(1, n + 1):
            most = 0
            for i in range(j - 1, -1, -1):  # the last group is rows[i:j]
                most = max(most, rows[i].num_queries)
                cost = best[k - 1][i] + (j - i) * rows[j - 1].end * most
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    work = sum(r.end * r.num_queries for r in rows)
    k = next((k for k in range(1, len(best)) if best[k][n] <= PADDING * work), None)
    k = k or min(range(len(best)), key=lambda k: best[k][n])
    groups, j = [], n
    while j > 0:
        groups.append(rows[cut[k][j]:j])
        j, k = cut[k][j], k - 1
    return groups[::-1]


@dataclass
class RowGroup:
    """Rows that attend together, each over its context padded to the group's longest; with
    prefix > 0, the first `prefix` tokens of every row's context are held in the same blocks and
    read once for all (shared_prefix_attention), and only the rest of each row is padded.

    >>> rows = [Row(0, 99, 100, None), Row(1, 109, 110, None)]
    >>> RowGroup(rows).slots_read, RowGroup(rows, prefix=96).slots_read   # 2 x 110; 96 + 2 x (110 - 96)
    (220, 124)
    """

    rows: list[Row]
    prefix: int = 0

    @property
    def slots_read(self) -> int:
        """The pool slots the group reads in each layer, padding included."""
        return self.prefix + len(self.rows) * (max(r.end for r in self.rows) - self.prefix)


# -----------------------------------------------------------------------------
# 3. Shared prefixes, where they pay
#
# Decodes whose block tables start with the same blocks (one system prompt) can attend over
# them once for all and each over its own part apart (shared_prefix_attention): that saves
# (decodes - 1) x prefix slots a layer. It is not free. Their own parts are padded to the
# longest among them (one 2,000-token conversation behind a chat template would make every
# other member pad to it); they are attended by matmuls that materialize the scores, slower
# per slot than the one fused scaled_dot_product_attention of a plain group; and the group
# runs a dozen more small operations. So a step weighs it, as vLLM weighs cascade attention
# before it uses it (use_cascade_attention in vllm/v1/attention/backends/flash_attn.py: never
# below 256 shared tokens or 8 requests, then a cost model of its kernels):
#   - a family: at least CASCADE_MIN_REQUESTS decodes whose tables hold their first
#     CASCADE_MIN_TOKENS tokens in the same blocks;
#   - its members by context, the shortest first, as many share the prefix as save the most
#     against reading their contexts whole, the group's work counted by cascade_cost; the
#     longer members form a group of their own the same way, or go with the plain groups;
#   - the step uses these groups only if their cost with the plain groups of the rest is
#     below the slots group_rows over all its decodes reads. So a step never reads more slots
#     with cascade on than off.
# The constants come from timing this file's attention on a 2-core x86_64 CPU with
# SmolLM2-135M's slots (3 KV heads of 64, fp32): families of 2 to 64 decodes sharing 32 to
# 1,008 tokens, with own parts of 30 to 1,000 tokens, and python prefix_caching.py --bench
# attention. 2 or 3 decodes gained little even behind 1,000 shared tokens. Own parts cost
# about 1.5 times a plain group's slots, and the extra operations what reading about 800
# slots costs on 2 threads (half that on 1; more for a model with smaller slots).
# CASCADE_MIN_TOKENS also says which decodes make a family: a chat template's first block or
# two never does, so a member that shares only those cannot shorten the others' prefix.
# Shorter prefixes paid too where many decodes shared them, but less.

CASCADE_MIN_REQUESTS = 4
CASCADE_MIN_TOKENS = 256
CASCADE_OWN_COST = 1.5
CASCADE_GROUP_SLOTS = 800


def shared_prefix(rows: list[Row], block_size: int) -> int:
    """Tokens at the start of every row's context held in the same blocks (whole blocks, and
    never a row's whole context: each keeps at least its own last token).

    >>> rows = [Row(0, 9, 10, [4, 5, 6]), Row(1, 10, 11, [4, 5, 7])]
    >>> shared_prefix(rows, block_size=4)   # blocks 4 and 5: tokens 0-7
    8
    """
    if len(rows) < 2:
        return 0
    common = 0
    for ids in zip(*(r.table for r in rows)):
        if len(set(ids)) > 1:
            break
        common += 1
    return min(common * block_size, (min(r.end for r in rows) - 1) // block_size * block_size)


def cascade_cost(group: RowGroup) -> float:
    """A group's work, in slots read: its slots_read, except that a group sharing its prefix
    pays CASCADE_OWN_COST for each slot of its own parts and CASCADE_GROUP_SLOTS for its
    extra operations.

    >>> rows = [Row(i, 479, 480, None) for i in range(16)]   # 16 decodes sharing 448 tokens, 32 of their own
    >>> RowGroup(rows).slots_read, cascade_cost(RowGroup(rows, prefix=448))   # 16 x 480; 448 + 1.5 x 16 x 32 + 800
    (7680, 2016.0)
    """
    if not group.prefix:
        return group.slots_read
    return group.prefix + CASCADE_OWN_COST * (group.slots_read - group.prefix) + CASCADE_GROUP_SLOTS


def members_sharing(family: list[Row], prefix: int) -> int:
    """How many of a family's rows, sorted by context, attend over their shared prefix once:
    the first m, m the count that saves the most against reading their contexts whole (what
    no plain grouping beats), the group's work counted by cascade_cost; 0 if none saves.

    >>> family = [Row(i, n - 1, n, None) for i, n in enumerate([470] * 9 + [2000])]   # sharing 448
    >>> members_sharing(family, prefix=448)   # 9 x 470 against 448 + 1.5 x 9 x 22 + 800; the long one would pad all
    9
    """
    best, count, needed = 0, 0, 0
    for m, row in enumerate(family, 1):
        needed += row.end
        cost = prefix + CASCADE_OWN_COST * m * (row.end - prefix) + CASCADE_GROUP_SLOTS  # row: the longest so far
        if m >= CASCADE_MIN_REQUESTS and needed - cost > best:
            best, count = needed - cost, m
    return count


def decode_groups(decodes: list[Row], block_size: int, cascade: bool) -> list[RowGroup]:
    """The decodes' groups: by context (group_rows); with cascade, groups sharing a prefix where
    that pays and the rest by context, if that costs less (section 3).

    >>> shared = list(range(16))   # blocks 0-15: the first 256 tokens, block size 16
    >>> rows = [Row(i, 299, 300, shared + [100 + i, 200 + i]) for i in range(16)]   # 16 decodes behind them
    >>> [(len(g.rows), g.prefix, g.slots_read) for g in decode_groups(rows, 16, cascade=True)]   # 256 + 16 x 44
    [(16, 256, 960)]
    >>> [(len(g.rows), g.prefix, g.slots_read) for g in decode_groups(rows[:4], 16, cascade=True)]   # 4 x 300
    [(4, 0, 1200)]
    """
    plain = [RowGroup(g) for g in group_rows(decodes)]
    if not cascade:
        return plain
    blocks = -(-CASCADE_MIN_TOKENS // block_size)  # the blocks that hold the first CASCADE_MIN_TOKENS tokens
    families: dict[tuple[int, ...], list[Row]] = {}
    for row in decodes:
        if row.end > blocks * block_size:  # long enough to share them and keep a last token of its own
            families.setdefault(tuple(row.table[:blocks]), []).append(row)
    shared = []
    for family in families.values():
        family = sorted(family, key=lambda r: r.end)
        while m := members_sharing(family, shared_prefix(family, block_size)):
            shared.append(RowGroup(family[:m], shared_prefix(family[:m], block_size)))
            family = family[m:]  # the longer ones: maybe a group of their own
    shared = sorted(shared, key=lambda g: cascade_cost(g) - sum(r.end for r in g.rows))[:MAX_GROUPS]  # most saved first
    taken = {id(row) for group in shared for row in group.rows}
    mixed = shared + [RowGroup(g) for g in group_rows([row for row in decodes if id(row) not in taken])]
    cost = sum(cascade_cost(g) for g in mixed)
    return mixed if shared and cost < sum(g.slots_read for g in plain) else plain


# -----------------------------------------------------------------------------
# 4. One step's inputs


@dataclass
class AttentionGroup:
    """Requests that attend together in one scaled_dot_product_attention call, padded to the
    group's longest context and most queries. Their K/V are read from the pool a block at a
    time (PagedKVPool.read_blocks): whole blocks, so the keys run to the end of the longest
    context's last block, and the mask hides what lies past each request's own tokens.

    For requests a computing tokens 4..6 of 7 and b decoding token 9, block size 4, in one group:
        context_blocks (2, 3): a's blocks 0, 1 and a padding block; b's blocks 0, 1, 2
        mask           (2, 1, 3, 12): a's query 4 sees keys 0..4, ...; b's one query sees 0..9
        query_index    (2, 3): the packed token of each (request, query); padding points at 0
        token_index    [0, 1, 2, 3]: the group's packed tokens, and for each its request's row
        token_row      [0, 0, 0, 1]  and its query in that row
        token_query    [0, 1, 2, 0]
    """

    context_blocks: torch.Tensor  # (rows, most blocks): the block ids of each row's context, in order
    mask: torch.Tensor  # (rows, 1, most queries, most blocks x block size), True = may attend
    query_index: torch.Tensor  # (rows, most queries)
    token_index: torch.Tensor  # (tokens of the group,)
    token_row: torch.Tensor
    token_query: torch.Tensor
    # Decodes sharing their first blocks (shared_prefix_attention): the shared blocks, read once;
    # context_blocks and mask then hold each one's own part only.
    prefix_blocks: torch.Tensor | None = None


@dataclass
class StepInputs:
    """What the attention layers need to find every request's K/V in the pool.

    For a step with request a computing tokens 4..6 of 7 and request b decoding token 9:
        positions      [4, 5, 6, 9]             each packed token's place in its request
        slot_mapping   the slots tokens 4, 5, 6 of a and 9 of b are written to
        groups         who attends with whom (group_rows)
    """

    pool: object  # kv_pool.PagedKVPool
    input_ids: torch.Tensor  # (1, T)
    positions: torch.Tensor  # (1, T)
    slot_mapping: torch.Tensor  # (T,)
    groups: list[AttentionGroup]
    last_token: torch.Tensor  # packed index of the last token of each request that samples
    slots_needed: int  # pool slots the step's requests attend to: the sum of their contexts
    slots_read: int  # the slots the groups attend over, padding included, in each layer
    slots_copied: int  # the slots read_blocks copies out of the pool for them: whole blocks, in each layer


def group_indices(rows: list[Row], block_size: int) -> dict[str, torch.Tensor]:
    """The CPU index tensors of one group (AttentionGroup's, with the queries' positions
    instead of the mask, which is built from them where it is used)."""
    most_blocks = -(-max(r.end for r in rows) // block_size)
    most_queries = max(r.num_queries for r in rows)
    context_blocks = torch.zeros(len(rows), most_blocks, dtype=torch.long)  # padding reads block 0, masked
    query_index = torch.zeros(len(rows), most_queries, dtype=torch.long)
    query_position = torch.zeros(len(rows), most_queries, dtype=torch.long)  # padding rows see key 0 only
    token_index, token_row, token_query = [], [], []
    for i, r in enumerate(rows):
        blocks = r.table[: -(-r.end // block_size)]
        context_blocks[i, : len(blocks)] = torch.tensor(blocks)
        query_index[i, : r.num_queries] = torch.arange(r.first, r.first + r.num_queries)
        query_position[i, : r.num_queries] = torch.arange(r.start, r.end)
        token_index += range(r.first, r.first + r.num_queries)
        token_row += [i] * r.num_queries
        token_query += range(r.num_queries)
    return {"context_blocks": context_blocks, "query_index": query_index, "query_position": query_position,
            "token_index": torch.tensor(token_index), "token_row": torch.tensor(token_row),
            "token_query": torch.tensor(token_query)}


def to_device(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Long tensors moved to `device` in one copy (on a GPU, each copy has a fixed cost)."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensors
    moved = torch.cat([t.reshape(-1) for t in tensors]).to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(moved.split([t.numel() for t in tensors]), tensors)]


def build_step(plan: StepPlan, pool, block_tables: dict[str, list[int]], device, cascade: bool = True) -> StepInputs:
    """cascade: decodes that share a prefix's blocks may attend over them once
    (shared_prefix_attention), where counted work says it pays (decode_groups); False: never."""
    block_size = pool.block_size
    tokens, positions, slots, last = [], [], [], []
    decodes, prefills = [], []
    for s in plan.scheduled:
        table = block_tables[s.request.request_id]
        row = Row(len(tokens), s.start, s.end, table)
        (decodes if s.end - s.start == 1 else prefills).append(row)
        tokens += s.request.token_ids[s.start : s.end]
        positions += range(s.start, s.end)
        slots.append(slot_ids(table, block_size, s.start, s.end))
        if s.samples:  # a chunk that stops part-way through a prompt has no next token to pick
            last.append(len(tokens) - 1)
    row_groups = decode_groups(decodes, block_size, cascade) + [RowGroup(g) for g in group_rows(prefills)]
    indices = []
    for group in row_groups:
        if group.prefix:  # the group attends over its shared prefix once, then each over its own part
            p = group.prefix
            own = [Row(r.first, r.start - p, r.end - p, r.table[p // block_size :]) for r in group.rows]
            prefix_blocks = torch.tensor(group.rows[0].table[: p // block_size])
            indices.append(group_indices(own, block_size) | {"prefix_blocks": prefix_blocks})
        else:
            indices.append(group_indices(group.rows, block_size))
    cpu = [torch.tensor([tokens]), torch.tensor([positions]), torch.cat(slots), torch.tensor(last, dtype=torch.long)]
    cpu += [t for group in indices for t in group.values()]
    moved = iter(to_device(cpu, device))
    input_ids, position_ids, slot_mapping, last_token = (next(moved) for _ in range(4))
    groups = []
    for group in indices:
        parts = {name: next(moved) for name in group}
        position = parts.pop("query_position")
        keys = parts["context_blocks"].shape[1] * block_size
        mask = torch.arange(keys, device=position.device)[None, None, :] <= position[:, :, None]  # causal
        groups.append(AttentionGroup(mask=mask.unsqueeze(1), **parts))
    copied = sum(g.context_blocks.numel() + (0 if g.prefix_blocks is None else g.prefix_blocks.numel())
                 for g in groups) * block_size
    return StepInputs(pool=pool, input_ids=input_ids, positions=position_ids, slot_mapping=slot_mapping,
                      groups=groups, last_token=last_token, slots_needed=sum(r.end for r in decodes + prefills),
                      slots_read=sum(g.slots_read for g in row_groups), slots_copied=copied)
