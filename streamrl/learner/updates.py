"""One policy version's updates on a rank: score every minibatch, then an optimizer update per minibatch
for each epoch, and the version's statistics merged from its updates'."""

from __future__ import annotations

from collections.abc import Callable

from streamrl.learner.batching import Shard
from streamrl.learner.policy import Policy

SUMMED = ("forward_s", "backward_s", "optimizer_s")  # phase times add up over a version's updates
MAXED = ("is_weight_max", "adv_abs_max", "skipped", "mismatch_max", "fresh_mismatch_max")


def train(policy: Policy, shards: list[Shard], epochs: int, critic=None, ptx=None,
          before_update: Callable[[], None] | None = None) -> tuple[dict, int]:
    """One policy version's updates: ``epochs`` passes over the minibatches (this rank's ``shards`` of them), one
    optimizer update each.

    Every minibatch is scored before the first update (the critic's values, and the proximal logprobs:
    ``Policy.score_proximal``), so the proximal policy is the weights at the version's start and PPO's clip
    bounds how far the later updates move from it. Scoring here, once, keeps every rank's forwards in step
    under ZeRO-3 (an empty micro-batch's stand-in forward runs exactly when the others' proximal forwards do).
    Shared prompts are laid out after it. A non-finite update stops the rest. ``before_update`` runs once, before
    the first optimizer step (the learner ends its weight push there). Returns the updates' merged statistics
    and how many minibatches were trained.
    """
    rows = [critic.prepare(micro) if critic else policy.collate(micro) for micro, _, _ in shards]
    policy.score_proximal(rows)
    for (micro, _, _), minibatch_rows in zip(shards, rows):
        policy.share_prompts(micro, minibatch_rows)
    updates, landed = [], 0
    for _epoch in range(epochs):
        for i, ((_, tokens, sequences), minibatch_rows) in enumerate(zip(shards, rows)):
            stats = policy.update(minibatch_rows, tokens, sequences, ptx, before_update)
            before_update = None
            if stats["skipped"]:
                return merge(updates + [stats], len(shards)), landed
            if critic:
                stats.update(critic.update(minibatch_rows, tokens))
            updates.append(stats)
            landed = max(landed, i + 1)
    return merge(updates, len(shards)), landed


def merge(updates: list[dict], minibatches: int) -> dict:
    """A version's statistics from its updates' (one, for a single update): phase times summed, maxima kept,
    token counts of one pass over the batch, the rest averaged."""
    merged = {}
    for key in updates[0]:
        values = [u[key] for u in updates if key in u]
        if key in SUMMED:
            merged[key] = sum(values)
        elif key in MAXED:
            merged[key] = max(values)
        elif key in ("tokens", "fresh_tokens"):
            merged[key] = sum(values[:minibatches])
        else:
            merged[key] = sum(values) / len(values)
    merged["updates"] = len([u for u in updates if not u["skipped"]])
    return merged
