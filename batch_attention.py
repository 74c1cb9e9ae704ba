"""
Attention on the paged pool: how one forward pass serves many requests at once.

Read kv_pool.py (the pool) and scheduler.py (what a step schedules) first; batch_engine.py
runs a step with what this file builds.

    1. pool attention    an attention function registered with transformers'
                         AttentionInterface. The model stays an unmodified Hugging Face model;
                         only the function its attention layers call changes. Decodes that
                         share a prefix's blocks attend over it once (shared_prefix_attention).
    2. one step          the scheduled tokens of every request packed into one sequence:
                         input ids, their positions, the slot each token's K/V goes to, and
                         who attends with whom over which slots (build_step)

In every layer, the step's new K/V are written into their slots first; only then does any
request attend. So a request admitted in the same step as another can hit the blocks the
other computes in that very step, as in vLLM.

References: vLLM's attention metadata (slot_mapping, block tables) and its cascade attention
(vllm/v1/attention/backends/flash_attn.py: cascade_attention, merge_attn_states).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from kv_pool import slot_ids
from scheduler import StepPlan

# -----------------------------------------------------------------------------
# 1. Pool attention
#
# Registered under its own name; when a forward pass carries no `pool_step` (one_request.py's
# path, or plain model.generate) it is exactly transformers' sdpa.

POOL_ATTENTION = "prefix_caching_pool"


def pool_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, pool_step=None, **kwargs):
    """query (1, heads, T, dim) for the T packed tokens of the step; key/value (1, kv heads, T, dim).

    Returns (1, T, heads, dim), as transformers' attention functions do.
    """
    if pool_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    step: StepInputs = pool_step
    flat = step.pool.slots(module.layer_idx)  # (2, slots, kv heads, dim)
    # Write first: every new key and value of the step lands in its slot before anyone reads.
    flat[0, step.slot_mapping] = key[0].transpose(0, 1).to(flat.dtype)
    flat[1, step.slot_mapping] = value[0].transpose(0, 1).to(flat.dtype)
    # Then read: each request's whole context, through its block table, a group at a time.
    packed = query[0].transpose(0, 1)  # (T, heads, dim)
    out = packed.new_empty(packed.shape)
    for group in step.groups:
        if group.prefix_slots is not None:
            out[group.token_index] = shared_prefix_attention(packed[group.query_index[:, 0]], flat, group, scaling)
            continue
        keys, values = flat[:, group.context_slots].transpose(2, 3)  # each (rows, kv heads, context, dim)
        queries = packed[group.query_index].transpose(1, 2)  # (rows, heads, queries, dim)
        attended = F.scaled_dot_product_attention(queries, keys.to(queries.dtype), values.to(queries.dtype),
                                                  attn_mask=group.mask, scale=scaling, enable_gqa=True)
        out[group.token_index] = attended.transpose(1, 2)[group.token_row, group.token_query]  # packed order
    return out.unsqueeze(0), None


def attend(queries, keys, values, scale, valid=None):
    """Attention of queries (n, kv heads, g, dim) over keys and values (n, keys, kv heads, dim),
    or (keys, kv heads, dim) shared by all n; valid (n, keys) masks out padding. Returns the
    output (n, kv heads, g, dim) and the log-sum-exp of each query's scores (n, kv heads, g, 1)."""
    shared = keys.dim() == 3
    scores = torch.einsum("nkgd,pkd->nkgp" if shared else "nkgd,npkd->nkgp", queries, keys) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    out = torch.einsum("nkgp,pkd->nkgd" if shared else "nkgp,npkd->nkgd", (scores - lse).exp(), values)
    return out, lse


