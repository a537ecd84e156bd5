"""The discrete-event model against hand-computed pipelines (no timing: the model's clock is virtual)."""


import pytest

from benchmarks.simulate import Fleet, check_against, replay, simulate


def fleet(group_s: float, train_s: float, push_s: float, slots: int = 16) -> Fleet:
    """One engine and one rank, every sample 10 tokens: a group takes ``group_s``, a step ``train_s``."""
    return Fleet(engines=1, ranks=1, slots=slots, n=8, groups_per_step=16, mean_len=10, sigma=0.0, max_len=10,
                 engine_tokens_per_s=10 / group_s * slots * 8, rank_tokens_per_s=16 * 8 * 10 / train_s,
                 dp_efficiency=1.0, push_s=push_s)


def test_sync_steps_are_rollout_then_train_then_push():
    out = simulate(fleet(group_s=2.0, train_s=0.5, push_s=0.1), max_staleness=0, steps=10)
    assert out["steady_samples_per_s"] == pytest.approx(128 / 2.6)
    assert out["staleness_max"] == 0


def test_async_with_fast_rollout_is_learner_bound():
    out = simulate(fleet(group_s=0.2, train_s=0.5, push_s=0.1), max_staleness=2, steps=30)
    assert out["steady_samples_per_s"] == pytest.approx(128 / 0.6)
    assert out["bottleneck"] == "learner" and 0 < out["staleness_mean"] <= out["staleness_max"] <= 2


def test_async_with_slow_rollout_is_bound_by_groups_in_flight():
    # 32 groups at once, 2 s each: 16 groups per second, a step per second; the learner needs 0.6 s of it
    out = simulate(fleet(group_s=2.0, train_s=0.5, push_s=0.1, slots=32), max_staleness=4, steps=30)
    assert out["steady_samples_per_s"] == pytest.approx(128 / 1.0)
    assert out["bottleneck"] == "rollout"
    # the staleness bound caps what may be in flight: with bound 0 the same fleet is synchronous
    sync = simulate(fleet(group_s=2.0, train_s=0.5, push_s=0.1, slots=32), max_staleness=0, steps=30)
    assert sync["steady_samples_per_s"] == pytest.approx(128 / 2.6)


def test_groups_overtaken_past_the_staleness_bound_are_dropped_not_trained():
    # group latencies spread wide: slow groups finish after later ones, too old for the learner
    spread = Fleet(**{**fleet(group_s=0.01, train_s=0.5, push_s=0.1, slots=32).__dict__, "env_s": 2.0,
                      "env_sigma": 1.0})
    out = simulate(spread, max_staleness=1, steps=40)
    assert out["staleness_max"] <= 1 and 0 < out["dropped_fraction"] < 0.5
    assert simulate(spread, max_staleness=0, steps=10)["dropped_fraction"] == 0  # sync: nothing outruns a step
    kept = simulate(spread, max_staleness=1, steps=40, keep_late=True)  # off_policy.stale=keep
    assert kept["dropped_fraction"] == 0 and kept["staleness_max"] > 1


def stages(mode: str, **kw) -> dict:
    return {"mode": mode, "max_staleness": 4, "n": 8, "groups_per_step": 16, "groups_in_flight": 16,
            "tokens_per_sample": 6.0, "group_s": 2.0, "learner_step_s": 0.5, "push_s": 0.1, **kw}


def test_replay_turns_a_runs_stage_speeds_into_the_model():
    assert replay(stages("sync"), steps=10)["steady_samples_per_s"] == pytest.approx(128 / 2.6)
    assert replay(stages("async", group_s=0.1), steps=30)["steady_samples_per_s"] == pytest.approx(128 / 0.6)
    # a synchronous step waits for its slowest group: spread in group latency slows it at the same mean
    spread = replay(stages("sync", group_s_std=1.0), steps=30)["steady_samples_per_s"]
    assert spread < 0.8 * 128 / 2.6


def test_check_against_compares_model_and_measurement_per_mode(tmp_path):
    run = {"steady_samples_per_s": 50.0, "staleness": {"0": 1280}, "stages": stages("sync")}
    old = {"steady_samples_per_s": 60.0}  # a run from before stage speeds were recorded: skipped
    (row,) = check_against({"max_steps": 10, "runs": {"agentic": {"sync": [run, run, old]}}})
    assert row["runs"] == 2 and row["measured"] == 50.0
    assert row["predicted"] == pytest.approx(128 / 2.6) and row["measured_staleness"] == row["predicted_staleness"] == 0
    assert check_against(None) == []
