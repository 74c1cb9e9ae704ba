"""The scheduler's rules, without a model: one token budget per step (decodes first, then the
next chunk of a prompt still prefilling, then waiting requests in arrival order, a prompt
longer than what is left split across steps), preemption of the most recently admitted, and
its invariants after every step of random workloads (hypothesis): among them, no block can
be found before the step that writes its K/V."""

import pytest

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from allocator import PrefixCachingAllocator
from engine.request import SamplingParams
from engine.scheduler import FINISHED, RUNNING, WAITING, Budget, Request, Scheduler


def run_step(scheduler: Scheduler, token: int = 7, budget=None) -> list[tuple[str, int, int]]:
    """Schedule a step and pretend the model ran it: each request that reached the end of its
    tokens samples `token` (a chunk part-way through a prompt samples nothing)."""
    plan = scheduler.schedule(budget)
    for s in plan.scheduled:
        s.request.num_computed_tokens = s.end
        if s.samples:
            s.request.append_output(token)
    return [(s.request.request_id, s.start, s.end) for s in plan.scheduled]


def test_a_request_admitted_in_the_same_step_hits_the_blocks_the_first_computes():
    s = Scheduler(PrefixCachingAllocator(num_blocks=10, block_size=4))
    s.add(Request("a", list(range(10))))
    s.add(Request("b", list(range(8)) + [50, 51, 52]))
    assert run_step(s) == [("a", 0, 10), ("b", 8, 11)]  # b computes only its own 3 tokens
    assert s.shared_blocks() == {0: ["a", "b"], 1: ["a", "b"]}


def test_running_requests_decode_before_new_ones_are_admitted():
    s = Scheduler(PrefixCachingAllocator(num_blocks=10, block_size=4))
    s.add(Request("a", [1, 2, 3]))
    run_step(s)
    s.add(Request("b", [4, 5]))
    assert run_step(s) == [("a", 3, 4), ("b", 0, 2)]


def test_prompts_held_to_0_still_move_when_no_newcomer_can_be_admitted():
    """A budget policy may hold the prompts prefilling to 0 for newcomers (step_budget's yield);
    where none of those fits the pool, the step does not run empty: the prompts take their share."""
    s = Scheduler(PrefixCachingAllocator(num_blocks=4, block_size=4))
    s.add(Request("long", list(range(16))))
    assert run_step(s, budget=Budget(8)) == [("long", 0, 8)]  # 2 of the 4 blocks held
    s.add(Request("newcomer", list(range(100, 112))))  # its 12 tokens need 3 blocks
    plan = run_step(s, budget=Budget(12, {"long": 0}))
    assert [rid for rid, _, _ in plan] == ["long"] and plan[0][2] > 8
    assert [r.request_id for r in s.waiting] == ["newcomer"]


def test_admission_stops_at_the_first_request_that_does_not_fit():
    s = Scheduler(PrefixCachingAllocator(num_blocks=4, block_size=4))
    s.add(Request("big", list(range(12))))  # 3 blocks
    s.add(Request("too-big-now", list(range(100, 108))))  # 2 blocks: only 1 left
    s.add(Request("small", [1]))  # would fit, but does not overtake
    assert run_step(s) == [("big", 0, 12)]
    assert [r.request_id for r in s.waiting] == ["too-big-now", "small"]


def test_the_token_budget_counts_only_uncached_tokens():
    alloc = PrefixCachingAllocator(num_blocks=20, block_size=4)
    s = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=10)
    s.add(Request("a", list(range(9))))
    run_step(s)
    s.finish(s.running[0])
    s.add(Request("b", list(range(8)) + [60, 61]))  # 10 tokens, 8 cached: costs 2
    s.add(Request("c", list(range(8)) + [70, 71]))
    assert run_step(s) == [("b", 8, 10), ("c", 8, 10)]


