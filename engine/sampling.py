"""
Sampling: how the engines pick the next token from the logits of a request's last position.

    sample           one token id: argmax, or a draw from the softmax (top_p kept)
    sample_batch     one token id per request of a batched step

Read engine/request.py first: SamplingParams, what a request asks for, lives there (its one home).

engine/one_request.py calls sample once a step; engine/batch_engine.py calls sample_batch once a step.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams

__all__ = ["sample", "sample_batch"]


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
