"""Advantages and the staleness-corrected policy loss (ARCHITECTURE §3), on flat token tensors.

Shapes: per-token tensors are ``[T]`` over a micro-batch's concatenated sequences;
``mask`` is 1 on tokens the policy generated. Losses return *sums*: the caller
divides by the global token (or sequence) count, so an uneven split across ranks
gives exactly the full batch's gradient (see ``normaliser``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

# --------------------------------------------------------------------------- advantages


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out: ``A_i = R_i - mean_{j != i} R_j`` over one group. Sums to zero."""
    n = rewards.numel()
    if n < 2 or _equal(rewards):
        return torch.zeros_like(rewards)
    return rewards - (rewards.sum() - rewards) / (n - 1)


def grpo(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``(R_i - mean) / (std + eps)`` over one group (std unbiased; ``scale=False`` skips it)."""
    if _equal(rewards):
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean()
    if not scale or rewards.numel() < 2:
        return centred
    return centred / (rewards.std() + eps)


def _equal(rewards: torch.Tensor) -> bool:
    """A group of equal rewards has no signal: exactly zero advantages. Computed, the mean's rounding leaves
    R_i - mean at ~1e-8 (eight rewards of 0.1 in fp32), which GRPO's 1 / (std + eps) blows up to ~1e-2."""
    return bool((rewards == rewards[0]).all()) if rewards.numel() else True


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one sequence's generated tokens.

    ``rewards[t]`` and ``values[t]`` per token; the value after the last token is 0.
    Returns (advantages, returns = advantages + values).
    """
    advantages = torch.zeros_like(rewards)
    running = torch.zeros((), dtype=rewards.dtype)
    for t in reversed(range(rewards.numel())):
        next_value = values[t + 1] if t + 1 < values.numel() else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + values


def turn_advantages(turn_rewards: list[list[float]], estimator: Callable[[torch.Tensor], torch.Tensor],
                    gamma: float = 1.0, lam: float = 1.0) -> list[torch.Tensor]:
    """Turn-level credit over one group of multi-turn episodes: ``[episode][turn]`` advantages.

    Turn k of episode i is scored by its lambda-return (0 past the episode's last turn)

        G_ik = r_ik + gamma * ((1 - lam) * V_k+1 + lam * G_i,k+1)

    where ``V_k``, the value of reaching turn k, is the mean return-to-go from turn k over the episodes
    that reached it; ``estimator`` (rloo, grpo) then compares G_ik across those episodes only.
    lam = 1 credits a turn with what followed it in its own episode (with gamma = 1 turn 0 gets
    exactly the episode-level advantage); lam = 0 with what follows such a turn on average in the
    group, so a lucky later turn does not vouch for the turn before it.
    """
    n_turns = max(len(r) for r in turn_rewards)
    to_go = [_returns(r, gamma, lam=1.0, values=None) for r in turn_rewards]
    values = [sum(g[k] for g in to_go if len(g) > k) / sum(len(g) > k for g in to_go) for k in range(n_turns)]
    scored = [_returns(r, gamma, lam, values) for r in turn_rewards]
    out = [torch.zeros(len(r)) for r in turn_rewards]
    for k in range(n_turns):
        reached = [i for i, r in enumerate(turn_rewards) if len(r) > k]
        for i, a in zip(reached, estimator(torch.tensor([scored[i][k] for i in reached]))):
            out[i][k] = a
    return out


def _returns(rewards: list[float], gamma: float, lam: float, values: list[float] | None) -> list[float]:
    out, following = [0.0] * len(rewards), 0.0
    for k in reversed(range(len(rewards))):
        if k + 1 < len(rewards):
            bootstrap = (1 - lam) * values[k + 1] if values is not None else 0.0
            out[k] = rewards[k] + gamma * (bootstrap + lam * following)
        else:
            out[k] = rewards[k]
        following = out[k]
    return out


# --------------------------------------------------------------------------- KL to a reference


def kl(logp: torch.Tensor, logp_ref: torch.Tensor, kind: Literal["k1", "k2", "k3"] = "k3") -> torch.Tensor:
    """Per-token estimators of KL(pi || pi_ref) for tokens sampled from pi, with ``r = pi_ref / pi``.

    k1 = -log r (unbiased, noisy), k2 = (log r)^2 / 2, k3 = r - 1 - log r (unbiased, >= 0).
    """
    log_r = logp_ref - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3")


# --------------------------------------------------------------------------- policy loss


@dataclass(frozen=True)
class PolicyLoss:
    correction: Literal["none", "tis", "decoupled"] = "decoupled"
    clip_low: float = 0.2
    clip_high: float | None = None  # None: same as clip_low
    dual_clip: float | None = None  # c > 1: bound the loss of negative advantages (Ye et al. 2020)
    tis_cap: float = 2.0
    behav_cap: float | None = None  # decoupled: tokens with pi_prox / pi_behav above it leave the loss

    def __call__(self, logp: torch.Tensor, logp_behav: torch.Tensor, logp_prox: torch.Tensor | None,
                 advantages: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss (masked, not yet summed) and statistics.

        none:      u = pi / pi_behav,                        w = 1
        tis:       u = pi / pi_prox, w = min(pi_prox / pi_behav, C)   (stop-gradient)
        decoupled: u = pi / pi_prox, w = pi_prox / pi_behav            (stop-gradient)
                   (w = 0 where w > behav_cap: a token the data's policy found far less likely than
                   the proximal one is too stale to correct, so it is left out rather than amplified)
        loss = -w * min(u A, clip(u, 1 - eps, 1 + eps_high) A)

        The statistics include the first two moments of the data's importance weight against the current
        policy, r = pi_prox / pi_behav (pi / pi_behav without a proximal policy), uncapped: the step's
        effective sample size is mean(r)^2 / mean(r^2).
        """
        dropped = None  # tokens left out by behav_cap
        if self.correction == "none" or logp_prox is None:
            anchor, weight = logp_behav, torch.ones_like(logp)
        else:
            anchor = logp_prox.detach()
            weight = torch.exp(anchor - logp_behav)
            if self.correction == "tis":
                weight = weight.clamp(max=self.tis_cap)
            elif self.behav_cap is not None:
                dropped = weight > self.behav_cap
                weight = weight.masked_fill(dropped, 0.0)
        ratio = torch.exp(logp - anchor)
        staleness = torch.exp(logp_prox.detach() - logp_behav) if logp_prox is not None else ratio.detach()
        high = self.clip_low if self.clip_high is None else self.clip_high
        clipped = ratio.clamp(1 - self.clip_low, 1 + high)
        objective = torch.minimum(ratio * advantages, clipped * advantages)
        if self.dual_clip is not None:
            objective = torch.where(advantages < 0, torch.maximum(objective, self.dual_clip * advantages), objective)
        per_token = -weight.detach() * objective * mask
        m = mask.bool()
        stats = {
            "ratio_mean": ratio[m].mean() if m.any() else ratio.new_zeros(()),
            "clip_frac": ((ratio[m] - clipped[m]).abs() > 0).float().mean() if m.any() else ratio.new_zeros(()),
            "is_weight_mean": weight[m].mean() if m.any() else ratio.new_zeros(()),
            "is_weight_max": weight[m].max() if m.any() else ratio.new_zeros(()),
            "is_raw_mean": staleness[m].mean() if m.any() else ratio.new_zeros(()),
            "is_raw_sq_mean": staleness[m].square().mean() if m.any() else ratio.new_zeros(()),
        }
        if self.correction == "tis" and m.any():
            stats["is_capped_frac"] = (weight[m] >= self.tis_cap).float().mean()
        elif dropped is not None and m.any():
            stats["is_capped_frac"] = dropped[m].float().mean()
        return per_token, stats


def effective_sample_size(weight_sum: float, square_sum: float, n: float) -> float:
    """The share of ``n`` samples of importance weights ``w`` that their weighted mean is worth (Kish):
    ``(sum w)^2 / (n sum w^2)``, 1 when every weight is equal, near 1/n when one dominates."""
    return weight_sum**2 / (n * square_sum) if square_sum > 0 else 1.0


def normaliser(global_tokens: int, world_size: int) -> float:
    """Scale for a rank's summed loss: ``sum / N * world_size``, because DP all-reduce averages."""
    if global_tokens < 1:
        raise ValueError("the global batch has no generated tokens")
    return world_size / global_tokens
