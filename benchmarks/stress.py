"""Stress: data made stale on purpose, and what ``off_policy.max_staleness: auto`` does about it.

Each run is a real ``streamrl up`` of ``configs/agentic.yaml`` (the toy task as an agentic loop: the learner
waits on a ~1 s checker, so an ``auto`` bound rises). From step ``PAUSES[0]`` on, every ``PAUSES[1]`` steps, the
study stops the learner (SIGSTOP to its process tree) for ``PAUSES[2]`` seconds, as a preempted, checkpointing
or overloaded learner would stop: the rollout workers keep generating, the replay stream fills with groups up
to the bound in force, and once the learner goes on it trains data up to that many versions old while its
weights move on.

Three arms on the same seeds (paired): a fixed bound of 8, ``auto`` (within its default 0..8, opening at the
depth its first step measures), and ``mode: sync`` (no stale data: the reference accuracy). Reported per arm: samples/s, the staleness of trained
samples, the importance weights' lowest effective sample size, the bound's changes with their causes, and,
off the clock, the final weights' greedy accuracy on 512 held-out prompts (paired with sync). The plot draws
each arm's online accuracy, bound and effective sample size against the step; each ``auto`` run's own
``plots.png`` is kept beside it.

A variant with config overrides for every arm (``--streamrl-set learner.lr=2e-4``: a policy that moves further
each step, so that the same staleness is further off-policy; the controller's own, ``off_policy.auto.*``, for the
auto arm alone) is kept beside the as-shipped one, with its own tables and plot. The results are written after
every seed.

    python -m benchmarks.stress [--quick] [--repeats N] [--first-seed S] [--streamrl-set K=V]   (streamrl bench stress)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from benchmarks.common import (
    by_seed,
    cli,
    console,
    earlier_results,
    join_seeds,
    median,
    new_figure,
    points,
    print_table,
    save_figure,
    this_invocation,
    write_json,
)
from benchmarks.e2e_run import TOY, prepare_shared, summarise, up_argv
from streamrl.config import ConfigError, load_config
from streamrl.rollout.evaluate import read_records

ARMS = {"fixed 8": ("async", 8), "auto": ("async", "auto"), "sync": ("sync", 1)}  # arm -> mode, max staleness
STEPS, QUICK_STEPS = 60, 16
PAUSES, QUICK_PAUSES = (15, 15, 20.0), (6, 6, 8.0)  # first step, steps between, seconds each
AUTO_SETTINGS = "off_policy.auto."  # overrides for the auto arm alone


class LearnerPauser(threading.Thread):
    """Stops the run's learner (its process tree) for ``seconds`` at step ``first`` and every ``every`` steps
    after, before step ``last`` (the run's end, where a pause stales nothing), while ``streamrl up`` runs;
    records each pause as ``[step, seconds]``."""

    def __init__(self, run_path: Path, first: int, every: int, seconds: float, last: int | None = None):
        super().__init__(daemon=True)
        self.run_path, self.first, self.every, self.seconds, self.last = run_path, first, every, seconds, last
        self.pauses: list[list[float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        due = self.first
        while not self.done.wait(0.2):
            if self.last is not None and due >= self.last:
                return
            if self._step() >= due:
                self._pause(due)
                due += self.every

    def _step(self) -> int:
        records = read_records(self.run_path / "metrics" / "learner.jsonl")
        return max((r["step"] for r in records if "loss" in r), default=0)

    def _pause(self, step: int) -> None:
        try:
            parts = json.loads((self.run_path / "parts.json").read_text())
            root = psutil.Process(parts["learner"]["pid"])
            tree = [root, *root.children(recursive=True)]
        except (OSError, KeyError, ValueError, psutil.NoSuchProcess):
            return  # the learner is restarting or done: nothing to stop
        for p in tree:
            _signal(p, "suspend")
        t0 = time.monotonic()
        self.done.wait(self.seconds)
        for p in tree:
            _signal(p, "resume")
        self.pauses.append([step, time.monotonic() - t0])


def _signal(p: psutil.Process, what: str) -> None:
    try:
        getattr(p, what)()
    except psutil.NoSuchProcess:
        pass


def one_run(run_dir: Path, prepared: Path, arm: str, steps: int, pauses: tuple, seed: int,
            overrides: tuple[str, ...]) -> dict:
    mode, bound = ARMS[arm]
    argv, name = up_argv(run_dir, prepared, "env-latency", mode, steps, bound, seed, arm_overrides(arm, overrides),
                         name=f"{arm.replace(' ', '-')}-{seed}")
    pauser = LearnerPauser(run_dir / name, *pauses, last=steps)
    pauser.start()
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    finally:
        pauser.done.set()
        pauser.join()
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed ({out.returncode}):\n{out.stdout[-3000:]}")
    return {**summarise(run_dir / name, TOY), **trace(run_dir / name), "pauses": pauser.pauses, "seed": seed}


def arm_overrides(arm: str, overrides: tuple[str, ...]) -> tuple[str, ...]:
    """The overrides ``arm`` runs with: the controller's (``off_policy.auto.*``) go to the auto arm alone (a fixed
    bound's config refuses them)."""
    return tuple(o for o in overrides if ARMS[arm][1] == "auto" or not o.startswith(AUTO_SETTINGS))


def trace(run_path: Path) -> dict:
    """The run's course, step by step: the bound, the staleness trained, the importance weights' ESS, the
    online accuracy, and each change of the bound with its cause."""
    steps = [r for r in read_records(run_path / "metrics" / "learner.jsonl") if "loss" in r]
    evals = read_records(run_path / "metrics" / "eval.jsonl")
    return {"by_step": {k: [[r["step"], r.get(k)] for r in steps] for k in ("staleness_bound", "staleness_max", "is_ess")},
            "eval_by_step": [[e["step"], e["eval/accuracy"]] for e in evals],
            "changes": [r["staleness_change"] for r in steps if "staleness_change" in r],
            "ess_min": min((r["is_ess"] for r in steps if "is_ess" in r), default=None)}


def run(quick: bool, repeats: int | None, first_seed: int, overrides: tuple[str, ...], out: Path,
        plot: str) -> Iterator[dict]:
    """Every arm on each seed, the runs so far given after each seed (a study cut short keeps its finished
    seeds); each auto run's own plots.png is kept as ``out/{plot}_auto_seed{seed}.png``."""
    steps, pauses = (QUICK_STEPS, QUICK_PAUSES) if quick else (STEPS, PAUSES)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    invocation = this_invocation()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        console.log("warm start (once, shared by every run)")
        _, prepared = prepare_shared(tmp)
        for seed in range(first_seed, first_seed + (repeats or (1 if quick else 2))):
            order = list(ARMS)[seed % len(ARMS):] + list(ARMS)[:seed % len(ARMS)]  # who goes first rotates
            for arm in order:
                row = {**one_run(tmp / "runs", prepared, arm, steps, pauses, seed, overrides), "invocation": invocation}
                runs[arm].append(row)
                if ARMS[arm][1] == "auto":  # its own curves: the bound and the signals it moved on
                    out.mkdir(parents=True, exist_ok=True)
                    shutil.copy(tmp / "runs" / f"auto-{seed}" / "plots.png", out / f"{plot}_auto_seed{seed}.png")
                console.log(f"{arm} seed {seed}: {row['samples_per_s']:.1f} samples/s, held-out "
                            f"{row['held_out_final']:.3f}, {len(row['changes'])} bound changes, pauses {row['pauses']}")
            yield {"study": "stress", "max_steps": steps, "pauses": list(pauses), "overrides": list(overrides),
                   "runs": runs}


def summarise_arms(data: dict) -> dict:
    runs = data["runs"]
    summary = {}
    for arm, rows in runs.items():
        summary[arm] = {"samples_per_s": median([x["samples_per_s"] for x in rows]),
                        "held_out_final": median([x["held_out_final"] for x in rows]),
                        "ess_min": median([x["ess_min"] for x in rows if x["ess_min"] is not None]),
                        "staleness_max": median([max(int(k) for k in x["staleness"]) for x in rows]),
                        "changes": median([len(x["changes"]) for x in rows]),
                        "vs_sync": by_seed(rows, runs["sync"], "held_out_final")}
    return {**data, "repeats": len(runs["sync"]), "summary": summary}


def report(variants: dict[str, dict], out: Path) -> None:
    """Each variant's tables (all saved in one results file), then each one's plot."""
    for key, data in variants.items():
        s, (first, every, seconds) = data["summary"], data["pauses"]
        when = sorted({x.get("invocation", "unrecorded") for rows in data["runs"].values() for x in rows})
        print_table(f"Stress, {key}: the learner stopped {seconds:.0f} s every {every} steps from step {first}, "
                    f"{data['max_steps']} steps, medians of {data['repeats']}; held-out: difference from sync over "
                    f"seed-paired runs; run {', '.join(when)}",
                    ["arm", "samples/s", "max staleness trained", "lowest ESS", "bound changes",
                     "held-out first try (512)", "vs sync"],
                    [[arm, m["samples_per_s"], m["staleness_max"], m["ess_min"], m["changes"], m["held_out_final"],
                      "" if arm == "sync" else points(m["vs_sync"])] for arm, m in s.items()])
        print_table(f"Stress, {key}: each change of the auto bound, with its cause", ["seed", "change"],
                    [[x["seed"], c] for x in data["runs"]["auto"] for c in x["changes"]] or [["", "none"]])
    json_path = write_json(out, "stress", {"study": "stress", "variants": variants})
    for key, data in variants.items():
        save_figure(figure(data, key), out, plot_name(key), json_path)


def figure(data: dict, key: str):
    """Each arm's online accuracy, bound and ESS against the step, the pauses dotted."""
    fig, (acc, bound, ess) = new_figure(3, f"Stale data on purpose ({key}): the learner stopped "
                                           f"{data['pauses'][2]:.0f} s every {data['pauses'][1]} steps")
    for i, (arm, rows) in enumerate(data["runs"].items()):
        for j, x in enumerate(rows):
            label = arm if j == 0 else None
            acc.plot(*zip(*x["eval_by_step"]), color=f"C{i}", marker=".", alpha=0.8, label=label)
            if arm != "sync":
                bound.step(*zip(*x["by_step"]["staleness_bound"]), where="mid", color=f"C{i}", label=label)
                ess.plot(*zip(*[p for p in x["by_step"]["is_ess"] if p[1] is not None]), color=f"C{i}", alpha=0.7,
                         label=label)
    for step, _ in (data["runs"]["auto"][0]["pauses"] if data["runs"]["auto"] else []):
        for ax in (acc, bound, ess):
            ax.axvline(step, color="grey", lw=0.5, ls=":")
    acc.set_ylabel("online greedy accuracy (64)")
    bound.set_ylabel("max staleness in force")
    ess.set_ylabel("importance weights' ESS (a share)")
    for ax in (acc, bound, ess):
        ax.set_xlabel("learner step (dotted: the learner stopped)")
        ax.legend(fontsize=8)
    return fig


def plot_name(key: str) -> str:
    return "stress" if key == "as shipped" else "stress_" + re.sub(r"[^A-Za-z0-9.]+", "-", key).strip("-")


def variant(overrides: tuple[str, ...], quick: bool) -> str:
    """A run's key in the results file: its overrides, so that a harsher variant sits beside the as-shipped one."""
    return (" ".join(overrides) or "as shipped") + (" (quick)" if quick else "")


def main(quick: bool = False, out: Path = Path("benchmarks/results"), repeats: int | None = None,
         first_seed: int = 0, streamrl_set: tuple[str, ...] = ()) -> dict:
    """``first_seed``: the first seed (runs of other seeds of the same variant, in the results file, join);
    ``streamrl_set``: config overrides for every arm, e.g. ``learner.lr=2e-4`` (a faster-moving policy), and
    ``off_policy.auto.*`` for the auto arm: a variant of its own, kept beside the others."""
    for arm, (mode, bound) in ARMS.items():  # a bad override fails here, before any run
        try:
            load_config(TOY.workloads["env-latency"], [f"mode={mode}", f"off_policy.max_staleness={bound}",
                                                       *arm_overrides(arm, tuple(streamrl_set))])
        except ConfigError as e:
            raise SystemExit(f"--streamrl-set ({arm}): {e}") from None
    key = variant(tuple(streamrl_set), quick)
    earlier = earlier_results(out, "stress")
    for data in run(quick, repeats, first_seed, tuple(streamrl_set), out, plot_name(key)):
        variants = keep(earlier["variants"] if earlier else {}, key, data)
        report(variants, out)  # after every seed: what ran is kept if the study is cut short
    return variants[key]


def keep(variants: dict[str, dict], key: str, data: dict) -> dict[str, dict]:
    """The variants with ``data`` summarised as ``key``'s: joined to that variant's earlier seeds where it ran the
    same steps and pauses, else in their place; the other variants as they were."""
    if (old := variants.get(key)) and old["max_steps"] == data["max_steps"] and old["pauses"] == data["pauses"]:
        data = {**data, "runs": join_seeds(old["runs"], data["runs"])}
    return {**variants, key: summarise_arms(data)}


if __name__ == "__main__":
    cli(main, __doc__)
