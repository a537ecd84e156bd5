"""Synthetic groups with every wire field filled in, for tests and benchmarks."""

from __future__ import annotations

import asyncio

import numpy as np

from streamrl.envs.arithmetic import Arithmetic
from streamrl.envs.single_turn import SingleTurn
from streamrl.protocol import Group, Sample


def synthetic_group(
    num_samples: int = 8,
    num_tokens: int = 1024,
    *,
    prompt_len: int = 128,
    version: int = 0,
    vocab: int = 32000,
    rng: np.random.Generator | None = None,
    prompt_id: str = "p0",
) -> Group:
    """A group whose samples have a shared prompt and random responses of ``num_tokens`` total.

    Response tokens carry versions ``version`` and ``version + 1`` (a weight swap in
    flight halfway through), so version ranges are non-trivial.
    """
    rng = rng or np.random.default_rng()
    prompt_len = min(prompt_len, num_tokens - 1)
    prompt = rng.integers(0, vocab, prompt_len)
    samples = []
    for _ in range(num_samples):
        n_resp = num_tokens - prompt_len
        mask = np.r_[np.zeros(prompt_len), np.ones(n_resp)].astype(np.uint8)
        versions = np.full(num_tokens, -1)
        versions[prompt_len:] = version
        versions[prompt_len + n_resp // 2 :] = version + 1
        logprobs = np.zeros(num_tokens, np.float32)
        logprobs[prompt_len:] = -rng.exponential(1.0, n_resp)
        samples.append(
            Sample(
                tokens=np.r_[prompt, rng.integers(0, vocab, n_resp)],
                loss_mask=mask,
                logprobs=logprobs,
                versions=versions,
                reward=float(rng.integers(0, 2)),
                finish_reason="stop",
                turn_rewards=[0.0],
                env_info={"answer": "42", "turns": 1},
                timings={"generate_s": 0.5, "env_s": 0.01},
            )
        )
    return Group(prompt_id=prompt_id, env="synthetic", samples=samples, meta={"dataset_index": 0})


class Flaky(Arithmetic):
    """Arithmetic whose every third reset raises: for tests of failure handling."""

    resets = 0

    async def reset(self, item):
        Flaky.resets += 1
        if Flaky.resets % 3 == 0:
            raise RuntimeError("flaky env failed on purpose")
        return await super().reset(item)


class Slow(Arithmetic):
    """Arithmetic whose every episode takes at least two seconds: for tests of leases and of restarts mid-run."""

    async def reset(self, item):
        await asyncio.sleep(2.0)
        return await super().reset(item)


class Unhurried(SingleTurn):
    """A single-turn env whose every episode waits ``delay_s`` first (as a slow checker would): it paces a toy
    run that would otherwise end before a test has made its events happen."""

    def __init__(self, delay_s: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.delay_s = delay_s

    async def reset(self, item):
        await asyncio.sleep(self.delay_s)
        return await super().reset(item)


def learner_logprob_gap(model, sample: Sample) -> float:
    """Largest gap between a sample's behaviour logprobs and the learner's own (its packed forward, each
    sequence from its own start) on the generated tokens: ~1e-5 when server and learner agree."""
    import torch

    from streamrl.learner import batching, packing

    seqs = batching.sequences([Group("p", "test", [sample, sample])], version=0, algorithm="rloo")
    batch = packing.collate(seqs[: len(sample.seq_lens) if sample.seq_lens is not None else 1])
    with torch.no_grad():
        logp, _ = packing.token_logprobs(packing.forward(model, batch), batch, 1.0)
    mask = batch["mask"][0] > 0
    assert int(mask.sum()) == int(sample.loss_mask.sum()), "the mask is not the sample's generated tokens"
    return float((logp[0][mask] - batch["logprobs"][0][mask]).abs().max())
