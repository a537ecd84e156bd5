"""The staleness controller, driven with synthetic signals: each decision and its cause."""

import math

import pytest

from streamrl.config.sections import AutoStalenessConfig
from streamrl.learner.staleness import Signals, StalenessController, afford, median_noise, signals

CALM = Signals(wait_share=0.5, ess=0.97, second_moment=1.02, clip_frac=0.01, grad_norm=1.0)


def calm(**changed) -> Signals:
    return Signals(**{**CALM.__dict__, **changed})


def controller(bound: int | None = None, doubling: bool = True, **rules) -> StalenessController:
    """A controller under ``off_policy.auto`` settings (their defaults, but for ``rules``); ``doubling``: in a
    fresh run's climb."""
    return StalenessController(AutoStalenessConfig(**rules), bound, doubling)


def run(controller: StalenessController, signals: list[Signals], first_step: int = 0) -> list:
    return [(step, c) for step, s in enumerate(signals, first_step) if (c := controller.observe(step, s))]


def test_a_learner_waiting_on_healthy_data_doubles_the_bound_up_to_its_ceiling():
    """Slow start: while the bound doubles, the last step's held wait raises it, once `patience` steps under the
    bound are in (the raise's trial compares them with the steps after it) and the last raise is judged."""
    c = controller(low=1, high=8, bound=1, patience=3, cooldown=4)
    changes = run(c, [CALM] * 20)
    assert [(step, ch.old, ch.new) for step, ch in changes] == [(2, 1, 2), (6, 2, 4), (10, 4, 8)]
    assert "waited 50% of its step for data the bound held back 3 steps running" in changes[0][1].cause
    assert c.bound == 8
    c = controller(low=1, high=8, bound=1, patience=3, cooldown=4)
    changes = run(c, [calm(held_share=0.0)] * 2 + [CALM] + [calm(held_share=0.0)] * 3 + [CALM] * 2)
    assert [(step, ch.new) for step, ch in changes] == [(2, 2), (6, 4)]  # only held waits count
    capped = controller(low=0, high=3, bound=0, patience=1, cooldown=1)
    assert [ch.new for _, ch in run(capped, [CALM] * 5)] == [1, 2, 3]  # from 0 by one; never past high
    assert [ch.new for _, ch in run(controller(high=8, start=5, patience=1), [CALM])] == [8]


def test_once_the_bound_has_come_down_raises_add_one():
    c = controller(low=1, high=8, bound=4, patience=2, cooldown=2)
    changes = run(c, [calm(wait_share=0.0)] * 2 + [CALM] * 10)  # raises wait for the easing's verdict (step 7)
    assert [(step, ch.way, ch.new) for step, ch in changes] == [(1, "eased", 3), (7, "raised", 4), (9, "raised", 5),
                                                               (11, "raised", 6)]


def test_a_learner_that_waits_a_little_keeps_the_bound():
    c = controller(bound=2)  # between idle_share (2%) and wait_share (10%)
    assert run(c, [calm(wait_share=0.05)] * 20) == [] and c.bound == 2


def test_a_learner_that_never_waits_eases_the_bound_one_at_a_time_to_its_floor():
    """The learner is the bottleneck: a smaller bound costs no throughput and trains fresher data."""
    c = controller(low=1, high=8, bound=4, patience=3, cooldown=4)
    changes = run(c, [calm(wait_share=0.01)] * 20)
    # each easing is judged before the next, on the steps after the groups admitted under the old bound
    assert [(step, ch.old, ch.new) for step, ch in changes] == [(2, 4, 3), (10, 3, 2), (17, 2, 1)]
    assert str(changes[0][1]).startswith("max staleness eased 4 -> 3 at step 2: the learner waited under 2.0% of its "
                                         "step for data 3 steps running") and c.bound == 1
    never = controller(bound=4, idle_share=0.0)
    assert run(never, [calm(wait_share=0.0)] * 20) == []  # idle_share 0 turns easing off


def test_easing_never_goes_to_0_only_a_cut_does():
    """Under 0 generation cannot overlap training: the learner waits for every step's data, so a learner that
    never waits under 1 would only be slowed by 0."""
    c = controller(low=0, high=8, bound=3, patience=1, cooldown=1)
    assert [ch.new for _, ch in run(c, [calm(wait_share=0.0)] * 10)] == [2, 1] and c.bound == 1
    assert [ch.new for _, ch in run(c, [calm(ess=0.5)], first_step=10)] == [0]


def test_easing_stops_one_above_the_bound_the_learner_last_waited_at():
    """Bound 2 starves the learner, 4 (its double) feeds it: easing leaves it at 3, not 3, 2, 3, 2 ...; a cut
    clears that floor."""
    c = controller(low=1, high=8, bound=2, patience=2, cooldown=2)
    changes = run(c, [calm(wait_share=0.3)] * 2 + [calm(wait_share=0.0)] * 20)
    assert [(step, ch.old, ch.new) for step, ch in changes] == [(1, 2, 4), (3, 4, 3)] and c.bound == 3
    changes = run(c, [calm(ess=0.5)] + [calm(wait_share=0.0)] * 3, first_step=22)
    assert [(ch.old, ch.new) for _, ch in changes] == [(3, 1)]  # halved past the floor
    c = controller(low=1, high=8, bound=4, patience=2, cooldown=1)
    assert [ch.new for _, ch in run(c, [calm(wait_share=0.3)] * 2 + [calm(ess=0.5)])] == [8, 4]
    changes = run(c, [calm(wait_share=0.0)] * 16, first_step=3)
    assert [(ch.old, ch.new) for _, ch in changes] == [(4, 3), (3, 2), (2, 1)]


def idle(step_s: float) -> Signals:
    return calm(step_s=step_s, wait_share=0.0)


def test_an_easing_that_slows_the_learner_is_reverted_and_not_retried_until_a_cut():
    """The learner never waits under 2 or 1, yet its steps take 1.25 s under 1 against 1.0 s under 2 (on a shared
    machine a step also waits for the cores, not only for data: SmolLM2's agentic runs eased 2 -> 1 at 1.39 and
    1.12 samples/s). The easing is judged as a raise is, over the steps after the two that still train groups
    admitted under 2, and reverted; easing then stops at 2 until a cut says what fed the learner is unknown."""
    c = controller(low=1, high=8, bound=2, patience=2, cooldown=3, doubling=False)
    changes = drive(c, 30, {2: 1.0, 1: 1.25}, wait_share=0.0)
    assert [(step, ch.way, ch.old, ch.new) for step, ch in changes] == [(1, "eased", 2, 1), (6, "reverted", 1, 2)]
    assert str(changes[1][1]) == ("max staleness reverted 1 -> 2 at step 6: easing it at step 1 did not keep the "
                                  "learner as fast: 1 s a step before, 1.25 s after (median); easing stops at 2")
    changes = run(c, [calm(ess=0.5)] + [idle(1.0)] * 8, first_step=30)
    assert [(step, ch.way, ch.new) for step, ch in changes] == [(30, "lowered", 1)]  # at low: nothing to ease
    c = controller(low=1, high=8, bound=4, patience=2, cooldown=3, doubling=False)
    changes = run(c, [idle(1.0)] * 2 + [idle(1.25)] * 6 + [calm(ess=0.5)] + [idle(1.0)] * 5)
    assert [(step, ch.way, ch.new) for step, ch in changes] == [(1, "eased", 3), (8, "lowered", 1)]


