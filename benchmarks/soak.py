"""Soak: the quickstart system running for a long time, with each part's memory sampled.

Runs ``streamrl up configs/quickstart.yaml`` with no step limit for ``--minutes`` (20 by default,
3 with --quick), sampling every part's resident memory (its whole process tree) every few seconds.
The baseline is each part's own memory just after warm-up; the figure is its growth from there
to the end (medians of the first and last five samples). Goal: no part grows more than 10%.

    python -m benchmarks.soak [--quick] [--minutes M]      (or: streamrl bench soak)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.common import cli, console, median, new_figure, print_table, save_figure, write_json
from streamrl.buffer.redis_server import free_port
from streamrl.rollout.evaluate import read_records

GOAL = 0.10


def tree_rss(pid: int) -> int | None:
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return None


def run(minutes: float, every_s: float, warmup_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_path = Path(tmp) / "soak"
        argv = [sys.executable, "-m", "streamrl", "up", "configs/quickstart.yaml", f"run.dir={tmp}", "run.name=soak",
                "learner.max_steps=1000000", "eval.every=50", "learner.checkpoint_every=50",
                "learner.export_every=50", f"router.port={free_port()}", f"router.prometheus_port={free_port()}",
                f"server.base_port={free_port()}", "supervise.display=plain"]
        log = open(Path(tmp) / "up.log", "w")
        up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        samples: list[dict] = []
        try:
            while not (run_path / "metrics" / "learner.jsonl").exists():  # clock starts with the first step
                if up.poll() is not None:
                    raise RuntimeError(f"streamrl up exited with {up.returncode}; see {run_path / 'logs'}")
                time.sleep(1)
            start = time.time()
            console.log(f"training; sampling memory every {every_s:.0f}s for {minutes:.0f} min")
            while time.time() - start < minutes * 60:
                parts = json.loads((run_path / "parts.json").read_text())
                row = {"t": time.time() - start, "step": _step(run_path)}
                row.update({name: tree_rss(p["pid"]) for name, p in parts.items()})
                row["restarts"] = sum(p["restarts"] for p in parts.values())
                samples.append(row)
                time.sleep(every_s)
        finally:  # the samples are kept whatever the teardown does
            stopped = _stop(up)
    return {"study": "soak", "minutes": minutes, "every_s": every_s, "warmup_s": warmup_s, "samples": samples,
            "growth": growth(samples, warmup_s), "goal": GOAL, "teardown_s": stopped}


def _stop(up: subprocess.Popen) -> float | None:
    """Stop the run as a service manager would; seconds until it exited (None: it had to be killed).

    SIGTERM, not SIGINT: a study started in the background of a non-interactive shell inherits SIGINT
    ignored (POSIX), and Python then never raises KeyboardInterrupt for it.
    """
    t0 = time.time()
    up.send_signal(signal.SIGTERM)
    try:
        up.wait(300)
        return time.time() - t0
    except subprocess.TimeoutExpired:
        console.log("streamrl up did not exit within 5 min of SIGTERM: killing it")
        up.kill()
        up.wait()
        return None


def _step(run_path: Path) -> int:
    steps = [r["step"] for r in read_records(run_path / "metrics" / "learner.jsonl") if "loss" in r]
    return max(steps, default=0)


def growth(samples: list[dict], warmup_s: float) -> dict[str, dict]:
    after = [s for s in samples if s["t"] >= warmup_s]
    names = [k for k in samples[0] if k not in ("t", "step", "restarts")] if samples else []
    out = {}
    for name in names:
        values = [s[name] for s in after if s.get(name)]
        if len(values) < 10:
            continue
        first, last = median(values[:5]), median(values[-5:])
        out[name] = {"after_warmup_mb": first / 2**20, "end_mb": last / 2**20, "growth": last / first - 1,
                     "peak_mb": max(values) / 2**20}
    return out


def report(data: dict, out: Path) -> None:
    g, samples = data["growth"], data["samples"]
    steps = samples[-1]["step"] - next(s["step"] for s in samples if s["t"] >= data["warmup_s"]) if samples else 0
    print_table(f"Memory per part over a {data['minutes']:.0f}-minute quickstart run ({steps} steps after warm-up; "
                f"restarts: {samples[-1]['restarts'] if samples else 0})",
                ["part", "after warm-up MB", "end MB", "peak MB", "growth", f"within {GOAL:.0%}"],
                [[name, v["after_warmup_mb"], v["end_mb"], v["peak_mb"], f"{v['growth']:+.1%}",
                  "yes" if v["growth"] <= GOAL else "NO"] for name, v in g.items()])
    json_path = write_json(out, "soak", data)
    fig, (ax,) = new_figure(1, "Resident memory per part (process tree)")
    for name in g:
        ax.plot([s["t"] / 60 for s in samples], [(s.get(name) or float("nan")) / 2**20 for s in samples], label=name)
    ax.axvline(data["warmup_s"] / 60, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes of training")
    ax.set_ylabel("MB")
    ax.legend(fontsize=7)
    save_figure(fig, out, "soak", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results"), minutes: float | None = None) -> dict:
    minutes = float(minutes) if minutes else (3.0 if quick else 20.0)
    data = run(minutes, every_s=5.0 if quick else 10.0, warmup_s=min(180.0, minutes * 60 / 4))
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
