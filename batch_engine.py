"""
Many requests, one forward pass: the step that runs what scheduler.py plans, on the paged pool.

Read one_request.py first (stage 7: one request at a time, its cached prefix copied out of
the pool into a private DynamicCache) and scheduler.py (what runs in the next step). Here
there is no DynamicCache: in every layer, the model's attention takes each request's K/V
from the pool through its block table.

    1. pool attention    an attention function registered with transformers'
                         AttentionInterface. The model stays an unmodified Hugging Face model;
                         only the function its attention layers call changes.
    2. one step          the scheduled tokens of every request packed into one sequence:
                         input ids, their positions, the slot each token's K/V goes to, the
                         slots each request attends over, and a mask that keeps requests apart
    3. the batch runner  schedule, run the step, sample a token per request, finish requests
    4. the engine loop   a thread that steps the runner for callers in other threads
                         (Engine(batching=True): the server's clients)

In every layer, the step's new K/V are written into their slots first; only then does any
request attend. So a request admitted in the same step as another can hit the blocks the
other computes in that very step, as in vLLM.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from kv_pool import slot_ids
from outputs import Generation, ReplyBuilder, StreamEvent
from prefix_caching import OutOfBlocksError
from sampling import SamplingParams, sample_batch
from scheduler import FINISHED, Request, Scheduler, StepPlan

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
    merged by their log-sum-exp, as vLLM's cascade attention and FlashInfer's shared-prefix
    decoding do. The same numbers as one attention over the whole context, up to rounding:
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
# chunks: at most 2 x MAX_GROUPS calls a layer, whatever the number of requests.

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


# -----------------------------------------------------------------------------
# 3. The batch runner


@dataclass
class _State:
    """What the runner keeps with each request (Request.payload)."""

    params: SamplingParams
    generator: torch.Generator | None
    builder: ReplyBuilder  # the reply, and its text as the tokens come (outputs.py)
    arrival: float
    admitted_at: float | None = None
    new_text: str = ""  # what the last sampled token added to the reply's text
    events: queue.SimpleQueue | None = None  # where an EngineLoop sends this request's StreamEvents

    @property
    def reply(self) -> Generation:
        return self.builder.reply


@dataclass(frozen=True)
class StepFigures:
    """How big one step was: its requests, the tokens of its forward pass, how many of those
    were prefill (a prompt's uncached part, or a resumed request's text again), and the pool
    slots its attention needed and read (padding included), in each layer."""

    num_requests: int
    num_tokens: int
    num_prefill_tokens: int
    num_slots_needed: int = 0
    num_slots_read: int = 0

    @classmethod
    def of(cls, plan: StepPlan, inputs: StepInputs) -> StepFigures:
        prefill = sum(s.end - s.start for s in plan.scheduled if s.is_prefill)
        return cls(len(plan.scheduled), plan.num_tokens, prefill, inputs.slots_needed, inputs.slots_read)


class BatchRunner:
    """Runs requests together over an engine's model and pool: one forward pass per step for
    all of them, planned by a Scheduler of its own.

    engine: what it runs on (engine.Engine): its model, tokenizer, stop_token_ids, allocator,
    kv (the PagedKVPool), and its two locks: lock, held for every step, and allocator_lock,
    held around the allocator's and the scheduler's bookkeeping only.
    """

    def __init__(self, engine, *, cascade_attention: bool = True, **scheduler_options) -> None:
        """cascade_attention: decodes that share their first blocks attend over them once
        (shared_prefix_attention). scheduler_options: Scheduler's max_num_seqs,
        max_num_batched_tokens and enable_chunked_prefill."""
        self.engine = engine
        self.cascade_attention = cascade_attention
        use_pool_attention(engine.model)
        self.scheduler = Scheduler(engine.allocator, **scheduler_options)
        self.last_plan: StepPlan | None = None  # the latest step's plan; None while one is being made
        self.num_steps = 0  # steps that scheduled anything: one forward pass each
        self.last_step: StepFigures | None = None  # the latest of them, maybe running now

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
            stop: tuple[str, ...] = ()) -> Request:
        request = self.new_request(request_id, prompt_ids, params, cache_salt, stop)
        self.scheduler.add(request)
        return request

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                    stop: tuple[str, ...] = ()) -> Request:
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        reply = Generation(request_id, prompt_tokens=len(prompt_ids))
        builder = ReplyBuilder(reply, self.engine.tokenizer, self.engine.stop_token_ids, stop, params.max_tokens)
        state = _State(params, generator, builder, time.perf_counter())
        return Request(request_id, list(prompt_ids), cache_salt, params.max_tokens, payload=state)

    def step(self) -> list[Request]:
        """Schedule, run one forward pass, sample; returns the requests that finished (their
        blocks freed, their replies complete).

        Holds engine.lock for the step (so it never interleaves with another caller's steps)
        and engine.allocator_lock around the allocator's bookkeeping only. If it raises, the
        requests of last_plan (all of them, if that is None) are the ones it left half done."""
        engine, scheduler = self.engine, self.scheduler
        self.last_plan = None
        with engine.lock:
            with engine.allocator_lock:
                plan = self.last_plan = scheduler.schedule()
                block_tables = {s.request.request_id: list(engine.allocator.block_tables[s.request.request_id])
                                for s in plan.scheduled}
            if not plan.scheduled:
                return []
            inputs = build_step(plan, engine.kv, block_tables, engine.device, self.cascade_attention)
            self.num_steps += 1
            self.last_step = StepFigures.of(plan, inputs)
            now = time.perf_counter()
            for s in plan.scheduled:
                if s.request.payload.admitted_at is None:  # its first admission: its hit is known
                    s.request.payload.admitted_at = now
                    s.request.payload.reply.cached_tokens = s.request.num_cached_tokens
            with torch.inference_mode():
                logits = engine.model(
                    input_ids=inputs.input_ids, position_ids=inputs.positions, use_cache=False,
                    logits_to_keep=inputs.last_token, pool_step=inputs,
                ).logits[0]  # (requests that sample, vocab)
            for s in plan.scheduled:
                s.request.num_computed_tokens = s.end  # its K/V are in the pool now
            # Every request samples before any finishes: a failure in one leaves them all as
            # they were, for the caller to fail together.
            sampling = [s.request for s in plan.scheduled if s.samples]
            tokens = sample_batch(logits, [r.payload.params for r in sampling], [r.payload.generator for r in sampling])
            finished = [request for request, token in zip(sampling, tokens) if self._add_token(request, token)]
            with engine.allocator_lock:
                for request in finished:
                    scheduler.finish(request)
        end = time.perf_counter()
        for request in finished:
            state, reply = request.payload, request.payload.reply
            reply.total_ms = (end - state.arrival) * 1e3
            reply.wait_ms = (state.admitted_at - state.arrival) * 1e3
            reply.num_preemptions = request.num_preemptions
        return finished

    def _add_token(self, request: Request, token: int) -> bool:
        """Add the request's sampled token to it and to its reply; whether that finished it."""
        state = request.payload
        request.output_ids.append(token)
        if len(request.output_ids) == 1:
            state.reply.ttft_ms = (time.perf_counter() - state.arrival) * 1e3
        state.new_text, finish_reason = state.builder.add(token)
        return finish_reason is not None

    def run(self, requests: list[Request]) -> list[Generation]:
        """Step until every one of `requests` has finished; their replies, in order.

        The runner's scheduler sees only its own requests. If a step can run none of them
        while none runs, the pool is held by someone else (a stream of the same engine): that
        raises OutOfBlocksError instead of waiting for blocks this runner cannot see freed."""
        while any(r.status != FINISHED for r in requests):
            self.step()
            plan = self.last_plan
            if not (plan.scheduled or plan.preempted or self.scheduler.running):
                raise OutOfBlocksError(
                    f"the KV pool is held by other requests of this engine ({self.engine.allocator.num_free_blocks} "
                    f"blocks free): use Engine(batching=True) to queue every caller's requests together"
                )
        return [r.payload.reply for r in requests]


# -----------------------------------------------------------------------------
# 4. The engine loop: calls from many threads, one forward pass per step for all of them


@dataclass(frozen=True)
class LoopSnapshot:
    """The engine loop at one moment (EngineLoop.snapshot), for a status page."""

    running: list[tuple[str, str | None]]  # (request id, cache_salt), in admission order
    waiting: list[tuple[str, str | None]]  # the same, in queue order: the head is admitted next
    prefilling: dict[str, tuple[int, int]]  # running requests part-way through their prompt: (computed, total)
    num_preemptions: int
    num_steps: int
    last_step: StepFigures | None


class EngineLoop:
    """A thread that owns the model and steps one BatchRunner while any request waits or runs:
    the engine's only scheduler, whoever calls.

    Callers (a server's request threads, generate_batch) submit requests and read each one's
    StreamEvents from a queue; a caller that gives up cancels, and the request's blocks are
    freed before the next step. A step that fails fails every request in it, with the error
    as its last event, and the loop goes on with the rest.
    """

    def __init__(self, engine, **options) -> None:
        self.engine = engine
        self.runner = BatchRunner(engine, **options)
        self._wake = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._cancelled: list[Request] = []
        self.live: dict[str, Request] = {}  # submitted and not finished, by request id
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def scheduler(self):
        return self.runner.scheduler

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                    stop: tuple[str, ...] = ()) -> Request:
        request = self.runner.new_request(request_id, prompt_ids, params, cache_salt, stop)
        request.payload.events = queue.SimpleQueue()
        return request

    def submit(self, requests: list[Request]) -> None:
        """Queue `requests` in this order, behind everything submitted before; all of them or,
        when one is refused, none."""
        ids = [r.request_id for r in requests]
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine loop has stopped: the process is exiting")
            taken = sorted({i for i in ids if i in self.live or ids.count(i) > 1})
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already running; pick another id")
            for request in requests:
                self.live[request.request_id] = request
                self._inbox.append(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
                self._thread.start()
                atexit.register(self.stop)
            self._wake.notify()

    def stop(self) -> None:
        """Let the step that runs finish, then end the thread. Called at exit: a thread
        killed inside a forward pass aborts the whole process ("terminate called without an
        active exception"), since torch's C++ frames cannot be unwound under it."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def cancel(self, request: Request) -> None:
        with self._wake:
            self._cancelled.append(request)
            self._wake.notify()

    def events(self, request: Request):
        """The request's StreamEvents as they come; cancels it if the caller stops early."""
        try:
            while True:
                event = request.payload.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if request.status != FINISHED:
                self.cancel(request)

    def _run(self) -> None:
        scheduler, engine = self.runner.scheduler, self.engine
        while True:
            with self._wake:
                while not (self._inbox or self._cancelled or scheduler.has_work() or self._stopping):
                    self._wake.wait()
                if self._stopping:
                    return
                inbox, self._inbox = list(self._inbox), deque()
                cancelled, self._cancelled = self._cancelled, []
            with engine.allocator_lock:
                for request in inbox:
                    scheduler.add(request)
                for request in cancelled:
                    if request.status != FINISHED:
                        scheduler.finish(request)
                        self._forget(request)
            try:
                finished = set(self.runner.step())
            except Exception as err:
                self._fail(err)
                continue
            for s in self.runner.last_plan.scheduled:
                if not s.samples:
                    continue  # a chunk of a prompt: nothing to tell its caller yet
                request, state = s.request, s.request.payload
                if request in finished:
                    self._forget(request)
                event = StreamEvent(request.output_ids[-1], state.new_text, state.reply.finish_reason, state.reply)
                state.events.put(event)

    def _fail(self, err: Exception) -> None:
        """The step raised: every request in it (finished in it or not) ends with the error,
        its blocks freed; requests that were not in it go on."""
        scheduler, plan = self.runner.scheduler, self.runner.last_plan
        failed = [s.request for s in plan.scheduled] if plan else [*scheduler.running, *scheduler.waiting]
        with self.engine.allocator_lock:
            for request in failed:
                if request.status != FINISHED:
                    scheduler.finish(request)
        for request in failed:
            self._forget(request)
            request.payload.events.put(err)

    def snapshot(self) -> LoopSnapshot:
        """Who runs, who waits, and the steps so far, read without waiting for a forward pass:
        the scheduler's queues change only under engine.allocator_lock, which a step holds
        around its bookkeeping and never across the model."""
        with self.engine.allocator_lock, self._wake:
            scheduler, cancelled = self.scheduler, set(self._cancelled)
            waiting = [r for r in [*scheduler.waiting, *self._inbox] if r not in cancelled]
            return LoopSnapshot(
                running=[(r.request_id, r.cache_salt) for r in scheduler.running],
                waiting=[(r.request_id, r.cache_salt) for r in waiting],
                prefilling={r.request_id: (r.num_computed_tokens, r.num_computed_tokens + r.num_prefill_left)
                            for r in scheduler.running if r.num_prefill_left},
                num_preemptions=scheduler.num_preemptions,
                num_steps=self.runner.num_steps,
                last_step=self.runner.last_step,
            )

    def _forget(self, request: Request) -> None:
        with self._wake:
            self.live.pop(request.request_id, None)
