"""The frozen reference policy (the initial weights) that KL penalties are measured against.

Under a LoRA policy the reference is the policy itself with its adapter switched off: the base weights,
which never train, and no second copy of them.

It lives on the learner's device, in the policy's dtype, and runs packed forwards like the policy. Under
ZeRO-3 it is sharded the way the policy is (DeepSpeed's parameter partitioning, no optimizer): each rank
holds a slice and every forward gathers it, so every rank runs as many reference forwards (``stand_in``
for a rank with nothing to score).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from streamrl.learner import losses, packing
from streamrl.learner.batching import TrainSequence
from streamrl.learner.partition import first_fit
from streamrl.protocol import Group


class Reference:
    """``model``'s logprobs; with ``adapter_off`` the model is the LoRA policy's engine, run with its adapter
    switched off (the base weights, which never train)."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str, temperature: float,
                 adapter_off: bool = False):
        self.model, self.device, self.temperature, self.adapter_off = model, device, temperature, adapter_off

    @classmethod
    def load(cls, model_path: str, device: torch.device | str, dtype: torch.dtype, temperature: float,
             zero_stage: int = 0) -> Reference:
        """A frozen copy of the model at ``model_path``."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=packing.attention())
        model.eval().requires_grad_(False)
        if zero_stage == 3:
            import deepspeed

            config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                      "bf16": {"enabled": dtype == torch.bfloat16}}
            model = deepspeed.initialize(model=model, config=config)[0]
            model.eval()  # DeepSpeed's engine returns None here, not itself
        return cls(model if zero_stage == 3 else model.to(device), device, temperature)

    @classmethod
    def base_of(cls, policy: torch.nn.Module, temperature: float) -> Reference:
        """The base under a LoRA policy (DeepSpeed's engine around a PEFT model): no second copy."""
        return cls(policy, policy.device, temperature, adapter_off=True)

    @torch.no_grad()
    def logprobs(self, row: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's logprobs ``[1, N]`` of a packed micro-batch's tokens."""
        with self._weights():
            return packing.logprobs(self.model, row, self.temperature)[0]

    @contextlib.contextmanager
    def _weights(self) -> Iterator[None]:
        """The reference's weights in force: the base's, where the model is a LoRA policy."""
        if not self.adapter_off:
            yield
            return
        training = self.model.training
        self.model.eval()  # the adapter's dropout off too
        try:
            with self.model.module.disable_adapter():
                yield
        finally:
            self.model.train(training)

    @torch.no_grad()
    def stand_in(self) -> None:
        """A one-token forward, in step with the other ranks' reference forwards (ZeRO-3 gathers in each)."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.model(input_ids=ids, position_ids=ids, use_cache=False)

    def kl_penalties(self, groups: list[Group], coef: float, estimator: str, token_budget: int) -> list[np.ndarray]:
        """``coef * sum_t KL_t(pi_behav || pi_ref)`` over each sample's generated tokens (KL in the reward),
        estimated from the data's behaviour logprobs, so only the reference runs a forward: packed rows of
        up to ``token_budget`` tokens."""
        seqs, owner = [], []
        for g, group in enumerate(groups):
            for i, sample in enumerate(group.samples):
                for part in sample.sequences():
                    seqs.append(TrainSequence(sample.tokens[part], sample.loss_mask[part], sample.logprobs[part],
                                              np.zeros(part.stop - part.start, np.float32), 0))
                    owner.append((g, i))
        totals = np.zeros(len(seqs))
        for members in first_fit([len(s) for s in seqs], token_budget):
            row = packing.collate([seqs[i] for i in members], self.device)
            k = losses.kl(row["logprobs"], self.logprobs(row), estimator) * row["mask"]
            totals[members] = packing.per_sequence(k, row).double().cpu().numpy()
        out = [np.zeros(len(group.samples)) for group in groups]
        for (g, i), total in zip(owner, totals):
            out[g][i] += coef * total
        return out
