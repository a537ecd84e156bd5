"""The PPO critic: a value head on a transformer backbone, trained beside the policy.

Rewards sit on each sequence's last generated token; GAE runs over the generated
tokens of a sequence (observation tokens in between are not time steps). The value of
the state in which token t is chosen is read where that token's logprob is: at position
t - 1, whose hidden state has not seen token t (at t it has: that would be Q(s, a), and
the last token's advantage would vanish as the critic learns the reward). The value
loss is PPO's clipped squared error around the values at the version's start.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from streamrl.config import Config
from streamrl.learner import packing, tally
from streamrl.learner.batching import TrainSequence
from streamrl.learner.losses import gae, normaliser
from streamrl.learner.policy import deepspeed_config, empty_micro_batch_loss, weights_dtype


class ValueModel(torch.nn.Module):
    def __init__(self, path: str, dtype: torch.dtype = torch.float32):
        from transformers import AutoModel

        super().__init__()
        self.backbone = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=packing.attention())
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1, dtype=dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Values ``[1, N]`` of a packed row's positions (in bf16 under DeepSpeed's autocast: mixed precision)."""
        hidden = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def gae_advantages(values: torch.Tensor, seqs: list[TrainSequence], bounds: torch.Tensor, gamma: float, lam: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages and returns ``[1, N]`` for a packed micro-batch whose sequence i spans
    ``bounds[i]:bounds[i + 1]``: a generated token's advantage at its own position, its return at the
    position before it, where its state's value is read (``value_positions``); 0 elsewhere."""
    advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
    for i, seq in enumerate(seqs):
        # the tokens the policy scores: generated, not the sequence's first (``packing.scored``)
        steps = int(bounds[i]) + 1 + torch.as_tensor(seq.mask[1:].astype(bool)).nonzero().squeeze(-1)
        if steps.numel() == 0:
            continue
        rewards = torch.zeros(steps.numel())
        rewards[-1] = seq.reward
        adv, ret = gae(rewards, values[0, steps - 1], gamma, lam)
        advantages[0, steps], returns[0, steps - 1] = adv, ret
    return advantages, returns


def value_positions(row: dict[str, torch.Tensor]) -> torch.Tensor:
    """Where a packed row's values are trained ``[1, N]``: the position before each token the policy scores
    (generated, not a sequence's first: so never the last position of the sequence packed before it)."""
    before = torch.zeros_like(row["mask"])
    before[0, packing.scored(row) - 1] = 1
    return before


class Critic:
    def __init__(self, cfg: Config, path: str):
        import deepspeed

        self.cfg = cfg
        model = ValueModel(path, weights_dtype(cfg))  # as the policy, mixed precision too (deepspeed_config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.critic_lr, weight_decay=cfg.learner.weight_decay)
        self.model, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))

    @torch.no_grad()
    def values(self, row: dict[str, torch.Tensor]) -> torch.Tensor:
        return packing.values(self.model, row)

    def prepare(self, shard: list[list[TrainSequence]]) -> list[dict[str, Any] | None]:
        """Collate each micro-batch and put GAE advantages and returns into it (before any update)."""
        out = []
        for mb in shard:
            if not mb:
                if self.cfg.learner.zero_stage == 3:
                    with torch.no_grad():
                        empty_micro_batch_loss(self.model, 3)  # in step with the other ranks' forwards
                out.append(None)
                continue
            row = packing.collate(mb, self.model.device)
            row["old_values"] = self.values(row)
            adv, ret = gae_advantages(row["old_values"].float().cpu(), mb, row["bounds"], self.cfg.learner.gamma,
                                      self.cfg.learner.lam)
            row["advantages"], row["returns"] = adv.to(self.model.device), ret.to(self.model.device)
            out.append(row)
        if self.cfg.learner.whiten_advantages:
            _whiten([b for b in out if b is not None], self.model.device)
        return out

    def update(self, rows: list[dict[str, Any] | None], global_tokens: int) -> dict[str, float]:
        """One optimizer update of the value model over this rank's rows of a minibatch (``prepare``'s)."""
        scale = normaliser(global_tokens, self.world_size)
        eps, total = self.cfg.learner.value_clip, 0.0
        for i, row in enumerate(rows):
            last = i == len(rows) - 1
            self.model.set_gradient_accumulation_boundary(last)
            if row is None:
                loss = empty_micro_batch_loss(self.model, self.cfg.learner.zero_stage)
            else:
                v = packing.values(self.model, row)
                old, ret, mask = row["old_values"], row["returns"], value_positions(row)
                clipped = old + (v - old).clamp(-eps, eps)
                loss = (0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2) * mask).sum()
                total += float(loss.detach())
            self.model.backward(loss * scale)
            self.model.step()
        return {"value_loss": tally.sum_over_ranks(total, self.model.device) / max(global_tokens, 1)}


def _whiten(rows: list[dict[str, Any]], device: torch.device) -> None:
    """Advantages to zero mean, unit variance over the generated tokens of the whole global batch."""
    import torch.distributed as dist

    moments = torch.zeros(3, dtype=torch.float64, device=device)
    for b in rows:
        a, m = b["advantages"].double(), b["mask"].double()
        moments += torch.stack([(a * m).sum(), (a * a * m).sum(), m.sum()])
    if dist.is_initialized():
        dist.all_reduce(moments)
    total, squares, count = moments.tolist()
    if count < 2:
        return
    mean = total / count
    std = max(squares / count - mean**2, 0.0) ** 0.5
    for b in rows:
        b["advantages"] = (b["advantages"] - mean) / (std + 1e-6) * b["mask"]
