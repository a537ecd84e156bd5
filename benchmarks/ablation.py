"""Ablations on the agentic workload: one change at a time, side by side, paired by seed.

Every arm is e2e's agentic workload (`env-latency`: a checker with ~1 s of latency per reply, and a
second try worth half after a wrong one) with a few overrides, trained for 40 steps from the same warm
start (80 for `longer`). Each repeat runs every arm at the same seed, in an order that rotates. Per arm: samples/s, the
share of finished groups the learner dropped as stale, and the final weights' greedy scores on 512
held-out prompts (first-try accuracy, and the task's reward). Against each of its baselines: the ratio
of median samples/s, and the seed-paired held-out difference ± its 95% t interval.

- `credit`: every token of an episode gets the episode's advantage (`learner.credit=episode`), or each
  turn gets its own (`learner.credit=turn`, `learner.turn_lam=0`), in sync and async training.
- `late-groups`: groups that finish past the staleness bound (a slow group is overtaken by younger
  ones). At max staleness 2: busy servers serve the requests of groups admitted at older policy versions
  first (`rollout.oldest_first`) or first come first served; and the learner drops late groups
  (`off_policy.stale=drop`) or trains them with the decoupled correction (`keep`). All with turn credit.
- `is-weights`: at max staleness 4, the decoupled correction's weights pi_prox / pi_behav as they are
  (one optimizer step per batch makes the PPO ratio 1, so nothing bounds them: up to ~13 were seen),
  truncated at 2 (`off_policy.correction=tis`), or with tokens above 5 left out
  (`off_policy.behav_weight_cap=5`, AReaL's rule). All with turn credit.
- `minibatches`: at max staleness 4, four optimizer steps per batch, each on a quarter of its groups
  (`learner.minibatches=4`), at the quickstart's learning rate and at a quarter of it (so that four steps
  move about as far as one did). All with turn credit. The proximal policy is the weights before the
  batch's first step, so from the second step on PPO's clip bounds how far the weights move from it;
  with one step per batch the clip never acts. `minibatches-sync`: the same change at a quarter of the
  learning rate in sync, the baseline async with it must be held to.
- `longer`: sync and max staleness 4 (turn credit) trained for 80 steps instead of 40: whether async's
  loss at 40 steps is a lag that closes once both have converged, or a lower level it stays at.

    python -m benchmarks.ablation [--quick] [--repeats N] [--study NAME]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import e2e_run
from benchmarks.common import (
    cli,
    console,
    earlier_results,
    median,
    new_figure,
    paired_difference,
    percent,
    points,
    print_table,
    save_figure,
    write_json,
)
from streamrl.config import load_config

# Every arm starts from the quickstart's learner on the agentic config (configs/agentic.yaml tunes its learner:
# UNTUNED sets back each learner field where the two configs differ); the arms add changes one at a time.
QUICKSTART, AGENTIC = (load_config(path).learner for path in e2e_run.WORKLOADS.values())
UNTUNED = tuple(f"learner.{name}={getattr(QUICKSTART, name)}" for name in type(QUICKSTART).model_fields
                if getattr(QUICKSTART, name) != getattr(AGENTIC, name))
TURN = ("learner.credit=turn", "learner.turn_lam=0")  # each turn credited with its own advantage
MINIBATCHES = ("learner.minibatches=4",)
QUARTER_LR = (f"learner.lr={QUICKSTART.lr / 4}",)  # four minibatch steps move about as far as one
OLDEST = ("rollout.oldest_first=true",)
KEEP = ("off_policy.stale=keep",)
TRUNCATE = ("off_policy.correction=tis", "off_policy.tis_cap=2")
MASK = ("off_policy.behav_weight_cap=5",)
# study -> arm -> (mode, max staleness, overrides, the arms it is compared with)
STUDIES: dict[str, dict[str, tuple[str, int, tuple[str, ...], tuple[str, ...]]]] = {
    "credit": {
        "sync": ("sync", 0, (), ()),
        "sync, turn credit": ("sync", 0, TURN, ("sync",)),
        "staleness 2": ("async", 2, (), ("sync",)),
        "staleness 2, turn credit": ("async", 2, TURN, ("sync, turn credit", "staleness 2")),
        "staleness 4, turn credit": ("async", 4, TURN, ("sync, turn credit",)),
    },
    "late-groups": {
        "sync": ("sync", 0, TURN, ()),
        "staleness 2": ("async", 2, TURN, ("sync",)),
        "staleness 2, oldest first": ("async", 2, TURN + OLDEST, ("sync", "staleness 2")),
        "staleness 2, oldest first, keep late": ("async", 2, TURN + OLDEST + KEEP, ("sync", "staleness 2")),
        "staleness 4, oldest first": ("async", 4, TURN + OLDEST, ("sync",)),
    },
    "is-weights": {
        "sync": ("sync", 0, TURN, ()),
        "staleness 4": ("async", 4, TURN, ("sync",)),
        "staleness 4, truncated at 2": ("async", 4, TURN + TRUNCATE, ("sync", "staleness 4")),
        "staleness 4, masked above 5": ("async", 4, TURN + MASK, ("sync", "staleness 4")),
    },
    "minibatches": {
        "sync": ("sync", 0, TURN, ()),
        "staleness 4": ("async", 4, TURN, ("sync",)),
        "staleness 4, 4 minibatches": ("async", 4, TURN + MINIBATCHES, ("sync", "staleness 4")),
        "staleness 4, 4 minibatches, lr / 4": ("async", 4, TURN + MINIBATCHES + QUARTER_LR, ("sync", "staleness 4")),
    },
    "minibatches-sync": {
        "sync": ("sync", 0, TURN, ()),
        "sync, 4 minibatches, lr / 4": ("sync", 0, TURN + MINIBATCHES + QUARTER_LR, ("sync",)),
    },
    "longer": {
        "sync": ("sync", 0, TURN, ()),
        "staleness 4": ("async", 4, TURN, ("sync",)),
    },
}
STEPS = {"longer": 80}  # learner steps of a study's runs, where not 40
MEASURES = ("samples_per_s", "dropped_fraction", "held_out_final", "held_out_reward")


def run_study(arms: dict, repeats: int, steps: int, prepared: Path, run_dir: Path) -> dict[str, list[dict]]:
    """Every arm once per seed, the order rotating; e2e's runs, so the same clock and scores."""
    rows: dict[str, list[dict]] = {arm: [] for arm in arms}
    names = list(arms)
    for seed in range(repeats):
        for arm in names[seed % len(names):] + names[:seed % len(names)]:
            mode, staleness, overrides, _ = arms[arm]
            row = e2e_run.one_run(run_dir, prepared, "env-latency", mode, steps, max(staleness, 1), seed=seed,
                              overrides=UNTUNED + overrides)
            rows[arm].append({**row, "seed": seed})
            console.log(f"{arm}, seed {seed}: {row['samples_per_s']:.1f} samples/s, "
                        f"dropped {100 * row['dropped_fraction']:.0f}%, held-out {row['held_out_final']:.3f}")
    return rows


