"""``streamrl bench stress``: the learner's pauses and how the arms are judged."""

import json
import subprocess
import sys
import time

import psutil
import pytest


def test_stress_stops_the_learners_whole_process_tree_at_the_steps_due_and_lets_it_go_on(tmp_path):
    from benchmarks.stress import LearnerPauser

    spin = "import time\nwhile True: time.sleep(0.01)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys\nsubprocess.Popen([sys.executable, "
                               f"'-c', {spin!r}])\n{spin}"])
    try:
        deadline = time.monotonic() + 20
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = [psutil.Process(parent.pid), *psutil.Process(parent.pid).children()]
        assert len(tree) == 2
        (tmp_path / "parts.json").write_text(json.dumps({"learner": {"pid": parent.pid}}))
        (tmp_path / "metrics").mkdir()
        lines = tmp_path / "metrics" / "learner.jsonl"
        pauser = LearnerPauser(tmp_path, first=2, every=3, seconds=1.0, last=8)  # steps 2, 5 (not 8: the end)
        pauser.start()
        for step in range(1, 9):
            with lines.open("a") as f:
                f.write(json.dumps({"step": step, "loss": 0.0}) + "\n")
            time.sleep(0.5)
            if step in (2, 5):  # due: the whole tree stops for the pause, then goes on
                assert all(p.status() == psutil.STATUS_STOPPED for p in tree), step
                time.sleep(1.0)
            assert all(p.status() != psutil.STATUS_STOPPED for p in tree), step
        pauser.done.set()
        pauser.join()
        assert [step for step, _ in pauser.pauses] == [2, 5] and all(s >= 1.0 for _, s in pauser.pauses)
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()


def test_stress_pairs_each_arm_with_sync_by_seed(tmp_path):
    from benchmarks.stress import summarise_arms

    def row(seed, held_out, stale):
        return {"seed": seed, "samples_per_s": 10.0 * (seed + 1), "held_out_final": held_out, "ess_min": 0.5,
                "staleness": {"0": 3, str(stale): 1}, "changes": ["x"] * seed}

    data = summarise_arms({"runs": {"fixed 8": [row(0, 0.5, 8), row(1, 0.7, 8)], "auto": [row(1, 0.9, 2)],
                                    "sync": [row(0, 0.9, 0), row(1, 0.95, 0)]}})
    s = data["summary"]
    assert data["repeats"] == 2 and s["fixed 8"]["staleness_max"] == 8 and s["auto"]["changes"] == 1
    assert s["fixed 8"]["vs_sync"]["mean"] == pytest.approx(((0.5 - 0.9) + (0.7 - 0.95)) / 2)
    assert s["auto"]["vs_sync"]["pairs"] == 1 and s["auto"]["vs_sync"]["mean"] == pytest.approx(-0.05)


def test_stress_keeps_each_variant_apart_and_joins_a_variants_later_seeds(tmp_path):
    from benchmarks import stress

    def row(seed):
        return {"seed": seed, "samples_per_s": 1.0, "held_out_final": 0.9, "ess_min": 0.8, "staleness": {"0": 1},
                "changes": ["raised 1 -> 2 (waited)"], "eval_by_step": [[0, 0.5], [4, 0.9]], "pauses": [[2, 1.0]],
                "by_step": {"staleness_bound": [[1, 1], [4, 2]], "is_ess": [[1, None], [4, 0.8]]}}

    def study(*seeds, steps=60):
        return {"study": "stress", "max_steps": steps, "pauses": [15, 15, 20.0],
                "runs": {arm: [row(s) for s in seeds] for arm in stress.ARMS}}

    shipped, harsh = stress.variant((), False), stress.variant(("learner.lr=2e-4",), False)
    assert (shipped, harsh, stress.variant((), True)) == ("as shipped", "learner.lr=2e-4", "as shipped (quick)")
    v = stress.keep({}, shipped, study(0, 1))
    v = stress.keep(v, harsh, study(0))
    assert v[shipped]["repeats"] == 2 and v[harsh]["repeats"] == 1  # a new variant leaves the others alone
    v = stress.keep(v, harsh, study(1))
    assert [x["seed"] for x in v[harsh]["runs"]["auto"]] == [0, 1]  # a later seed joins its own variant
    assert stress.keep(v, harsh, study(2, steps=16))[harsh]["repeats"] == 1  # other settings replace it

    stress.report(v, tmp_path)
    saved = json.loads((tmp_path / "stress.json").read_text())
    assert set(saved["variants"]) == {shipped, harsh}
    assert sum(t["title"].startswith(f"Stress, {harsh}:") for t in saved["tables"]) == 2
    assert saved["tables"][0]["title"].endswith("seed-paired runs; run unrecorded")  # runs without their invocation
    assert {p.name for p in tmp_path.glob("*.png")} == {"stress.png", "stress_learner.lr-2e-4.png"}


def test_a_stress_study_cut_short_keeps_the_seeds_it_finished(tmp_path, monkeypatch):
    from benchmarks import stress

    ran = []

    def one_run(runs, prepared, arm, steps, pauses, seed, overrides):
        if seed == 1:
            raise KeyboardInterrupt  # cut short on seed 1's first run
        ran.append(arm)
        if stress.ARMS[arm][1] == "auto":  # the run's own plot, which the study keeps
            (runs / f"auto-{seed}").mkdir(parents=True)
            (runs / f"auto-{seed}" / "plots.png").write_bytes(b"png")
        return {"seed": seed, "samples_per_s": 1.0, "held_out_final": 0.9, "ess_min": 0.8, "staleness": {"0": 1},
                "changes": [], "eval_by_step": [[0, 0.5], [4, 0.9]], "pauses": [[2, 1.0]],
                "by_step": {"staleness_bound": [[1, 1], [4, 2]], "is_ess": [[1, None], [4, 0.8]]}}

    monkeypatch.setattr(stress, "one_run", one_run)
    monkeypatch.setattr(stress, "prepare_shared", lambda tmp: (None, tmp))
    with pytest.raises(KeyboardInterrupt):
        stress.main(out=tmp_path, repeats=2)
    results = json.loads((tmp_path / "stress.json").read_text())
    saved = results["variants"]["as shipped"]
    assert sorted(ran) == sorted(stress.ARMS) and saved["repeats"] == 1
    when = {x["invocation"] for rows in saved["runs"].values() for x in rows}  # each run says when and where it ran
    assert len(when) == 1 and results["tables"][0]["title"].endswith(f"; run {when.pop()}")
    assert {arm: [x["seed"] for x in rows] for arm, rows in saved["runs"].items()} == {arm: [0] for arm in stress.ARMS}


def test_stress_gives_the_controllers_settings_to_the_auto_arm_alone_and_refuses_a_bad_one_before_any_run():
    from benchmarks import stress

    both = ("learner.lr=5e-4", "off_policy.auto.low=0")
    assert stress.arm_overrides("auto", both) == both
    assert stress.arm_overrides("fixed 8", both) == stress.arm_overrides("sync", both) == ("learner.lr=5e-4",)
    with pytest.raises(SystemExit, match=r"(?s)--streamrl-set \(auto\):.*low 9 > high 8"):
        stress.main(streamrl_set=("off_policy.auto.low=9",))
    with pytest.raises(SystemExit, match=r"(?s)--streamrl-set \(fixed 8\):.*lr"):
        stress.main(streamrl_set=("learner.lr=-1",))
