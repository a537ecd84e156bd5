"""The policy under DeepSpeed: one optimizer step over a rank's micro-batches.

Every rank runs the same number of micro-batches (see ``partition``); DeepSpeed's
accumulation boundary is set explicitly on the last one, so a step's size can vary
from step to step. Each micro-batch's loss is its token sum times
``world_size / N_global``: the data-parallel all-reduce averages, so the step equals
the full batch's gradient however unevenly the tokens fell on the ranks.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from streamrl.config import Config
from streamrl.learner.batch import TrainSequence, collate
from streamrl.learner.losses import PolicyLoss, normaliser


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logp[b, t]`` of token t under the distribution at position t-1, in fp32 (0 at t=0).

    The same quantity the rollout engine reports: tempered, before any truncation.
    """
    logp = torch.log_softmax(logits[:, :-1].float() / (temperature or 1.0), -1)
    picked = logp.gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked, (1, 0))


def deepspeed_config(cfg: Config) -> dict[str, Any]:
    if cfg.learner.deepspeed_config:
        import json

        return json.loads(cfg.learner.deepspeed_config.read_text())
    bf16 = cfg.model.dtype == "bfloat16"
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # boundaries are set per step instead
        "gradient_clipping": cfg.learner.grad_clip,
        "zero_optimization": {"stage": cfg.learner.zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class PolicyEngine:
    def __init__(self, cfg: Config, model_path: str):
        import deepspeed
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        model.config.use_cache = False
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr)  # no Adam op to compile
        warmup = cfg.learner.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg))
        self.loss = PolicyLoss(correction=cfg.off_policy.correction, clip_low=cfg.learner.clip_eps,
                               clip_high=cfg.learner.clip_eps_high, tis_cap=cfg.off_policy.tis_cap)
        self.temperature = cfg.rollout.sampling.temperature
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @torch.no_grad()
    def proximal(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Logprobs of the weights at the start of the step (for tis / decoupled)."""
        self.engine.eval()
        out = [token_logprobs(self.engine(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits,
                              mb["input_ids"], self.temperature) for mb in micro_batches]
        self.engine.train()
        return out

    def step(self, shard: list[list[TrainSequence]], global_tokens: int) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns summed statistics."""
        batches = [collate(mb) if mb else None for mb in shard]
        prox = self.proximal([b for b in batches if b is not None]) if self.cfg.off_policy.correction != "none" else None
        scale = normaliser(global_tokens, self.world_size)
        stats = {"loss": 0.0, "tokens": 0.0, "clip_frac": 0.0, "is_weight_max": 0.0}
        prox_iter = iter(prox or [])
        for i, batch in enumerate(batches):
            self.engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
            if batch is None:  # an empty micro-batch still joins the step, with a zero loss
                loss = sum(p.sum() * 0.0 for p in self.engine.module.parameters())
            else:
                logits = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                logp = token_logprobs(logits, batch["input_ids"], self.temperature)
                per_token, s = self.loss(logp, batch["logprobs"], next(prox_iter, None), batch["advantages"],
                                         batch["mask"])
                loss = per_token.sum() * scale
                n = float(batch["mask"].sum())
                stats["loss"] += float(per_token.sum()) / max(global_tokens, 1)
                stats["tokens"] += n
                stats["clip_frac"] += float(s["clip_frac"]) * n
                stats["is_weight_max"] = max(stats["is_weight_max"], float(s["is_weight_max"]))
            if not math.isfinite(float(loss)):
                raise FloatingPointError(f"non-finite loss {float(loss)} in micro-batch {i}")
            self.engine.backward(loss)
            self.engine.step()
        stats["clip_frac"] /= max(stats["tokens"], 1.0)
        stats["lr"] = self.scheduler.get_last_lr()[0] if self.scheduler else self.cfg.learner.lr
        return stats
