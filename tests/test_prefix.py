import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.learner import packing, prefix
from streamrl.learner.batching import TrainSequence


def _sequence(prompt, reply, rng) -> TrainSequence:
    tokens = np.r_[prompt, reply].astype(np.int32)
    mask = np.r_[np.zeros(len(prompt)), np.ones(len(reply))].astype(np.uint8)
    return TrainSequence(tokens, mask, np.zeros(len(tokens), np.float32),
                         np.full(len(tokens), rng.normal(), np.float32), staleness=0)


def _micro_batch(rng) -> list[TrainSequence]:
    """Two groups with prompts of different lengths, a lone sequence, replies of different lengths, interleaved."""
    short, long_, lone = rng.integers(3, 200, 12), rng.integers(3, 200, 20), rng.integers(3, 200, 15)
    mb = []
    for i in range(4):
        mb.append(_sequence(short, rng.integers(3, 200, 1 + i), rng))
        mb.append(_sequence(long_, rng.integers(3, 200, 2 + i), rng))
    mb.insert(2, _sequence(lone, rng.integers(3, 200, 5), rng))
    return mb


def _loss_and_grads(model, logits, batch):
    model.zero_grad()
    logp, _ = packing.token_logprobs(logits, batch, 1.0)
    loss = (logp * batch["mask"] * batch["advantages"]).sum()
    loss.backward()
    return logp.detach(), [p.grad.clone() for p in model.parameters()]


def test_a_shared_prompt_forward_gives_the_packed_forwards_logprobs_and_gradient(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=packing.attention())
    mb = _micro_batch(np.random.default_rng(0))
    batch = packing.collate(mb)
    shared = prefix.layout(mb)
    assert shared["prompt_ids"].shape == (3, 20)  # three distinct prompts, left-padded to the longest
    assert shared["prompt_row"].tolist() == [0, 1, 2, 0, 1, 0, 1, 0, 1]

    want_logp, want_grads = _loss_and_grads(model, packing.forward(model, batch), batch)
    got_logp, got_grads = _loss_and_grads(model, packing.forward(model, {**batch, **shared}), batch)

    generated = batch["mask"].bool()
    assert torch.allclose(got_logp[generated], want_logp[generated], atol=1e-5)
    scale = max(g.abs().max() for g in want_grads)
    for want, got in zip(want_grads, got_grads):
        assert torch.allclose(got, want, atol=1e-5 * scale)


@pytest.mark.parametrize("case", ["distinct prompts", "no prompt", "long replies"])
def test_nothing_worth_sharing_leaves_the_plain_forward(case):
    rng = np.random.default_rng(1)
    if case == "distinct prompts":
        mb = [_sequence(rng.integers(3, 200, 5), rng.integers(3, 200, 3), rng) for _ in range(3)]
    elif case == "long replies":  # a shared prompt of 8 beside replies of 40: two forwards would cost more
        prompt = rng.integers(3, 200, 8)
        mb = [_sequence(prompt, rng.integers(3, 200, 40), rng) for _ in range(4)]
    else:  # a sequence whose first token is generated has no prompt to share
        mb = [_sequence([], rng.integers(3, 200, 3), rng), _sequence([], rng.integers(3, 200, 3), rng)]
    assert prefix.layout(mb) is None
