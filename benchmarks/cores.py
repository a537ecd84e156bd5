"""Cores: where a run's CPU goes when the servers and the learner share it, and whether the learner's widening uses it.

Each run is a real ``streamrl up``, asynchronous at max staleness 2, of one of two workloads on this machine's
cores: the SmolLM2 recipe on the vllm engine (``configs/smollm2.yaml server.engine=vllm``, 20 steps, as `streamrl
bench trl --trl-trainer async` runs streamrl's side: the learner sets the pace) and the toy quickstart
(``configs/quickstart.yaml``, 40 steps: generation sets it), each evaluated once, after its last step. Two arms on
the same seeds, who goes first rotating: an even share (``supervise.learner_threads`` at half the cores: the learner
keeps its share throughout) and ``auto`` (the default: the learner takes every core from the first phase of a step
at which admission holds generation; docs/up.md).

A sampler reads every process's CPU time through the run (``cpu_share``) and files it under generating (the
servers, vLLM's processes), training (the learner) or other (workers, router, evaluator, Redis); what none
took is idle. Reported per arm (medians): samples/s, each role's share of the cores over the clock (the
worker's opening report to the learner's last step), the steps the learner widened in, and the held-out score of
the final weights; per workload, ``auto``'s samples/s over the even share's, paired by seed. The plot draws both.

    python -m benchmarks.cores [--quick] [--repeats N] [--workload W]   (streamrl bench cores)
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks import cpu_share
from benchmarks.common import (
    cli,
    console,
    median,
    new_figure,
    percent,
    print_table,
    save_figure,
    this_invocation,
    write_json,
)
from benchmarks.cpu_share import CpuShare
from benchmarks.e2e_run import RECIPES, prepare_shared, summarise, up_argv
from streamrl.rollout.evaluate import read_records

WORKLOADS = {"smollm2": (RECIPES["smollm2"], ("server.engine=vllm",)), "toy": (RECIPES["toy"], ())}
# the even share is the launcher's own split of the cores between one server and one learner rank
ARMS = {"even share": f"supervise.learner_threads={max(1, (os.cpu_count() or 1) // 2)}",
        "auto": "supervise.learner_threads=auto"}
BASE = "even share"
ROLES = ["generating", "training", "other", "idle"]
STALENESS = 2


def one_run(run_dir: Path, prepared: Path, workload: str, arm: str, steps: int, seed: int) -> dict:
    recipe, overrides = WORKLOADS[workload]
    # evaluated at the end alone, as `bench trl` runs it: an evaluation midway takes the servers from generation
    argv, name = up_argv(run_dir, prepared, "single-turn", "async", steps, STALENESS, seed,
                         (*overrides, f"eval.every={steps}", ARMS[arm]), recipe,
                         name=f"{workload}-{arm.replace(' ', '')}-{seed}")
    with CpuShare(cpu_share.STREAMRL) as cores:
        out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed ({out.returncode}):\n{out.stdout[-3000:]}")
    row = summarise(run_dir / name, recipe)
    start = read_records(run_dir / name / "metrics" / "rollout-worker-0.jsonl")[0]["time"]
    row["cpu_share"] = cores.shares(start, start + row["wall_s"])
    trained = [r for r in read_records(run_dir / name / "metrics" / "learner.jsonl") if "loss" in r]
    row["widened"] = [r["step"] for r in trained if "wide_from" in r]  # steps trained on every core from a phase
    row["steps"] = len(trained)
    return {**row, "seed": seed}


def run(quick: bool, repeats: int | None, workloads: list[str]) -> dict:
    invocation, runs = this_invocation(), {w: {arm: [] for arm in ARMS} for w in workloads}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for workload in workloads:
            recipe = WORKLOADS[workload][0]
            console.log(f"{workload}: warm start (once, shared by its runs)")
            _, prepared = prepare_shared(tmp / workload, recipe)
            steps = recipe.quick_steps if quick else recipe.steps
            for seed in range(repeats or (1 if quick else 2)):
                for arm in (list(ARMS) if seed % 2 == 0 else list(reversed(ARMS))):
                    row = {**one_run(tmp / workload / "runs", prepared, workload, arm, steps, seed),
                           "invocation": invocation}
                    runs[workload][arm].append(row)
                    console.log(f"{workload} / {arm} seed {seed}: {row['samples_per_s']:.2f} samples/s, idle "
                                f"{percent(row['cpu_share']['idle'])}, widened in {len(row['widened'])} steps")
    return summarise_arms({"study": "cores", "staleness": STALENESS, "runs": runs})


def summarise_arms(data: dict) -> dict:
    """Each arm's medians, and per workload auto's samples/s over the even share's, paired by seed."""
    summary = {}
    for workload, arms in data["runs"].items():
        summary[workload] = {arm: {"samples_per_s": median([x["samples_per_s"] for x in rows]),
                                   "held_out_final": median([x["held_out_final"] for x in rows]),
                                   **{role: median([x["cpu_share"][role] for x in rows]) for role in ROLES}}
                             for arm, rows in arms.items()}
        pairs = [a["samples_per_s"] / b["samples_per_s"] for a, b in
                 zip(sorted(arms["auto"], key=lambda x: x["seed"]), sorted(arms[BASE], key=lambda x: x["seed"]))]
        summary[workload]["ratio"] = median(pairs)
    return {**data, "summary": summary}


