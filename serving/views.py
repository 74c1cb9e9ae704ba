"""
What a caller of server.py may see: the figures of /health and the pool of /cache, for the
public tenant, a keyed tenant (--salt-by-api-key) or the admin.

    state = ServerState(engine, Settings("my-model", salt_by_api_key=True))
    state.figures(Viewer("<sha-256 of alice's key>", keyed=True))   # Alice's /health

A block's tenant is the cache_salt of the request that filled it (None: public). A caller
reads the hash and text of its own tenant's blocks only (without keys, every caller is the
public tenant, and sees every figure); any other block is opaque.

Under --salt-by-api-key a tenant sees its own and no more. Every figure that moves with
another tenant's traffic is scoped to its own requests or left out (null):

    its own                       running_requests, waiting_requests, prefilling_requests,
                                  blocks_in_use, num_cached_blocks, the counters (requests,
                                  queried_tokens, hit_tokens, hit_rate), block_tables,
                                  prefilling, waiting_queue, its blocks and their place in
                                  the free queue
    the same for everyone         status, model, num_blocks, block_size and the
                                  scheduler's settings: what the teacher started it with
    null or left out              num_free_blocks, preemptions, steps (null);
                                  last_step, step_costs, attention_costs (left out); every other block is its
                                  id alone, opaque, even an empty one (else their count would
                                  tell how many blocks the others fill)

What no server with one shared pool can hide is said in docs/server.md: how long a request
takes, and whether one's own cached blocks were evicted (someone else needed the room).
The admin key sees everything.

The loop's queues and the pool's figures come from the snapshot the engine loop publishes
after each change (engine.snapshot()), read without a lock: /health answers while a step
runs, without waiting for the loop. Only the blocks themselves (a keyed tenant's own, and
/cache's copy of every block, the free queue and the block tables) are read under
engine.allocator_lock, held for microseconds around the allocator's bookkeeping, never
across a forward pass. /cache is the biggest answer (every block, decoded): it is rendered
at most once per PAGE_EVERY_S for each viewer, and a key that owns nothing in the pool (a
made-up one) gets the one page every such key gets, so new keys cost no new rendering.

Read serving/requests.py first (Settings, who is asking); serving/routes.py answers with this.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from allocator import KVCacheBlock, short_hash
from engine.llm_engine import Engine
from serving.requests import Settings, is_admin, tenant_of

PAGE_EVERY_S = 0.25


@dataclass(frozen=True)
class Viewer:
    """Who is looking at /health or /cache."""

    tenant: str | None  # whose blocks it may read: its requests' cache_salt (None: the public cache)
    admin: bool = False  # the admin key: every block and figure
    keyed: bool = False  # a tenant of --salt-by-api-key: its own requests and figures only
    share: str | None = None  # whose fair share it sees: who asks as the scheduler counts it (Asker.tenant)


STRANGER = Viewer("", keyed=True)  # any keyed tenant with nothing in the pool: they all see the same page


@dataclass
class TenantCounters:
    """One tenant's share of the allocator's hit counters, counted by the server."""

    requests: int = 0
    queried_tokens: int = 0  # prompt tokens looked up in the cache
    hit_tokens: int = 0  # of those, found there

    def as_dict(self) -> dict:
        hit_rate = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
        return {**self.__dict__, "hit_rate": round(hit_rate, 4)}


def share_of(loop, tenant: str | None) -> dict:
    """A tenant's own fair-share figures: the tokens computed for it (refused prompts' too)
    while it or anyone has work, and how far that is ahead of the least-served tenant with
    work (engine/scheduler.py's counter; 0 when it is the least served, or nobody has work)."""
    served = loop.served.get(tenant, 0)
    ahead = 0 if loop.least_served is None else max(0, served - loop.least_served)
    return {"served_tokens": served, "tokens_ahead_of_least_served": ahead}


@dataclass
class ServerState:
    """The engine and what the server keeps beside it; one per app."""

    engine: Engine
    settings: Settings
    started: int = field(default_factory=lambda: int(time.time()))
    tenants: dict[str, TenantCounters] = field(default_factory=dict)
    tenants_lock: threading.Lock = field(default_factory=threading.Lock)
    pages: dict[Viewer, bytes] = field(default_factory=dict)  # /cache bodies rendered since pages_time
    pages_time: float = 0.0
    page_every_s: float = PAGE_EVERY_S
    pages_lock: threading.Lock = field(default_factory=threading.Lock)
    texts: dict[bytes, str] = field(default_factory=dict)  # a cached block's decoded text, by its hash

    def viewer(self, headers, share: str | None = None) -> Viewer:
        """Who looks, from the request's headers; share: the fair-share tenant it counts as
        (a listed key's, else its address: Asker.tenant), which is not its cache_salt where a
        key nobody listed is in use."""
        settings = self.settings
        if not settings.salt_by_api_key:
            return Viewer(None)
        if is_admin(headers, settings.admin_key):
            return Viewer(tenant_of(headers, True), admin=True, share=share)
        return Viewer(tenant_of(headers, True), keyed=True, share=share)

    def count(self, tenant: str | None, prompt_tokens: int, cached_tokens: int) -> None:
        if not self.settings.salt_by_api_key:
            return  # no tenants to keep apart: /health shows the allocator's own counters
        with self.tenants_lock:
            counters = self.tenants.setdefault(tenant, TenantCounters())
            counters.requests += 1
            counters.queried_tokens += prompt_tokens
            counters.hit_tokens += cached_tokens

    def failure(self) -> str | None:
        """Why the engine takes no requests any more (its loop failed for good), or None."""
        return self.engine.snapshot().failure

    # --- /health ---

    def figures(self, viewer: Viewer) -> dict:
        """What /health reports to `viewer`."""
        engine, alloc = self.engine, self.engine.allocator
        loop = engine.snapshot()  # the loop's queues and the pool's figures, published together
        pool = {
            "num_blocks": alloc.num_blocks,
            "block_size": alloc.block_size,
            "num_free_blocks": loop.num_free_blocks,
            "num_cached_blocks": loop.num_cached_blocks,
            "blocks_in_use": loop.blocks_in_use,
            "running_requests": loop.running_requests,
        }
        counters = loop.cache_stats
        if viewer.keyed:
            with engine.allocator_lock:  # its own blocks: the allocator's, read under its lock
                own = [b for b in alloc.blocks if b.cache_salt == viewer.tenant and b.token_ids]
                pool |= {"num_free_blocks": None, "num_cached_blocks": sum(b.block_hash is not None for b in own),
                         "blocks_in_use": sum(b.ref_cnt > 0 for b in own)}
        last = loop.last_step
        pool |= {
            "waiting_requests": len(loop.waiting),
            "prefilling_requests": len(loop.prefilling),  # running, part-way through their prompt
            "preemptions": loop.num_preemptions,
            "steps": loop.num_steps,
            **engine.scheduler_options,  # max_num_seqs, max_num_batched_tokens, enable_chunked_prefill
            "target_step_ms": engine.target_step_ms,  # None: max_num_batched_tokens every step
            "fair_share": engine.config.fair_share,
        }
        if viewer.keyed:  # each of these moves with the other tenants' requests
            mine = {rid for rid, salt in [*loop.running, *loop.waiting] if salt == viewer.tenant}
            pool |= {"running_requests": sum(salt == viewer.tenant for _, salt in loop.running),
                     "waiting_requests": sum(salt == viewer.tenant for _, salt in loop.waiting),
                     "prefilling_requests": len(mine & set(loop.prefilling)),
                     "preemptions": None, "steps": None,
                     **share_of(loop, viewer.tenant if viewer.share is None else viewer.share)}
        else:
            if loop.step_budget is not None:  # what a step costs on this machine, learned (engine/step_budget.py)
                pool["step_costs"] = loop.step_budget["learned"]
                pool["attention_costs"] = loop.step_budget["attention_flops"]  # in flops of the weights
            pool["cuda_graphs"] = loop.cuda_graphs  # null on a CPU, which runs no graph
            pool["last_step"] = None if last is None else {
                "requests": last.num_requests, "tokens": last.num_tokens, "prefill_tokens": last.num_prefill_tokens,
            }
            if last is not None and loop.step_budget is not None:  # the budget the target step time gave it
                pool["last_step"]["budget"] = loop.step_budget["last_budget"]
        if viewer.keyed:
            with self.tenants_lock:
                counters = self.tenants.get(viewer.tenant, TenantCounters()).as_dict()
        counted = "this API key" if viewer.keyed else "all requests"
        return {"status": "ok", "model": self.settings.model_name, **pool,
                "counted": counted, **counters}

    # --- /cache ---

    def cache_page(self, viewer: Viewer) -> bytes:
        """/cache's body for `viewer` as compact JSON, rendered again only when the last
        rendering is page_every_s old: a class polling it costs a few renderings a second."""
        if viewer.keyed and not self.owns_anything(viewer.tenant):
            viewer = STRANGER
        with self.pages_lock:  # one rendering at a time: pollers wait for it, not start their own
            now = time.monotonic()
            if now - self.pages_time >= self.page_every_s:
                self.pages, self.pages_time = {}, now
            page = self.pages.get(viewer)
            if page is None:
                page = self.pages[viewer] = json.dumps(self.snapshot(viewer), separators=(",", ":")).encode()
            return page

    def owns_anything(self, tenant: str) -> bool:
        """Whether the tenant has counted requests, or requests waiting or running (whose
        blocks it may see): else its page is every stranger's."""
        with self.tenants_lock:
            if tenant in self.tenants:
                return True
        loop = self.engine.snapshot()
        if any(salt == tenant for _, salt in [*loop.running, *loop.waiting]):
            return True
        with self.engine.allocator_lock:
            return any(b.cache_salt == tenant for b in self.engine.allocator.blocks)

    def snapshot(self, viewer: Viewer) -> dict:
        """What /cache reports to `viewer`: figures() plus every block, the free queue, the
        block tables and the waiting queue. The blocks are copied under allocator_lock,
        decoded after it; the queues are the loop's published snapshot, read in the same hold
        (the loop publishes in every hold that changes the pool, so the two agree)."""
        alloc = self.engine.allocator
        with self.engine.allocator_lock:
            blocks = [KVCacheBlock(b.block_id, b.ref_cnt, b.block_hash, list(b.token_ids), b.cache_salt)
                      for b in alloc.blocks]
            free_queue = alloc.free_queue.block_ids()  # head (evicted first) -> tail
            tables = {rid: list(table) for rid, table in alloc.block_tables.items()}
            snap = self.figures(viewer)
            loop = self.engine.snapshot()  # in the same hold: the snapshot figures() read
        if not viewer.keyed:  # the pool's figures counted from the copy: the page's tiles agree with its picture
            snap |= {"num_free_blocks": len(free_queue), "blocks_in_use": len(blocks) - len(free_queue),
                     "num_cached_blocks": sum(b.block_hash is not None for b in blocks),
                     "running_requests": len(tables)}
        if len(self.texts) > 2 * len(blocks):
            self.texts.clear()  # the hashes of blocks long evicted
        shown = [self.sees(viewer, block) for block in blocks]
        snap["blocks"] = [self.block_view(block, viewer, shown[block.block_id]) for block in blocks]
        snap["free_queue"] = [b for b in free_queue if shown[b] or not viewer.keyed]  # its order tells of hits
        # A request's blocks all carry its salt: the first one tells whose request it is.
        snap["block_tables"] = {rid: table for rid, table in tables.items()
                                if not viewer.keyed or table and blocks[table[0]].cache_salt == viewer.tenant}
        salts = dict(loop.running)  # head first; under keys, a tenant's own requests only
        snap["waiting_queue"] = [rid for rid, salt in loop.waiting if not viewer.keyed or salt == viewer.tenant]
        snap["prefilling"] = {rid: {"computed_tokens": done, "prompt_tokens": total}
                              for rid, (done, total) in loop.prefilling.items()
                              if not viewer.keyed or salts[rid] == viewer.tenant}
        return snap

    @staticmethod
    def sees(viewer: Viewer, block: KVCacheBlock) -> bool:
        """Whether `viewer` may read the block: its tenant is the cache_salt it was filled
        with; a block never filled belongs to nobody while free, to someone while held. A
        keyed tenant sees its own filled blocks only: counting the empty ones would count
        everyone else's."""
        if viewer.admin:
            return True
        if not block.token_ids:
            return not viewer.keyed and block.ref_cnt == 0
        return block.cache_salt == viewer.tenant

    def block_view(self, block: KVCacheBlock, viewer: Viewer, shown: bool) -> dict:
        state = "in_use" if block.ref_cnt else "cached" if block.block_hash is not None else "empty"
        view = {"block_id": block.block_id, "ref_cnt": block.ref_cnt, "state": state, "opaque": not shown}
        if not shown:
            # Its hash and text stay hidden: the hash of a block everybody can guess (a chat's
            # first block) would let its salt, the key, be tested offline. Under keys its ref
            # count and state too: they tell when another tenant's prompt hits it.
            hidden = {"block_hash": None, "num_tokens": None, "text": None}
            return ({"block_id": block.block_id, "opaque": True} | hidden) if viewer.keyed else view | hidden
        if block.block_hash is None:  # filling up: decoded each time
            text = self.engine.tokenizer.decode(block.token_ids)
        else:  # full and cached: its text never changes while its hash stays
            text = self.texts.get(block.block_hash)
            if text is None:
                text = self.texts[block.block_hash] = self.engine.tokenizer.decode(block.token_ids)
        return view | {"block_hash": None if block.block_hash is None else short_hash(block.block_hash),
                       "num_tokens": len(block.token_ids), "text": text}

    def reset_prefix_cache(self) -> bool:
        if not self.engine.reset_prefix_cache():
            return False
        with self.tenants_lock:
            self.tenants.clear()  # the allocator zeroed its counters: so do we
        return True
