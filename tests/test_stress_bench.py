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
    from benchmarks import report
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
    line = report.stress_headline({**data, "pauses": [15, 15, 20.0]})
    assert line.startswith(report.HEADLINES["stress"]) and "auto 0.900 (-5.0 pts (1 pair) from sync)" in line