def test_an_easing_that_keeps_the_learner_as_fast_is_kept_and_the_next_one_tried():
    c = controller(low=1, high=8, bound=4, patience=2, cooldown=3, doubling=False)
    changes = run(c, [idle(1.0)] * 20)  # each judged after the old bound's groups and max(cooldown, patience) steps
    assert [(step, ch.way, ch.new) for step, ch in changes] == [(1, "eased", 3), (8, "eased", 2), (14, "eased", 1)]


def test_an_easing_is_judged_on_the_steps_after_the_groups_admitted_under_the_old_bound_are_trained():
    """The two steps after easing 2 -> 1 still train groups admitted under 2 and read 1.0 s; the smaller pipeline
    shows from the third on (1.3 s). A verdict over the first three steps (median 1.0 s) would keep it."""
    c = controller(low=1, high=8, bound=2, patience=2, cooldown=3, doubling=False)
    changes = run(c, [idle(1.0)] * 4 + [idle(1.3)] * 4)
    assert [(step, ch.way, ch.new) for step, ch in changes] == [(1, "eased", 1), (6, "reverted", 2)]


def test_a_learner_an_easing_starves_waits_and_the_verdict_takes_the_easing_back():
    """Under 1 the learner waits for data the bound holds back once the groups admitted under 2 are trained: no
    raise comes during the easing's trial (it would be judged against steps still fed under 2), the waits
    lengthen the steps, and the verdict puts the bound back; easing stops there."""
    c = controller(low=1, high=8, bound=2, patience=2, cooldown=3, doubling=False)
    changes = run(c, [idle(1.0)] * 4 + [calm(step_s=1.4)] * 3 + [idle(1.0)] * 12)
    assert [(step, ch.way, ch.old, ch.new) for step, ch in changes] == [(1, "eased", 2, 1), (6, "reverted", 1, 2)]
    assert "1 s a step before, 1.4 s after (median); easing stops at 2" in changes[1][1].cause and c.bound == 2


@pytest.mark.parametrize("bad, cause", [(calm(ess=0.6), "ESS 0.60 < 0.8"), (calm(second_moment=2.0), "E[w^2] 2.00"),
                                        (calm(clip_frac=0.3), "clip fraction 0.30 > 0.1"),
                                        (calm(ess=0.79961), "ESS 0.7996 < 0.8")])  # not "0.80 < 0.8"
def test_degraded_off_policy_data_halves_the_bound_at_once_with_its_cause(bad, cause):
    c = controller(low=1, high=8, bound=8, cooldown=4)
    changes = run(c, [bad] * 9)
    assert [(ch.old, ch.new) for _, ch in changes] == [(8, 4), (4, 2), (2, 1)]  # once per cooldown, to the floor
    assert [step for step, _ in changes] == [0, 4, 8] and cause in changes[0][1].cause
    assert str(changes[0][1]).startswith("max staleness lowered 8 -> 4 at step 0: ")
    assert run(c, [bad] * 10, first_step=9) == [] and c.bound == 1  # never under low


def test_the_age_the_drift_affords_against_hand_computed_values():
    # age * ln(0.8) / ln(ESS): ln 0.8 = -0.22314
    assert afford(0.27, 1, 0.8) == 0  # 0.22314 / 1.30933 = 0.17
    assert afford(0.5, 2, 0.8) == 0  # 2 * 0.22314 / 0.69315 = 0.64
    assert afford(0.73, 4, 0.8) == 2  # 4 * 0.22314 / 0.31471 = 2.84
    assert afford(0.7, 8, 0.8) == 5  # 8 * 0.22314 / 0.35667 = 5.005
    assert afford(0.79, 10, 0.8) == 9  # just under the floor: just under the age measured
    assert afford(0.0, 3, 0.8) == 0
    assert afford(0.5, 0, 0.8) is None and afford(1.0, 4, 0.8) is None  # on-policy data; no drift measured
    # the invariant: an ESS under the floor never affords the age it was measured at
    for ess in (0.01, 0.3, 0.6, 0.799):
        assert all(afford(ess, age, 0.8) < age for age in range(1, 20))


