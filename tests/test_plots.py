"""A run's curves: drawn from its metrics files, by `streamrl plot` and at the end of `streamrl up`."""

import json
import os
import subprocess
import sys

import pytest

from streamrl.launch.plots import plot_run


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_run_with_steps_evaluations_and_a_worker_gets_one_png(tmp_path):
    metrics = tmp_path / "metrics"
    _write(metrics / "learner.jsonl",
           [{"step": s, "time": 10.0 + s, "loss": 0.1, "reward_mean": s / 4, "staleness_max": 1, "tokens_per_s": 900}
            for s in range(1, 5)] + [{"push_s": 0.2, "push_version": 4, "time": 15.0}])
    _write(metrics / "eval.jsonl", [{"step": 0, "eval/accuracy": 0.2}, {"step": 4, "eval/accuracy": 0.8}])
    _write(metrics / "rollout-worker-0.jsonl", [{"time": 9.0}, {"time": 12.5, "tokens_per_s": 300.0}])
    path = plot_run(tmp_path, bound=2)
    assert path == tmp_path / "plots.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = subprocess.run([sys.executable, "-m", "streamrl", "plot", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "400"})  # a long path stays on one line
    assert out.returncode == 0 and "plots.png" in out.stderr


def test_a_run_with_nothing_to_draw_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no learner steps or evaluations"):
        plot_run(tmp_path)
    out = subprocess.run([sys.executable, "-m", "streamrl", "plot", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "400"})  # a long path stays on one line
    assert out.returncode == 2 and "no learner steps or evaluations" in out.stderr
