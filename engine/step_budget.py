"""
Each step's token budget, picked from a target step time (stage 8).

Read engine/scheduler.py first: Scheduler.schedule(budget) hands out `budget` tokens a step, decodes
first, then chunks of prompts. vLLM's budget is a fixed number, max_num_batched_tokens
(2,048 by default here as there), sized for a GPU. On a laptop's CPU a step that size takes
seconds, and every stream waits for it: four students' replies freeze while a fifth
student's long prompt is prefilled. So here the budget comes from a time instead, the idea
of Sarathi-Serve's stall-free batching (Agrawal et al., "Taming Throughput-Latency Tradeoff
in LLM Inference with Sarathi-Serve", OSDI 2024: pick the chunk size from a latency target):

    step_flops    what a step computes, from its plan, in flops of the weights: each token
                  through the weights, and its attention: each key it attends to and each
                  key its request reads from the pool (AttentionCosts: counted at first, timed
                  on the engine's own attention when it starts)
    StepCosts     what a step costs on this machine, learned from the steps run:
                  seconds = fixed + per_flop x flops, one fit per thread count
                  (engine/cpu_threads.py runs a step with one thread while others keep the cores busy)
    StepBudget    calibrated when the engine starts (two passes far apart in work), then
                  before each step: the decodes' predicted time, then as many prompt tokens
                  as keep the step within the target and within STALL times the decodes'
                  step (what a stream waits for its next token), never fewer than fit in as
                  long as the decodes take (so the prompt still gets half of each step)
    FixedBudget   max_num_batched_tokens every step

Both are budget policies, the objects a BatchRunner is handed (engine/batch_engine.py): before each
step budget(candidates, threads) says what the step may compute (engine/scheduler.py's Budget:
a total, and a cap per request where a policy wants one); after it, record(threads, plan,
seconds) tells the policy what the step took; describe() is what /health shows.

With max_num_batched_tokens given, the budget is that number every step (vLLM's meaning):
lessons, exercises and tests pass one, so their plans are the same on every machine.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass

from engine.scheduler import Budget, Candidate, Request, StepPlan, keys_attended, share_tokens

DEFAULT_TARGET_STEP_MS = 400.0  # a step never longer than this (the chunks it gives: docs/measured.md)
STALL = 2.2  # a step carrying a prompt's chunk: at most this many times the streams' own step
FIRST_CHUNK = 16  # prompt tokens in a step before any step with its thread count has been timed
CALIBRATION_TOKENS = (16, 256)  # the passes an engine times when it starts (StepBudget.calibrate): 16x apart in work
MIN_CHUNK = 16  # prompt tokens a step gives a prompt at least: it always moves on
FLOOR = 3.0  # a step's prompt tokens cost at least this many times its fixed cost: no crumbs
GAP_MAX = 2.5  # ... unless that makes a stream wait more than this many times its own step (predicted)
FAIR_STALL = 1.1  # a step of a tenant far ahead's prompts beside others' decodes: at most this times theirs
FAIR_SLACK = 1024  # "far ahead": served this many tokens more than the least-served tenant with work




@dataclass(frozen=True)
class Bound:
    """One promise the default budget policy keeps, with where to see it kept."""

    scene: str  # who waits for what
    rule: str  # what the policy holds it to, in its constants
    shown: str  # the lesson scene and the benchmark that measure it


# Every bound in one table: stage 8 prints it, docs/serving.md sets what was measured beside it
# (tests/course checks that the two agree). A step costs a fixed part f plus c a token, so a
# prompt in steps of n tokens takes (1 + f / cn) times its time in one step while a stream
# beside it waits (1 + cn / f) times its own step: the two excesses multiply to 1 and cannot
# both be small. Alone, the prompt's bound holds (FLOOR); beside streams, FLOOR holds until
# the streams' gap reaches GAP_MAX times their step, and from there the gap wins.
BOUNDS = (
    Bound("a long prompt alone", f"at most {(FLOOR + 1) / FLOOR:.2f}x its time in one step: each step's prompt "
          f"tokens cost at least FLOOR ({FLOOR:g}) times the step's fixed cost",
          "stage 8 scene 2d; --bench first_prompt"),
    Bound("a stream's gap while a prompt fills", f"at most STALL ({STALL:g}) times the streams' own step, and "
          f"the target step time; where FLOOR asks for more, up to GAP_MAX ({GAP_MAX:g}) times it",
          "stage 8 scene 2d; --bench stalls"),
    Bound("a long prompt beside streams", f"chunks that cost at least the streams' own step (half of each "
          f"step), and FLOOR times the fixed cost while the gap stays within GAP_MAX: past that the gap wins",
          "stage 8 scene 2d; --bench stalls"),
    Bound("an arrival behind a long prompt", "the step running when it arrives, then its first step without the "
          "prompts prefilling: they yield it, at most FLOOR fixed costs of steps in a row",
          "stage 8 scene 2e; --bench first_prompt"),
    Bound("a student's share", f"a tenant more than FAIR_SLACK ({FAIR_SLACK:,}) tokens ahead of the least "
          f"served (tokens and the keys they attend to) gets what keeps a step within FAIR_STALL "
          f"({FAIR_STALL:g}) times the others' decodes, MIN_CHUNK ({MIN_CHUNK}) tokens at least",
          "stage 8 scene 2e; --bench server_abuse"),
    Bound("a held-back prompt", f"at least MIN_CHUNK ({MIN_CHUNK}) tokens a step: n tokens in at most "
          f"n / {MIN_CHUNK} steps", "tests/engine/test_step_budget.py"),
)


# -----------------------------------------------------------------------------
# 1. What a step computes, counted


@dataclass(frozen=True)
class ModelShape:
    """The sizes step_flops needs, from a Hugging Face model (ModelShape.of)."""

    body_params: int  # parameters each token goes through (all but the embedding table)
    layers: int
    heads: int
    head_dim: int

    @property
    def attention(self) -> AttentionCosts:
        """Attention's cost as counted: the multiply-adds of q.k and of the weighted v, at the
        weights' speed, and nothing for reading the keys."""
        return AttentionCosts(per_pair=4.0 * self.layers * self.heads * self.head_dim)

    @property
    def key_cost(self) -> float:
        """What attending to one key costs, in tokens through the weights (chunk_flops's
        terms): the scheduler charges a tenant by it (Scheduler's key_cost)."""
        return 4.0 * self.layers * self.heads * self.head_dim / (2.0 * self.body_params)

    @classmethod
    def of(cls, model) -> ModelShape:
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        total = sum(p.numel() for p in model.parameters())
        return cls(total - model.get_input_embeddings().weight.numel(), config.num_hidden_layers, heads, head_dim)


