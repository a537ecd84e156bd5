"""Next-token sampling and the behaviour logprob that goes with it.

The logprob is that of the sampled token under the tempered distribution it was
drawn from, before top-p/top-k truncation, in fp32 (ARCHITECTURE §2.1); the learner
computes the same quantity, so the two agree for the same weights. Greedy
(temperature 0) reports the logprob under temperature 1.
"""

from __future__ import annotations

import torch

from streamrl.rollout.engines.base import SamplingParams


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """One token from a row of logits ``[V]``; returns (token id, behaviour logprob)."""
    logits = logits.float()
    if params.temperature == 0:
        token = int(logits.argmax())
        return token, float(torch.log_softmax(logits, -1)[token])
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, -1)
    truncated = truncate(scaled, params.top_k, params.top_p)
    token = int(torch.multinomial(torch.softmax(truncated, -1), 1, generator=generator))
    return token, float(logprobs[token])


def truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside the top-k and the top-p nucleus set to -inf."""
    if top_k == -1 and top_p >= 1.0:
        return scaled
    sorted_logits, order = scaled.sort(descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k != -1:
        drop[top_k:] = True
    if top_p < 1.0:
        probs = torch.softmax(sorted_logits, -1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop |= (probs.cumsum(-1) - probs) >= top_p
    return scaled.masked_fill(torch.empty_like(drop).scatter_(0, order, drop), float("-inf"))
