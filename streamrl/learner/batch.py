"""From groups in the replay stream to training sequences: staleness guard, advantages, packing for ranks."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from streamrl.learner import losses
from streamrl.protocol import Group


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


def advantages(rewards: np.ndarray, algorithm: str) -> np.ndarray:
    r = torch.as_tensor(rewards, dtype=torch.float32)
    if algorithm == "rloo":
        return losses.rloo(r).numpy()
    if algorithm == "grpo":
        return losses.grpo(r).numpy()
    if algorithm == "ppo":  # the critic computes per-token advantages on each rank
        return np.zeros(len(rewards), np.float32)
    raise ValueError(f"unknown algorithm {algorithm!r}; expected rloo, grpo or ppo")


def stale(group: Group, version: int, max_staleness: int) -> bool:
    oldest, _ = group.version_range()
    return oldest >= 0 and version - oldest > max_staleness


def sequences(groups: list[Group], version: int, algorithm: str,
              penalties: list[np.ndarray] | None = None) -> list[TrainSequence]:
    """Every sequence of every sample, with its sample's advantage on each of its tokens.

    ``penalties[g][i]`` is subtracted from sample i of group g's reward first (KL in the reward).
    """
    out = []
    for g, group in enumerate(groups):
        rewards = np.array([s.reward for s in group.samples])
        if penalties is not None:
            rewards = rewards - penalties[g]
        adv = advantages(rewards, algorithm)
        for i, (sample, a) in enumerate(zip(group.samples, adv)):
            oldest = int(sample.generated_versions.min())
            for part in sample.sequences():
                out.append(TrainSequence(
                    tokens=sample.tokens[part], mask=sample.loss_mask[part], logprobs=sample.logprobs[part],
                    advantages=np.full(part.stop - part.start, a, np.float32), staleness=version - oldest,
                    reward=float(sample.reward - (penalties[g][i] if penalties is not None else 0.0))))
    return out


# ------------------------------------------------------------------ rank shards on the wire (msgpack, no pickle)


def pack(shard: list[list[TrainSequence]], global_tokens: int, global_sequences: int = 0) -> bytes:
    return msgpack.packb({"global_tokens": global_tokens, "global_sequences": global_sequences, "micro_batches": [
        [[s.tokens.tobytes(), s.mask.tobytes(), s.logprobs.tobytes(), s.advantages.tobytes(), s.staleness, s.reward]
         for s in mb] for mb in shard]})


def unpack(payload: bytes) -> tuple[list[list[TrainSequence]], int, int]:
    raw = msgpack.unpackb(payload)
    shard = [[TrainSequence(np.frombuffer(t, np.int32), np.frombuffer(m, np.uint8), np.frombuffer(lp, np.float32),
                            np.frombuffer(a, np.float32), st, r) for t, m, lp, a, st, r in mb]
             for mb in raw["micro_batches"]]
    return shard, raw["global_tokens"], raw["global_sequences"]


def collate(mb: list[TrainSequence], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-padded tensors for one micro-batch, on ``device``."""
    width = max(len(s) for s in mb)

    def pad(name: str, dtype) -> torch.Tensor:
        out = torch.zeros(len(mb), width, dtype=dtype)
        for i, s in enumerate(mb):
            out[i, : len(s)] = torch.as_tensor(np.asarray(getattr(s, name)).astype(np.float32 if dtype.is_floating_point
                                                                                    else np.int64))
        return out

    attention = torch.zeros(len(mb), width, dtype=torch.long)
    for i, s in enumerate(mb):
        attention[i, : len(s)] = 1
    batch = {"input_ids": pad("tokens", torch.long), "attention_mask": attention, "mask": pad("mask", torch.float32),
             "logprobs": pad("logprobs", torch.float32), "advantages": pad("advantages", torch.float32)}
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def kl_penalties(groups: list[Group], reference: torch.nn.Module, coef: float, temperature: float,
                 estimator: str = "k1") -> list[np.ndarray]:
    """``coef * sum_t KL_t(pi_behav || pi_ref)`` over each sample's generated tokens, estimated from the
    data's behaviour logprobs, so only the frozen reference runs a forward."""
    out = []
    for group in groups:
        penalties = []
        for sample in group.samples:
            total = 0.0
            for part in sample.sequences():
                ids = torch.as_tensor(sample.tokens[part], dtype=torch.long)[None]
                logits = reference(input_ids=ids).logits[0, :-1].float() / (temperature or 1.0)
                ref = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()
                mask = sample.loss_mask[part][1:].astype(bool)
                behav = torch.as_tensor(sample.logprobs[part][1:][mask])
                total += float(losses.kl(behav, torch.as_tensor(ref[mask]), estimator).sum())
            penalties.append(coef * total)
        out.append(np.array(penalties))
    return out