def shared_prefix_attention(query, flat, group: AttentionGroup, scaling):
    """Decodes that share their first blocks (a system prompt): attention over the shared
    prefix computed once for all their queries, over each one's own part apart, and the two
    merged by their log-sum-exp, as vLLM's cascade attention does (cascade_attention and
    merge_attn_states in vllm/v1/attention/backends/flash_attn.py; there one prefix common to
    every request of the batch, here one for each family of decodes, decode_groups). The same
    numbers as one attention over the whole context, up to rounding:
        softmax over [prefix, own] = (e^lse_p * out_p + e^lse_o * out_o) / (e^lse_p + e^lse_o)

    query (n, heads, dim), one per decode; returns (n, heads, dim).
    """
    n, heads, dim = query.shape
    kv_heads = flat.shape[2]
    q = query.view(n, kv_heads, heads // kv_heads, dim)
    scale = dim ** -0.5 if scaling is None else scaling
    prefix_k, prefix_v = flat[:, group.prefix_slots]  # (prefix, kv heads, dim): read once for all n
    own_k, own_v = flat[:, group.context_slots]  # (n, own, kv heads, dim)
    out_p, lse_p = attend(q, prefix_k.to(q.dtype), prefix_v.to(q.dtype), scale)
    out_o, lse_o = attend(q, own_k.to(q.dtype), own_v.to(q.dtype), scale, valid=group.mask[:, 0, 0, :])
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
# 2. One step's inputs
#
# Attention runs in a few groups, each one scaled_dot_product_attention call over its
# requests' contexts padded to the longest in the group. One group for everyone would make
# every request pay for the longest context (one 2,000-token request among short ones makes
# every decode read 2,000 slots); one call per request makes many small operations, each
# with a fixed cost. So the decodes are sorted by context and cut into as few groups as keep
# the padding within PADDING (25 %) of the work, at most MAX_GROUPS, and so are the prompts'
# chunks; decodes sharing a prefix's blocks form up to MAX_GROUPS families of their own
# (decode_groups). At most 3 x MAX_GROUPS groups a layer, whatever the number of requests.

MAX_GROUPS = 4
PADDING = 1.25


@dataclass
class Row:
    """One request in a step: its tokens [start, end) are packed from `first` on."""

    first: int
    start: int
    end: int
    context_slots: torch.Tensor  # the pool slots of its tokens 0..end-1
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
class AttentionGroup:
    """Requests that attend together in one scaled_dot_product_attention call, padded to the
    group's longest context and most queries.

    For requests a computing tokens 4..6 of 7 and b decoding token 9, in one group:
        context_slots  (2, 10): a's slots 0..6, padded; b's slots 0..9
        mask           (2, 1, 3, 10): a's query 4 sees keys 0..4, ...; b's one query sees 0..9
        query_index    (2, 3): the packed token of each (request, query); padding points at 0
        token_index    [0, 1, 2, 3]: the group's packed tokens, and for each its request's row
        token_row      [0, 0, 0, 1]  and its query in that row
        token_query    [0, 1, 2, 0]
    """

    context_slots: torch.Tensor  # (rows, longest context)
    mask: torch.Tensor  # (rows, 1, most queries, longest context), True = may attend
    query_index: torch.Tensor  # (rows, most queries)
    token_index: torch.Tensor  # (tokens of the group,)
    token_row: torch.Tensor
    token_query: torch.Tensor
    # Decodes sharing their first blocks (shared_prefix_attention): the shared slots, read once;
    # context_slots and mask then hold each one's own part only.
    prefix_slots: torch.Tensor | None = None


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
    slots_read: int  # the slots the groups read, padding included, in each layer


def group_indices(rows: list[Row]) -> dict[str, torch.Tensor]:
    """The CPU index tensors of one group (AttentionGroup's, with the queries' positions
    instead of the mask, which is built from them where it is used)."""
    longest_context = max(r.end for r in rows)
    most_queries = max(r.num_queries for r in rows)
    context_slots = torch.zeros(len(rows), longest_context, dtype=torch.long)
    query_index = torch.zeros(len(rows), most_queries, dtype=torch.long)
    query_position = torch.zeros(len(rows), most_queries, dtype=torch.long)  # padding rows see key 0 only
    token_index, token_row, token_query = [], [], []
    for i, r in enumerate(rows):
        context_slots[i, : r.end] = r.context_slots
        query_index[i, : r.num_queries] = torch.arange(r.first, r.first + r.num_queries)
        query_position[i, : r.num_queries] = torch.arange(r.start, r.end)
        token_index += range(r.first, r.first + r.num_queries)
        token_row += [i] * r.num_queries
        token_query += range(r.num_queries)
    return {"context_slots": context_slots, "query_index": query_index, "query_position": query_position,
            "token_index": torch.tensor(token_index), "token_row": torch.tensor(token_row),
            "token_query": torch.tensor(token_query)}


def shared_prefix(rows: list[Row], block_size: int) -> int:
    """Tokens at the start of every row's context held in the same blocks (whole blocks, and
    never a row's whole context: each keeps at least its own last token).

    >>> rows = [Row(0, 9, 10, None, [4, 5, 6]), Row(1, 10, 11, None, [4, 5, 7])]
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


def decode_groups(decodes: list[Row], cascade: bool) -> list[list[Row]]:
    """The decodes' groups. With cascade, decodes whose tables start with the same block (a
    family: one system prompt) form a group of their own, at most MAX_GROUPS families, the
    largest first: their shared prefix is read once and only their own parts are padded, to
    the longest own part. The others are grouped by context (group_rows)."""
    if not cascade:
        return group_rows(decodes)
    families: dict[int, list[Row]] = {}
    for row in decodes:
        families.setdefault(row.table[0], []).append(row)
    shared = sorted((f for f in families.values() if len(f) > 1), key=len, reverse=True)[:MAX_GROUPS]
    taken = {id(row) for family in shared for row in family}
    return shared + group_rows([row for row in decodes if id(row) not in taken])


def to_device(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Long tensors moved to `device` in one copy (on a GPU, each copy has a fixed cost)."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensors
    moved = torch.cat([t.reshape(-1) for t in tensors]).to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(moved.split([t.numel() for t in tensors]), tensors)]


def build_step(plan: StepPlan, pool, block_tables: dict[str, list[int]], device, cascade: bool = True) -> StepInputs:
    """cascade: decodes grouped together that share their first blocks attend over them once
    (shared_prefix_attention)."""
    block_size = pool.block_size
    tokens, positions, slots, last = [], [], [], []
    decodes, prefills = [], []
    for s in plan.scheduled:
        table = block_tables[s.request.request_id]
        row = Row(len(tokens), s.start, s.end, slot_ids(table, block_size, 0, s.end), table)
        (decodes if s.end - s.start == 1 else prefills).append(row)
        tokens += s.request.token_ids[s.start : s.end]
        positions += range(s.start, s.end)
        slots.append(slot_ids(table, block_size, s.start, s.end))
        if s.samples:  # a chunk that stops part-way through a prompt has no next token to pick
            last.append(len(tokens) - 1)
    indices, slots_read = [], 0
    for rows, decoding in [(g, True) for g in decode_groups(decodes, cascade)] + [(g, False) for g in group_rows(prefills)]:
        prefix = shared_prefix(rows, block_size) if cascade and decoding else 0
        if prefix:  # the group attends over its shared prefix once, then each over its own part
            own = [Row(r.first, r.start - prefix, r.end - prefix, r.context_slots[prefix:]) for r in rows]
            indices.append(group_indices(own) | {"prefix_slots": rows[0].context_slots[:prefix]})
            slots_read += prefix + len(own) * max(r.end for r in own)
        else:
            indices.append(group_indices(rows))
            slots_read += len(rows) * max(r.end for r in rows)
    cpu = [torch.tensor([tokens]), torch.tensor([positions]), torch.cat(slots), torch.tensor(last, dtype=torch.long)]
    cpu += [t for group in indices for t in group.values()]
    moved = iter(to_device(cpu, device))
    input_ids, position_ids, slot_mapping, last_token = (next(moved) for _ in range(4))
    groups = []
    for group in indices:
        parts = {name: next(moved) for name in group}
        position = parts.pop("query_position")
        longest = parts["context_slots"].shape[1]
        mask = torch.arange(longest, device=position.device)[None, None, :] <= position[:, :, None]  # causal
        groups.append(AttentionGroup(mask=mask.unsqueeze(1), **parts))
    return StepInputs(pool=pool, input_ids=input_ids, positions=position_ids, slot_mapping=slot_mapping,
                      groups=groups, last_token=last_token, slots_needed=sum(r.end for r in decodes + prefills),
                      slots_read=slots_read)