def summarise(arms: dict, rows: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for arm, (mode, staleness, overrides, baselines) in arms.items():
        mine = {x["seed"]: x for x in rows[arm]}
        summary = {"mode": mode, "max_staleness": staleness, "overrides": list(overrides), "runs": len(mine),
                   **{k: median([x[k] for x in mine.values() if x.get(k) is not None]) for k in MEASURES}}
        summary["against"] = {}
        for base in baselines:
            theirs = {x["seed"]: x for x in rows[base]}
            seeds = sorted(mine.keys() & theirs.keys())
            summary["against"][base] = {
                "ratio": median([mine[s]["samples_per_s"] for s in seeds])
                / median([theirs[s]["samples_per_s"] for s in seeds]),
                **{k: paired_difference([mine[s][k] for s in seeds], [theirs[s][k] for s in seeds])
                   for k in ("held_out_final", "held_out_reward")}}
        out[arm] = summary
    return out


def report(data: dict, out: Path) -> None:
    for study, result in data["studies"].items():
        arms, rows = result["arms"], []
        for arm, s in arms.items():
            rows.append([arm, s["samples_per_s"], percent(s["dropped_fraction"]), f"{s['held_out_final']:.3f}",
                         f"{s['held_out_reward']:.3f}"])
            rows.extend([f"  {arm} / {base}", f"{a['ratio']:.2f}×", "", points(a["held_out_final"]),
                         points(a["held_out_reward"])] for base, a in s["against"].items())
        runs = max(s["runs"] for s in arms.values())
        print_table(f"Ablation `{study}`, agentic workload, {result['max_steps']} steps, medians of {runs}; a row "
                    "'A / B': samples/s ratio, and the held-out difference A − B paired by seed ± 95% t interval",
                    ["arm", "samples/s", "dropped stale", f"held-out first try ({e2e_run.HELD_OUT})", "held-out reward"],
                    rows)
    json_path = write_json(out, "ablation", data)
    fig, axes = new_figure(len(data["studies"]), "Ablations: throughput against final accuracy (medians)")
    for ax, (study, result) in zip(axes, data["studies"].items()):
        for arm, s in result["arms"].items():
            ax.scatter(s["samples_per_s"], s["held_out_final"], s=40)
            ax.annotate(arm, (s["samples_per_s"], s["held_out_final"]), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
        ax.margins(x=0.35, y=0.15)  # room for the labels
        ax.set_title(study, fontsize=10)
        ax.set_xlabel("samples/s")
        ax.set_ylabel(f"held-out first-try accuracy ({e2e_run.HELD_OUT})")
    save_figure(fig, out, "ablation", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results"), repeats: int | None = None,
         study: str | None = None) -> dict:
    if study is not None and study not in STUDIES:
        raise SystemExit(f"unknown study {study!r}; available: {', '.join(STUDIES)}")
    repeats = repeats or (1 if quick else 5)
    earlier = earlier_results(out, "ablation")  # a study run alone keeps the others' results
    data = {"study": "ablation", "studies": earlier["studies"] if earlier else {}}
    with tempfile.TemporaryDirectory() as tmp:
        console.log("warm start (once, shared by every run)")
        _, prepared = e2e_run.prepare_shared(Path(tmp))
        for name in [study] if study else list(STUDIES):
            steps = 12 if quick else STEPS.get(name, 40)
            rows = run_study(STUDIES[name], repeats, steps, prepared, Path(tmp) / "runs")
            data["studies"][name] = {"max_steps": steps, "arms": summarise(STUDIES[name], rows), "runs": rows}
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
