"""Coverage: who the staleness bound trains, on a workload whose groups take from under a second to a minute.

Each run is a real ``streamrl up`` of ``configs/agentic.yaml`` (the toy task as an agentic loop) with the
checker's latency spread wide (``rollout.env_args.jitter=1.5``: log-normal, mean 1 s), the workload where a bound
drops the slow groups: hard prompts (a wrong first try earns a retry) and unlucky tool calls. Three arms on the
same seeds, run in turn: a fixed bound of 4 (the config's), ``auto`` with late groups dropped
(``off_policy.auto.late=drop``, as a fixed bound does), and ``auto`` as shipped (a group past the bound in force
is trained under the correction, within ``high``, while no cut has said the data degraded).

Reported per arm (medians over seeds): each quartile's trained share over the run's, by generation time and by
mean reward (1.0: no bias; docs/concepts.md, "Who the bound drops"), samples/s, the groups dropped as stale and
kept late, and, off the clock, the final weights' greedy accuracy on 512 held-out prompts. The plot draws each
arm's quartile ratios on both axes. The results are written after every seed.

    python -m benchmarks.coverage [--quick] [--repeats N] [--first-seed S]   (streamrl bench coverage)
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import (
    cli,
    console,
    earlier_results,
    join_seeds,
    median,
    new_figure,
    print_table,
    save_figure,
    this_invocation,
    write_json,
)
from benchmarks.e2e_run import TOY, prepare_shared, summarise, up_argv
from streamrl.learner import coverage
from streamrl.rollout.evaluate import read_records

ARMS = {"fixed 4": ("4", ()), "auto, late drop": ("auto", ("off_policy.auto.late=drop",)), "auto": ("auto", ())}
LONG_TAIL = ("rollout.env_args.jitter=1.5",)
STEPS, QUICK_STEPS = 40, 10
GOAL = (0.9, 1.1)  # every quartile's ratio within it: the trained distribution is the started one


def one_run(run_dir: Path, prepared: Path, arm: str, steps: int, seed: int) -> dict:
    bound, overrides = ARMS[arm]
    argv, name = up_argv(run_dir, prepared, "env-latency", "async", steps, bound, seed, (*LONG_TAIL, *overrides),
                         name=f"{re.sub(r'[^a-z0-9]+', '-', arm)}-{seed}")
    out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed ({out.returncode}):\n{out.stdout[-3000:]}")
    return {**summarise(run_dir / name, TOY), **shares(run_dir / name), "seed": seed}


def shares(run_path: Path) -> dict:
    """The run's quartiles on both axes, over every group the learner read, and the groups it kept late."""
    lines = read_records(run_path / "metrics" / "learner.jsonl")
    rows = coverage.from_lines(lines)
    return {"quartiles": {axis: coverage.quartiles(rows, axis) for axis in coverage.AXES}, "groups_read": len(rows),
            "late_kept": sum(r.get("late_kept", 0) for r in lines if "loss" in r)}


def run(quick: bool, repeats: int | None, first_seed: int) -> Iterator[dict]:
    """Every arm on each seed (who goes first rotates), the runs so far given after each seed."""
    steps = QUICK_STEPS if quick else STEPS
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    invocation = this_invocation()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        console.log("warm start (once, shared by every run)")
        _, prepared = prepare_shared(tmp)
        for seed in range(first_seed, first_seed + (repeats or (1 if quick else 2))):
            order = list(ARMS)[seed % len(ARMS):] + list(ARMS)[:seed % len(ARMS)]
            for arm in order:
                row = {**one_run(tmp / "runs", prepared, arm, steps, seed), "invocation": invocation}
                runs[arm].append(row)
                console.log(f"{arm} seed {seed}: {row['samples_per_s']:.1f} samples/s, slowest quartile "
                            f"{ratios(row, 'time')[-1]:.2f}, {row['dropped_stale']} dropped, {row['late_kept']} late")
            yield {"study": "coverage", "max_steps": steps, "overrides": list(LONG_TAIL), "runs": runs}