def report(data: dict, out: Path) -> None:
    s = data["summary"]
    repeats = min(len(rows) for arms in data["runs"].values() for rows in arms.values())
    print_table(f"Cores: the learner's threads on shared cores, async at max staleness {data['staleness']}, medians "
                f"of {repeats}; shares of all cores over the run's clock",
                ["workload", "arm", "samples/s", *ROLES, "held-out"],
                [[w, arm, m["samples_per_s"], *(percent(m[r]) for r in ROLES), m["held_out_final"]]
                 for w, arms in s.items() for arm, m in arms.items() if arm != "ratio"]
                + [[w, f"auto / {BASE} (paired by seed)", arms["ratio"], "", "", "", "", ""] for w, arms in s.items()])
    print_table("Cores: each run, and the steps the learner widened in",
                ["workload", "arm", "seed", "samples/s", "idle", "widened"],
                [[w, arm, x["seed"], x["samples_per_s"], percent(x["cpu_share"]["idle"]),
                  f"{len(x['widened'])} of {x['steps']}"]
                 for w, arms in data["runs"].items() for arm, rows in arms.items() for x in rows])
    json_path = write_json(out, "cores", data)
    save_figure(figure(data), out, "cores", json_path)


def figure(data: dict):
    """Per workload and arm: samples/s over the even share's, and where the cores went (stacked shares)."""
    fig, (ax1, ax2) = new_figure(2, "The learner's threads on shared cores")
    labels = [f"{w}\n{arm}" for w, arms in data["summary"].items() for arm in arms if arm != "ratio"]
    cells = [m for arms in data["summary"].values() for arm, m in arms.items() if arm != "ratio"]
    base = [arms[BASE]["samples_per_s"] for arms in data["summary"].values() for arm in arms if arm != "ratio"]
    ax1.bar(labels, [m["samples_per_s"] / b for m, b in zip(cells, base)], color=[f"C{i % 2}" for i in range(len(cells))])
    ax1.axhline(1.0, color="grey", linestyle="--")
    ax1.set_ylabel(f"samples/s over the {BASE}'s (medians)")
    bottom = [0.0] * len(cells)
    for i, role in enumerate(ROLES):
        ax2.bar(labels, [m[role] for m in cells], bottom=bottom, label=role, color="lightgrey" if role == "idle" else f"C{i + 2}")
        bottom = [b + m[role] for b, m in zip(bottom, cells)]
    ax2.set_ylabel("share of all cores")
    ax2.legend(fontsize=8)
    return fig


def main(quick: bool = False, out: Path = Path("benchmarks/results"), repeats: int | None = None,
         workload: tuple[str, ...] = ()) -> dict:
    """``workload``: run only these (smollm2, toy; default both)."""
    for w in workload:
        if w not in WORKLOADS:
            raise SystemExit(f"--workload: {w!r} is not one of {', '.join(WORKLOADS)}")
    data = run(quick, repeats, list(workload) or list(WORKLOADS))
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