def test_a_prompt_longer_than_the_budget_is_split_across_steps_beside_the_decodes():
    s = Scheduler(PrefixCachingAllocator(num_blocks=20, block_size=4), max_num_seqs=4, max_num_batched_tokens=8)
    s.add(Request("a", [1, 2]))
    run_step(s)
    s.add(Request("long", list(range(100, 120))))  # 20 tokens
    s.add(Request("short", [5]))
    assert run_step(s) == [("a", 2, 3), ("long", 0, 7)]  # a decodes; the budget left is long's first chunk
    # long now prefills, and shares what a's decode leaves with short: short needs 1 of the 7
    assert run_step(s) == [("a", 3, 4), ("long", 7, 13), ("short", 0, 1)]
    assert run_step(s) == [("a", 4, 5), ("long", 13, 19), ("short", 1, 2)]  # two decodes, 6 left
    assert run_step(s) == [("a", 5, 6), ("long", 19, 20), ("short", 2, 3)]  # long's last chunk samples
    s.check_invariants()


def test_a_short_request_behind_a_long_prompt_starts_in_the_next_step():
    """The rule that keeps a class moving: a prompt already prefilling shares the step's
    tokens with the requests that arrive behind it, so a short one is prefilled whole at once."""
    s = Scheduler(PrefixCachingAllocator(num_blocks=200, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    s.add(Request("long", list(range(1000, 1500))))
    assert run_step(s) == [("long", 0, 64)]  # alone: the whole budget
    s.add(Request("short", [5] * 10))
    s.add(Request("mid", [6] * 40))
    # short takes its 10 of an equal share, mid and long split the other 54
    assert run_step(s) == [("long", 64, 91), ("short", 0, 10), ("mid", 0, 27)]
    assert run_step(s) == [("long", 91, 141), ("short", 10, 11), ("mid", 27, 40)]  # mid's 13 are less than half


def test_a_request_that_shares_a_prefilling_prompts_prefix_waits_for_its_hit():
    """Admitted while the prompt ahead of it writes their common prefix, it would compute the
    prefix again: it waits for the hit, and the requests behind it do not wait for it."""
    s = Scheduler(PrefixCachingAllocator(num_blocks=100, block_size=4), max_num_seqs=8, max_num_batched_tokens=16)
    shared = list(range(100, 140))
    s.add(Request("first", shared + [1]))
    assert run_step(s) == [("first", 0, 16)]
    s.add(Request("second", shared + [2]))  # its next block is one first is about to write
    s.add(Request("other", [9] * 6))
    assert run_step(s) == [("first", 16, 26), ("other", 0, 6)]
    assert run_step(s) == [("first", 26, 41), ("other", 6, 7)]  # second still waits: no tokens left
    # first's prompt has all its slots: second is admitted and hits the 10 blocks of the prefix
    assert run_step(s) == [("first", 41, 42), ("other", 7, 8), ("second", 40, 41)]
    s.check_invariants()


def test_a_chunk_caches_only_the_blocks_it_writes():
    alloc = PrefixCachingAllocator(num_blocks=20, block_size=4)
    s = Scheduler(alloc, max_num_seqs=2, max_num_batched_tokens=6)
    long = list(range(100, 116))  # 16 tokens: 4 blocks
    s.add(Request("long", long))
    assert run_step(s) == [("long", 0, 6)]  # block 0 written and cached; block 1 half written
    assert alloc.peek(long + [1]) == 4  # a request arriving now would hit block 0 only
    s.add(Request("copy", long + [1]))
    assert run_step(s) == [("long", 6, 12)]  # the budget is spent: copy waits
    assert alloc.peek(long + [1]) == 12
    # long's last chunk writes block 3 in this step; copy, admitted in the same step, hits it
    # (every new K/V of a step is written before anyone attends).
    assert run_step(s) == [("long", 12, 16), ("copy", 16, 17)]
    s.check_invariants()


def test_without_chunked_prefill_a_prompt_longer_than_the_budget_runs_alone():
    s = Scheduler(PrefixCachingAllocator(num_blocks=20, block_size=4), max_num_seqs=4, max_num_batched_tokens=4,
                  enable_chunked_prefill=False)
    s.add(Request("long", list(range(30))))
    s.add(Request("short", [1]))
    assert run_step(s) == [("long", 0, 30)]


@pytest.mark.parametrize("seqs, budget, words", [
    (8, 4, "must be at least max_num_seqs"), (0, 8, "max_num_seqs must be an int >= 1"),
    (4, 0, "max_num_batched_tokens must be an int >= 1"), (True, 8, "max_num_seqs must be an int"),
])
def test_a_step_size_that_cannot_work_is_refused_at_construction(seqs, budget, words):
    with pytest.raises(ValueError, match=words):
        Scheduler(PrefixCachingAllocator(num_blocks=4, block_size=4), max_num_seqs=seqs, max_num_batched_tokens=budget)


def test_when_the_pool_runs_out_the_most_recent_request_is_preempted_and_resumes_from_the_cache():
    alloc = PrefixCachingAllocator(num_blocks=4, block_size=4)
    s = Scheduler(alloc)
    s.add(Request("old", list(range(8))))  # 2 blocks, full
    s.add(Request("new", list(range(20, 28))))  # 2 blocks, full: the pool is now full
    run_step(s)
    # Both need a new block for their next token; none is free: "new" is preempted.
    assert run_step(s) == [("old", 8, 9)]
    new = next(r for r in s.waiting)
    assert new.request_id == "new" and new.status == WAITING and new.num_preemptions == 1
    assert s.num_preemptions == 1
    # Its blocks went back last block first, so the block "old" just took for token 8 was
    # new's second block: evicted. Its first block is still cached.
    s.finish(s.running[0])  # "old" finishes: room again
    # "new" comes back with prompt + its 1 sampled token and recomputes only what was evicted.
    assert run_step(s) == [("new", 4, 9)]
    s.check_invariants()


def test_a_lone_request_that_outgrows_the_pool_preempts_itself_and_waits():
    s = Scheduler(PrefixCachingAllocator(num_blocks=2, block_size=4))
    s.add(Request("a", list(range(8))))
    run_step(s)
    assert run_step(s) == []  # needs a 3rd block: preempted, and not re-admitted in the same step
    assert [r.request_id for r in s.waiting] == ["a"] and s.running == []
    s.check_invariants()


def test_finish_frees_a_running_request_and_drops_a_waiting_one():
    alloc = PrefixCachingAllocator(num_blocks=8, block_size=4)
    s = Scheduler(alloc, max_num_seqs=1)
    a, b = Request("a", [1, 2]), Request("b", [3])
    s.add(a), s.add(b)
    run_step(s)
    s.finish(a), s.finish(b)
    assert a.status == b.status == FINISHED and not s.has_work()
    assert alloc.num_free_blocks == 8
    s.check_invariants()


# --- random workloads: the invariants hold after every step --------------------------------

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5], [9, 9, 9, 9, 1], [3], list(range(20, 33))]


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, budgets, pool sizes, chunking on or off, cancellations. A pretend
    model writes each step's scheduled tokens into `written` (slot -> the tokens up to and
    including it, which is what decides its K/V); after every schedule, every token a
    scheduled request attends to must be written before the step or in it, and so must every
    block a later request could find."""

    def __init__(self):
        super().__init__()
        self.scheduler = None
        self.count = 0
        self.written: dict[tuple[int, int], tuple] = {}  # (block, offset) -> prefix it holds

    @rule(num_blocks=st.integers(4, 12), max_seqs=st.integers(1, 4), extra=st.integers(0, 16), chunked=st.booleans())
    @precondition(lambda self: self.scheduler is None)
    def make(self, num_blocks, max_seqs, extra, chunked):
        self.scheduler = Scheduler(PrefixCachingAllocator(num_blocks=num_blocks, block_size=4), max_num_seqs=max_seqs,
                                   max_num_batched_tokens=max_seqs + extra, enable_chunked_prefill=chunked)

    @rule(prompt=st.sampled_from(PROMPTS), tail=st.lists(st.integers(0, 3), max_size=3), max_tokens=st.integers(1, 8))
    @precondition(lambda self: self.scheduler is not None)
    def add(self, prompt, tail, max_tokens):
        alloc = self.scheduler.allocator
        if len(prompt + tail) + max_tokens - 1 > alloc.num_blocks * alloc.block_size:
            return  # the engine refuses at once what could never fit, however empty the pool
        self.count += 1
        self.scheduler.add(Request(f"r{self.count}", prompt + tail, params=SamplingParams(max_tokens=max_tokens)))

    def check_and_write(self, plan) -> None:
        alloc, size = self.scheduler.allocator, self.scheduler.allocator.block_size
        step = {}  # what this step's forward pass writes
        for s in plan.scheduled:
            table, tokens = alloc.block_tables[s.request.request_id], s.request.token_ids
            for p in range(s.start, s.end):
                step[table[p // size], p % size] = tuple(tokens[: p + 1])
        seen = self.written | step  # in a step, every new K/V is written before anyone attends
        for s in plan.scheduled:
            table, tokens = alloc.block_tables[s.request.request_id], s.request.token_ids
            for p in range(s.end):
                assert seen.get((table[p // size], p % size)) == tuple(tokens[: p + 1]), (
                    f"{s.request.request_id} reads token {p} from a slot nobody wrote")
        for block in alloc.blocks:
            if block.block_hash is not None:
                held = [seen.get((block.block_id, offset)) for offset in range(size)]
                assert all(held) and [prefix[-1] for prefix in held] == block.token_ids, (
                    f"block {block.block_id} can be found before its K/V is written")
        self.written = seen

    @rule(token=st.integers(0, 3))
    @precondition(lambda self: self.scheduler is not None)
    def step(self, token):
        scheduler = self.scheduler
        before = {r.request_id: len(r.output_ids) for r in scheduler.running + list(scheduler.waiting)}
        plan = scheduler.schedule()
        self.check_and_write(plan)
        for s in plan.scheduled:
            s.request.num_computed_tokens = s.end
            if s.samples:
                s.request.append_output(token)
        for s in plan.scheduled:
            r = s.request
            assert len(r.output_ids) == before[r.request_id] + s.samples  # a chunk part-way samples nothing
            if len(r.output_ids) == r.params.max_tokens:
                scheduler.finish(r)
        assert plan.num_tokens <= scheduler.max_num_batched_tokens or (
            not scheduler.enable_chunked_prefill and len(plan.scheduled) == 1)  # a long prompt alone
        assert len(scheduler.running) <= scheduler.max_num_seqs

    @rule()
    @precondition(lambda self: self.scheduler is not None and self.scheduler.has_work())
    def every_request_finishes(self):
        """Stepping on always empties the queue: nothing starves, nothing deadlocks."""
        for _ in range(500):
            if not self.scheduler.has_work():
                return
            self.step(token=1)
        raise AssertionError("requests still waiting or running after 500 steps")

    @rule(data=st.data())
    @precondition(lambda self: self.scheduler is not None and self.scheduler.has_work())
    def cancel_one(self, data):
        """A client that leaves, whether its request waits, prefills or decodes."""
        self.scheduler.finish(data.draw(st.sampled_from(self.scheduler.running + list(self.scheduler.waiting))))

    @invariant()
    def consistent(self):
        if self.scheduler is not None:
            self.scheduler.check_invariants()
            for r in self.scheduler.running:
                assert r.status == RUNNING
                # A running request holds slots for exactly the tokens it has computed.
                assert self.scheduler.allocator.num_tokens(r.request_id) == r.num_computed_tokens


SchedulerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_scheduler_invariants_hold_under_random_workloads = pytest.mark.slow(SchedulerMachine.TestCase)


def test_a_budget_policy_caps_single_requests_and_sees_what_each_would_compute():
    """What the next step's budget policy sees (candidates) and what it may say (a Budget with
    a cap per request): a capped prompt gets its cap, a cap of 0 waits and nobody overtakes it."""
    s = Scheduler(PrefixCachingAllocator(num_blocks=16, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    s.add(Request("a", list(range(20)), tenant="t1"))
    run_step(s)  # a's prompt, whole; its 4 full blocks cached
    s.add(Request("b", list(range(16)) + [90, 91, 92], tenant="t2"))  # hits a's 4 blocks
    s.add(Request("c", [7] * 10))
    seen = [(c.request.request_id, c.running, c.num_cached_tokens, c.num_computed_tokens, c.num_remaining_tokens,
             c.tenant) for c in s.candidates()]
    assert seen == [("a", True, 0, 20, 1, "t1"), ("b", False, 16, 16, 3, "t2"), ("c", False, 0, 0, 10, None)]
    assert run_step(s, budget=Budget(64, {"b": 2, "c": 4})) == [("a", 20, 21), ("b", 16, 18), ("c", 0, 4)]
    assert run_step(s, budget=Budget(64, {"a": 0, "c": 0})) == [("a", 21, 22), ("b", 18, 19)]  # a decode is never capped
    s.add(Request("d", [8] * 5))
    assert run_step(s, budget=Budget(64, {"d": 0})) == [("a", 22, 23), ("b", 19, 20), ("c", 4, 10)]
    assert [r.request_id for r in s.waiting] == ["d"]
    s.check_invariants()


# --- fair shares between tenants (the Virtual Token Counter) --------------------------------


def test_fair_share_admits_the_least_served_tenant_first_and_lifts_a_returning_one():
    s = Scheduler(PrefixCachingAllocator(num_blocks=100, block_size=4), max_num_seqs=2, max_num_batched_tokens=64,
                  fair_share=True)
    s.add(Request("heavy-1", [1] * 40, tenant="heavy"))
    assert run_step(s) == [("heavy-1", 0, 40)]
    assert s.served == {"heavy": 40}
    s.add(Request("heavy-2", [2] * 40, tenant="heavy"))  # arrived first ...
    s.add(Request("student-1", [3] * 8, tenant="student"))  # ... but student was served less
    assert s.served["student"] == 40  # lifted to the least-served active tenant: time away is not credit
    s.served["student"] = 0  # as if student had been here all along, served nothing
    assert s.lead("heavy") == 40 and s.lead("student") == 0
    assert run_step(s) == [("heavy-1", 40, 41), ("student-1", 0, 8)]  # max_num_seqs 2: heavy-2 waits
    assert [c.lead for c in s.candidates()] == [33, 0]  # heavy-1 (41 served) and student-1 (8), running
    s.check_invariants()


def test_a_tenant_is_charged_the_keys_its_tokens_attend_to():
    """With key_cost, a decode over a long context costs its tenant more than one over a short
    one (VTC charges what serving cost): two streams, 4,000 and 40 tokens of context."""
    s = Scheduler(PrefixCachingAllocator(num_blocks=400, block_size=16), max_num_seqs=2,
                  max_num_batched_tokens=8192, fair_share=True, key_cost=0.001)
    s.add(Request("long", [1] * 4000, tenant="long"))
    s.add(Request("short", [2] * 40, tenant="short"))
    run_step(s)  # both prompts whole: 4,000 tokens and 8,002,000 keys; 40 and 820
    assert s.served == {"long": 4000 + 8002, "short": 40 + 1}
    before = dict(s.served)
    run_step(s)  # one decode each: the long one's token attends to 4,001 keys
    assert s.served["long"] - before["long"] == 1 + 4 and s.served["short"] - before["short"] == 1 + 0


def test_without_fair_share_the_queue_is_read_in_arrival_order():
    s = Scheduler(PrefixCachingAllocator(num_blocks=100, block_size=4), max_num_seqs=2, max_num_batched_tokens=64)
    s.add(Request("heavy-1", [1] * 40, tenant="heavy"))
    run_step(s)
    s.add(Request("heavy-2", [2] * 40, tenant="heavy"))
    s.add(Request("student-1", [3] * 8, tenant="student"))
    s.served["student"] = 0
    assert run_step(s) == [("heavy-1", 40, 41), ("heavy-2", 0, 40)]


def test_counters_are_forgotten_when_they_could_not_matter():
    s = Scheduler(PrefixCachingAllocator(num_blocks=100, block_size=4), fair_share=True)
    s.charge("refused", 500)  # a prompt tokenized, then refused: its sender pays for it
    assert s.served == {}  # nobody has work: every tenant starts equal next time
    a = Request("a", [1] * 8, tenant="a")
    s.add(a)
    s.charge("refused", 500)
    assert s.lead("refused") == 500  # ahead of a, and remembered while a has work
    run_step(s)
    s.finish(a)
    assert s.served == {} and not s.active
