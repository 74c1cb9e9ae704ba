"""Exercise 6: one step of the scheduler (exercises/scheduler.py). Needs no other exercise:
it runs on prefix_caching's allocator, which has the decode side (append_tokens) and peek.

Your scheduler runs in the child; its allocator lives here, and each of its calls comes
here to run. No model runs: `step` below plays it, so each test reads as a few steps and
the plans they give. A plan is a list of (request id, start, end): compute tokens
[start, end) this step. Every step also runs on engine/scheduler.py's Scheduler, and the plans,
queues, counters and allocators are compared.

The tests write their inputs as small literals (a=[1, 2], cache_salt="tenant-b"), and run on
stand-ins drawn anew each run (grading.SEED, one draw per test): every token id, prompt or
sampled, becomes an id below 262,144, every request id and salt the literal and 4 drawn hex
digits ('a' -> 'a-3f9c'). Equal literals get equal stand-ins and different ones different,
so prompts share the blocks they share in the test, and the pool sizes, budgets and order of
arrivals are as written: each test expects the plans, preemptions and counters it states,
with this run's request ids in them.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator import OutOfBlocksError
from engine.scheduler import RUNNING, WAITING, Request
from grading import GRADING, drawn
from twins import RemoteScheduler

EXERCISE = "scheduler"
VOCABULARY = 262_144  # drawn token ids are below it: a large real vocabulary's size


class DrawnScheduler(RemoteScheduler):
    """exercise 6's RemoteScheduler (grading.py), with this run's stand-ins for one test's
    literals, drawn from grading.drawn(the test's name) as each is first used, one to one.
    A request id or salt keeps its literal in front ('a' -> 'a-3f9c'), so a failure reads
    like the test, and the stand-ins sort as the literals do."""

    def __init__(self, child, num_blocks: int, name: str, **options):
        super().__init__(child, num_blocks, **options)
        self.rng = drawn(name)
        self.drawn_tokens: dict[int, int] = {}
        self.drawn_names: dict[str, str] = {}

    def token(self, literal: int) -> int:
        while literal not in self.drawn_tokens:
            token = self.rng.randrange(VOCABULARY)
            if token not in self.drawn_tokens.values():  # one to one: an id taken already is drawn again
                self.drawn_tokens[literal] = token
        return self.drawn_tokens[literal]

    def token_ids(self, literals: list[int]) -> list[int]:
        return [self.token(t) for t in literals]

    def name(self, literal: str) -> str:
        """A request id or a salt: 'a' -> 'a-3f9c'."""
        if literal not in self.drawn_names:
            self.drawn_names[literal] = f"{literal}-{self.rng.randrange(16**4):04x}"
        return self.drawn_names[literal]


@pytest.fixture
def scheduler(child, request):
    """A scheduler over a pool of `num_blocks` blocks of 4 tokens, on this test's drawn inputs."""
    def make(num_blocks: int, **options):
        return DrawnScheduler(child, num_blocks, request.node.name, **options)

    return make


def add_request(s, role: str, prompt: list[int], cache_salt: str | None = None,
                output_ids: list[int] | None = None, **fields) -> str:
    """Add the request the test calls `role`, with this run's ids for its tokens; returns its
    request id. cache_salt is given drawn already (s.name)."""
    request_id = s.name(role)
    s.add(Request(request_id, s.token_ids(prompt), cache_salt=cache_salt, output_ids=s.token_ids(output_ids or []),
                  **fields))
    return request_id


def add(s, **prompts: list[int]) -> list[str]:
    """add(s, a=[1, 2], b=[3]): requests in that order; returns their request ids."""
    return [add_request(s, role, prompt) for role, prompt in prompts.items()]


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def state(s) -> str:
    alloc = s.allocator
    return (f"running {ids(s.running)}, waiting {ids(s.waiting)}, block tables {alloc.block_tables}, "
            f"free queue {alloc.free_queue.block_ids()}")


def step(s, token: int = 7, budget: int | None = None) -> tuple[list[tuple[str, int, int]], list[str]]:
    """Plan a step and play the model: each scheduled request has its tokens [start, end)
    computed, and one that reached the end of its tokens samples `token` (this run's id for
    it; a chunk part-way through a prompt samples nothing). Returns (the plan, who was
    preempted)."""
    plan, preempted = s.step(budget, s.token(token))
    limit = s.max_num_batched_tokens if budget is None else min(budget, s.max_num_batched_tokens)
    num_tokens = sum(end - start for _, start, end, _ in plan)
    if num_tokens > limit:
        pytest.fail(f"the step plans {num_tokens} tokens against a budget of {limit}: "
                    f"{[tuple(p[:3]) for p in plan]}. Every token a request computes comes out of the budget, a "
                    "resumed request's sampled tokens too", pytrace=False)
    empty = [tuple(p[:3]) for p in plan if p[2] <= p[1]]
    if empty:
        pytest.fail(f"the plan holds {empty}, which computes no token: a request whose share is 0 (or that has "
                    "nothing left to compute) is left out of the plan this step", pytrace=False)
    alloc = s.allocator
    try:
        alloc.check_invariants()
        assert set(alloc.block_tables) == set(ids(s.running)), "block tables belong to running requests only"
        assert all(r.status == RUNNING for r in s.running) and all(r.status == WAITING for r in s.waiting), (
            "a running request's status is RUNNING, a waiting one's WAITING")
    except AssertionError as err:
        pytest.fail(f"after the step the state does not add up ({err}): {state(s)}. A preempted request's blocks "
                    "are freed and it leaves self.running; an admitted one leaves self.waiting", pytrace=False)
    return [tuple(p[:3]) for p in plan], preempted


def request(s, request_id: str):
    return next(r for r in [*s.running, *s.waiting] if r.request_id == request_id)


# --- the worked example of the starter's docstring -----------------------------------------

A = list(range(8))
B = [0, 1, 2, 3, 40, 41, 42]  # a's first block, then 3 tokens of its own


def test_the_worked_example_step_by_step(scheduler):
    s = scheduler(4)
    a, b = add(s, a=A, b=B)
    plan, _ = step(s)
    assert plan == [(a, 0, 8), (b, 4, 7)], (
        f"step 1: expected a to compute its 8 tokens and b only its own 3, got {plan}. b hits block 0: a's full "
        "blocks are cached the moment allocate_with_prefix gives them to a, in this very step. Schedule an admitted "
        "request from its hit, not from 0"
    )
    assert s.allocator.block_tables == {a: [0, 1], b: [0, 2]}, f"step 1: {state(s)}"
    plan, _ = step(s)
    assert plan == [(a, 8, 9), (b, 7, 8)], (
        f"step 2: both running requests decode one token (append_tokens their last output id), got {plan}"
    )
    plan, preempted = step(s)
    assert preempted == [b] and plan == [(a, 9, 10)], (
        f"step 3: b's token 8 needs a new block and none is free, so b (the most recently admitted) is preempted; "
        f"a decodes. Expected plan {[(a, 9, 10)]} and preempted {[b]}, got {plan} and {preempted}. {state(s)}"
    )
    assert ids(s.waiting) == [b] and s.allocator.block_tables == {a: [0, 1, 3]}, f"step 3: {state(s)}"


def test_a_preempted_request_frees_its_blocks_and_resumes_from_the_cache(scheduler):
    s = scheduler(4)
    a, b = add(s, a=A, b=B)
    step(s), step(s), step(s)  # the worked example: b is preempted in step 3
    preempted = request(s, b)
    assert (preempted.status, preempted.num_computed_tokens) == (WAITING, 0), (
        f"a preempted request is WAITING with num_computed_tokens 0 again, got {preempted.status!r} and "
        f"{preempted.num_computed_tokens}"
    )
    assert (preempted.num_preemptions, s.num_preemptions) == (1, 1), (
        f"count each preemption in request.num_preemptions and self.num_preemptions, got {preempted.num_preemptions} "
        f"and {s.num_preemptions}"
    )
    assert s.allocator.free_queue.block_ids() == [2], f"b's own block 2 must be back in the free queue: {state(s)}"
    s.finish(a)
    plan, _ = step(s)
    assert plan == [(b, 8, 9)], (
        f"b comes back with its prompt and 2 sampled tokens (9 tokens) and finds blocks 0 and 2 still cached: it "
        f"recomputes 1 token. Got {plan}. Free a preempted request's blocks with allocator.free(request_id), which "
        "keeps the hashes of full blocks (recompute preemption loses the work of its last partial block only)"
    )
    assert preempted.num_cached_tokens == 4, (
        f"num_cached_tokens is what b's client is told: the 4 tokens it hit at its FIRST admission, got "
        f"{preempted.num_cached_tokens}. Set it only when request.admitted is False"
    )


LONG = list(range(100, 119))  # 19 tokens
TWIN = LONG[:16] + [90, 91]  # long's first 4 blocks, then 2 tokens of its own


def test_the_second_worked_example_step_by_step(scheduler):
    """A request waits for the blocks a prefilling prompt is writing, without holding up the
    ones behind it, and is admitted, hitting them, once they have slots."""
    s = scheduler(16, max_num_seqs=4, max_num_batched_tokens=8)
    long, = add(s, long=LONG)
    plan, _ = step(s)
    assert plan == [(long, 0, 8)], f"step 1: long is admitted with the whole budget, its first chunk. Got {plan}"
    twin, small = add(s, twin=TWIN, small=[50, 51])
    plan, _ = step(s)
    assert plan[:1] == [(long, 8, 14)], (
        f"step 2: long should compute tokens 8-13, got {plan}. twin hits 8 tokens and its next block (tokens 8-11) "
        "is one long, still prefilling, has yet to compute: twin waits for that hit and is not counted in the "
        "shares. long (needs 11) shares the 8 tokens with small (needs 2): small takes 2, under its equal share of "
        "4, and long's share is the 6 left"
    )
    assert plan == [(long, 8, 14), (small, 0, 2)] and ids(s.waiting) == [twin], (
        f"step 2: expected twin to wait and small, behind it, to be admitted, got plan {plan}, {state(s)}. At "
        "admission twin hits 12 tokens (long's chunk filled tokens 8-11) and its next block, 12-15, long has yet to "
        "compute: twin waits again, keeping its place in the queue, and admission goes on with small (a request "
        "waiting for its hit skips its turn; it does not stop admission)"
    )
    plan, _ = step(s)
    assert plan == [(long, 14, 19), (small, 2, 3), (twin, 16, 18)], (
        f"step 3: expected long 14-19, small 2-3, twin 16-18, got {plan}. small decodes; long needs 5 of the 7 left "
        "(twin, still waiting for tokens 12-15 when the step begins, is not counted). long's chunk fills tokens "
        "12-15, so when twin's turn comes its hit, looked up again, is 16 and its next block is not full: it is "
        "admitted in this very step and computes only its own 2 tokens"
    )
    assert request(s, twin).num_cached_tokens == 16, (
        f"twin hit 16 tokens at its admission; its num_cached_tokens is {request(s, twin).num_cached_tokens}"
    )


# --- admission -----------------------------------------------------------------------------


def test_waiting_requests_are_admitted_in_arrival_order(scheduler):
    s = scheduler(10)
    a, b, c = add(s, a=[1, 2], b=[3], c=[4, 5, 6])
    plan, _ = step(s)
    assert plan == [(a, 0, 2), (b, 0, 1), (c, 0, 3)] and ids(s.running) == [a, b, c], (
        f"a, b and c arrived in that order and all fit: admit them from the front of the waiting queue (popleft) "
        f"and append them to self.running, got plan {plan}, running {ids(s.running)}"
    )
    assert [r.status for r in s.running] == [RUNNING] * 3, "an admitted request's status is RUNNING"


def test_no_more_than_max_num_seqs_requests_run(scheduler):
    s = scheduler(10, max_num_seqs=2)
    a, b, c = add(s, a=[1], b=[2], c=[3])
    step(s)
    plan, _ = step(s)
    assert ids(s.running) == [a, b] and ids(s.waiting) == [c], (
        f"max_num_seqs is 2: c waits until a or b finishes, got {state(s)}"
    )


def test_a_budget_over_max_num_batched_tokens_plans_at_most_max_num_batched_tokens(scheduler):
    s = scheduler(40, max_num_seqs=4, max_num_batched_tokens=16)
    add(s, a=list(range(100)))
    plan, _ = s.step(budget=64, token=s.token(7))
    planned = sum(end - start for _, start, end, _ in plan)
    assert planned <= 16, (
        f"schedule(budget=64) with max_num_batched_tokens=16 planned {planned} tokens ({plan}): a step computes at "
        "most max_num_batched_tokens, and a budget passed to schedule can only lower it, "
        "min(budget, max_num_batched_tokens)"
    )


def test_a_running_request_whose_share_is_0_is_left_out_of_the_plan(scheduler):
    s = scheduler(20, max_num_seqs=4, max_num_batched_tokens=8)
    long, x, y = add(s, long=list(range(100, 120)), x=[1], y=[2])
    step(s)
    plan, _ = step(s)
    assert plan == [(long, 8, 14), (x, 0, 1), (y, 0, 1)], (
        f"step 2: long's share of 8 tokens beside x and y, then x and y, got {plan}")
    plan, _ = step(s, budget=2)
    assert plan == [(x, 1, 2), (y, 1, 2)], (
        f"a budget of 2: x and y decode one token each and leave long, still prefilling, a share of 0, so long is "
        f"not in the plan (an entry of 0 tokens asks the model for nothing). Expected {[(x, 1, 2), (y, 1, 2)]}, "
        f"got {plan}"
    )


def test_the_first_request_that_does_not_fit_stops_admission(scheduler):
    s = scheduler(5)
    big, next_, small = add(s, big=list(range(16)), next=list(range(100, 108)), small=[1])  # 4 blocks, then 2, then 1
    plan, _ = step(s)
    assert plan == [(big, 0, 16)] and ids(s.waiting) == [next_, small], (
        f"after big, 1 block is free: next needs 2 and waits, and small, which would fit, must not overtake it "
        f"(stop at the first refusal, do not skip it). Got plan {plan}, {state(s)}"
    )


def test_a_request_over_the_budget_gets_a_chunk_and_stops_admission(scheduler):
    s = scheduler(10, max_num_seqs=4, max_num_batched_tokens=10)
    a, b, c = add(s, a=list(range(8)), b=list(range(100, 105)), c=[1])
    plan, _ = step(s)
    assert plan == [(a, 0, 8), (b, 0, 2)], (
        f"a uses 8 of the 10 tokens; b needs 5 and gets the 2 that are left (its first chunk: exactly the budget "
        f"left, not rounded down to a block edge), and c must not overtake it: the budget is spent. Got {plan}"
    )
    plan, _ = step(s)
    assert plan == [(a, 8, 9), (b, 2, 5), (c, 0, 1)], (
        f"next step a decodes, b takes the rest of its prompt (3 tokens) and c fits in what is left. Got {plan}"
    )


def test_the_capacity_check_counts_the_blocks_after_the_prefix_hit(scheduler):
    s = scheduler(4)
    a, b = add(s, a=list(range(12)), b=list(range(12)) + [99])
    plan, _ = step(s)
    assert plan == [(a, 0, 12), (b, 12, 13)], (
        f"b's 13 tokens span 4 blocks and only 1 is free after a, but its first 3 blocks are hits on a's blocks "
        f"(in use, so they cost no free block): b needs 1 new block and fits. Got {plan}. Do not count a "
        "prompt's blocks yourself: allocate_with_prefix checks the room after the prefix hit"
    )


def test_a_request_that_does_not_fit_waits_even_when_its_hits_are_free_blocks(scheduler):
    s = scheduler(6)
    a, x = add(s, a=list(range(8)), x=list(range(50, 61)))  # a: blocks 0 1 (full), x: 2 3 4 (11 tokens)
    step(s)
    s.finish(a)  # free queue: 5, then 1 and 0, still cached
    c, = add(s, c=list(range(8)) + list(range(70, 76)))  # 4 blocks: hits 0 and 1, 2 new
    try:
        plan, _ = step(s)
    except OutOfBlocksError as err:
        pytest.fail(f"schedule() raised OutOfBlocksError ({err}). c needs 2 new blocks and 3 are free, but its hits, "
                    "blocks 0 and 1, are free blocks too: taking them leaves 1 for 2 new ones. A count of the new "
                    "blocks alone misses that; allocate_with_prefix does not, and refuses: catch its "
                    "OutOfBlocksError and let c wait")
    assert plan == [(x, 11, 12)] and ids(s.waiting) == [c], f"c does not fit and waits: got {plan}, {state(s)}"


def test_no_block_is_findable_before_the_step_that_computes_it(scheduler):
    s = scheduler(10, max_num_seqs=4, max_num_batched_tokens=4)
    add(s, long=list(range(12)))
    step(s)  # tokens 0-3: block 0 only
    found = s.allocator.peek(s.token_ids(list(range(12)) + [99]))
    assert found == 4, (
        f"after a step that computed tokens 0-3 of long, another request would find {found} of them in the pool: "
        "blocks whose K/V nobody has written yet are cached. Allocate only the tokens this step computes "
        "(token_ids[:hit + that many]); allocating the whole prompt and freeing it again leaves its blocks cached"
    )


def test_a_salted_request_finds_nothing_of_another_tenant(scheduler):
    s = scheduler(10, max_num_seqs=4, max_num_batched_tokens=13)
    a, = add(s, a=list(range(9)))  # no salt: blocks 0 and 1 cached, block 2 partial
    step(s)
    salt = s.name("tenant-b")
    b = add_request(s, "b", list(range(12)), cache_salt=salt)  # a's first 8 tokens, and 4 more
    plan, _ = step(s)
    assert plan == [(a, 9, 10), (b, 0, 12)], (
        f"b sends a's first 8 tokens under its own cache_salt: it finds nothing and computes all 12 tokens, got "
        f"{plan}. peek(token_ids, cache_salt): without the salt, the hit is another tenant's"
    )
    shared = set(s.allocator.block_tables[a]) & set(s.allocator.block_tables[b])
    assert not shared, (
        f"b (cache_salt {salt!r}) holds a's blocks {sorted(shared)}: pass the request's cache_salt to "
        "allocate_with_prefix, or one tenant reads another's K/V and learns its prompt from cached_tokens"
    )
    assert request(s, b).num_cached_tokens == 0, "b's client must be told 0 cached tokens"


def test_a_resumed_request_pays_for_its_sampled_tokens_too(scheduler):
    s = scheduler(10, max_num_seqs=4, max_num_batched_tokens=12)
    # back from a preemption with nothing left in the pool: 4 prompt tokens and 6 it had sampled
    r = add_request(s, "r", [1, 2, 3, 4], output_ids=[5, 6, 7, 8, 9, 10], num_preemptions=1, admitted=True)
    c, = add(s, c=[20, 21, 22])
    plan, _ = step(s)
    assert plan == [(r, 0, 10), (c, 0, 2)], (
        f"r recomputes its 10 tokens (prompt and sampled ones), so c gets the 2 left of the budget of 12, got "
        f"{plan}. A request costs len(token_ids) - hit, and token_ids holds what it sampled before it was "
        "preempted"
    )


# --- the token budget ------------------------------------------------------------------------


def test_the_token_budget_counts_only_uncached_tokens(scheduler):
    s = scheduler(20, max_num_seqs=4, max_num_batched_tokens=6)
    a, = add(s, a=list(range(12)))
    step(s), step(s)  # a's prompt, in two chunks of 6
    s.finish(a)
    b, c = add(s, b=list(range(8)) + [60, 61, 62], c=list(range(8)) + [70, 71, 72])  # 11 tokens, 8 of them cached
    plan, _ = step(s)
    assert plan == [(b, 8, 11), (c, 8, 11)], (
        f"b and c hit 8 tokens each and compute 3: 6 tokens, within the budget of 6. Got {plan}. A request costs "
        "len(token_ids) - allocator.peek(token_ids, cache_salt), not its length"
    )


def test_a_request_admitted_earlier_in_the_step_lowers_the_cost_of_the_next(scheduler):
    s = scheduler(10, max_num_seqs=4, max_num_batched_tokens=12)
    a, b = add(s, a=list(range(10)), b=list(range(9)) + [99])
    plan, _ = step(s)
    assert plan == [(a, 0, 10), (b, 8, 10)], (
        f"a costs 10 tokens; then b hits a's 2 full blocks, cached when a got them, and costs 2: 12 in all. Got "
        f"{plan}. peek each request when its turn comes, after the requests admitted before it, not all at the start"
    )


def test_each_decode_takes_one_token_of_the_budget(scheduler):
    s = scheduler(10, max_num_seqs=4, max_num_batched_tokens=4)
    a, = add(s, a=[1, 2, 3])
    step(s)
    b, = add(s, b=[4, 5, 6, 7])
    plan, _ = step(s)
    assert plan == [(a, 3, 4), (b, 0, 3)], (
        f"a's decode uses 1 of the 4 tokens, so b (4 tokens) gets the 3 left, its first chunk. Got {plan}"
    )


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks(scheduler):
    s = scheduler(20, max_num_seqs=4, max_num_batched_tokens=4)
    long, short = add(s, long=list(range(10)), short=[1])
    plan, _ = step(s)
    assert plan == [(long, 0, 4)], (
        f"a 10-token prompt is over a budget of 4: schedule the first 4 (allocate_with_prefix on token_ids[:4] only, "
        f"so no block is cached before the step that writes it) and the rest in later steps. Got {plan}"
    )
    assert s.allocator.num_tokens(long) == 4, (
        f"the allocator holds {s.allocator.num_tokens(long)} tokens of long: a step takes slots for the tokens it "
        "schedules, not for the whole prompt"
    )
    plan, _ = step(s)
    assert plan == [(long, 4, 7), (short, 0, 1)], (
        f"long is still prefilling, so it takes its share of the 4 tokens, which it shares with short (waiting, and "
        f"it could be admitted): short needs 1, under its equal share of 2, so long's share is the other 3 "
        f"(allocator.append_tokens gives them slots), and short is admitted with the 1 left. Got {plan}"
    )
    assert request(s, long).output_ids == [], "a chunk that stops part-way through a prompt samples nothing"
    plan, _ = step(s)
    assert plan == [(long, 7, 10), (short, 1, 2)], (
        f"short decodes (1 token) and long's last chunk takes the 3 left. Got {plan}"
    )
    plan, _ = step(s)
    assert plan == [(long, 10, 11), (short, 2, 3)], f"both decode now: got {plan}"


def test_a_chunk_comes_after_the_decodes(scheduler):
    s = scheduler(20, max_num_seqs=4, max_num_batched_tokens=5)
    a, b = add(s, a=[1, 2], b=[3])
    step(s)
    long, = add(s, long=list(range(100, 112)))
    plans = [step(s)[0] for _ in range(4)]
    assert plans == [
        [(a, 2, 3), (b, 1, 2), (long, 0, 3)],
        [(a, 3, 4), (b, 2, 3), (long, 3, 6)],
        [(a, 4, 5), (b, 3, 4), (long, 6, 9)],
        [(a, 5, 6), (b, 4, 5), (long, 9, 12)],
    ], (
        f"each step a and b decode first (1 token each) and long gets the 3 tokens left, until its 12-token prompt "
        f"is done. Got {plans}"
    )


# --- decodes first, and preemption -----------------------------------------------------------


def test_running_requests_decode_before_new_ones_are_admitted(scheduler):
    s = scheduler(10)
    a, = add(s, a=[1, 2, 3])
    step(s)
    b, = add(s, b=[4, 5])
    plan, _ = step(s)
    assert plan == [(a, 3, 4), (b, 0, 2)], f"the running request decodes first, then b is admitted: got {plan}"


def test_a_running_request_gets_the_last_free_block_before_a_new_one(scheduler):
    s = scheduler(3)
    a, = add(s, a=list(range(8)))  # blocks 0 and 1, both full
    step(s)
    b, = add(s, b=[50])
    plan, preempted = step(s)
    assert plan == [(a, 8, 9)] and not preempted and ids(s.waiting) == [b], (
        f"a's token 8 needs a new block and b needs one: a, already running, decodes first and gets block 2, b "
        f"waits. Got plan {plan}, preempted {preempted}, {state(s)}"
    )


def test_self_num_preemptions_counts_every_preemption_of_every_request(scheduler):
    s = scheduler(3)
    a, b, c = add(s, a=[1, 2, 3], b=[4, 5, 6], c=[8, 9, 10])  # a block each; each decode needs a second
    step(s), step(s)
    _, preempted = step(s)
    assert preempted == [c, b], f"a's token 4 needs a block: c, then b, are preempted; got {preempted}"
    counts = {r.request_id: r.num_preemptions for r in [*s.running, *s.waiting]}
    assert counts == {a: 0, b: 1, c: 1} and s.num_preemptions == 2, (
        f"b and c were preempted once each: their num_preemptions are 1 and self.num_preemptions counts every "
        f"preemption of every request, 2. Got {counts} and self.num_preemptions {s.num_preemptions}: add one to "
        "each in _preempt (self.num_preemptions += 1), do not copy the request's own count"
    )


def test_a_full_pool_preempts_the_most_recently_admitted_request(scheduler):
    s = scheduler(6)
    old, mid, new = add(s, old=list(range(8)), mid=list(range(20, 28)), new=list(range(40, 48)))  # 2 full blocks each
    step(s)
    plan, preempted = step(s)  # each needs a 3rd block; none is free
    assert preempted == [new], (
        f"old's token 8 needs a block and none is free: preempt the LAST of self.running (new, admitted last; it "
        f"has done the least work), not old itself nor the oldest. Got preempted {preempted}"
    )
    assert plan == [(old, 8, 9), (mid, 8, 9)], (
        f"new's 2 freed blocks go to old and mid. Expected {[(old, 8, 9), (mid, 8, 9)]}, got {plan}: after "
        "preempting, retry the request that needed the block"
    )


def test_a_preempted_request_goes_to_the_front_of_the_waiting_queue(scheduler):
    s = scheduler(4)
    _, b = add(s, a=list(range(8)), b=list(range(20, 28)))  # the pool is full after step 1
    step(s)
    c, = add(s, c=list(range(40, 48)))
    step(s)  # a's token 8 needs a block: b is preempted
    assert ids(s.waiting) == [b, c], (
        f"b arrived before c: a preempted request goes back to the FRONT of the waiting queue (appendleft), got "
        f"waiting {ids(s.waiting)}"
    )


def test_nobody_is_admitted_in_a_step_that_preempts(scheduler):
    s = scheduler(4)
    a, b = add(s, a=list(range(8)), b=list(range(20, 28)))
    step(s)
    add(s, c=[1])  # after b is preempted and a takes one of its blocks, 1 block is free: c would fit
    plan, preempted = step(s)
    assert preempted == [b] and plan == [(a, 8, 9)], (
        f"c was admitted in the step that preempted b (plan {plan}). b goes back to the FRONT of the waiting queue, "
        "since it arrived before c, and admission stops at a request preempted in this step: c must not overtake it"
    )


def test_a_preempted_request_is_not_readmitted_in_the_same_step(scheduler):
    s = scheduler(4)
    # v's prompt is a's first 8 tokens: it hits a's block 0 and computes its own copy of a's block 1
    # (a hit must leave a token to compute). Preempted, v frees that copy, and it is all v needs to
    # come back with 9 tokens: its 2 hits are a's blocks, in use. So v fits again at once.
    a, v = add(s, a=list(range(9)), v=list(range(8)))
    step(s)
    plan, preempted = step(s)  # v's token 8 needs a block and none is free: v preempts itself
    assert preempted == [v] and plan == [(a, 9, 10)], (
        f"v was preempted and admitted again in the same step (plan {plan}). The pool was just too small for it: "
        "vLLM admits nobody in a step that preempted, or the same request is preempted and readmitted over and "
        "over. Stop admission when the front of the waiting queue was preempted in this step"
    )
    plan, _ = step(s)
    assert plan == [(a, 10, 11), (v, 8, 9)], f"next step v comes back: got {plan}"


def test_a_salted_request_finds_its_own_tenants_blocks(scheduler):
    s = scheduler(10, max_num_seqs=4, max_num_batched_tokens=16)
    salt = s.name("tenant-a")
    a = add_request(s, "a", list(range(9)), cache_salt=salt)
    step(s)
    b = add_request(s, "b", list(range(8)) + [50, 51, 52], cache_salt=salt)
    plan, _ = step(s)
    assert plan == [(a, 9, 10), (b, 8, 11)], (
        f"b shares a's tenant (cache_salt {salt!r}) and a's first 8 tokens: it hits them and computes 3, got "
        f"{plan}. The salt is peek's cache_salt (peek(token_ids, cache_salt)), not an extra key: as an extra key "
        "it names other blocks, and a tenant never finds its own"
    )


def test_a_resumed_request_samples_only_at_the_end_of_its_tokens(scheduler):
    s = scheduler(10, max_num_seqs=4, max_num_batched_tokens=4)
    # back from a preemption with nothing left in the pool: 4 prompt tokens and 6 it had sampled
    r = add_request(s, "r", [1, 2, 3, 4], output_ids=[5, 6, 7, 8, 9, 10], num_preemptions=1, admitted=True)
    outputs = []
    for _ in range(3):
        step(s, token=99)
        outputs.append(list(request(s, r).output_ids))
    sampled = s.token_ids([5, 6, 7, 8, 9, 10])
    assert outputs == [sampled] * 2 + [sampled + [s.token(99)]], (
        f"r recomputes its 10 tokens in chunks of 4, 4 and 2, and samples once, after the last: its output_ids went "
        f"{outputs}. A chunk samples only when it reaches the end of the request's tokens (its prompt and what it "
        "had sampled): its tokens past the prompt are already known, so a chunk that stops there samples nothing"
    )


# --- a prompt prefilling takes its share -------------------------------------------------------------


def test_a_short_request_behind_a_prefilling_prompt_is_prefilled_beside_it(scheduler):
    s = scheduler(20, max_num_seqs=4, max_num_batched_tokens=8)
    long, = add(s, long=list(range(100, 130)))
    step(s)
    short, = add(s, short=[1, 2, 3])
    plan, _ = step(s, token=99)
    assert plan == [(long, 8, 13), (short, 0, 3)], (
        f"long is still prefilling (22 tokens to go) and short arrived behind it: expected long 8-13 and short 0-3, "
        f"got {plan}. A running prompt takes only its share of the budget: the 8 tokens are shared with the waiting "
        "requests that could be admitted, smallest need first; short needs 3, under its equal share of 4, so long "
        "gets the 5 left, and short is admitted with its whole prompt instead of waiting for all of long's"
    )
    assert request(s, short).output_ids == [s.token(99)], (
        "short's whole prompt was computed: it samples its first token")
    plan, _ = step(s)
    assert plan == [(long, 13, 20), (short, 3, 4)], (
        f"short decodes (1 token) and long, the only prompt left, takes the 7 left. Got {plan}"
    )


def test_shares_go_smallest_need_first_and_the_rest_to_the_larger(scheduler):
    s = scheduler(30, max_num_seqs=4, max_num_batched_tokens=8)
    a, = add(s, a=list(range(14)))
    step(s)
    b, = add(s, b=list(range(100, 130)))
    plan, _ = step(s)
    assert plan == [(a, 8, 12), (b, 0, 4)], (
        f"a (running, needs 6) and b (waiting, needs 30) share the 8 tokens: an equal share is 4 each, so a takes 4 "
        f"and b is admitted with the 4 left. Got {plan}"
    )
    plan, _ = step(s)
    assert plan == [(a, 12, 14), (b, 4, 10)], (
        f"a needs 2 and b 26, both prefilling: smallest need first, a takes its 2 (under its equal share of 4) and "
        f"b gets the 6 left, not an equal 4. Got {plan}"
    )
    c, = add(s, c=[50, 51, 52])
    plan, _ = step(s)
    assert plan == [(a, 14, 15), (b, 10, 14), (c, 0, 3)], (
        f"a decodes (1 token); the 7 left are shared by b (needs 20) and c (waiting, needs 3): c, the smaller need, "
        f"comes first and needs less than its equal share (4), so b gets the other 4. Got {plan}"
    )


def test_an_equal_share_is_rounded_up_and_ties_go_to_the_running_request(scheduler):
    s = scheduler(20, max_num_seqs=4, max_num_batched_tokens=7)
    a, = add(s, a=list(range(27)))
    step(s)
    b, = add(s, b=list(range(100, 120)))
    plan, _ = step(s)
    assert plan == [(a, 7, 11), (b, 0, 3)], (
        f"a (running) and b (waiting) need 20 tokens each and share 7: a tie keeps the order the needs are listed "
        f"in, running requests first, and an equal share is rounded up: a gets ceil(7 / 2) = 4, b is admitted with "
        f"the 3 left. Got {plan}"
    )


def test_no_more_prompts_share_the_tokens_than_there_are_tokens(scheduler):
    s = scheduler(30, max_num_seqs=5, max_num_batched_tokens=8)
    d1, d2, p = add(s, d1=[1], d2=[2], p=list(range(100, 120)))
    step(s)  # d1 and d2 sample; p computes 6 of its 20 tokens
    w1, _ = add(s, w1=[30, 31], w2=[40])
    plan, _ = step(s, budget=4)
    assert plan == [(d1, 1, 2), (d2, 1, 2), (p, 6, 7), (w1, 0, 1)], (
        f"the decodes leave 2 of the 4 tokens: p (running, needs 14) and w1 (needs 2) are listed and take 1 each; "
        f"w2 is not listed, since 2 needs already share 2 tokens (list waiting requests only while there are fewer "
        f"needs than tokens, so each could get one). Expected p 6-7 and w1 0-1 after the decodes, got {plan}"
    )


def test_only_the_requests_that_could_be_admitted_are_counted_in_the_shares(scheduler):
    s = scheduler(30, max_num_seqs=2, max_num_batched_tokens=8)
    p, = add(s, p=list(range(100, 120)))
    step(s)
    w1, _ = add(s, w1=list(range(200, 210)), w2=[1])
    plan, _ = step(s)
    assert plan == [(p, 8, 12), (w1, 0, 4)], (
        f"max_num_seqs is 2 and p runs: only 1 waiting request could be admitted, so p (needs 12) shares the 8 "
        f"tokens with w1 (needs 10) alone, 4 each; w2 is not counted (max_num_seqs - len(self.running) of them). "
        f"Got {plan}"
    )


# --- waiting for a hit ------------------------------------------------------------------------------------


def test_a_request_waits_for_the_blocks_a_prefilling_prompt_is_writing(scheduler):
    s = scheduler(20, max_num_seqs=4, max_num_batched_tokens=4)
    long, = add(s, long=list(range(16)))
    step(s)  # tokens 0-3: long's first block
    copy, other = add(s, copy=list(range(12)) + [77], other=[60, 61])
    plan, _ = step(s)
    assert plan == [(long, 4, 6), (other, 0, 2)] and ids(s.waiting) == [copy], (
        f"copy hits long's first block and its next one, tokens 4-7, is one long (still prefilling) has yet to "
        f"compute: copy waits for that hit instead of computing long's tokens a second time, and is not counted in "
        f"the shares, so long (needs 12) and other (needs 2) share the 4 tokens. copy keeps its place and other, "
        f"behind it, is admitted. Got plan {plan}, {state(s)}"
    )
    plans = [step(s)[0] for _ in range(3)]
    assert plans == [[(long, 6, 9), (other, 2, 3)], [(long, 9, 12), (other, 3, 4)],
                     [(long, 12, 14), (other, 4, 5), (copy, 12, 13)]], (
        f"copy waits while long computes tokens 4-11 (its hit grows with each chunk, and each time its next block is "
        f"one long has yet to compute; in the second of these steps the decode and long's chunk leave no budget), "
        f"then it is admitted hitting all 12 tokens and computes only its own. Got {plans}"
    )
    assert request(s, copy).num_cached_tokens == 12, (
        f"copy's client is told the 12 tokens it hit, not {request(s, copy).num_cached_tokens}")


def test_a_request_of_another_tenant_does_not_wait_for_a_prompt_it_cannot_hit(scheduler):
    s = scheduler(20, max_num_seqs=4, max_num_batched_tokens=4)
    long, = add(s, long=list(range(16)))
    step(s)
    other = add_request(s, "other", list(range(8)), cache_salt=s.name("tenant-b"))
    plan, _ = step(s)
    assert plan == [(long, 4, 6), (other, 0, 2)], (
        f"other has long's first 8 tokens under another cache_salt: it can never hit long's blocks, so it has no "
        f"hit to wait for and is admitted, sharing the 4 tokens with long. Got {plan}. Compare the salt too (with "
        "block hashes it is in block 0's hash)"
    )


# --- any script of requests, compared with the reference --------------------------------------------------

# A script is a list of steps. Before each, up to 3 requests arrive; after it, one request may
# leave (finished, or its client gone). Prompts share whole blocks (one prefix stops mid-block)
# and budgets are small, so prompts are prefilled in chunks beside others, and requests wait
# for blocks a prompt is writing. Every pool holds the longest request a script makes (20
# prompt tokens and one sampled a step: 8 blocks), so a preempted request always fits again.
# The ids the strategies give are literals too: the scheduler draws this run's for them.
SHARED = list(range(1, 13))
REQUEST = st.tuples(st.sampled_from([[], SHARED[:4], SHARED[:6], SHARED[:8], SHARED[:12]]),
                    st.lists(st.integers(0, 3), max_size=8), st.sampled_from([None, None, "t"]))
STEP = st.tuples(st.lists(REQUEST, max_size=3), st.sampled_from([None, None, 2, 3, 5]),
                 st.one_of(st.none(), st.none(), st.integers(0, 7)))


@pytest.mark.slow
@settings(GRADING, max_examples=60)
@given(st.lists(STEP, min_size=1, max_size=12), st.sampled_from([(8, 2, 4), (8, 3, 6), (10, 4, 8), (16, 4, 12)]))
def test_any_script_of_requests_matches_the_reference(scheduler, script, size):
    num_blocks, max_num_seqs, max_num_batched_tokens = size
    s = scheduler(num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    present = []
    for i, (requests, budget, leaves) in enumerate(script):
        for j, (prefix, rest, salt) in enumerate(requests):
            present.append(add_request(s, f"r{i}.{j}", (prefix + rest) or [0], cache_salt=salt and s.name(salt)))
            s.check()
        step(s, token=i, budget=budget)
        s.check()
        if leaves is not None and present:
            s.finish(present.pop(leaves % len(present)))
            s.check()
