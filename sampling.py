"""
Sampling: how the engines pick the next token from the logits of a request's last position.

    SamplingParams   max_tokens, temperature (0 = greedy), top_p, seed; checked when made
    sample           one token id: argmax, or a draw from the softmax (top_p kept)

Both engines (one_request.py, batch_engine.py) call sample once per request and step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy (argmax); top_p keeps the smallest set of
    tokens whose probabilities add up to at least top_p; seed makes sampling repeatable."""
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
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
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")

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
        raise ValueError(f"{name} is too large to be a number of this engine (got an int of {len(str(x))} digits)") from None


def sample(logits, params: SamplingParams, generator=None) -> int:
    """One token id from the logits of the last position.

    >>> import torch
    >>> sample(torch.tensor([0.1, 2.0, 0.3]), SamplingParams())   # greedy: the largest logit
    1
    >>> sample(torch.tensor([0.1, 2.0, 0.3]), SamplingParams(temperature=1.0, top_p=0.5))  # 1 alone has p > 0.5
    1
    """
    if params.greedy:
        return int(logits.argmax())
    # Sampling runs on the CPU so a seed gives the same tokens on every device.
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above each one
        drop = before >= params.top_p  # the set already reached top_p without this token
        drop[0] = False  # the most likely token always stays, however small top_p is
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(logits, params: list[SamplingParams], generators: list) -> list[int]:
    """One token id per row of logits (rows, vocab): every greedy row from one argmax and one
    copy to the host, the others sampled one by one, each with its own generator.

    >>> import torch
    >>> sample_batch(torch.tensor([[0.1, 2.0], [3.0, 0.2]]), [SamplingParams()] * 2, [None, None])
    [1, 0]
    """
    greedy = logits.argmax(-1).tolist() if any(p.greedy for p in params) else []
    return [greedy[row] if p.greedy else sample(logits[row], p, generator)
            for row, (p, generator) in enumerate(zip(params, generators))]