@dataclass(frozen=True)
class AttentionCosts:
    """What a step's attention costs, in flops of the weights (what the same seconds would
    compute there): per query-key pair, and per key a request reads, all layers together.

    Counted (ModelShape.attention), a pair is its multiply-adds and reading is free. Timed on
    this engine's attention (AttentionCosts.timed), neither is: each request's keys are copied
    out of the pool, its whole context every step (a 16-token chunk after 3,000 cached tokens
    reads 3,016 keys in every layer), and a masked attention runs slower a flop than the
    weights' matrix products. On the course's 2-core CPU, counted costs predicted a chunk
    beside four streams at 222 ms where it took about 280 (docs/measured.md).
    """

    per_pair: float
    per_key: float = 0.0

    @classmethod
    def timed(cls, counted: AttentionCosts, per_flop: float, chunks: tuple, decodes: tuple) -> AttentionCosts:
        """From two pairs of timed attention steps, (query-key pairs, keys read, seconds) each,
        all layers: a chunk at the start of a context and the same chunk after a long one, and
        decodes of short contexts and of long ones. The two differences, each a sum of pairs and
        of keys read, give the two costs (two equations, two unknowns); per_flop (seconds a flop
        of the weights) turns them into flops. `counted` where the timing says nothing
        (per_flop unknown, or the costs came out negative or nothing: noise).

        >>> counted = AttentionCosts(per_pair=100.0)
        >>> chunks = ((2_000, 64, 1e-3), (130_000, 2_112, 1e-3 + 128_000 * 2e-9 + 2_048 * 1e-8))
        >>> decodes = ((128, 128, 1e-4), (8_192, 8_192, 1e-4 + 8_064 * (2e-9 + 1e-8)))
        >>> AttentionCosts.timed(counted, 1e-11, chunks, decodes)   # 2 ns a pair, 10 ns a key read
        AttentionCosts(per_pair=200.0, per_key=1000.0)
        """
        (p1, k1, s1), (p2, k2, s2) = chunks
        (p3, k3, s3), (p4, k4, s4) = decodes
        a, b, y1 = p2 - p1, k2 - k1, s2 - s1  # a x pair + b x key = y1
        c, d, y2 = p4 - p3, k4 - k3, s4 - s3  # c x pair + d x key = y2
        det = a * d - b * c
        if per_flop <= 0 or not det:
            return counted
        pair, key = (y1 * d - b * y2) / det, (a * y2 - c * y1) / det
        if key < 0:  # reading came out free: the pairs take all of the chunks' difference
            pair, key = y1 / a, 0.0
        elif pair < 0:
            pair, key = 0.0, y2 / d
        if pair < 0 or key < 0 or not pair + key:  # attention for nothing: noise
            return counted
        return cls(round(pair / per_flop, 6), round(key / per_flop, 6))


