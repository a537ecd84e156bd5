"""The real-model recipe on each engine: ``configs/smollm2.yaml`` (SmolLM2-135M-Instruct learning two-digit
addition, full fine-tuning, fp32) served by ``hf`` and by ``vllm`` (vLLM's CPU build), the same seeds (paired),
each run a whole ``streamrl up`` of the config with only its engine changed and the online evaluation every
10 steps instead of 20 (a finer clock for time to accuracy).

Reported per run: its wall time (from the rollout worker's opening report to the learner's last step),
samples/s, the online greedy accuracy on the recipe's 256 held-out questions at every evaluation, the time to
a fixed accuracy (``TARGET``, 0.672: the median after 60 steps of three earlier `hf` runs), and, off the clock,
the final weights' greedy accuracy on the same questions (scored as `streamrl bench trl` scores both sides).
Both curves flatten near the target from step 30 on (0.62–0.73 in the first runs), so the time to it turns on
which 10-step evaluation first lands above it, with a 256-question evaluation's noise (±3 points): read it
beside the plot. Seeds can be added one session at a time (``--first-seed``).

    python -m benchmarks.engines [--quick] [--repeats N] [--steps N] [--first-seed S]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import cpu_share
from benchmarks.common import (
    cli,
    console,
    earlier_results,
    join_seeds,
    median,
    new_figure,
    paired_difference,
    percent,
    points,
    print_table,
    save_figure,
    settings,
    write_json,
)
from benchmarks.cpu_share import CpuShare
from benchmarks.smollm2 import prepare_shared, streamrl_run

ENGINES = ("hf", "vllm")
TARGET = 0.672  # held-out greedy accuracy after 60 steps of the README's earlier hf runs (seeds 0-2): fixed, so seeds compare
EVAL_EVERY = 10


def time_to(target: float, evals: list[list[float]]) -> float | None:
    """Seconds to the first evaluation at or above ``target`` (None if none reached it)."""
    return next((t for t, _, accuracy in evals if accuracy >= target), None)


def run(seeds: range, steps: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {engine: [] for engine in ENGINES}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg, prepared = prepare_shared(tmp)
        for seed in seeds:
            for engine in ENGINES[seed % 2:] + ENGINES[:seed % 2]:  # who goes first rotates
                with CpuShare(cpu_share.STREAMRL) as cores:
                    row = streamrl_run(cfg, prepared, tmp / "runs", steps=steps, seed=seed, precision="fp32",
                                       overrides=(f"server.engine={engine}", f"eval.every={EVAL_EVERY}"),
                                       name=f"{engine}-{seed}")
                row.update(seed=seed, time_to_target=time_to(TARGET, row["evals"]),
                           cpu_share=cores.shares(*row["window"]))  # where the cores went while the clock ran
                runs[engine].append(row)
                console.log(f"{engine} seed {seed}: {row['samples_per_s']:.2f} samples/s over {row['wall_s']:.0f} s, "
                            f"eval {row['eval_online_final']:.3f}, held-out {row['held_out_final']:.3f}, "
                            f"to {TARGET}: " + ("not reached" if row["time_to_target"] is None
                                                 else f"{row['time_to_target']:.0f} s"))
    return runs


def summary(runs: dict[str, list[dict]]) -> dict:
    """Each engine's medians; time to target over the runs that reached it; vllm against hf paired by seed."""
    med = {}
    for engine, rs in runs.items():
        reached = [r["time_to_target"] for r in rs if r["time_to_target"] is not None]
        med[engine] = {**{k: median([r[k] for r in rs]) for k in ("wall_s", "samples_per_s", "eval_online_final",
                                                                   "held_out_final")},
                       "time_to_target": median(reached), "reached": len(reached)}
        # figures that runs from before they were recorded lack: over the runs that have them
        for key in ("step_train_s", "learner_waiting"):
            if have := [r[key] for r in rs if key in r]:
                med[engine][key] = median(have)
        if measured := [r["cpu_share"] for r in rs if "cpu_share" in r]:
            med[engine]["cpu_share"] = {role: median([x[role] for x in measured]) for role in measured[0]}
    return {"runs": runs, "median": med,
            "speedup": med["vllm"]["samples_per_s"] / med["hf"]["samples_per_s"],
            "held_out_vllm_vs_hf": paired_difference([r["held_out_final"] for r in runs["vllm"]],
                                                     [r["held_out_final"] for r in runs["hf"]])}


def report(data: dict, out: Path) -> None:
    m, n = data["median"], len(data["runs"]["hf"])
    print_table(f"configs/smollm2.yaml on each engine, {data['steps']} steps, medians of {n} seeds",
                ["engine", "samples/s", "wall s", f"time to {TARGET} s (runs that reached it)",
                 f"online eval at step {data['steps']}", "held-out greedy accuracy (256)"],
                [[e, m[e]["samples_per_s"], m[e]["wall_s"], f"{m[e]['time_to_target']:,.0f} ({m[e]['reached']}/{n})",
                  m[e]["eval_online_final"], m[e]["held_out_final"]] for e in ENGINES]
                + [["vllm / hf", data["speedup"], "", "", "", points(data["held_out_vllm_vs_hf"])]])
    print_table("Each run (seed, engine): wall time and held-out accuracy, for the README",
                ["seed", "engine", "wall min", "online eval by step", "held-out greedy accuracy"],
                [[r["seed"], e, r["wall_s"] / 60, " ".join(f"{s}:{a:.2f}" for _, s, a in r["evals"]),
                  r["held_out_final"]] for e in ENGINES for r in data["runs"][e]])
    if all("cpu_share" in m[e] and "step_train_s" in m[e] for e in ENGINES):
        roles = ["generating", "training", "other", "idle"]
        print_table("Where the cores went while the clock ran (share of all cores, medians of the runs that "
                    "measured it): generating (the server and its engine's processes), training (the learner), "
                    "other (rollout worker, router, evaluator, Redis), idle; and the learner's seconds of compute "
                    "a step and share of the clock spent waiting for data",
                    ["engine", *roles, "learner s a step", "learner waiting"],
                    [[e, *(percent(m[e]["cpu_share"][r]) for r in roles), m[e]["step_train_s"],
                      percent(m[e]["learner_waiting"])] for e in ENGINES])
    json_path = write_json(out, "engines", data)
    fig, (ax,) = new_figure(1, "configs/smollm2.yaml: online greedy accuracy against wall time")
    for e, color in zip(ENGINES, ("tab:blue", "tab:orange")):
        for i, r in enumerate(data["runs"][e]):
            ax.plot([t / 60 for t, _, _ in r["evals"]], [a for _, _, a in r["evals"]], color=color, marker=".",
                    label=e if i == 0 else None)
    ax.axhline(TARGET, color="grey", linestyle="--", label=f"target {TARGET}")
    ax.set_xlabel("minutes")
    ax.set_ylabel("held-out greedy accuracy (256)")
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, out, "engines", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results"), repeats: int | None = None,
         steps: int | None = None, first_seed: int = 0) -> dict:
    repeats, steps = repeats or (1 if quick else 3), steps or (EVAL_EVERY if quick else 60)
    settings.update(steps=steps)
    runs = run(range(first_seed, first_seed + repeats), steps)
    earlier = earlier_results(out, "engines")
    if earlier and earlier.get("steps") == steps:
        runs = join_seeds(earlier["runs"], runs)
    data = {"study": "engines", "steps": steps, "target": TARGET, **summary(runs)}
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
