"""An update's statistics: sums over its micro-batches' tokens made means, the train/inference mismatch, and
the wall time of each phase."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from streamrl.learner.losses import effective_sample_size, kl

MISMATCH = {key: 0.0 for key in ("mismatch_abs", "mismatch_max", "mismatch_kl", "fresh_tokens", "fresh_mismatch_abs",
                                   "fresh_mismatch_max", "fresh_mismatch_kl")}
# what a rank adds up over its micro-batches, and what it keeps the largest of: both over every rank (``over_ranks``)
SUMS = ("loss", "tokens", "clip_frac", "ratio_mean", "entropy", "kl", "adv_sum", "is_weight_mean", "is_capped_frac",
        "is_raw_mean", "is_raw_sq_mean", "mismatch_abs", "mismatch_kl", "fresh_tokens", "fresh_mismatch_abs",
        "fresh_mismatch_kl", "ptx_nll", "ptx_tokens")
HIGHS = ("is_weight_max", "adv_abs_max", "mismatch_max", "fresh_mismatch_max")


def started() -> dict[str, float]:
    """The sums an update adds its micro-batches' figures into."""
    return {"loss": 0.0, "tokens": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "is_weight_max": 0.0, "entropy": 0.0,
            "kl": 0.0, **MISMATCH}


def sum_over_ranks(value: float, device: torch.device) -> float:
    """``value`` summed over every rank (itself, on one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    summed = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    return float(summed.item())


def over_ranks(stats: dict, device: torch.device) -> None:
    """Every rank's sums and maxima, so that the update's figures are of all of its tokens (the auto bound judges
    their ESS and clip fraction), not of rank 0's share. A key a rank lacks (one with no tokens adds none) counts
    as 0 there and is kept where any rank has it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    sums = torch.tensor([stats.get(k, 0.0) for k in SUMS] + [float(k in stats) for k in SUMS + HIGHS],
                        dtype=torch.float64, device=device)
    highs = torch.tensor([stats.get(k, 0.0) for k in HIGHS], dtype=torch.float64, device=device)  # all >= 0
    dist.all_reduce(sums)
    dist.all_reduce(highs, op=dist.ReduceOp.MAX)
    values, had = [*sums[: len(SUMS)].tolist(), *highs.tolist()], sums[len(SUMS):].tolist()
    for key, value, ranks_with_it in zip(SUMS + HIGHS, values, had):
        if ranks_with_it:
            stats[key] = value


def means(stats: dict, global_tokens: int) -> None:
    """Per-token sums to means (``over_ranks``': over every rank's tokens); the importance weights' effective sample
    size, as a share of the tokens, and E[r^2]."""
    n = max(stats["tokens"], 1.0)
    stats["clip_frac"] /= n
    stats["ratio_mean"] /= n
    for key in ("adv_sum", "is_weight_mean", "is_capped_frac", "is_raw_mean", "is_raw_sq_mean"):
        if key in stats:
            stats[key.replace("_sum", "_mean")] = stats.pop(key) / n
    mean, square = stats.pop("is_raw_mean", 0.0), stats.pop("is_raw_sq_mean", 0.0)
    if square > 0:
        stats["is_ess"], stats["is_second_moment"] = effective_sample_size(mean, square, 1.0), square
    stats["entropy"] /= n
    stats["kl"] /= n
    if "ptx_nll" in stats:  # the SFT rows' token cross-entropy, over their own tokens
        stats["ptx_loss"] = stats.pop("ptx_nll") / max(stats.pop("ptx_tokens"), 1.0)
    mismatch_means(stats)
    stats["loss"] /= max(global_tokens, 1)


def add_mismatch(stats: dict, learner_logp: torch.Tensor, row: dict[str, torch.Tensor]) -> None:
    """Add a micro-batch's train/inference mismatch to ``stats``: |log pi_learner - log pi_behav| and the k3
    estimate of KL(behav || learner) over the generated tokens, and again over the fresh ones (of sequences
    generated wholly by the learner's weights: only numerics differ; a sequence updated in flight attended
    to keys and values of older weights)."""
    gap = (learner_logp - row["logprobs"]).detach()
    k3 = kl(row["logprobs"], learner_logp.detach(), "k3")
    generated = row["mask"] > 0
    for scope, where in (("", generated), ("fresh_", row["fresh"])):
        stats[f"{scope}mismatch_abs"] += float(gap[where].abs().sum())
        stats[f"{scope}mismatch_kl"] += float(k3[where].sum())
        if where.any():
            stats[f"{scope}mismatch_max"] = max(stats[f"{scope}mismatch_max"], float(gap[where].abs().max()))
    stats["fresh_tokens"] += float(row["fresh"].sum())


def mismatch_means(stats: dict) -> None:
    """Sums over tokens to means: over all generated tokens, and over the fresh ones."""
    for scope, count in (("", stats["tokens"]), ("fresh_", stats["fresh_tokens"])):
        for key in ("mismatch_abs", "mismatch_kl"):
            stats[scope + key] /= max(count, 1.0)


class Timer:
    """Wall time per phase of an update (forward, backward, optimizer), summed over micro-batches."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0
