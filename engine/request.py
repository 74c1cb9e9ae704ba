"""
What a request is: how to sample it (SamplingParams) and everything the engine knows of it
while it runs (Request), in one object every layer above reads.

Read engine/outputs.py first (the reply a request builds). Pure Python, like the allocator.

    SamplingParams   max_tokens, temperature (0 = greedy), top_p, seed, stop; checked when made
    Request          one request's life: its tokens (prompt, then output, appended as they
                     come), its block hashes (computed once, extended as blocks fill), where
                     the scheduler has it, its reply and where its events go

One object from the Engine's front to the reply, as nano-vllm's Sequence
(nanovllm/engine/sequence.py) and vLLM's Request (vllm/v1/request.py): the scheduler, the
step, the loop and the finisher all read and write this one, and callers get values back
(a StreamEvent per token, the finished Generation), never the Request itself.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from allocator import BlockHash, check_text
from engine.outputs import Generation, ReplyBuilder, check_stop

# -----------------------------------------------------------------------------
# 1. How to sample


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens, and when to stop. temperature 0 is greedy (argmax); top_p keeps the
    smallest set of tokens whose probabilities add up to at least top_p; seed makes sampling
    repeatable; stop: strings that end the reply before them (a str or a list of them)."""
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r:.40}")
        # Stored as floats: an int such as 10**400 or 2**64 would otherwise overflow only
        # later, inside the sampler, after the whole prefill ran.
        object.__setattr__(self, "temperature", _as_float(self.temperature, "temperature"))
        object.__setattr__(self, "top_p", _as_float(self.top_p, "top_p"))
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r:.40}")
        stop = check_stop(self.stop)
        for text in stop:
            check_text(text, "a stop string")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf and softmax gives NaN; the limit of
        # sampling as temperature falls to 0 is argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


GREEDY_BELOW_TEMPERATURE = 1e-5


def _as_float(x, name: str) -> float:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise ValueError(f"{name} must be a number, got {x!r:.40}")
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{name} is too large to be a number of this engine "
                         f"(got an int of {len(str(x))} digits)") from None


# -----------------------------------------------------------------------------
# 2. One request's life

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Request:
    """One request, from the Engine's front to its last token.

    Its tokens: prompt_ids, output_ids (sampled so far) and token_ids (both, in order), kept
    as lists that grow by append_output, never concatenated again. block_hashes: the chained
    hashes of its full blocks, computed once (the scheduler extends them through its
    allocator's hash_blocks when more blocks are full), however long it waits at the head of
    a full pool and however often it is preempted: vLLM's Request.block_hashes.

    The scheduler's side: status, num_computed_tokens (of token_ids, those whose K/V are in
    the pool), num_cached_tokens (its prompt's hit at first admission), num_preemptions.
    The engine's side: the builder of its reply (outputs.ReplyBuilder), its sampler's
    generator, its times, and where its StreamEvents go (events: a queue, or None when nobody
    streams it). (A caller's hang-up check is the engine loop's to keep: engine/engine_loop.py.)

    >>> r = Request("a", [1, 2, 3]); r.append_output(7); r.token_ids, r.output_ids
    ([1, 2, 3, 7], [7])
    """

    request_id: str
    prompt_ids: list[int]
    cache_salt: str | None = None
    params: SamplingParams = SamplingParams()
    output_ids: list[int] = field(default_factory=list)  # sampled so far (given: a resumed request's)
    status: str = WAITING
    num_computed_tokens: int = 0  # of token_ids, tokens whose K/V are in the pool
    num_cached_tokens: int = 0  # prompt tokens hit at first admission (what the client is told)
    num_preemptions: int = 0
    admitted: bool = False  # ever admitted (num_cached_tokens is set)
    tenant: str | None = None  # who asked (a server's API key's tenant), for a fair share
    builder: ReplyBuilder | None = None  # its reply, and its text as the tokens come
    generator: Any = None  # a seeded torch.Generator, or None
    events: Any = None  # a queue.SimpleQueue its StreamEvents (or its error) go to, or None
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None  # first admission: when its wait ended
    error: BaseException | None = None  # why it ended early, if it failed
    token_ids: list[int] = field(init=False)  # prompt_ids + output_ids, appended to
    block_hashes: list[BlockHash] = field(init=False, default_factory=list)  # of its full blocks

    def __post_init__(self):
        self.token_ids = [*self.prompt_ids, *self.output_ids]

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        self.token_ids.append(token)

    @property
    def reply(self) -> Generation:
        return self.builder.reply

    @property
    def num_prefill_left(self) -> int:
        """Tokens still to compute before it can sample again, beyond the one it decodes next:
        above 0 while a prompt (or a resumed request's text) comes in chunks."""
        return max(0, len(self.token_ids) - (1 if self.output_ids else 0) - self.num_computed_tokens)