def ratios(row: dict, axis: str) -> list[float]:
    return [q["ratio"] for q in row["quartiles"][axis] or []]


def summarise_arms(data: dict) -> dict:
    """Each arm's medians over its seeds, quartile by quartile."""
    summary = {}
    for arm, rows in data["runs"].items():
        summary[arm] = {axis: [median([ratios(x, axis)[i] for x in rows if ratios(x, axis)]) for i in range(4)]
                        for axis in coverage.AXES}
        summary[arm].update({key: median([x[key] for x in rows]) for key in
                             ("samples_per_s", "dropped_stale", "late_kept", "held_out_final")})
        summary[arm]["within_goal"] = all(GOAL[0] <= r <= GOAL[1] for r in summary[arm]["time"] + summary[arm]["reward"])
    return {**data, "repeats": min(map(len, data["runs"].values())), "summary": summary}


def report(data: dict, out: Path) -> None:
    s = data["summary"]
    when = sorted({x.get("invocation", "unrecorded") for rows in data["runs"].values() for x in rows})
    print_table(f"Coverage: the trained share of each quartile over the run's (1.00: no bias), "
                f"{' '.join(data['overrides'])}, {data['max_steps']} steps, medians of {data['repeats']}; "
                f"run {', '.join(when)}",
                ["arm", "by time q1", "q2", "q3", "q4 (slowest)", "by reward q1 (hardest)", "q2", "q3", "q4",
                 "samples/s", "dropped stale", "kept late", "held-out first try (512)"],
                [[arm, *m["time"], *m["reward"], m["samples_per_s"], m["dropped_stale"], m["late_kept"],
                  m["held_out_final"]] for arm, m in s.items()])
    print_table("Coverage: each run's slowest quartile (by generation time) and hardest (by reward)",
                ["arm", "seed", "slowest", "hardest", "samples/s", "dropped stale", "kept late"],
                [[arm, x["seed"], ratios(x, "time")[-1], ratios(x, "reward")[0], x["samples_per_s"],
                  x["dropped_stale"], x["late_kept"]] for arm, rows in data["runs"].items() for x in rows])
    json_path = write_json(out, "coverage", data)
    save_figure(figure(data), out, "coverage", json_path)


def figure(data: dict):
    """Each arm's quartile ratios, by generation time and by mean reward, with the goal's band."""
    fig, axes = new_figure(2, "Who the bound trains: each quartile's trained share over the run's "
                              f"({' '.join(data['overrides'])})")
    width = 0.8 / len(data["summary"])
    for ax, axis in zip(axes, coverage.AXES):
        for i, (arm, m) in enumerate(data["summary"].items()):
            ax.bar([q + i * width for q in range(4)], m[axis], width, label=arm, color=f"C{i}")
        ax.axhspan(*GOAL, color="grey", alpha=0.15, label=f"goal {GOAL[0]}-{GOAL[1]}")
        ax.set_xticks([q + width for q in range(4)], coverage.QUARTILES)
        ax.set_xlabel(f"quartile of {coverage.AXES[axis]}")
        ax.set_ylabel("trained share / the run's")
        ax.set_ylim(0, 1.5)
        ax.legend(fontsize=8, ncol=2, loc="upper center")
    return fig


def main(quick: bool = False, out: Path = Path("benchmarks/results"), repeats: int | None = None,
         first_seed: int = 0) -> dict:
    """``first_seed``: the first seed (runs of other seeds, in the results file, join)."""
    earlier = earlier_results(out, "coverage")
    for data in run(quick, repeats, first_seed):
        if earlier and earlier["max_steps"] == data["max_steps"]:
            data = {**data, "runs": join_seeds(earlier["runs"], data["runs"])}
        data = summarise_arms(data)
        report(data, out)  # after every seed: what ran is kept if the study is cut short
    return data


if __name__ == "__main__":
    cli(main, __doc__)
