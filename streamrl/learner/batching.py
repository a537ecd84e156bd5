"""From groups in the replay stream to training sequences: staleness guard, advantages, rank shards on the wire."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import msgpack
import numpy as np
import torch

from streamrl.learner import losses
from streamrl.protocol import Group, Sample


@dataclass
class TrainSequence:
    tokens: np.ndarray      # int32 [T]
    mask: np.ndarray        # uint8 [T], 1 on generated tokens
    logprobs: np.ndarray    # float32 [T], behaviour logprobs
    advantages: np.ndarray  # float32 [T]
    staleness: int          # learner version minus the oldest generated token's
    reward: float = 0.0     # the trajectory's reward (PPO puts it on the last generated token)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


ESTIMATORS = {"rloo": losses.rloo, "grpo": losses.grpo}  # group baselines, per episode or per turn


def advantages(rewards: np.ndarray, algorithm: str) -> np.ndarray:
    if algorithm == "ppo":  # the critic computes per-token advantages on each rank
        return np.zeros(len(rewards), np.float32)
    if algorithm not in ESTIMATORS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected rloo, grpo or ppo")
    return ESTIMATORS[algorithm](torch.as_tensor(rewards, dtype=torch.float32)).numpy()


def no_signal(group: Group) -> bool:
    """Every sample got the same reward: a group baseline (RLOO, GRPO) gives each a zero advantage."""
    return len({s.reward for s in group.samples}) == 1


def has_gradient(seq: TrainSequence) -> bool:
    """A non-zero advantage on a generated token: without one the policy term's loss and gradient are zero."""
    return bool(np.any(seq.advantages[seq.mask > 0]))


def stale(group: Group, version: int, max_staleness: int) -> bool:
    oldest, _ = group.version_range()
    return oldest >= 0 and version - oldest > max_staleness


@dataclass(frozen=True)
class TurnCredit:
    """``learner.credit: turn``: each turn of an episode gets its own advantage (``losses.turn_advantages``)."""
    gamma: float = 1.0
    lam: float = 1.0


def sequences(groups: list[Group], version: int, algorithm: str, penalties: list[np.ndarray] | None = None,
              turns: TurnCredit | None = None) -> list[TrainSequence]:
    """Every sequence of every sample, with its advantage on each of its tokens: the sample's, or with
    ``turns`` that of the turn that generated the token.

    ``penalties[g][i]`` is subtracted from sample i of group g's reward first (KL in the reward).
    """
    out = []
    for g, group in enumerate(groups):
        rewards = np.array([s.reward for s in group.samples], np.float64)
        if penalties is not None:
            rewards = rewards - penalties[g]
        if turns is None:
            per_token = [np.full(s.num_tokens, a, np.float32)
                         for s, a in zip(group.samples, advantages(rewards, algorithm))]
        else:
            per_token = _by_turn(group, rewards, algorithm, turns)
        for sample, reward, adv in zip(group.samples, rewards, per_token):
            oldest = int(sample.generated_versions.min())
            out.extend(TrainSequence(tokens=sample.tokens[part], mask=sample.loss_mask[part],
                                     logprobs=sample.logprobs[part], advantages=adv[part],
                                     staleness=version - oldest, reward=float(reward))
                       for part in sample.sequences())
    return out


def turn_spans(sample: Sample) -> list[slice] | None:
    """The token ranges each turn generated (a turn is one run of the loss mask), or None where they do
    not match the env's turns one to one (a turn that generated nothing)."""
    edges = np.diff(np.concatenate([[0], sample.loss_mask.astype(np.int8), [0]]))
    spans = [slice(a, b) for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1))]
    return spans if sample.turn_rewards is not None and len(sample.turn_rewards) == len(spans) else None


def _by_turn(group: Group, rewards: np.ndarray, algorithm: str, turns: TurnCredit) -> list[np.ndarray]:
    """Per-token advantages from turn-level credit. What of a sample's reward its turn rewards do not account
    for (a KL penalty) counts at its last turn; a sample whose turns cannot be told apart is one turn."""
    spans = [turn_spans(s) for s in group.samples]
    per_turn = [[r] if sp is None else [*s.turn_rewards[:-1], s.turn_rewards[-1] + r - sum(s.turn_rewards)]
                for s, r, sp in zip(group.samples, rewards, spans)]
    out = []
    for sample, sp, adv in zip(group.samples, spans,
                               losses.turn_advantages(per_turn, ESTIMATORS[algorithm], turns.gamma, turns.lam)):
        tokens = np.full(sample.num_tokens, float(adv[0]), np.float32)
        for span, a in zip(sp or [], adv.tolist()):
            tokens[span] = a
        out.append(tokens)
    return out


# ------------------------------------------------------------------ rank shards on the wire (msgpack, no pickle)


class Shard(NamedTuple):
    """A rank's share of a minibatch: its micro-batches, and the minibatch's token and sequence counts over every
    rank (0 sequences: counted where needed)."""

    micro_batches: list[list[TrainSequence]]
    global_tokens: int
    global_sequences: int


def encode_shard(micro_batches: list[list[TrainSequence]], global_tokens: int, global_sequences: int = 0) -> bytes:
    return msgpack.packb({"global_tokens": global_tokens, "global_sequences": global_sequences, "micro_batches": [
        [[s.tokens.tobytes(), s.mask.tobytes(), s.logprobs.tobytes(), s.advantages.tobytes(), s.staleness, s.reward]
         for s in mb] for mb in micro_batches]})


def decode_shard(payload: bytes) -> Shard:
    raw = msgpack.unpackb(payload)
    micro_batches = [[TrainSequence(np.frombuffer(t, np.int32), np.frombuffer(m, np.uint8),
                                    np.frombuffer(lp, np.float32), np.frombuffer(a, np.float32), st, r)
                      for t, m, lp, a, st, r in mb]
                     for mb in raw["micro_batches"]]
    return Shard(micro_batches, raw["global_tokens"], raw["global_sequences"])
