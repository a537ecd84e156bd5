"""Who gets trained: each quartile's trained share over the run's, by generation time and by reward, from the
groups the learner read; shown by `streamrl doctor` and in plots.png."""

import json
import math

import pytest
from rich.console import Console

from streamrl.doctor import show_coverage
from streamrl.launch.plots import plot_run
from streamrl.learner import coverage
from streamrl.testing import synthetic_group


def test_quartile_ratios_are_each_quartiles_trained_share_over_the_whole():
    # 16 groups, 1..16 s; the slowest four were all dropped, one of the fastest four too
    rows = [(float(s), 0.5, int(s not in (1, 13, 14, 15, 16))) for s in range(1, 17)]
    found = coverage.quartiles(rows, "time")
    overall = 11 / 16
    assert [q["groups"] for q in found] == [4, 4, 4, 4]
    assert [(q["low"], q["high"]) for q in found] == [(1, 4), (5, 8), (9, 12), (13, 16)]
    assert [q["trained_share"] for q in found] == [0.75, 1.0, 1.0, 0.0]
    assert [q["ratio"] for q in found] == pytest.approx([0.75 / overall, 1 / overall, 1 / overall, 0.0])
    assert coverage.metrics(rows)["coverage_time_q4"] == 0.0
    line = coverage.summary(rows, "time")
    assert line.startswith("generation time: q1 (1-4 s) 1.09") and line.endswith("q4 (13-16 s) 0.00")


def test_an_unbiased_run_reads_one_in_every_quartile_and_groups_without_a_time_count_by_reward_alone():
    rows = [(float(s), s / 10, int(s % 2)) for s in range(40)] + [(None, 0.3, 1)] * 4
    for axis in coverage.AXES:
        assert all(abs(q["ratio"] - 1) < 0.2 for q in coverage.quartiles(rows, axis)), axis
    assert sum(q["groups"] for q in coverage.quartiles(rows, "time")) == 40
    assert sum(q["groups"] for q in coverage.quartiles(rows, "reward")) == 44
    assert coverage.quartiles(rows[:7], "time") is None  # too few to cut in four


def test_a_groups_facts_are_its_workers_time_and_its_mean_reward():
    group = synthetic_group(4, 20, prompt_len=4, vocab=50)
    for i, s in enumerate(group.samples):
        s.reward = float(i)
    group.meta["group_s"] = 2.34567
    assert coverage.facts(group) == (2.346, 1.5)
    del group.meta["group_s"]  # a worker that did not say
    assert coverage.facts(group) == (None, 1.5)
    group.meta["group_s"] = math.nan
    assert coverage.facts(group)[0] is None


def _run(tmp_path, slow_dropped: bool):
    lines = []
    for step in range(1, 9):
        rows = [[float(step + k), k / 4, int(not (slow_dropped and k == 3))] for k in range(4)]
        lines.append({"step": step, "time": 100.0 + step, "loss": 0.1, "reward_mean": 0.5, "staleness_max": 1,
                      "tokens_per_s": 100.0, "groups_read": rows})
    lines.append({**lines[2], "groups_read": [[99.0, 0.0, 0]] * 4})  # step 3 again, after a resume: its last line
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "learner.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return tmp_path


def test_doctor_names_the_quartiles_and_a_step_written_twice_counts_once(tmp_path):
    run = _run(tmp_path, slow_dropped=True)
    rows = coverage.from_lines([json.loads(x) for x in (run / "metrics" / "learner.jsonl").open()])
    assert len(rows) == 32 and rows.count((99.0, 0.0, 0)) == 4
    console = Console(record=True, width=200)
    show_coverage(run, console)
    text = console.export_text()
    assert "who was trained" in text and "trained share by generation time: q1" in text
    q4 = coverage.quartiles(rows, "time")[3]
    assert f"q4 ({q4['low']:.3g}-{q4['high']:.3g} s) {q4['ratio']:.2f}" in text and q4["ratio"] < 0.5
    assert (plot_run(run)).is_file()


def test_doctor_says_nothing_of_coverage_for_a_run_without_it(tmp_path):
    console = Console(record=True)
    show_coverage(tmp_path, console)
    assert console.export_text() == ""