@pytest.mark.parametrize("bound, ess, age, low, new", [
    (7, 0.27, 1, 0, 0),  # the stress run's second step: one version of lag already read 0.27
    (7, 0.27, 1, 1, 1),  # never under low
    (8, 0.5, 2, 0, 0),
    (4, 0.73, 4, 0, 2),  # affords 2 = half: a dip just under the floor is halved, as before
    (8, 0.7, 8, 0, 4),  # affords 5 > half: halved
    (8, 0.7, 3, 0, 1),  # the data was younger than the bound let it be: floor(3 * 0.626) = 1
    (8, 0.5, 0, 0, 4),  # no age measured: halved
])
def test_an_ess_far_under_the_floor_cuts_to_the_age_the_drift_affords(bound, ess, age, low, new):
    c = controller(low=low, high=8, bound=bound)
    changes = run(c, [calm(ess=ess, age=age)] * 2)  # twice: a shallow dip cuts on its second reading
    assert [(ch.old, ch.new) for _, ch in changes] == [(bound, new)]
    cause = changes[0][1].cause
    deeper = new < max(low, bound // 2)
    assert ("data keeps an ESS of 0.8 up to" in cause) == deeper and cause.startswith(f"ESS {ess:.2f} < 0.8")
    if deeper:
        assert f"on data up to {age} version{'s' if age > 1 else ''} old" in cause


@pytest.mark.parametrize("bound, ess, age", [(2, 0.71, 2), (4, 0.73, 4), (8, 0.7, 8), (8, 0.75, 6)])
def test_a_single_shallow_ess_dip_cuts_nothing_and_a_second_in_a_row_cuts(bound, ess, age):
    """A dip whose drift still affords data half the bound old (the toy's single-turn workload read 0.71 on data 2
    versions old once in 40 steps, and a cut to 1 dropped a step's groups) is noise until the next step reads
    degraded too; a deep one, or a shallow one beside another symptom, cuts at once."""
    steady = calm(wait_share=0.05)  # neither starved nor idle: nothing else moves the bound
    dip = calm(ess=ess, age=age, wait_share=0.05)
    c = controller(low=0, high=8, bound=bound)
    assert run(c, [dip, steady, dip, steady, steady]) == [] and c.bound == bound
    changes = run(c, [dip, dip], first_step=5)
    assert [(step, ch.new) for step, ch in changes] == [(6, bound // 2)]
    assert changes[0][1].cause == f"ESS {ess:.2f} < 0.8, the second degraded step in a row"
    c = controller(low=0, high=8, bound=bound)  # the second reading of another symptom
    assert [(step, ch.new) for step, ch in run(c, [calm(second_moment=2.0, wait_share=0.05), dip])] == [(0, bound // 2)]

    def cut_at_once(s: Signals) -> bool:
        return run(controller(low=0, high=8, bound=bound), [s]) != []

    assert not cut_at_once(dip)
    assert cut_at_once(calm(ess=ess - 0.3, age=age))  # deep: the drift affords data under half the bound old
    assert cut_at_once(calm(ess=ess, age=0))  # no drift measured
    assert cut_at_once(calm(ess=ess, age=age, clip_frac=0.3))
    assert cut_at_once(calm(ess=ess, age=age, second_moment=2.0))


def test_a_raise_whose_data_degrades_is_cut_at_once_and_backs_raises_off():
    """The cooldown lets data made under a looser bound drain before the next verdict; after a raise there is
    none, and the data made under it is the raise's verdict (at lr 5e-4 under stress an ESS of 0.32 the step after
    a raise went unjudged through the cooldown). A raise that brought degraded data did not pay: raises stop where
    it started, as after a revert, for a hold that doubles with each such raise in a row."""
    c = controller(low=0, high=8, bound=1, patience=2, cooldown=3, revert_hold=6, doubling=False)
    bad = calm(ess=0.5)
    changes = run(c, [calm()] * 2 + [bad] + [calm()] * 6 + [bad] + [calm()] * 14)
    assert [(step, ch.way, ch.old, ch.new) for step, ch in changes] == [
        (1, "raised", 1, 2), (2, "lowered", 2, 1), (8, "raised", 1, 2), (9, "lowered", 2, 1), (21, "raised", 1, 2)]
    assert [changes[i][1].cause for i in (1, 3)] == ["ESS 0.50 < 0.8; raises stop at 1 for 6 steps",
                                                     "ESS 0.50 < 0.8; raises stop at 1 for 12 steps"]
    # only a cut skips the cooldown: a learner idle from the raise on is not eased during it
    idle = controller(low=0, high=8, bound=2, patience=2, cooldown=3)  # doubled to 4: may ease to 3 after
    assert [(step, ch.way) for step, ch in run(idle, [calm()] * 2 + [calm(wait_share=0.0)] * 4)] == [
        (1, "raised"), (4, "eased")]
    # after a cut the data made under the looser bound drains first: a degraded step in its cooldown waits
    assert [step for step, _ in run(controller(low=0, bound=8, cooldown=3), [bad] * 4)] == [0, 3]


def test_a_clip_fraction_or_second_moment_cut_halves_whatever_the_age():
    for bad in (calm(clip_frac=0.3, age=1), calm(second_moment=2.0, age=1)):
        assert [ch.new for _, ch in run(controller(low=0, bound=8), [bad])] == [4]


def test_a_gradient_spike_on_off_policy_data_lowers_the_bound_once_and_a_norm_that_stays_up_becomes_the_level():
    c = controller(bound=4, spike=3.0, cooldown=1, patience=2)
    assert run(c, [calm(grad_norm=1.0, wait_share=0.05)] * 5) == []
    # a jump on data off-policy enough to explain it (ESS under ess_raise), then the norm stays up
    changes = run(c, [calm(grad_norm=10.0, ess=0.85)] + [calm(grad_norm=10.0)] * 3, first_step=5)
    assert [(ch.old, ch.new) for _, ch in changes] == [(4, 2), (2, 3)]  # the mean follows: waiting raises again
    assert "gradient norm 10 > 3.0 x its running mean 1, ESS 0.85" in changes[0][1].cause
    assert c._grad_mean == pytest.approx(10 - 9 * StalenessController.smoothing**4)


@pytest.mark.parametrize("skipped", [math.inf, math.nan])
def test_a_step_whose_update_was_skipped_is_no_spike_and_leaves_the_running_mean_as_it_was(skipped):
    """A non-finite gradient skips the update (its record has no norm: NaN); in the mean, an infinite one would
    make every later spike unseeable, and a NaN one every later comparison false."""
    c = controller(low=1, high=8, bound=4, patience=100)
    assert run(c, [calm(grad_norm=1.0, ess=0.85)] * 6 + [calm(grad_norm=skipped, ess=0.85)]) == []
    assert c._grad_mean == pytest.approx(1.0)
    changes = run(c, [calm(grad_norm=5.0, ess=0.85)], first_step=7)
    assert [(step, ch.way) for step, ch in changes] == [(7, "lowered")]
    assert signals({"wait_s": 0.0, "train_s": 1.0}).norm_per_signal is None  # a record without a norm


def test_a_gradient_spike_on_near_on_policy_data_keeps_the_bound():
    """Measured on the toy's agentic workload near convergence: a norm of 5.55 against a running mean of 1.51
    with ESS 0.96, a rare group with signal; a smaller bound would only have dropped 7 groups as stale."""
    c = controller(bound=4, spike=3.0, cooldown=1)
    norms = [1.83, 1.28, 0.7, 2.18, 1.0, 5.55]
    assert run(c, [calm(grad_norm=g, ess=0.96, wait_share=0.05) for g in norms]) == [] and c.bound == 4
    assert run(c, [calm(grad_norm=40.0, ess=0.89, wait_share=0.05)], first_step=6)[0][1].new == 2


def test_the_gradient_norm_of_a_policy_starting_to_learn_is_not_a_spike():
    """The norms of SmolLM2-135M's first 20 agentic steps (measured): near 0 while few groups had a signal, then
    growing 30x as it learnt. Against a mean of the first two norms step 3 read as a spike, and with spikes
    kept out of the mean every later step did, pinning the bound at its floor."""
    norms = [0.047, 0.005, 0.237, 0.081, 0.277, 0.253, 0.299, 0.263, 0.387, 0.493, 0.75, 0.643, 0.711, 0.65, 0.801,
             0.967, 0.821, 0.39, 0.943, 1.579]
    c = controller(low=1, high=8, bound=2, patience=3, cooldown=4)
    changes = run(c, [calm(grad_norm=g) for g in norms])
    assert [(step, ch.new) for step, ch in changes] == [(2, 4), (6, 8)]
    norms = [0.05, 0.06, 0.05, 0.06, 0.05, 0.3]
    jump = run(controller(bound=2), [calm(grad_norm=g, wait_share=0.05, ess=0.85) for g in norms])
    assert [(step, ch.new) for step, ch in jump] == [(5, 1)]  # a jump after the warm-up still is one


def test_a_norm_that_shrinks_with_the_share_of_groups_with_a_signal_is_no_spike():
    """Near convergence most groups have equal rewards: they add no gradient but count in the loss's mean, so the
    norm shrinks with the share of groups with a signal (here 0.1 a group with one). A step that draws nine such
    groups of sixteen after a run of one or two is 9x the mean of the raw norms; per share of groups with a
    signal it is the same as every other step's. A real jump per group still is a spike."""
    shares = [12, 8, 4, 2, 1, 1, 2, 1, 1, 2, 1, 9]
    steps = [calm(grad_norm=0.1 * n / 16, signal_share=n / 16, ess=0.85, wait_share=0.05) for n in shares]
    c = controller(bound=4)
    assert run(c, steps) == [] and c._grad_mean == pytest.approx(0.1)
    jump = calm(grad_norm=0.5 * 2 / 16, signal_share=2 / 16, ess=0.85, wait_share=0.05)  # 5x per group
    changes = run(c, [jump], first_step=len(shares))
    assert [(ch.old, ch.new) for _, ch in changes] == [(4, 2)]
    assert "gradient norm 0.0625 / 12% of groups with a signal = 0.5 > 3.0 x its running mean 0.1" in changes[0][1].cause
    silent = controller(bound=4)  # a step with no signal at all says nothing of the norm's level
    run(silent, steps[:6] + [calm(grad_norm=0.0, signal_share=0.0)] * 5)
    assert silent._grad_mean == pytest.approx(0.1) and silent._grad_norms == 6


def test_a_jump_in_the_norm_of_a_few_groups_with_a_signal_is_no_spike():
    """Near convergence one to three groups of sixteen carry a signal on most of the quickstart's steps, and their
    norm per share spreads far wider than that of four or more (measured: over 3x its median on 16%, 10% and 6% of
    the steps with 1, 2 and 3 of them, 2% or fewer with 4 or more). The same jump per group from 4 groups still is one."""
    level = [calm(grad_norm=0.1 * 8 / 16, signal_share=8 / 16, signal_groups=8, ess=0.85, wait_share=0.05)] * 6
    for n, cut in ((1, False), (3, False), (4, True), (16, True)):
        c = controller(bound=4)
        assert run(c, level) == [] and c._grad_mean == pytest.approx(0.1)
        jump = calm(grad_norm=0.5 * n / 16, signal_share=n / 16, signal_groups=n, ess=0.85, wait_share=0.05)
        assert [ch.new for _, ch in run(c, [jump], first_step=len(level))] == ([2] if cut else []), n
        assert c._grad_mean > 0.1  # judged or not, the step's norm is part of the level


def test_a_raise_waits_for_patience_and_the_cooldown_after_a_cut():
    c = controller(low=1, high=8, bound=4, patience=2, cooldown=5)
    assert run(c, [calm(ess=0.5)])[0][1].new == 2
    changes = run(c, [CALM] * 10, first_step=1)
    assert [(step, ch.new) for step, ch in changes] == [(5, 3), (10, 4)]  # after step 0 + cooldown; by one after a cut


def drive(c: StalenessController, steps: int, step_s: dict[int, float], first_step: int = 0, **signal) -> list:
    """Run ``c`` against a learner whose step takes ``step_s[bound]`` seconds under the bound in force (its other
    signals ``calm``'s, but for ``signal``)."""
    return [(step, ch) for step in range(first_step, first_step + steps)
            if (ch := c.observe(step, calm(step_s=step_s[c.bound], **signal)))]


def test_a_raise_that_does_not_shorten_the_learners_step_is_reverted_and_retried_after_holds_that_double():
    """The learner waits because generation is at capacity (on a shared machine more groups in flight slow both
    sides): 1 -> 2 paid (1.0 s a step, then 0.7 s), 2 -> 4 did not, so the bound goes back to 2, and raises stop
    there for `revert_hold` steps; then one more is tried (by one: the climb is over), judged the same way, and
    each further raise that does not pay holds twice as long: an unchanged run is not asked again and again."""
    c = controller(low=1, high=8, bound=1, patience=3, cooldown=4, raise_gain=0.05, revert_hold=12)
    changes = drive(c, 60, {1: 1.0, 2: 0.7, 3: 0.7, 4: 0.7})
    assert [(step, ch.way, ch.old, ch.new) for step, ch in changes] == [
        (2, "raised", 1, 2), (6, "raised", 2, 4), (10, "reverted", 4, 2), (22, "raised", 2, 3), (26, "reverted", 3, 2),
        (50, "raised", 2, 3), (54, "reverted", 3, 2)]
    assert str(changes[2][1]) == ("max staleness reverted 4 -> 2 at step 10: raising it at step 6 did not speed the "
                                  "learner up: 0.7 s a step before, 0.7 s after (median); raises stop at 2 for 12 "
                                  "steps") and c.bound == 2
    assert changes[4][1].cause.endswith("raises stop at 2 for 24 steps")
    assert changes[6][1].cause.endswith("raises stop at 2 for 48 steps")


def test_a_raise_that_pays_ends_the_back_off():
    c = controller(low=1, high=8, bound=2, patience=2, cooldown=3, revert_hold=4, doubling=False)
    slower = {2: 1.0, **dict.fromkeys(range(3, 9), 1.1)}
    changes = drive(c, 14, slower)
    assert [(step, ch.way) for step, ch in changes] == [(1, "raised"), (4, "reverted"), (8, "raised"),
                                                        (11, "reverted")]
    assert changes[3][1].cause.endswith("for 8 steps")  # raises stop at 2 until step 19
    faster = {2: 1.0, **{b: 1.0 - 0.1 * (b - 2) for b in range(3, 9)}}  # the run changed: raises pay now
    changes = drive(c, 12, faster, first_step=14)
    assert [(step, ch.way, ch.new) for step, ch in changes][:2] == [(19, "raised", 3), (22, "raised", 4)]
    assert c._reverts == 0


@pytest.mark.parametrize("stall_at", [2, 3, 4, None])
def test_a_stall_in_a_raises_trial_does_not_revert_a_raise_that_paid(stall_at):
    """1.0 s a step under 1, 0.7 s under 2, and one step of the trial (steps 2-4) stalled for 20 s (servers
    stopped, a slow disk): the median of the trial's three steps reads 0.7 s, and the raise stays. A mean read
    7.1 s, and reverted it."""
    c = controller(low=1, high=8, bound=1, patience=2, cooldown=3, doubling=False)
    trial = [calm(step_s=20.0 if step == stall_at else 0.7, wait_share=0.05) for step in range(2, 8)]
    assert [(step, ch.way, ch.new) for step, ch in run(c, [calm(step_s=1.0)] * 2 + trial)] == [(1, "raised", 2)]


def test_a_stall_among_the_steps_before_a_raise_does_not_make_one_that_did_not_pay_look_paying():
    c = controller(low=1, high=8, bound=1, patience=5, cooldown=3, doubling=False)
    before = [calm(step_s=20.0 if i == 2 else 1.0) for i in range(5)]  # median 1.0; mean 4.8
    changes = run(c, before + [calm(step_s=1.1, wait_share=0.05)] * 5)
    assert [(step, ch.way, ch.new) for step, ch in changes] == [(4, "raised", 2), (9, "reverted", 1)]
    assert "1 s a step before, 1.1 s after (median)" in changes[1][1].cause


def test_a_stall_in_most_of_the_trial_still_reverts():
    """The median hides a stall in a minority of the trial's steps, not a raise that slowed most of them."""
    c = controller(low=1, high=8, bound=1, patience=2, cooldown=3, doubling=False)
    trial = [calm(step_s=s, wait_share=0.05) for s in (20.0, 20.0, 0.7)]
    assert [ch.way for _, ch in run(c, [calm(step_s=1.0)] * 2 + trial)] == ["raised", "reverted"]


def test_each_raise_of_the_climb_is_judged_before_the_next():
    """A climb that overshoots on the first raise goes back to where it started, not to a bound that was never
    judged (on SmolLM2's agentic workload max staleness 2 trained 12% fewer samples/s than 1)."""
    c = controller(low=1, high=8, bound=1, patience=3, cooldown=4, raise_gain=0.05)
    changes = drive(c, 10, {1: 1.0, 2: 1.12})
    assert [(step, ch.way, ch.new) for step, ch in changes] == [(2, "raised", 2), (6, "reverted", 1)]


def test_by_default_a_raise_is_kept_unless_it_slowed_the_learner():
    """`raise_gain` 0: 1 -> 2 left the step time as it was (kept), 2 -> 4 made it longer (reverted)."""
    changes = drive(controller(bound=1), 12, {1: 1.0, 2: 1.0, 4: 1.1})
    assert [(step, ch.way, ch.new) for step, ch in changes] == [(1, "raised", 2), (4, "raised", 4), (7, "reverted", 2)]


@pytest.mark.parametrize("after, kept", [(0.94, True), (0.96, False), (1.2, False)])
def test_a_raise_is_kept_when_it_cut_the_step_time_by_raise_gain(after, kept):
    c = controller(low=1, high=8, bound=2, patience=2, cooldown=3, raise_gain=0.05, doubling=False)
    changes = run(c, [calm(step_s=1.0)] * 2 + [calm(step_s=after)] * 3)  # raised at step 1, judged at step 4
    # kept: the learner still waits, so the judging step raises again
    assert [ch.way for _, ch in changes] == ["raised"] + (["raised"] if kept else ["reverted"])
    assert c.bound == (4 if kept else 2)


def test_the_noise_of_a_difference_of_medians_against_hand_computed_values():
    """Residuals from each side's median: 0, .4, .4, .2, .2 and 0, .4, .4; their median 0.3 is sigma / 1.4826, and
    the difference of medians of 5 and 3 steps varies sqrt(pi / 2 * (1/5 + 1/3)) sigma."""
    before, after = [1.0, 1.4, 0.6, 1.2, 0.8], [1.1, 0.7, 1.5]
    assert median_noise(before, after) == pytest.approx(0.3 * 1.4826 * math.sqrt(math.pi / 2 * (1 / 5 + 1 / 3)))
    assert median_noise([1.0] * 5, [1.1] * 3) == 0  # steps that do not vary: any difference is the raise's
    stalled = median_noise([1.0, 1.4, 0.6, 1.2, 20.0], after)  # a stall is one residual of eight, like any other
    assert stalled == pytest.approx(median_noise(before, after), rel=0.4)


@pytest.mark.parametrize("after, way", [([1.1, 0.7, 1.5], "raised"), ([1.9, 1.5, 2.3], "reverted")])
def test_a_raise_is_reverted_only_when_it_slowed_the_learner_by_more_than_the_steps_noise(after, way):
    """Steps of about 1 s varying by 0.4 s from one to the next: a trial's median 0.1 s longer is the noise's (a
    verdict without the margin reverted it), 0.9 s longer is the raise's."""
    c = controller(low=1, high=8, bound=2, patience=2, cooldown=3, doubling=False)
    before = [calm(step_s=x, wait_share=0.05 if i < 3 else 0.5) for i, x in enumerate((1.0, 1.4, 0.6, 1.2, 0.8))]
    trial = [calm(step_s=x, wait_share=0.05) for x in after]
    changes = run(c, before + trial)
    assert [ch.way for _, ch in changes] == ["raised"] + (["reverted"] if way == "reverted" else [])
    if way == "reverted":
        assert changes[1][1].cause.startswith("raising it at step 4 did not speed the learner up: 1 s a step "
                                              "before, 1.9 s after (median; their noise 0.41 s)")


def test_after_a_revert_the_bound_rises_past_it_only_once_the_hold_is_over():
    """A lowering for degraded data says nothing of whether a raise past the reverted bound would pay: the bound
    climbs back to it, and past it once the hold is over."""
    rules = dict(low=1, high=8, bound=2, patience=2, cooldown=2, raise_gain=0.05, revert_hold=6, doubling=False)
    c = controller(**rules)
    changes = run(c, [calm(step_s=1.0)] * 8)
    assert [(step, ch.way, ch.new) for step, ch in changes] == [(1, "raised", 3), (3, "reverted", 2)]
    c = controller(**{**rules, "revert_hold": 10})
    assert [ch.way for _, ch in run(c, [calm(step_s=1.0)] * 5)] == ["raised", "reverted"]  # no raise past 2 till 13
    changes = run(c, [calm(ess=0.5, step_s=1.0)] + [calm(step_s=1.0 - 0.05 * i) for i in range(9)], first_step=5)
    assert [(step, ch.way, ch.new) for step, ch in changes] == [(5, "lowered", 1), (7, "raised", 2), (13, "raised", 3)]
    # a cut while a raise is on trial ends the trial: nothing is reverted after it
    c = controller(**{**rules, "cooldown": 3})
    changes = run(c, [calm(step_s=1.0)] * 4 + [calm(ess=0.5, step_s=1.0)] + [calm(step_s=1.0, wait_share=0.05)] * 6)
    assert [(ch.way, ch.new) for _, ch in changes] == [("raised", 3), ("lowered", 1)]


def test_a_learner_waiting_while_the_bound_holds_little_back_keeps_the_bound():
    """Generation at capacity, not the bound, starves it: workers were turned away for under half of each wait
    and nothing was dropped as stale, so a larger bound would only put more groups in flight."""
    c = controller(low=1, high=8, bound=2, patience=3, cooldown=4, doubling=False)
    assert run(c, [calm(held_share=0.0)] * 10 + [calm(held_share=0.49)] * 10) == [] and c.bound == 2
    held_now_and_then = [calm(held_share=1.0 if i % 3 == 0 else 0.1) for i in range(20)]  # never 3 steps running
    assert run(c, held_now_and_then) == []
    changes = run(c, [calm(held_share=0.1)] * 2 + [calm(held_share=0.5)] * 3, first_step=40)
    assert [(step, ch.new) for step, ch in changes] == [(44, 3)]
    assert "waited 50% of its step for data the bound held back 3 steps running" in changes[0][1].cause
    climbing = controller(low=1, high=8, bound=2, patience=3, cooldown=4)  # one held wait is enough
    assert [(step, ch.new) for step, ch in run(climbing, [calm(held_share=0.49)] * 5 + [CALM])] == [(5, 4)]
    anything = controller(low=1, high=8, bound=2, patience=3, held_share=0.0, doubling=False)
    assert [ch.new for _, ch in run(anything, [calm(held_share=0.0)] * 3)] == [3]  # held_share 0: any wait counts


def test_signals_read_from_a_learner_record():
    record = {"wait_s": 0.5, "train_s": 1.5, "is_ess": 0.9, "is_second_moment": 1.1, "clip_frac": 0.02,
              "grad_norm": 0.3}
    assert signals(record) == Signals(wait_share=0.25, ess=0.9, second_moment=1.1, clip_frac=0.02, grad_norm=0.3,
                                      step_s=2.0, held_share=0.0)
    # a held worker retries every 0.5 s: in a 2 s wait one refusal held a worker back a quarter of it
    waited = {**record, "wait_s": 2.0}
    assert [signals({**waited, "admission_refused": n}).held_share for n in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    assert signals({**record, "dropped_stale": 1}).held_share == 1.0  # the bound cost the learner a group
    assert signals({**record, "staleness_max": 3}).age == 3  # the oldest sequence trained, in versions
    # 16 groups trained, 12 with equal rewards (2 more were read with equal rewards and left out)
    silent = {**record, "groups": 16, "groups_no_signal": 14, "dropped_no_signal": 2}
    assert signals(silent).signal_share == 0.25 and signals(silent).norm_per_signal == pytest.approx(1.2)
    assert signals(silent).signal_groups == 4 and signals(record).signal_groups is None  # (no groups counted)
    assert signals({**silent, "groups_no_signal": 18, "dropped_no_signal": 2}).norm_per_signal is None


def test_signals_wavering_at_a_threshold_do_not_make_the_bound_oscillate():
    """ESS between the floor and the raise threshold: healthy enough to keep, not to raise; a single dip under
    the floor lowers once, and a change waits out its cooldown."""
    c = controller(low=1, high=8, bound=4, cooldown=4)
    wavering = [calm(ess=0.85 if i % 7 else 0.79) for i in range(40)]
    changes = run(c, wavering)
    assert all(ch.new < ch.old for _, ch in changes)  # never back up on data at the margin
    assert all(b - a >= 4 for (a, _), (b, _) in zip(changes, changes[1:]))
    assert c.bound == 1


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match=r"off_policy.auto.start 2 is outside \[low 3, high 8\]"):
        AutoStalenessConfig(low=3, high=8, start=2)
    with pytest.raises(ValueError, match="low 3 <= start 2"):
        controller(low=3, high=8, start=3, bound=2)
    with pytest.raises(ValueError, match="idle_share 0.2 must be under wait_share 0.1: set it lower, or 0"):
        AutoStalenessConfig(idle_share=0.2)
    assert AutoStalenessConfig(wait_share=0, idle_share=0).wait_share == 0  # any wait raises; never eased
    with pytest.raises(ValueError, match="ess_floor 0.9 must be under ess_raise 0.8"):
        controller(ess_floor=0.9, ess_raise=0.8)


def test_the_learners_auto_bound_is_published_where_admission_reads_it_and_survives_a_restart(ns):
    from streamrl.buffer import Admission
    from streamrl.config import load_config
    from streamrl.learner.auto_bound import AutoBound

    cfg = load_config(None, ["off_policy.max_staleness=auto", "off_policy.auto.low=1", "off_policy.auto.high=4",
                             "off_policy.auto.start=1", "off_policy.auto.patience=1", "off_policy.auto.cooldown=1",
                             "off_policy.auto.revert_hold=1"])  # the cut in the raise's trial backs off 1 step
    worker = Admission(ns, max_staleness=cfg.admission_bound, groups_per_step=2)
    assert (cfg.staleness_bound, worker.bound()) == (4, 1)  # a worker up before the learner admits under start
    auto = AutoBound(cfg.off_policy.auto, Admission(ns, max_staleness=cfg.admission_bound, groups_per_step=2))
    assert auto.bound == 1 and worker.bound() == 1
    waited = {"wait_s": 3.0, "train_s": 1.0, "is_ess": 0.99, "is_second_moment": 1.0, "clip_frac": 0.0,
              "grad_norm": 1.0}
    assert auto.after_step(1, waited) == {}  # it waited, but the bound held nothing back meanwhile
    waited["admission_refused"] = 6  # from here on it turned workers away for the whole wait (6 x 0.5 s = 3 s)
    assert "raised 1 -> 2 at step 2" in auto.after_step(2, waited)["staleness_change"]
    assert auto.bound == 2 == worker.bound()
    record = auto.after_step(3, {**waited, "is_ess": 0.5})
    assert "lowered 2 -> 1 at step 3: ESS 0.50 < 0.8" in record["staleness_change"] and worker.bound() == 1
    assert auto.after_step(4, {**waited, "wait_s": 0.0}) == {}  # no wait for data: it stays (at low: nothing to ease)
    auto.after_step(5, waited)
    restarted = AutoBound(cfg.off_policy.auto, Admission(ns, max_staleness=cfg.admission_bound, groups_per_step=2))
    assert restarted.bound == 2 == worker.bound()  # a resumed learner goes on from the bound in force


def test_the_learners_bound_is_published_where_admission_reads_it_and_a_resumed_learner_goes_on_from_it(ns):
    from streamrl.buffer import Admission
    from streamrl.learner.auto_bound import AutoBound

    admission = Admission(ns, max_staleness=8, groups_per_step=1)  # the ceiling; the published bound rules
    rules = AutoStalenessConfig(low=1, high=4, start=1, patience=1, cooldown=1)
    auto = AutoBound(rules, admission)
    assert auto.bound == 1 and admission.published() is None  # a fresh run fills under low, as admission's default
    waiting = {"wait_s": 1.0, "train_s": 1.0, "is_ess": 0.99, "clip_frac": 0.0, "grad_norm": 1.0, "dropped_stale": 1}
    assert auto.after_step(1, waiting) == {} and admission.published() == 1  # the fill's wait is not judged
    assert "raised 1 -> 2 at step 2" in auto.after_step(2, waiting)["staleness_change"]
    assert admission.published() == 2
    restarted = AutoBound(rules, admission)
    assert restarted.bound == 2  # a restarted learner goes on from the bound in force, raising it by one
    assert "raised 2 -> 3" in restarted.after_step(2, waiting)["staleness_change"]
    assert "lowered 2 -> 1" in auto.after_step(3, {**waiting, "is_ess": 0.5})["staleness_change"]
    assert admission.published() == 1


def test_a_fresh_run_fills_its_pipeline_under_low_and_the_controller_starts_after_the_first_step(ns):
    """No bound keeps a learner from waiting for its first groups, and every group admitted beyond them competes
    with them for the servers: the first step's data comes in under low, start opens after it, and the fill's
    wait (held back by low throughout) counts towards no raise."""
    from streamrl.buffer import Admission
    from streamrl.config import load_config
    from streamrl.learner.auto_bound import AutoBound

    cfg = load_config(None, ["off_policy.max_staleness=auto", "off_policy.auto.low=1", "off_policy.auto.start=2",
                             "off_policy.auto.patience=2"])
    worker = Admission(ns, max_staleness=cfg.admission_bound, groups_per_step=2)
    auto = AutoBound(cfg.off_policy.auto, Admission(ns, max_staleness=cfg.admission_bound, groups_per_step=2))
    assert (auto.bound, auto.bound_for(0), worker.bound(), worker.published()) == (1, 1, 1, None)
    held = {"wait_s": 3.0, "train_s": 1.0, "is_ess": 0.99, "clip_frac": 0.0, "grad_norm": 1.0,
            "admission_refused": 6}  # workers turned away for the whole wait
    restarted = AutoBound(cfg.off_policy.auto, Admission(ns, max_staleness=cfg.admission_bound, groups_per_step=2))
    assert restarted.bound == 1  # a learner restarted before its first step fills afresh
    change = auto.after_step(1, held)["staleness_change"]
    assert change == "max staleness opened 1 -> 2 at step 1: the first step, its data admitted under 1, is trained"
    assert auto.bound == 2 == worker.bound()
    assert auto.after_step(2, held) == {}  # a raise's trial needs `patience` steps under the bound it leaves
    assert "raised 2 -> 4 at step 3" in auto.after_step(3, held)["staleness_change"]  # still doubling
    ns.conn.delete(ns.key("staleness_bound"))  # a fresh run whose start is low (the default) opens nothing
    at_low = AutoBound(AutoStalenessConfig(low=2, patience=2), Admission(ns, max_staleness=2, groups_per_step=2))
    assert at_low.after_step(1, held) == {} and worker.published() == 2  # published, not judged
    assert at_low.after_step(2, held) == {}
    assert "raised 2 -> 4 at step 3" in at_low.after_step(3, held)["staleness_change"]  # doubling from low


def test_the_bound_opens_at_1_or_at_low_if_larger_unless_start_is_set():
    """Where the first step measures no depth, a fresh run opens at 1 after its fill under low (0: the floor cuts
    may go to, not a bound to climb from, a doubling later than 1), or at low if that is larger."""
    assert controller().bound == 1 == AutoStalenessConfig().first and AutoStalenessConfig().start is None
    assert AutoStalenessConfig().low == 0 and controller(low=0, high=1).bound == 1
    assert controller(low=3, high=8).bound == 3 and controller(low=0, high=1, start=0).bound == 0
    assert controller(low=3, high=8, start=5).bound == 5


def test_a_fresh_run_opens_at_the_pipeline_depth_its_first_step_measured_by_one_doubling_where_generation_lagged(ns):
    """Little's law: a learner that trains a step every T seconds finds its next step waiting only if its groups,
    L seconds each to generate, were started L / T steps before; a bound k keeps k + 1 steps of data in flight. So
    the bound opens at ceil(L / T) - 1, within [max(low, 1), high], unless start is set, where the groups'
    generation (L less its env share) took no longer than the fill's bound + 1 steps; else the servers may limit the
    supply, and more groups in flight may only queue at them: it opens by one doubling at most."""
    from streamrl.buffer import Admission
    from streamrl.learner.auto_bound import AutoBound, depth

    def first_step(groups_s, train_s, env_share=None):
        return {"wait_s": 3.0, "train_s": train_s, "is_ess": 1.0, "clip_frac": 0.0, "grad_norm": 1.0,
                "groups_read": [(s, 0.5, 1) for s in groups_s]} | ({} if env_share is None else {"env_share": env_share})

    # the median of the groups that say, 2.41 s; 0.9 of it waiting on the env: 0.75 steps generating
    agentic = first_step([2.0, 2.41, 3.44, None], 0.32, env_share=0.9)
    assert depth(agentic) == pytest.approx(2.41 / 0.32) and depth(first_step([], 0.3)) is None
    assert depth(first_step([1.0], 0.0)) is None and depth({"train_s": 1.0}) is None

    def opened(record, **rules):
        ns.conn.delete(ns.key("staleness_bound"))  # a fresh run each
        auto = AutoBound(AutoStalenessConfig(**rules), Admission(ns, max_staleness=1, groups_per_step=2))
        # it fills under 1, the least under which the second step's groups start while the first trains
        assert auto.bound == min(max(rules.get("low", 0), 1), rules.get("start", 8))
        change = auto.after_step(1, record).get("staleness_change", "")
        return auto.bound, change

    bound, change = opened(agentic)
    assert bound == 7 and "opened 1 -> 7 at step 1" in change and "7.53 of its training steps" in change
    assert "0.75 of them generating" in change
    # generation alone took 3.83 steps (the single-turn toy's first step), over the 2 the fill admits them for: the
    # servers may limit the supply, so it opens by one doubling, as a raise would, not to the depth
    bound, change = opened(first_step([0.253] * 4, 0.066))
    assert bound == 2 == opened(first_step([0.253] * 4, 0.066, 0.4))[0]
    assert change == ("max staleness opened 1 -> 2 at step 1: the first step, its data admitted under 1, is trained; "
                      "its groups took 3.83 of its training steps to generate (median), 3.8 of them generating, more "
                      "than the 2 the fill admits them for: the servers, not the bound, may limit the supply, so it "
                      "opens by one doubling, as a raise would, and raises find out if more pays")
    assert opened(first_step([0.253] * 4, 0.066), low=2)[0] == 3  # from low's 2, a doubling is 4, the depth 3
    assert opened(first_step([0.253] * 4, 0.066), high=1)[0] == 1
    assert opened(first_step([0.253] * 4, 0.066, 0.5))[0] == 3  # 1.92 steps generating: it kept up
    assert opened({**agentic, "env_share": 0.7})[0] == 2  # 2.26 steps generating (SmolLM2's agentic: 10)
    assert opened(first_step([1.0] * 4, 0.5))[0] == 1  # 2 steps in flight: a bound of 1 keeps them
    assert opened(first_step([0.1] * 4, 1.0))[0] == 1  # under one step: still 1, the least a doubling starts at
    assert opened(agentic, high=4)[0] == 4 and opened(agentic, low=2, high=8)[0] == 7
    assert opened(first_step([0.1] * 4, 1.0), low=2)[0] == 2
    assert opened(agentic, start=2)[0] == 2  # a start given is kept
    assert opened(first_step([0.253] * 4, 0.066), start=3)[0] == 3  # whatever generation did
    assert opened(agentic, start=0) == (0, "")  # start 0: on-policy from the fill on, nothing to open
    # no depth measured: start's default, 1, which the run filled under: nothing to open
    assert opened({**agentic, "groups_read": []}) == (1, "")
    bound, change = opened({**agentic, "groups_read": []}, low=0, start=3)
    assert bound == 3 and change.endswith("opened 1 -> 3 at step 1: the first step, its data admitted under 1, is trained")


def test_the_env_share_is_the_share_of_episode_seconds_spent_waiting_on_the_env():
    from types import SimpleNamespace

    from streamrl.learner.auto_bound import env_share

    def group(*timings):  # what env_share reads of a group: its samples' timings
        return SimpleNamespace(samples=[SimpleNamespace(timings=t) for t in timings])

    assert env_share([group({"env_s": 3.0, "generate_s": 1.0}), group({"env_s": 1.0, "generate_s": 3.0}, {})]) == 0.5
    assert env_share([group({"generate_s": 2.0})]) == 0.0
    assert env_share([group({}), group({"env_s": 0.0, "generate_s": 0.0})]) is None and env_share([]) is None


def test_groups_made_before_an_easing_or_a_revert_keep_the_bound_they_were_admitted_under(ns):
    """Easing and reverting trade speed, not data: nothing admitted is dropped for them. A lowering (degraded
    data) judges every group at once."""
    from streamrl.buffer import Admission
    from streamrl.learner.auto_bound import AutoBound

    admission = Admission(ns, max_staleness=1, groups_per_step=1)  # the fill's: admission's default under auto
    auto = AutoBound(AutoStalenessConfig(low=0, high=8, start=4, patience=1, cooldown=1), admission)
    idle = {"wait_s": 0.0, "train_s": 1.0, "is_ess": 0.99, "clip_frac": 0.0, "grad_norm": 1.0}
    steady = {**idle, "wait_s": 0.05, "train_s": 0.95}  # between idle_share and wait_share: no move
    assert "opened 1 -> 4 at step 9" in auto.after_step(9, idle)["staleness_change"]  # the fill
    assert "eased 4 -> 3 at step 10" in auto.after_step(10, idle)["staleness_change"]
    assert admission.published() == 3 and [auto.bound_for(v) for v in (9, 10, 11)] == [4, 4, 3]
    resumed = AutoBound(AutoStalenessConfig(low=0, high=8, start=4, patience=1, cooldown=1), admission)
    assert [resumed.bound_for(v) for v in (9, 10, 11)] == [4, 4, 3]  # a restarted learner keeps them too
    for step in (11, 12, 13, 14):  # the easing's trial: its verdict waits until the groups made under 4 are in
        assert auto.after_step(step, idle if step % 2 else steady) == {}
    assert auto.bound_for(10) == 4  # at version 14 a group made at 10 is 4 old: still within the bound it had
    assert "eased 3 -> 2 at step 15" in auto.after_step(15, idle)["staleness_change"]  # the last one was kept
    assert [auto.bound_for(v) for v in (10, 15, 16)] == [3, 3, 2]  # made before the easing: 3, not 4
    assert "lowered 2 -> 1 at step 16" in auto.after_step(16, {**steady, "is_ess": 0.5})["staleness_change"]
    assert auto.bound_for(15) == 1  # a lowering keeps nothing, the easing just before it included
    assert admission.kept_bounds() == {} and AutoBound(auto.controller.rules, admission).bound_for(15) == 1


def test_groups_made_before_a_revert_keep_the_raised_bound(ns):
    from streamrl.buffer import Admission
    from streamrl.learner.auto_bound import AutoBound

    auto = AutoBound(AutoStalenessConfig(low=1, high=8, start=1, patience=1, cooldown=1),
                     Admission(ns, max_staleness=8, groups_per_step=1))
    waiting = {"wait_s": 1.0, "train_s": 1.0, "is_ess": 0.99, "clip_frac": 0.0, "grad_norm": 1.0, "dropped_stale": 1}
    assert auto.after_step(1, waiting) == {}  # the fill
    assert "raised 1 -> 2 at step 2" in auto.after_step(2, waiting)["staleness_change"]
    # a 2 s step before the raise, 3 s after it: it did not pay
    assert "reverted 2 -> 1 at step 3" in auto.after_step(3, {**waiting, "wait_s": 2.0})["staleness_change"]
    assert [auto.bound_for(v) for v in (2, 3, 4)] == [2, 2, 1]


def test_with_late_keep_a_slow_group_is_kept_up_to_twice_a_trusted_bound_until_a_cut(ns):
    """`late: keep`: the bound paces admission, and a group that comes back past it (a slow one) is trained
    under the correction, up to twice the bound in force (and `high`), once that bound has stood `cooldown` steps
    since it was opened or raised; a cut (degraded data) drops late groups as a fixed bound does, until the next
    raise. Measured at lr 5e-4 under stress: kept within `high` from the raise on, groups 2 and 3 versions old
    came in under a bound of 1, and the ESS fell to 0.70."""
    from streamrl.buffer import Admission
    from streamrl.learner.auto_bound import AutoBound

    # revert_hold 1: the cut at step 4 comes in the raise's trial, and backs raises off for that long only
    rules = AutoStalenessConfig(low=1, high=8, patience=1, cooldown=2, late="keep", revert_hold=1)
    auto = AutoBound(rules, Admission(ns, max_staleness=1, groups_per_step=1))
    waiting = {"wait_s": 1.0, "train_s": 1.0, "is_ess": 0.99, "clip_frac": 0.0, "grad_norm": 1.0, "dropped_stale": 1}
    assert auto.after_step(1, waiting) == {}  # the fill: nothing to open at low 1
    assert auto.bound_for(3) == 1 and auto.keeps_late(3, version=5) and not auto.keeps_late(3, version=6)
    assert "raised 1 -> 2" in auto.after_step(2, waiting)["staleness_change"]
    assert not auto.keeps_late(3, version=3)  # the raise is not trusted before its cooldown
    assert auto.keeps_late(3, version=7) and not auto.keeps_late(2, version=7)  # 4 old: twice 2; 5 old: past it
    assert "lowered 2 -> 1" in auto.after_step(4, {**waiting, "is_ess": 0.5})["staleness_change"]
    assert not auto.keeps_late(3, version=5) and not auto.keeps_late(3, version=9)  # a cut: until the next raise
    resumed = AutoBound(rules, Admission(ns, max_staleness=1, groups_per_step=1))
    # 2 old under the bound of 1 the cut left: late, and within twice it, but the cut withdrew the trust
    assert not auto.keeps_late(7, version=9) and not resumed.keeps_late(7, version=9)  # nor does a resumed learner forget it
    assert "raised 1 -> 2" in auto.after_step(6, waiting)["staleness_change"]
    assert not auto.keeps_late(5, version=7) and auto.keeps_late(5, version=9)
    resumed = AutoBound(rules, Admission(ns, max_staleness=1, groups_per_step=1))
    assert not resumed.keeps_late(5, version=7) and resumed.keeps_late(5, version=9)  # nor the raise's cooldown
    ns.conn.delete(ns.key("staleness_bound"))  # a fresh run
    zero = AutoBound(AutoStalenessConfig(low=0, high=8, start=0), Admission(ns, max_staleness=0, groups_per_step=1))
    zero.after_step(1, waiting)
    assert not zero.keeps_late(3, version=4)  # a bound of 0 keeps nothing late
    dropping = AutoBound(AutoStalenessConfig(low=1, high=4, late="drop"),
                         Admission(ns, max_staleness=1, groups_per_step=1))
    assert not dropping.keeps_late(3, version=5)  # as a fixed bound does
    assert AutoStalenessConfig().late == "keep"
