"""Off-policy corrections compared on one recorded run's data: each arm retrains the very same groups.

Separate runs of each correction (the `is-weights` ablation) train on different data: which groups finished
first, and which versions made them, depend on timing. Here one asynchronous run is recorded, the agentic
workload at max staleness 4 with the is-weights ablation's settings (the quickstart's learner, turn credit), and
``streamrl replay`` retrains it once per correction on its record:

- `none`: no correction (`off_policy.correction=none`);
- `truncated at 2`: truncated importance sampling (`off_policy.correction=tis`, `off_policy.tis_cap=2`);
- `decoupled`: the run's own correction, AReaL's decoupled objective (a replay without overrides: it must be
  the run, bit for bit);
- `decoupled, masked above 5`: with tokens whose behaviour weight passes 5 left out
  (`off_policy.behav_weight_cap=5`).

Each repeat records a run at its own seed; every arm's final weights are scored greedily on the held-out prompts,
and each arm is compared with `decoupled` paired by seed. The replays' learner time per step is set beside the
recorded run's (the same steps on the same threads, without the servers beside it).

Read the comparison with its one bias in mind: the data are the recorded arm's own. Its policy generated every
group, so `decoupled` trains at the staleness the run measured, while every other arm's weights drift away from
the policies that generated its data, and it trains further off-policy than its own run would have. Replays
remove the timing noise between arms, not this home advantage; a record per arm, each replayed by every arm,
would.

    python -m benchmarks.counterfactual [--quick] [--repeats N]     (or: streamrl bench counterfactual)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import e2e_run
from benchmarks.ablation import MASK, TRUNCATE, TURN, UNTUNED
from benchmarks.common import (
    cli,
    console,
    median,
    new_figure,
    paired_difference,
    points,
    print_table,
    save_figure,
    write_json,
)
from benchmarks.scoring import held_out
from streamrl.config import load_config

ARMS = {"none": ("off_policy.correction=none",), "truncated at 2": TRUNCATE, "decoupled": (),
        "decoupled, masked above 5": MASK}
BASELINE = "decoupled"
STALENESS = 4


def replay_arm(run: Path, out: Path, overrides: tuple[str, ...]) -> dict:
    """One replay of ``run`` with ``overrides``: its final weights' held-out scores and its learner's time."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "streamrl", "replay", str(run), "--out", str(out), *overrides],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"replay of {run} with {overrides} failed:\n{proc.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    steps = [json.loads(x) for x in (out / "metrics" / "learner.jsonl").read_text().splitlines() if '"loss"' in x]
    summary = json.loads((out / "replay.json").read_text())
    cfg = load_config(out / "config.yaml")
    scores = held_out(cfg, out / "export" / f"version-{summary['version']}",
                      e2e_run.held_out_rows(run / "prepared", e2e_run.HELD_OUT))
    return {"held_out_final": scores["accuracy"], "held_out_reward": scores["reward"], "wall_s": wall,
            "train_s": median([r["train_s"] for r in steps[2:]]), "identical": summary["difference"] is None,
            "identical_through": summary["identical_through"]}


def one_seed(seed: int, steps: int, prepared: Path, runs: Path) -> dict:
    name = f"recorded-{seed}"
    argv, _ = e2e_run.up_argv(runs, prepared, "env-latency", "async", steps, STALENESS, seed=seed,
                              overrides=UNTUNED + TURN, name=name)
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the recorded run failed:\n{proc.stdout[-3000:]}")
    run = runs / name
    recorded = [json.loads(x) for x in (run / "metrics" / "learner.jsonl").read_text().splitlines() if '"loss"' in x]
    row = {"seed": seed, "recorded_train_s": median([r["train_s"] for r in recorded[2:]]),
           "dropped_stale": sum(r.get("dropped_stale", 0) for r in recorded), "arms": {}}
    for arm, overrides in ARMS.items():
        row["arms"][arm] = result = replay_arm(run, runs / f"{name}-{arm.replace(' ', '-').replace(',', '')}",
                                               overrides)
        console.log(f"seed {seed}, {arm}: held-out {result['held_out_final']:.3f}, replay {result['train_s']:.2f} s "
                    f"per step (recorded {row['recorded_train_s']:.2f})" +
                    (", identical to the run" if result["identical"] else ""))
    return row


def summarise(rows: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        mine = [r["arms"][arm] for r in rows]
        base = [r["arms"][BASELINE] for r in rows]
        out[arm] = {"held_out_final": median([m["held_out_final"] for m in mine]),
                    "held_out_reward": median([m["held_out_reward"] for m in mine]),
                    "replay_vs_recorded_speed": median([r["recorded_train_s"] / r["arms"][arm]["train_s"]
                                                        for r in rows]),
                    "identical": all(m["identical"] for m in mine),
                    "against": None if arm == BASELINE else {
                        k: paired_difference([m[k] for m in mine], [b[k] for b in base])
                        for k in ("held_out_final", "held_out_reward")}}
    return out


def report(data: dict, out: Path) -> None:
    rows = []
    for arm, s in data["arms"].items():
        against = s["against"]
        rows.append([arm, f"{s['held_out_final']:.3f}", f"{s['held_out_reward']:.3f}",
                     "" if against is None else points(against["held_out_final"]),
                     f"{s['replay_vs_recorded_speed']:.2f}×",
                     "yes, every step" if s["identical"] else "no"])
    print_table(f"Corrections on one recorded run's data: agentic workload, max staleness {STALENESS}, "
                f"{data['max_steps']} steps, medians of {len(data['runs'])} recorded runs; held-out difference "
                f"against `{BASELINE}` paired by run ± 95% t interval",
                ["arm (replay of the recorded run)", f"held-out first try ({e2e_run.HELD_OUT})", "held-out reward",
                 f"vs {BASELINE}", "replay speed / run's learner", "weights identical to the run's"], rows)
    json_path = write_json(out, "counterfactual", data)
    fig, axes = new_figure(1, "Corrections on the same recorded data: held-out accuracy per recorded run")
    ax = axes[0]
    for i, arm in enumerate(data["arms"]):
        values = [r["arms"][arm]["held_out_final"] for r in data["runs"]]
        ax.scatter([i] * len(values), values, s=25)
    for r in data["runs"]:  # a line per recorded run: the arms on its data
        ax.plot(range(len(data["arms"])), [r["arms"][a]["held_out_final"] for a in data["arms"]], lw=0.6,
                alpha=0.5, color="grey")
    ax.set_xticks(range(len(data["arms"])), list(data["arms"]), fontsize=8)
    ax.set_ylabel(f"held-out first-try accuracy ({e2e_run.HELD_OUT})")
    save_figure(fig, out, "counterfactual", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results"), repeats: int | None = None) -> dict:
    repeats = repeats or (1 if quick else 4)
    steps = 12 if quick else 40
    with tempfile.TemporaryDirectory() as tmp:
        console.log("warm start (once, shared by every run)")
        _, prepared = e2e_run.prepare_shared(Path(tmp))
        rows = [one_seed(seed, steps, prepared, Path(tmp) / "runs") for seed in range(repeats)]
    data = {"study": "counterfactual", "max_staleness": STALENESS, "max_steps": steps, "arms": summarise(rows),
            "runs": rows}
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
