import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from streamrl.buffer.redis_server import free_port
from streamrl.learner.losses import PolicyLoss, gae, grpo, kl, normaliser, rloo


def test_rloo_by_hand_and_sums_to_zero():
    a = rloo(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert torch.allclose(a, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    for _ in range(20):
        r = torch.randn(int(torch.randint(2, 16, ())))
        assert abs(float(rloo(r).sum())) < 1e-5
    assert rloo(torch.tensor([3.0])).tolist() == [0.0]


def test_grpo_by_hand():
    a = grpo(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert torch.allclose(a, torch.tensor([1, -1, -1, 1]) * 0.5 / math.sqrt(1 / 3), atol=1e-5)
    assert torch.allclose(grpo(torch.tensor([1.0, 0.0, 0.0, 1.0]), scale=False), torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("estimator", [rloo, grpo])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantages(estimator):
    # eight rewards of 0.1 (a wrong bare number in the arithmetic env): in fp32 their mean is not 0.1, and GRPO's
    # 1 / (std + eps) once scaled the rounding to advantages of -7e-3
    for value in (0.1, 0.3, 1.0, -2.7):
        assert estimator(torch.full((8,), value)).tolist() == [0.0] * 8
    assert estimator(torch.tensor([0.1, 0.1, 0.1 + 1e-6])).abs().max() > 0  # any spread is signal


def test_gae_recursion_by_hand():
    adv, ret = gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.5, 0.5]), gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([0.5, 0.5, 0.5])) and torch.allclose(ret, torch.tensor([1.0, 1.0, 1.0]))
    adv, _ = gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.5, 0.5]), gamma=0.9, lam=0.5)
    # d2 = 1 - .5 = .5;  d1 = .9*.5 - .5 = -.05;  d0 = -.05;  A1 = d1 + .45*A2;  A0 = d0 + .45*A1
    assert torch.allclose(adv, torch.tensor([-0.05 + 0.45 * 0.175, 0.175, 0.5]))


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # log r = -1
    assert kl(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl(logp, ref, "k2").item() == pytest.approx(0.5)
    assert kl(logp, ref, "k3").item() == pytest.approx(math.exp(-1))
    assert kl(logp, logp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl(logp, ref, "k4")


def test_clipping_and_dual_clip_by_hand():
    behav = torch.zeros(3)
    logp = torch.log(torch.tensor([1.5, 0.5, 5.0]))
    adv = torch.tensor([1.0, -1.0, -1.0])
    mask = torch.ones(3)
    loss, stats = PolicyLoss(correction="none", clip_low=0.2)(logp, behav, None, adv, mask)
    assert torch.allclose(loss, torch.tensor([-1.2, 0.8, 5.0]))  # min(uA, clip(u)A), negated
    loss, _ = PolicyLoss(correction="none", clip_low=0.2, dual_clip=3.0)(logp, behav, None, adv, mask)
    assert torch.allclose(loss, torch.tensor([-1.2, 0.8, 3.0]))  # dual clip bounds the negative-A loss at c|A|
    loss, _ = PolicyLoss(correction="none", clip_low=0.2, clip_high=0.6)(logp, behav, None, adv, mask)
    assert loss[0].item() == pytest.approx(-1.5)  # 1.5 is inside [0.8, 1.6]
    assert stats["clip_frac"].item() == pytest.approx(1.0)


def test_tis_caps_the_weight_and_decoupled_does_not():
    behav = torch.zeros(2)
    prox = torch.log(torch.tensor([3.0, 0.5]))
    logp = prox.clone()
    adv, mask = torch.ones(2), torch.ones(2)
    tis, stats = PolicyLoss(correction="tis", tis_cap=2.0)(logp, behav, prox, adv, mask)
    assert torch.allclose(tis, torch.tensor([-2.0, -0.5]))
    assert stats["is_capped_frac"].item() == pytest.approx(0.5)
    dec, _ = PolicyLoss(correction="decoupled")(logp, behav, prox, adv, mask)
    assert torch.allclose(dec, torch.tensor([-3.0, -0.5]))


def test_decoupled_leaves_out_tokens_past_the_behaviour_weight_cap():
    behav = torch.zeros(3)
    prox = torch.log(torch.tensor([3.0, 0.5, 10.0]))  # w = pi_prox / pi_behav = 3, 0.5, 10
    adv, mask = torch.tensor([1.0, 1.0, -1.0]), torch.ones(3)
    out, stats = PolicyLoss(correction="decoupled", behav_cap=5.0)(prox.clone(), behav, prox, adv, mask)
    assert torch.allclose(out, torch.tensor([-3.0, -0.5, 0.0]))  # left out, not clamped to 5
    assert stats["is_capped_frac"].item() == pytest.approx(1 / 3)
    uncapped, _ = PolicyLoss(correction="decoupled")(prox.clone(), behav, prox, adv, mask)
    assert torch.allclose(uncapped, torch.tensor([-3.0, -0.5, 10.0]))


def test_on_policy_every_correction_is_plain_ppo_with_ratio_one():
    torch.manual_seed(0)
    logits = torch.randn(12, requires_grad=True)
    logp = torch.log_softmax(logits, 0)
    behav = logp.detach().clone()
    adv, mask = torch.randn(12), (torch.rand(12) > 0.3).float()
    grads, losses = [], []
    for correction in ("none", "tis", "decoupled"):
        loss, stats = PolicyLoss(correction=correction)(logp, behav, behav, adv, mask)
        assert stats["ratio_mean"].item() == pytest.approx(1.0) and stats["is_weight_mean"].item() == pytest.approx(1.0)
        (g,) = torch.autograd.grad(loss.sum(), logits, retain_graph=True)
        grads.append(g)
        losses.append(loss.detach())
    for g, loss_i in zip(grads[1:], losses[1:]):
        assert torch.allclose(g, grads[0]) and torch.allclose(loss_i, losses[0])
    assert torch.allclose(losses[0], -adv * mask)


# ---------------------------------------------------------------- uneven split == full batch, real gloo ranks

LENGTHS = [3, 9, 2, 4, 1]           # five sequences
SPLIT = {0: [1], 1: [0, 2, 3, 4]}   # rank 0 gets one long sequence, rank 1 four short ones


def _batch():
    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(n, 6, generator=g) for n in LENGTHS]
    tokens = [torch.randint(0, 5, (n,), generator=g) for n in LENGTHS]
    adv = [torch.full((n,), float(torch.randn((), generator=g))) for n in LENGTHS]
    behav = [torch.log_softmax(torch.randn(n, 5, generator=g), -1).gather(1, t[:, None])[:, 0]
             for n, t in zip(LENGTHS, tokens)]
    return feats, tokens, adv, behav


def _loss_sum(model, seqs):
    feats, tokens, adv, behav = _batch()
    total = 0.0
    for i in seqs:
        logp = torch.log_softmax(model(feats[i]), -1).gather(1, tokens[i][:, None])[:, 0]
        per_token, _ = PolicyLoss(correction="tis")(logp, behav[i], behav[i] + 0.1, adv[i], torch.ones(LENGTHS[i]))
        total = total + per_token.sum()
    return total


def _rank(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5)
    loss = _loss_sum(model, SPLIT[rank]) * normaliser(sum(LENGTHS), world_size=2)
    loss.backward()
    for p in model.parameters():  # what DeepSpeed / DDP do: average gradients over ranks
        dist.all_reduce(p.grad)
        p.grad /= 2
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    out[rank] = [p.detach().clone() for p in model.parameters()]
    dist.destroy_process_group()


def test_an_uneven_split_over_two_gloo_ranks_equals_the_full_batch():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5)
    (_loss_sum(model, range(len(LENGTHS))) / sum(LENGTHS)).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    full = [p.detach() for p in model.parameters()]

    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    for rank in range(2):
        for got, want in zip(out[rank], full):
            assert torch.allclose(got, want, atol=1e-6)


def test_the_statistics_carry_the_importance_weights_first_two_moments():
    """r = pi_prox / pi_behav over the generated tokens, uncapped: weights 1, 2, 4 (and one masked out) give
    mean 7/3 and mean square 7, so an effective sample size of (7/3)^2 / 7 = 7/9 of the tokens."""
    behav = torch.zeros(4)
    prox = torch.log(torch.tensor([1.0, 2.0, 4.0, 100.0]))
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    for correction in ("none", "tis", "decoupled"):  # whatever the loss does with them
        _, stats = PolicyLoss(correction=correction, tis_cap=1.5)(prox.clone(), behav, prox, torch.ones(4), mask)
        assert stats["is_raw_mean"].item() == pytest.approx(7 / 3)
        assert stats["is_raw_sq_mean"].item() == pytest.approx(7.0)
    _, stats = PolicyLoss()(prox.clone(), behav, None, torch.ones(4), mask)  # no proximal policy: pi / pi_behav
    assert stats["is_raw_mean"].item() == pytest.approx(7 / 3)
