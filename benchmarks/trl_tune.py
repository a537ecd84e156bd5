"""TRL's AsyncGRPOTrainer at its best on this machine: the settings TRL leaves to its user, tried before it runs
against streamrl (`streamrl bench trl --trl-trainer async`).

Each candidate runs TRL's async trainer alone (benchmarks/trl_async.py, with its patches) on the SmolLM2 recipe
(``configs/smollm2.yaml``: full fine-tuning, fp32, 64 samples a step, seed 0) for ``--steps`` steps, timed as
the head-to-head times it: from its first step's start to its last step's end. A candidate still running after
``LIMIT_S`` stops after the step it is in, and its samples/s counts the steps it made. No held-out evaluation:
a few steps say how fast it runs, not what it learns. The candidates vary what TRL leaves open:

- its in-flight requests (``max_inflight_tasks``; TRL's default is max staleness × samples per step);
- the torch threads of its trainer and of its vLLM server (``streamrl up`` gives each part one of two cores);
- max staleness (TRL's default is 4, the recipe's 1): more in flight, older samples.

The fastest candidate sets TRL's side of the head-to-head (``--trl-set``; a max staleness other than the
recipe's goes to both sides, ``--streamrl-set off_policy.max_staleness=K``). Candidates merge into an earlier
run's file by name, and each is saved as it finishes: they can be added one at a time (``--study NAME``).

    python -m benchmarks.trl_tune [--quick] [--steps N] [--study NAME]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.common import cli, console, earlier_results, new_figure, print_table, save_figure, settings, write_json
from benchmarks.smollm2 import CONFIG, prepare_shared
from benchmarks.trl_async import require_trl_version, trl_async_run, tuning
from streamrl.config import load_config

CANDIDATES = {  # name -> (max staleness, TRL's settings)
    "defaults": (1, ()),
    "threads-2": (1, ("trainer_threads=2", "server_threads=2")),
    "inflight-128": (1, ("max_inflight_tasks=128",)),
    "staleness-2": (2, ()),
    "staleness-4": (4, ()),
}
LIMIT_S = 420  # a candidate's time on the clock: ~1.5x what TRL's defaults take for 6 steps here
ABOUT = {"defaults": "TRL's defaults at the recipe's max staleness 1 (64 in flight), 1 thread each",
         "threads-2": "2 threads for the trainer and 2 for the server (both may use both cores)",
         "inflight-128": "128 requests in flight (the server runs 64 at a time, the rest wait in its queue)",
         "staleness-2": "max staleness 2 (128 in flight)",
         "staleness-4": "max staleness 4, TRL's default (256 in flight)"}


def run_candidate(name: str, steps: int) -> dict:
    staleness, pairs = CANDIDATES[name]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg, prepared = prepare_shared(tmp)
        cfg = load_config(CONFIG, [f"model.path={cfg.model.path}", f"off_policy.max_staleness={staleness}"])
        row = trl_async_run(cfg, prepared, tmp / "trl", steps=steps, seed=0, tune=tuning(pairs), evaluate=False,
                            time_limit_s=LIMIT_S)
    console.log(f"{name}: {row['samples_per_s']:.2f} samples/s over {row['wall_s']:.0f} s ({row['steps']} steps)")
    return {"candidate": name, "max_staleness": staleness, "trl_set": list(pairs), **row, "steps": steps,
            "steps_made": row["steps"]}


def report(rows: list[dict], out: Path) -> dict:
    rows = sorted(rows, key=lambda r: list(CANDIDATES).index(r["candidate"]))
    base = next((r["samples_per_s"] for r in rows if r["candidate"] == "defaults"), None)
    best = max(rows, key=lambda r: r["samples_per_s"])
    print_table(f"TRL AsyncGRPOTrainer (vLLM, fp32), SmolLM2-135M two-digit addition: each candidate alone, "
                f"{rows[0]['steps']} steps of 64 samples, seed 0",
                ["candidate", "what changes", "steps made", "samples/s", "/ defaults", "samples dropped as stale",
                 "mean staleness", "weight sync s", "train reward"],
                [[r["candidate"], ABOUT[r["candidate"]], r["steps_made"], r["samples_per_s"],
                  r["samples_per_s"] / base if base else "", int(r["dropped_stale"]), r["staleness_mean"],
                  r["weight_sync_s"], sum(r["train_rewards"]) / len(r["train_rewards"])] for r in rows])
    data = {"study": "trl_tune", "runs": rows, "best": best["candidate"], "best_trl_set": best["trl_set"],
            "best_max_staleness": best["max_staleness"]}
    json_path = write_json(out, "trl_tune", data)
    fig, (ax,) = new_figure(1, "TRL AsyncGRPOTrainer: its settings on this machine")
    ax.barh([r["candidate"] for r in rows], [r["samples_per_s"] for r in rows])
    ax.set_xlabel("samples/s")
    save_figure(fig, out, "trl_tune", json_path)
    return data


def main(quick: bool = False, out: Path = Path("benchmarks/results"), steps: int | None = None,
         study: str | None = None) -> dict:
    """``study``: one candidate (default: all of them), joining an earlier run's others."""
    require_trl_version()
    if study is not None and study not in CANDIDATES:
        raise SystemExit(f"--study: {study!r} is not one of {', '.join(CANDIDATES)}")
    steps = steps or (2 if quick else 6)
    settings.update(steps=steps)
    data = {}
    for name in [study] if study else CANDIDATES:  # each saved as it finishes: a stopped study keeps the others
        new = run_candidate(name, steps)
        earlier = earlier_results(out, "trl_tune")
        kept = [r for r in earlier["runs"] if r["candidate"] != name and r["steps"] == steps] if earlier else []
        data = report(kept + [new], out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
