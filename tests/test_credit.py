"""Turn-level credit for multi-turn episodes: hand-computed advantages, their place on the tokens, and invariants."""

import numpy as np
import pytest
import torch

from streamrl.config import ConfigError, load_config
from streamrl.learner import batching, losses
from streamrl.protocol import Group, Sample
from streamrl.testing import synthetic_group

# a retry task: right at once (1), wrong then right (half pay), wrong twice (two of them)
RETRY = [[1.0], [0.0, 0.5], [0.0, 0.0], [0.0, 0.0]]


def _advantages(turn_rewards, **kw):
    return [a.tolist() for a in losses.turn_advantages(turn_rewards, losses.rloo, **kw)]


def test_with_lam_1_a_turn_is_scored_by_what_followed_it_in_its_own_episode():
    adv = _advantages(RETRY)
    # turn 0 over all four episodes: returns 1, .5, 0, 0 -> the episode-level RLOO advantage
    assert adv[0] == pytest.approx([1 - 0.5 / 3])
    assert [a[0] for a in adv[1:]] == pytest.approx([0.5 - 1 / 3, -0.5, -0.5])
    # turn 1 only among the three that reached it: returns .5, 0, 0
    assert [a[1] for a in adv[1:]] == pytest.approx([0.5, -0.25, -0.25])


def test_with_lam_0_a_lucky_retry_does_not_vouch_for_the_wrong_first_reply():
    adv = _advantages(RETRY, lam=0.0)
    # reaching turn 1 is worth V_1 = mean(.5, 0, 0) = 1/6 to every first reply that got there
    assert adv[0] == pytest.approx([1 - 1 / 6])
    assert [a[0] for a in adv[1:]] == pytest.approx([1 / 6 - (1 + 2 / 6) / 3] * 3)
    assert [a[1] for a in adv[1:]] == pytest.approx([0.5, -0.25, -0.25])  # the last turn has nothing to bootstrap


def test_gamma_discounts_later_turns_in_the_return():
    adv = _advantages(RETRY, gamma=0.5)
    assert [a[0] for a in adv] == pytest.approx([1 - 0.25 / 3, 0.25 - 1 / 3, -1.25 / 3, -1.25 / 3])


def test_single_turn_groups_get_exactly_the_episode_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    for estimator in (losses.rloo, losses.grpo):
        for lam in (0.0, 1.0):
            got = losses.turn_advantages([[r] for r in rewards.tolist()], estimator, lam=lam)
            assert torch.allclose(torch.stack([a[0] for a in got]), estimator(rewards))


def _episode(turns: list[tuple[int, float]], prompt_len: int = 3) -> Sample:
    """A sample whose turn k generated ``turns[k][0]`` tokens for reward ``turns[k][1]``, an observation between."""
    mask = [0] * prompt_len
    for k, (n, _) in enumerate(turns):
        mask += ([0, 0] if k else []) + [1] * n
    n = len(mask)
    return Sample(tokens=np.arange(n) % 50, loss_mask=mask, logprobs=np.where(mask, -1.0, 0.0),
                  versions=np.where(mask, 0, -1), reward=sum(r for _, r in turns),
                  turn_rewards=[r for _, r in turns])


def _generated(seq: batching.TrainSequence) -> list[float]:
    return seq.advantages[seq.mask.astype(bool)].tolist()


def test_each_turns_tokens_carry_that_turns_advantage():
    group = Group("p", "retry", [_episode([(2, 1.0)]), _episode([(3, 0.0), (2, 0.5)]),
                                  _episode([(1, 0.0), (4, 0.0)]), _episode([(2, 0.0), (2, 0.0)])])
    seqs = batching.sequences([group], version=0, algorithm="rloo", turns=batching.TurnCredit())
    adv = _advantages(RETRY)
    assert _generated(seqs[1]) == pytest.approx([adv[1][0]] * 3 + [adv[1][1]] * 2)
    assert _generated(seqs[2]) == pytest.approx([adv[2][0]] * 1 + [adv[2][1]] * 4)
    assert [s.reward for s in seqs] == [1.0, 0.5, 0.0, 0.0]
    episode = batching.sequences([group], version=0, algorithm="rloo")
    assert [_generated(s)[0] for s in seqs] == pytest.approx([_generated(s)[0] for s in episode])  # turn 0


def test_a_kl_penalty_counts_at_the_last_turn():
    group = Group("p", "retry", [_episode([(2, 0.0), (2, 1.0)]), _episode([(2, 0.0), (2, 0.0)])])
    seqs = batching.sequences([group], version=0, algorithm="rloo", penalties=[np.array([0.25, 0.0])],
                              turns=batching.TurnCredit())
    # returns: turn 0 .75 vs 0, turn 1 .75 vs 0
    assert _generated(seqs[0]) == pytest.approx([0.75] * 4) and _generated(seqs[1]) == pytest.approx([-0.75] * 4)
    assert seqs[0].reward == pytest.approx(0.75)


def test_a_sample_whose_turns_cannot_be_told_apart_is_scored_as_one_turn():
    odd = _episode([(2, 0.0), (2, 1.0)])
    odd.turn_rewards = [0.0, 0.0, 1.0]  # three turns, two runs of generated tokens: one turn generated nothing
    group = Group("p", "retry", [odd, _episode([(2, 0.0)])])
    assert batching.turn_spans(odd) is None and batching.turn_spans(group.samples[1]) == [slice(3, 5)]
    seqs = batching.sequences([group], version=0, algorithm="rloo", turns=batching.TurnCredit())
    assert _generated(seqs[0]) == pytest.approx([1.0] * 4) and _generated(seqs[1]) == pytest.approx([-1.0] * 2)


def test_turn_credit_leaves_single_turn_training_data_unchanged():
    groups = [synthetic_group(4, 12, prompt_len=4, rng=np.random.default_rng(s)) for s in range(3)]
    for algorithm in ("rloo", "grpo"):
        a = batching.sequences(groups, version=1, algorithm=algorithm)
        b = batching.sequences(groups, version=1, algorithm=algorithm, turns=batching.TurnCredit(lam=0.0))
        assert all(np.allclose(_generated(x), _generated(y)) for x, y in zip(a, b))


def test_turn_credit_is_for_group_estimators(tmp_path):
    assert load_config(None, ["learner.credit=turn", "learner.turn_lam=0"]).learner.turn_lam == 0
    with pytest.raises(ConfigError, match="critic already scores every token"):
        load_config(None, ["learner.credit=turn", "learner.algorithm=ppo"])
    with pytest.raises(ConfigError, match="turn_lam"):
        load_config(None, ["learner.turn_lam=2"])
