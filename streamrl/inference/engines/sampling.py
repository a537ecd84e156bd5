"""Next-token sampling and the behaviour logprob that goes with it.

The logprob is that of the sampled token under the tempered distribution it was
drawn from, before top-p/top-k truncation, in fp32 (ARCHITECTURE §2.1); the learner
computes the same quantity, so the two agree for the same weights. Greedy
(temperature 0) reports the logprob under temperature 1.
"""

from __future__ import annotations

import torch

from streamrl.generation import SamplingParams


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """One token per row of ``logits [B, V]``; returns (token ids, behaviour logprobs)."""
    logits = logits.float()
    temperatures = torch.tensor([p.temperature or 1.0 for p in params]).unsqueeze(1)
    scaled = logits / temperatures
    logprobs = torch.log_softmax(scaled, -1)
    tokens = logits.argmax(-1)  # greedy rows keep this
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:
        rows = scaled[sampled]
        for j, i in enumerate(sampled):
            if params[i].top_k != -1 or params[i].top_p < 1.0:
                rows[j] = truncate(rows[j], params[i].top_k, params[i].top_p)
        probs = torch.softmax(rows, -1)
        shared = [j for j, i in enumerate(sampled) if generators[i] is None]
        if shared:  # one draw for every row without its own seed
            tokens[[sampled[j] for j in shared]] = torch.multinomial(probs[shared], 1).squeeze(1)
        for j, i in enumerate(sampled):
            if generators[i] is not None:
                tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), chosen.tolist()


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
        # keep the smallest prefix whose mass reaches top_p
        drop |= (probs.cumsum(-1) - probs) >= top_p
    drop[0] = False  # the likeliest token always stays (a top_p below float32's range compares as 0)
    return scaled.masked_fill(torch.empty_like(drop).scatter_(0, order, drop), float("-inf"))