def chunk_flops(shape: ModelShape, start: int, end: int, attention: AttentionCosts | None = None) -> float:
    """Tokens start..end-1 of one request: each through the weights (a multiply and an add per
    parameter), and their attention: per key they attend to, and per key of the context the
    request reads (attention: what those cost; None: counted, ModelShape.attention)."""
    attention = attention or shape.attention
    return (2.0 * shape.body_params * (end - start) + attention.per_pair * keys_attended(start, end)
            + attention.per_key * end)


def step_flops(shape: ModelShape, plan: StepPlan, attention: AttentionCosts | None = None) -> float:
    return sum(chunk_flops(shape, s.start, s.end, attention) for s in plan.scheduled)


# -----------------------------------------------------------------------------
# 2. What a step costs on this machine


class StepCosts:
    """seconds = fixed + per_flop x flops, fitted to what steps of each size take on this
    machine, one fit per thread count. `fixed` is what every step pays whatever its size (on
    a CPU mostly reading the weights once); per_flop is the machine's speed.

    A laptop is shared: for a minute another program takes a core, and every step is slower.
    A fit to the last steps would follow that minute, and its plans with it. So the steps
    are kept by size (a bucket for each half-doubling of flops), at most one a second per
    bucket and the last KEEP of each, so a bucket spans minutes; each bucket counts as its
    median step (a slow minute that makes less than half of a bucket's steps leaves it
    unmoved; a lower quantile, the machine's speed when nothing else runs, predicted steps
    quicker than they ran, and the streams' gaps came out longer than their bound); the
    line is the Theil-Sen fit through the buckets
    (the median of the slopes between every two of them, then the median intercept), so
    one bucket off the line (small prompts pay more than their flops say) does not tilt it.

    >>> costs = StepCosts()
    >>> costs.record(2, 1e9, 0.06); costs.record(2, 1e10, 0.15)   # two steps, 10x apart in work
    >>> round(costs.predict(2, 5e9), 3), costs.fit(2)              # fixed 50 ms, 10 ms per GFLOP
    (0.1, (0.05, 1e-11))
    """

    KEEP = 128  # steps a bucket keeps
    SPACING_S = 1.0  # a bucket keeps at most one step a second
    QUANTILE = 0.5  # what a bucket counts as: this quantile of its steps' seconds

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.buckets: dict[object, dict[int, deque]] = {}  # thread count (None: a GPU) -> bucket -> (flops, seconds)
        self.kept_at: dict[tuple, float] = {}  # (thread count, bucket) -> when it last kept a step
        self.last_fit: dict[object, tuple[float, float]] = {}  # the latest fit that could tell them apart

    def record(self, threads, flops: float, seconds: float) -> None:
        bucket = round(2 * math.log2(flops)) if flops > 0 else 0
        now, key = self.clock(), (threads, bucket)
        if key in self.kept_at and now - self.kept_at[key] < self.SPACING_S:
            return
        self.kept_at[key] = now
        self.buckets.setdefault(threads, {}).setdefault(bucket, deque(maxlen=self.KEEP)).append((flops, seconds))

    def known(self, threads) -> bool:
        return bool(self.buckets.get(threads))

    def num_steps(self, threads) -> int:
        """Steps kept for this thread count."""
        return sum(len(b) for b in self.buckets.get(threads, {}).values())

    def points(self, threads) -> list[tuple[float, float]]:
        """Each bucket as one point: its steps' median flops, and the QUANTILE of their seconds."""
        found = []
        for steps in self.buckets[threads].values():
            flops, seconds = sorted(x for x, _ in steps), sorted(y for _, y in steps)
            found.append((flops[len(flops) // 2], seconds[int(self.QUANTILE * (len(seconds) - 1))]))
        return found

    def fit(self, threads) -> tuple[float, float]:
        """(fixed seconds, seconds per flop). While the steps kept did about the same work
        (decodes only, or a long prompt's equal chunks), the two cannot be told apart: then
        `fixed` is kept from the latest fit that could, and per_flop is what the steps
        leave beyond it. Before any such fit, all of the time is counted per flop, which
        overestimates a prompt's cost (a smaller chunk, never a longer stall)."""
        points = sorted(self.points(threads))
        slopes = sorted((y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(points, 2)
                        if x2 >= 2 * x1)  # buckets far enough apart to tell fixed from per_flop
        slope = slopes[len(slopes) // 2] if slopes else 0.0
        if slope <= 0:  # too alike, or noise won
            mean_x = sum(x for x, _ in points) / len(points)
            mean_y = sum(y for _, y in points) / len(points)
            fixed = min(self.last_fit.get(threads, (0.0, 0.0))[0], mean_y / 2)
            return fixed, (mean_y - fixed) / mean_x
        fixed = sorted(y - slope * x for x, y in points)[len(points) // 2]
        fit = self.last_fit[threads] = (round(max(0.0, fixed), 9), slope)
        return fit

    def predict(self, threads, flops: float) -> float:
        fixed, per_flop = self.fit(threads)
        return fixed + per_flop * flops


class HeldCosts:
    """Costs measured once and held, never learned from the steps run: a machine profiled
    once (as Sarathi-Serve profiles before it serves), or a test's calibration, which makes
    the default policy's plans the same on every machine.

    >>> HeldCosts(fixed_s=0.02, per_flop=2e-11).predict(2, 1e9)
    0.04
    """

    def __init__(self, fixed_s: float, per_flop: float) -> None:
        self.fixed_s, self.per_flop = fixed_s, per_flop

    def record(self, threads, flops: float, seconds: float) -> None:
        """Nothing to learn: the costs are held."""

    def known(self, threads) -> bool:
        return True

    def num_steps(self, threads) -> int:
        return 0

    def fit(self, threads) -> tuple[float, float]:
        return self.fixed_s, self.per_flop

    def predict(self, threads, flops: float) -> float:
        return self.fixed_s + self.per_flop * flops

    @property
    def buckets(self) -> dict:
        return {}


# -----------------------------------------------------------------------------
# 3. The budget of the next step


class StepBudget:
    """Before each step, the token budget that keeps it near target_ms.

    The running requests that decode take a token each; a step of theirs alone would take
    `decode_s` (predicted): the gap a stream sees between two tokens. The prompts (the
    running requests still prefilling and the waiting ones; the scheduler shares the
    tokens among them) get the tokens that fit in

        max(target - fixed, FLOOR x fixed)                          with no decodes running
        max(decode_s, min(target - decode_s, (STALL - 1) x decode_s),
            min(FLOOR x fixed, (GAP_MAX - 1) x decode_s))          beside decodes

    so a stream's gap grows at most STALL times (and never past the target, if that is
    tighter), while the prompts still get at least half of each step. And never so few that
    a step's fixed cost dominates: at least FLOOR times it, so a prompt alone comes in
    within about (FLOOR + 1) / FLOOR of its time in one step, however slow the machine.
    Where that floor and the streams' bound disagree, the floor wins, up to a gap of
    GAP_MAX times the streams' own step. The prompts are priced at the latest position any
    of them starts from (a turn that follows 3,900 cached tokens attends to all of them).
    Never more than max_num_batched_tokens, never fewer than MIN_CHUNK prompt tokens.

    A request that has just arrived waits for the step running now, then for its own first
    step, which the prompts already prefilling yield to it (their caps in the Budget are 0):
    a question sent behind a long prompt gets its first token one step of its own after the
    step it found running. The prompts yield at most FLOOR fixed costs of steps in a row, then
    take a step of at least that much work: a flood of arrivals leaves them half the time.

    A fair share (Scheduler(fair_share=True) counts what each tenant was served): while a
    tenant within FAIR_SLACK tokens of the least served is decoding, the prompts of a tenant
    further ahead share only what keeps that step within FAIR_STALL times the decodes' own
    (their caps in the Budget), and never fewer than MIN_CHUNK tokens a step: one student's
    back-to-back long prompts cannot make every other student's tokens come STALL times
    slower, and still finish, MIN_CHUNK tokens a step at the least.

    >>> budget = StepBudget(ModelShape(body_params=10**8, layers=30, heads=9, head_dim=64), 400, 2048)
    >>> for flops in (1e9, 1e11):   # two steps timed: 20 ms fixed, 20 ms a GFLOP
    ...     budget.costs.record(2, flops, 0.020 + flops * 2e-11)
    >>> budget.tokens([], [Request("long", [1] * 4000)], threads=2)   # alone: 380 ms of prompt, ~4 ms a token
    93
    """

    def __init__(self, shape: ModelShape, target_ms: float, max_num_batched_tokens: int,
                 costs: StepCosts | HeldCosts | None = None) -> None:
        """costs: what a step costs on this machine; None: learned (StepCosts), from the
        engine's calibration and then every step run."""
        self.shape, self.target_ms, self.cap = shape, target_ms, max_num_batched_tokens
        self.costs = StepCosts() if costs is None else costs
        self.attention = shape.attention  # counted until calibrate times the engine's own
        self.last: int | None = None  # the latest budget handed out
        self.yielded = False  # the latest step's prefilling prompts yielded it to arrivals
        self.yielded_s = 0.0  # ... and the seconds of such steps in a row
        self.predicted: float | None = None  # the latest step's seconds, predicted before it ran (None: nothing known)
        self.took: float | None = None  # ... and as timed

    def budget(self, candidates: list[Candidate], threads) -> Budget:
        """The policy's answer before a step (Scheduler.candidates): a total, and caps on the
        prompts of tenants far ahead of the least served while others decode."""
        running = [c.request for c in candidates if c.running]
        waiting = [c for c in candidates if not c.running]
        start = max((c.num_computed_tokens for c in waiting), default=0)
        tokens = self.tokens(running, [c.request for c in waiting], threads, start)
        if not self.costs.known(threads):
            self.yielded = False  # nothing learned to bound a yield by
            return Budget(tokens)
        fixed, per_flop = self.costs.fit(threads)
        decodes = [r for r in running if not r.num_prefill_left]
        decode_s = fixed + per_flop * self.decode_flops(decodes)
        prompts = [c for c in candidates if not c.running or c.request.num_prefill_left]
        caps: dict[str, int] = {}

        # A request not yet admitted: its first step runs without the prompts already prefilling
        # (they yield it to the newcomers), so its time to first token is its own step after the
        # one running when it came. The prompts yield at most FLOOR fixed costs of steps in a
        # row, then move: a flood of arrivals still leaves them half the time.
        arrivals = [c for c in waiting if not c.request.admitted and not c.hit_coming]  # hit coming: it waits anyway
        prefilling = [c for c in prompts if c.running]
        self.yielded = bool(arrivals and prefilling) and self.yielded_s < FLOOR * fixed
        if self.yielded:
            caps = {c.request.request_id: 0 for c in prefilling}

        # A tenant far ahead, beside the decodes of one that is not: its prompts share what
        # keeps the step within FAIR_STALL times the decodes' own.
        behind_decoding = [c for c in candidates if c.running and not c.request.num_prefill_left
                           and c.lead <= FAIR_SLACK]
        ahead = [c for c in prompts if c.lead > FAIR_SLACK]
        if behind_decoding and ahead:
            # Never fewer than MIN_CHUNK tokens a step: held back, a prompt still finishes in
            # bounded time (2,206 tokens moved 3 a step for a minute when the floor was 1).
            room = max(MIN_CHUNK, self.chunk_within(max(c.num_computed_tokens for c in ahead),
                                                    (FAIR_STALL - 1) * decode_s / per_flop))
            for request_id, cap in share_tokens(room, {c.request.request_id: c.num_remaining_tokens
                                                       for c in ahead}).items():
                caps[request_id] = min(cap, caps.get(request_id, cap))
            if len(ahead) == len(prompts):
                tokens = min(tokens, len(decodes) + room)  # every prompt is ahead: the step is no longer than theirs
        return Budget(tokens, caps)

    def decode_flops(self, decodes: list[Request]) -> float:
        return sum(chunk_flops(self.shape, r.num_computed_tokens, r.num_computed_tokens + 1, self.attention)
                   for r in decodes)

    def tokens(self, running: list[Request], waiting, threads, waiting_start: int = 0) -> int:
        """The budget for a step whose scheduler holds `running` and `waiting`; threads: the
        count the step will likely run with (the key its costs are learned under);
        waiting_start: where the waiting requests' chunks would start (the latest hit)."""
        decodes = [r for r in running if not r.num_prefill_left]
        prefilling = [r for r in running if r.num_prefill_left]
        if not (prefilling or waiting):
            self.last = self.cap
            return self.cap
        start = max([r.num_computed_tokens for r in prefilling] + ([waiting_start] if waiting else []))
        if not self.costs.known(threads):
            chunk = FIRST_CHUNK
        else:
            fixed, per_flop = self.costs.fit(threads)
            target = self.target_ms / 1e3
            if decodes:
                decode_s = fixed + per_flop * self.decode_flops(decodes)
                allowance = max(decode_s, min(target - decode_s, (STALL - 1) * decode_s),
                                min(FLOOR * fixed, (GAP_MAX - 1) * decode_s))
            else:
                allowance = max(target - fixed, FLOOR * fixed)
            chunk = self.chunk_within(start, max(0.0, allowance) / per_flop)
        self.last = min(self.cap, len(decodes) + max(MIN_CHUNK, chunk))
        return self.last

    def chunk_within(self, start: int, flops: float) -> int:
        """The most tokens from `start` on whose chunk_flops fit in `flops` (a quadratic in n:
        each token costs its pass through the weights plus the keys before it, and the chunk
        reads the start + n keys of its context).

        >>> budget = StepBudget(ModelShape(body_params=100, layers=1, heads=1, head_dim=1), 400, 2048)
        >>> n = budget.chunk_within(0, 2_000.0); n, chunk_flops(budget.shape, 0, n) <= 2_000
        (9, True)
        """
        pair, key = self.attention.per_pair, self.attention.per_key
        a = pair / 2  # per n^2: n tokens after `start` attend to n x start + n (n + 1) / 2 keys
        b = 2.0 * self.shape.body_params + pair * (start + 0.5) + key
        room = flops - key * start  # the context already there is read whatever n is
        if room <= 0:
            return 0
        n = int((-b + math.sqrt(b * b + 4 * a * room)) / (2 * a)) if a else int(room / b)
        while n > 0 and chunk_flops(self.shape, start, start + n, self.attention) > flops:  # rounding
            n -= 1
        return n

    def predict(self, threads, plan: StepPlan) -> float | None:
        """Seconds the plan's step should take by what has been learned; None before any step
        ran with this thread count."""
        return (self.costs.predict(threads, step_flops(self.shape, plan, self.attention))
                if self.costs.known(threads) else None)

    def calibrate(self, threads, timed: list[tuple[int, float]], attention: dict | None = None) -> None:
        """The costs' first fit, from passes timed when the engine starts: (prompt tokens,
        seconds) of passes far enough apart in work (CALIBRATION_TOKENS) to tell a step's
        fixed cost from its cost per flop, so the first long prompt is chunked by what this
        machine does, not by FIRST_CHUNK; the steps run then refine it as any step does.
        attention: the engine's attention timed in "chunks" and "decodes" (AttentionCosts.timed),
        or None to keep it counted."""
        if attention and len(timed) >= 2:
            (n1, s1), (n2, s2) = timed[0], timed[-1]
            per_flop = (s2 - s1) / (chunk_flops(self.shape, 0, n2) - chunk_flops(self.shape, 0, n1))
            self.attention = AttentionCosts.timed(self.shape.attention, per_flop, **attention)
        for num_tokens, seconds in timed:
            self.costs.record(threads, chunk_flops(self.shape, 0, num_tokens, self.attention), seconds)

    def record(self, threads, plan: StepPlan, seconds: float) -> None:
        """A step ran: learn from it, after noting what the costs learned before it predicted."""
        self.predicted, self.took = self.predict(threads, plan), seconds
        self.yielded_s = self.yielded_s + seconds if self.yielded else 0.0
        self.costs.record(threads, step_flops(self.shape, plan, self.attention), seconds)

    def describe(self) -> dict:
        """The target and what has been learned, for /health."""
        learned = {}
        for threads in self.costs.buckets:
            fixed, per_flop = self.costs.fit(threads)
            name = "gpu" if threads is None else f"{threads} thread{'s' if threads > 1 else ''}"
            learned[name] = {"fixed_ms": round(fixed * 1e3, 1), "ms_per_gflop": float(f"{per_flop * 1e12:.3g}"),
                             "ms_per_prompt_token": float(f"{per_flop * 2 * self.shape.body_params * 1e3:.3g}"),
                             "steps": self.costs.num_steps(threads)}  # three figures: a tiny model's are tiny
        return {"target_step_ms": self.target_ms, "last_budget": self.last, "learned": learned,
                "attention_flops": {"per_pair": float(f"{self.attention.per_pair:.3g}"),
                                    "per_key_read": float(f"{self.attention.per_key:.3g}")}}


class FixedBudget:
    """The same budget every step, max_num_batched_tokens (vLLM's meaning): the policy of an
    engine given that number, and of the lessons and tests, whose plans must not depend on
    the machine."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def budget(self, candidates: list[Candidate], threads) -> Budget:
        return Budget(self.num_tokens)

    def record(self, threads, plan: StepPlan, seconds: float) -> None:
        """Nothing to learn: the budget is fixed."""

    def describe(self) -> None:
        return None
