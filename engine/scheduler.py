"""
The scheduler: which requests run in the next forward pass, and how many tokens each.

Read allocator/prefix_caching.py (the allocator) and engine/request.py (a request's state) first;
engine/batch_engine.py runs what this file plans.
Pure Python, like the allocator: the rules below are tested without a model.

There is no prefill phase and no decode phase, as in vLLM v1's Scheduler.schedule
(vllm/v1/core/sched/scheduler.py): every request knows how many of its tokens have K/V in
the pool (num_computed_tokens), and each step hands out a token budget,
max_num_batched_tokens:

    1. decodes first: each running request that is decoding takes 1 token (the one it
       sampled last step). Every running request, in admission order, gets its tokens'
       slots; when that takes a new block and the pool has none, the most recently admitted
       running request is preempted: its blocks are freed (last block first; the full ones
       stay cached), and it goes back to the front of the waiting queue. vLLM v1 calls this
       recompute preemption: when it is admitted again, it usually finds most of its tokens
       still in the pool.
    2. a prompt still prefilling takes only its share of what the decodes leave: the tokens
       left are shared between it, the other prompts prefilling and the waiting requests
       that could be admitted, each an equal share, and one that needs less than its share
       (a short prompt, or one mostly cached) leaves the rest to the others (share_tokens:
       smallest need first). So a short request that arrives behind a long prompt is
       prefilled whole in the next step, beside the long prompt's next chunk, instead of
       waiting for all of it; alone, the long prompt takes the whole budget. (vLLM v1 caps
       one prompt's tokens a step with a fixed long_prefill_token_threshold, in the same
       file; Sarathi-Serve's stall-free batching is the idea behind both.)
    3. then waiting requests, in arrival order, while the budget, max_num_seqs and the pool
       allow. After its prefix hit, a request's uncached tokens are scheduled up to the
       budget left; the rest come in later steps (chunked prefill). Its hit is looked up as
       it comes, so requests behind one shared prefix admitted in the same step compute it
       once: the first writes its blocks, the next ones hit them. A waiting request whose
       next block is one a prompt prefilling as the step began has yet to compute sits this
       step out, without holding up the ones behind it: admitted now, it would compute that
       prefix a second time (_hit_coming). allocate_with_prefix does the capacity check
       after the prefix hit and changes nothing when it refuses; the first request that does
       not fit stops admission (no overtaking).

fair_share=True (the Engine's default) changes one thing: the waiting queue is read
least-served tenant first, as the Virtual Token Counter does (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024): a counter per tenant of the tokens computed for
it (served), a tenant that comes back after a pause lifted to the least-served active
tenant's count (time away is not credit), and within one tenant arrival order. A budget
policy sees each tenant's lead over the least-served one (Candidate.lead) and may hold a
tenant that is far ahead to a smaller share (engine/step_budget.py does).

A step allocates slots only for the tokens it schedules, and a block is cached the moment
its last token gets a slot: so another request can find a block from the step that computes
its K/V on, never earlier. Within that step it may: the step's attention (engine/batch_attention.py,
pool_attention) writes every new K/V of the step into the pool before anything attends, so a
request admitted in the same step as another can hit the blocks the other computes in that
very step.

A request's block hashes are computed once and kept on it (engine/request.py: Request.block_hashes,
extended through the allocator's hash_blocks), so a request that waits at the head of a full
pool, or comes back after a preemption, is never hashed again. The scheduler trusts what it
is given (the Engine's front checked the request); the allocator keeps its own checks, as the
public API the lessons teach.

How many tokens a step may compute, and how many of them each request may take, is a budget
policy's to say (engine/step_budget.py): schedule(budget) takes a Budget (a total, and a cap per
request if the policy wants one), and candidates() is what a policy sees before it decides:
each running request and each waiting one that could be admitted, with its cached, computed
and remaining tokens and its tenant.

enable_chunked_prefill=False restores the older rule, for comparison: a prompt is prefilled
whole in one step, its uncached tokens counted against the budget, and one longer than the
budget left waits for a step of its own, which comes only when every running request has
finished; prompts are not shared then (a prompt is all or nothing).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from allocator import OutOfBlocksError, PrefixCachingAllocator
from engine.request import FINISHED, RUNNING, WAITING, Request

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # tokens one step computes at most (vLLM's flag of that name)

__all__ = ["Budget", "DEFAULT_MAX_NUM_BATCHED_TOKENS", "Candidate", "FINISHED", "RUNNING", "Request",
           "ScheduledRequest", "Scheduler", "StepPlan", "WAITING", "check_step_size", "keys_attended",
           "share_tokens"]


@dataclass
class ScheduledRequest:
    """Compute tokens [start, end) of request.token_ids in this step; if that reaches the end
    of its tokens, sample one more (a chunk that stops part-way through a prompt samples
    nothing: its next token is already known)."""

    request: Request
    start: int
    end: int
    samples: bool = field(init=False)  # set when planned: sampling adds a token to request.token_ids

    def __post_init__(self):
        self.samples = self.end == len(self.request.token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.end - self.start > 1 or self.start < len(self.request.prompt_ids)


@dataclass
class StepPlan:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.scheduled)


@dataclass(frozen=True)
class Candidate:
    """A request the next step could run, as a budget policy sees it (Scheduler.candidates).

    num_cached_tokens: tokens it finds in the pool (waiting: what a lookup finds now; running:
    what it hit when admitted). num_computed_tokens: where its next chunk starts (waiting: at
    its hit). num_remaining_tokens: what it still has to compute before it samples again (a
    decode: 1). lead: tokens its tenant has been served beyond the least-served tenant with
    work (0 without fair_share)."""

    request: Request
    running: bool
    num_cached_tokens: int
    num_computed_tokens: int
    num_remaining_tokens: int
    lead: int = 0
    hit_coming: bool = False  # waiting for its next block, which a prompt prefilling now will write

    @property
    def tenant(self) -> str | None:
        return self.request.tenant


@dataclass(frozen=True)
class Budget:
    """What one step may compute: `tokens` in all, and at most chunks[request_id] of a
    prompt the policy caps (absent: no cap of its own; 0: not this step). A decode's one
    token is never capped."""

    tokens: int
    chunks: dict[str, int] = field(default_factory=dict)


def share_tokens(tokens: int, needs: dict[str, int]) -> dict[str, int]:
    """Share `tokens` among requests that need needs[id] each: smallest need first, each at
    most an equal share (rounded up) of what is still left, so what a small need leaves
    goes to the larger ones.

    >>> share_tokens(100, {"long": 2000, "short": 20, "mid": 50})   # short 20, mid 40 (of 80 left / 2), long 40
    {'short': 20, 'mid': 40, 'long': 40}
    >>> share_tokens(100, {"long": 2000})
    {'long': 100}
    """
    given = {}
    order = sorted(needs, key=needs.__getitem__)  # sorted() is stable: ties keep their order
    for k, request_id in enumerate(order):
        given[request_id] = min(needs[request_id], -(-tokens // (len(order) - k)))
        tokens -= given[request_id]
    return given


def keys_attended(start: int, end: int) -> int:
    """Query-key pairs of tokens start..end-1 of one request: token p attends to keys 0..p.

    >>> keys_attended(0, 4), keys_attended(9, 10)   # 1 + 2 + 3 + 4; a decode at position 9
    (10, 10)
    """
    return (end * (end + 1) - start * (start + 1)) // 2


def check_step_size(max_num_seqs, max_num_batched_tokens) -> None:
    """Refuse (ValueError) a step size that cannot work."""
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r:.40}")
    if max_num_batched_tokens < max_num_seqs:
        # vLLM refuses it too: with fewer tokens than requests, a step could not decode every
        # running request, and a new request would wait for a budget never left over.
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs "
            f"({max_num_seqs}): every running request decodes a token each step"
        )


class Scheduler:
    """A waiting queue and a running list over one allocator.

    >>> from prefix_caching import PrefixCachingAllocator
    >>> s = Scheduler(PrefixCachingAllocator(num_blocks=8, block_size=4), max_num_seqs=4, max_num_batched_tokens=8)
    >>> s.add(Request("a", list(range(10)))); s.add(Request("b", list(range(9)) + [99]))
    >>> plan = s.schedule(); [(r.request.request_id, r.start, r.end) for r in plan.scheduled]  # a's first chunk
    [('a', 0, 8)]
    >>> for r in plan.scheduled: r.request.num_computed_tokens = r.end   # the model ran it (engine/batch_engine.py)
    >>> [(r.request.request_id, r.start, r.end) for r in s.schedule().scheduled]  # b hits a's 2 blocks
    [('a', 8, 10), ('b', 8, 10)]
    """

    def __init__(self, allocator: PrefixCachingAllocator, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 enable_chunked_prefill: bool = True, fair_share: bool = False, key_cost: float = 0.0) -> None:
        """key_cost: what attending to one key costs, counted in tokens through the weights
        (step_budget.ModelShape.key_cost), so a tenant is charged what its tokens cost: a
        decode that reads 3,600 keys more than one that reads 10. 0: every token counts 1."""
        check_step_size(max_num_seqs, max_num_batched_tokens)
        self.key_cost = key_cost
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.fair_share = fair_share
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        # The Virtual Token Counter: what was computed for each tenant, in tokens (a token
        # through the weights counts 1, each key it attends to key_cost; refused work is
        # charged too), and each tenant's requests waiting or running. Kept whether or not
        # fair_share orders the queue by it, so /health can show a tenant its share.
        self.served: dict[str | None, int] = {}
        self.active: Counter = Counter()

    def add(self, request: Request) -> None:
        self._arrive(request.tenant)
        self.active[request.tenant] += 1
        self.waiting.append(request)

    def _arrive(self, tenant: str | None) -> None:
        """A tenant with no request in the scheduler is lifted to the least-served active
        tenant's count: time away is not credit to spend later (VTC's counter lift)."""
        if not self.active[tenant]:
            floor = self.least_served()
            self.served[tenant] = 0 if floor is None else max(self.served.get(tenant, 0), floor)

    def least_served(self) -> int | None:
        """The smallest count among tenants with work; None when nobody has any."""
        return min((self.served.get(t, 0) for t, n in self.active.items() if n), default=None)

    def lead(self, tenant: str | None) -> int:
        """Tokens `tenant` has been served beyond the least-served tenant with work."""
        floor = self.least_served()
        return 0 if floor is None else max(0, self.served.get(tenant, 0) - floor)

    def charge(self, tenant: str | None, num_tokens: int) -> None:
        """Count work done for a tenant outside a step (a prompt tokenized, then refused)."""
        self._arrive(tenant)
        self.served[tenant] = self.served.get(tenant, 0) + num_tokens
        self._forget_idle()

    def _forget_idle(self) -> None:
        """Drop the counts a lift would restore anyway (idle tenants at or below the least
        served), and every count once nobody has work: the table stays as small as the class."""
        floor = self.least_served()
        if floor is None:
            self.served.clear()
            return
        for tenant in [t for t, n in self.served.items() if not self.active[t] and n <= floor]:
            del self.served[tenant]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_order(self) -> list[Request]:
        """The waiting queue in the order admission reads it: as it stands, or with
        fair_share least-served tenant first (arrival order within a tenant)."""
        if not self.fair_share:
            return list(self.waiting)
        return sorted(self.waiting, key=lambda r: self.served.get(r.tenant, 0))

    def candidates(self) -> list[Candidate]:
        """The running requests, then as many waiting ones as could be admitted, in order."""
        found = []
        for request in self.running:
            remaining = len(request.token_ids) - request.num_computed_tokens
            found.append(Candidate(request, True, request.num_cached_tokens, request.num_computed_tokens, remaining,
                                   self.lead(request.tenant) if self.fair_share else 0))
        coming = self._blocks_coming()
        for request in self.waiting_order()[: self.max_num_seqs - len(self.running)]:
            num_cached = self._lookup(request)
            found.append(Candidate(request, False, num_cached, num_cached, len(request.token_ids) - num_cached,
                                   self.lead(request.tenant) if self.fair_share else 0,
                                   self._hit_coming(request, coming, num_cached)))
        return found

    def _lookup(self, request: Request) -> int:
        """Tokens of the request the pool holds now; its block hashes extended, never redone.
        Its tokens were checked once, where it entered (the Engine's front): given its
        hashes, peek trusts them and walks the hit blocks only, never the whole prompt (a
        step looks up each waiting request up to three times)."""
        request.block_hashes = self.allocator.hash_blocks(request.token_ids, request.cache_salt, request.block_hashes)
        return self.allocator.peek(request.token_ids, request.cache_salt, block_hashes=request.block_hashes)

    def schedule(self, budget: int | Budget | None = None) -> StepPlan:
        """The next step's plan. budget: the tokens this step may compute (at most
        max_num_batched_tokens, the default), or a Budget that also caps single requests;
        engine/step_budget.py's policies pick one."""
        alloc = self.allocator
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        if not isinstance(budget, Budget):
            budget = Budget(self.max_num_batched_tokens if budget is None else budget)
        left = min(budget.tokens, self.max_num_batched_tokens)
        coming = self._blocks_coming()
        shares = self._prompt_shares(left, self.waiting_order(), budget.chunks, coming)

        # 1. Running requests, in admission order: a decode takes 1 token, a prompt still
        # prefilling its share (what it would get if the waiting requests shared with it).
        i = 0
        while i < len(self.running) and left > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            end = min(len(request.token_ids), start + min(left, shares.get(request.request_id, 1)))
            if end == start:  # no share this step
                i += 1
                continue
            try:
                alloc.append_tokens(request.request_id, request.token_ids[start:end])
            except OutOfBlocksError:
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                continue  # retry `request`, unless it was the victim (then the loop ends)
            scheduled.append(ScheduledRequest(request, start, end))
            self._count(request, start, end)
            left -= end - start
            i += 1

        # 2. Waiting requests, in order, while there is room. A request preempted in this
        # very step waits for the next one: the pool was just too small for it.
        for request in self.waiting_order():  # with fair_share, counting what step 1 just gave
            if preempted or len(self.running) >= self.max_num_seqs or left <= 0:
                break
            if self._hit_coming(request, coming):
                continue
            tokens = request.token_ids
            num_cached = self._lookup(request)  # may have grown: a running request's chunk just got its slots
            num_new = len(tokens) - num_cached
            if self.enable_chunked_prefill:
                num_new = min(num_new, left, budget.chunks.get(request.request_id, left))  # the rest in later steps
                if num_new == 0:
                    break  # no share this step: it waits, and nobody overtakes it
            elif num_new > left and scheduled:
                break  # over the token budget: next step (alone in a step, any length runs)
            try:
                alloc.allocate_with_prefix(request.request_id, tokens[: num_cached + num_new], request.cache_salt,
                                           block_hashes=request.block_hashes, num_query_tokens=len(tokens),
                                           preempted=request.num_preemptions > 0)
            except OutOfBlocksError:
                break  # the pool is full for now: wait until running requests finish
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RUNNING
            request.num_computed_tokens = num_cached
            if not request.admitted:
                request.admitted, request.num_cached_tokens = True, num_cached
            scheduled.append(ScheduledRequest(request, num_cached, num_cached + num_new))
            self._count(request, num_cached, num_cached + num_new)
            left -= num_new
        if not scheduled and not preempted and 0 in budget.chunks.values():
            # Prompts held to 0 (yielding to newcomers) while none of those could be admitted
            # (no room in the pool): a step with work never runs empty, so they take theirs.
            return self.schedule(Budget(budget.tokens, {k: v for k, v in budget.chunks.items() if v}))
        return StepPlan(scheduled, preempted)

    def _count(self, request: Request, start: int, end: int) -> None:
        """Charge the request's tenant for computing tokens start..end-1: each token, and
        each key it attends to at key_cost (VTC charges what serving cost, not a count)."""
        cost = end - start + round(self.key_cost * keys_attended(start, end))
        self.served[request.tenant] = self.served.get(request.tenant, 0) + cost

    def _blocks_coming(self) -> set:
        """The hashes of the blocks the prompts prefilling as the step begins have yet to
        compute (this step's chunk among them: a block is cached when it gets its slot, but
        judging by what the step began with keeps the rule one lookup a step)."""
        if not self.enable_chunked_prefill:
            return set()
        size = self.allocator.block_size
        return {h for r in self.running if r.num_prefill_left for h in r.block_hashes[r.num_computed_tokens // size:]}

    def _hit_coming(self, request: Request, coming: set, hit: int | None = None) -> bool:
        """Whether the block after the request's hit (looked up unless given) is one a
        prompt prefilling now will write (coming): then it waits for that hit (admitted now,
        it would compute the shared prefix a second time), without holding up the requests
        behind it."""
        if not coming:
            return False
        nxt = (self._lookup(request) if hit is None else hit) // self.allocator.block_size
        return nxt < len(request.block_hashes) and request.block_hashes[nxt] in coming

    def _prompt_shares(self, tokens: int, waiting: list[Request], caps: dict[str, int], coming: set) -> dict[str, int]:
        """The share of each running request still prefilling (share_tokens): what the
        decodes leave of `tokens`, shared with the waiting requests that could be admitted
        (one token each at least, so no more of them than there are tokens), each need at
        most its policy's cap; one waiting for a coming hit is not counted. The waiting
        requests' own shares are not handed out: they are
        admitted in order with whatever is left, their hits looked up again as they come (a
        chunk scheduled before them in this step may have written blocks they hit)."""
        needs = {}
        for request in self.running:
            if request.num_prefill_left:
                remaining = len(request.token_ids) - request.num_computed_tokens
                needs[request.request_id] = min(remaining, caps.get(request.request_id, remaining))
        left = tokens - sum(1 for r in self.running if not r.num_prefill_left)  # the decodes' tokens
        room = self.max_num_seqs - len(self.running)
        for request in waiting:  # read only as far as they could be admitted: one lookup each
            if room <= 0 or len(needs) >= left:
                break
            hit = self._lookup(request)
            if self._hit_coming(request, coming, hit):
                continue
            room -= 1
            remaining = len(request.token_ids) - hit
            needs[request.request_id] = min(remaining, caps.get(request.request_id, remaining))
        return share_tokens(max(0, left), needs)

    def _preempt(self, request: Request) -> None:
        # Every token the allocator holds for it has its K/V written (this step's token was
        # not appended), so its full blocks stay cached for when it comes back.
        self.allocator.free(request.request_id)
        request.status, request.num_computed_tokens = WAITING, 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Take a request out (finished, or its client left) and free its blocks."""
        if request.status == RUNNING:
            self.running.remove(request)
            # Normally every token it holds was computed (its last sampled token is never
            # appended). After a failed step, blocks past what was computed lose their hash.
            self.allocator.free(request.request_id, num_computed_tokens=request.num_computed_tokens)
        elif request.status == WAITING:
            self.waiting.remove(request)
        else:
            return  # finished already
        request.status = FINISHED
        self.active[request.tenant] -= 1
        if not self.active[request.tenant]:
            del self.active[request.tenant]
            self._forget_idle()

    def shared_blocks(self) -> dict[int, list[str]]:
        """Blocks in more than one running request's table: block id -> those requests."""
        holders: dict[int, list[str]] = {}
        for request in self.running:
            for block_id in self.allocator.block_tables[request.request_id]:
                holders.setdefault(block_id, []).append(request.request_id)
        return {block_id: ids for block_id, ids in sorted(holders.items()) if len(ids) > 1}

    def check_invariants(self) -> None:
        """No request both waiting and running; a block is in a running request's table only
        with a ref count for it; free + in use = the pool."""
        alloc = self.allocator
        running_ids = {r.request_id for r in self.running}
        assert not running_ids & {r.request_id for r in self.waiting}, "a request both waiting and running"
        assert set(alloc.block_tables) == running_ids, "block tables belong to running requests only"
        assert all(r.status == RUNNING for r in self.running) and all(r.status == WAITING for r in self.waiting)
        assert alloc.num_free_blocks + alloc.num_blocks_in_use == alloc.num_blocks
        alloc.check_invariants()
