"""A run's curves as one PNG (``streamrl plot RUN``; ``streamrl up`` draws it when a run ends).

Read from the run's metrics files: reward and held-out accuracy, staleness against its bound, generation and
training tokens/s, and the weight push, each against the learner's step; and who was trained, by quartile of
generation time and of reward (``learner.coverage``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from streamrl.learner import coverage
from streamrl.rollout.evaluate import read_records


def plot_run(run: Path, bound: int | None = None) -> Path:
    """Write ``run/plots.png`` and return its path; ``bound`` draws the staleness bound in force."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = run / "metrics"
    steps = [r for r in read_records(metrics / "learner.jsonl") if "loss" in r]
    pushes = [r for r in read_records(metrics / "learner.jsonl") if "push_s" in r]
    evals = read_records(metrics / "eval.jsonl")
    workers = {p.stem: read_records(p) for p in sorted(metrics.glob("rollout-*.jsonl"))}
    if not steps and not evals:
        raise FileNotFoundError(f"{metrics} has no learner steps or evaluations to plot")

    fig, ((reward, stale, who), (speed, push, blank)) = plt.subplots(2, 3, figsize=(16, 7))
    blank.axis("off")
    fig.suptitle(f"run {run.name}")
    reward.plot(_x(steps), _y(steps, "reward_mean"), label="train reward (mean)")
    reward.plot(_x(evals), _y(evals, "eval/accuracy"), "o-", label="held-out accuracy (greedy)")
    _label(reward, "reward and accuracy", "learner step")

    stale.plot(_x(steps), _y(steps, "staleness_max"), label="max staleness trained")
    if any("staleness_bound" in r for r in steps):  # the bound each step's data was judged under (auto moves it)
        stale.step(_x(steps), _y(steps, "staleness_bound"), where="mid", color="grey", ls="--", label="bound")
    elif bound is not None:
        stale.axhline(bound, color="grey", ls="--", label=f"bound ({bound})")
    _label(stale, "staleness (versions)", "learner step")
    if any("is_ess" in r for r in steps):  # what the data's age costs: the importance weights' effective sample
        ess = stale.twinx()
        ess.plot(_x(steps), _y(steps, "is_ess"), color="tab:green", alpha=0.6, label="effective sample size")
        if any("lr_scale" in r for r in steps):  # off_policy.ess_lr: the learning rate's share it let through
            ess.plot(_x(steps), _y(steps, "lr_scale"), color="tab:green", ls=":", label="learning-rate scale")
        ess.set_ylim(0, 1.05)
        ess.set_ylabel("ESS (share of tokens)")
        ess.legend(loc="lower right", fontsize=8)

    speed.plot(_x(steps), _y(steps, "tokens_per_s"), label="training")
    for name, lines in workers.items():  # a worker's reports placed at the learner's step when they came
        at = np.interp([r["time"] for r in lines[1:]], _y(steps, "time"), _x(steps)) if steps else []
        speed.plot(at, [r.get("tokens_per_s", 0.0) for r in lines[1:]], alpha=0.7, label=f"generation ({name})")
    _label(speed, "tokens/s", "learner step")

    push.plot([r.get("push_version", r.get("step")) for r in pushes], _y(pushes, "push_s"), "o-",
              label="push seconds")
    _label(push, "weight push (s)", "version pushed")

    _coverage(who, coverage.from_lines(steps))

    fig.tight_layout()
    path = run / "plots.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _coverage(ax, rows: list) -> None:
    """Each quartile's trained share over the run's, by generation time and by mean reward: 1 is no bias."""
    width = 0.38
    for i, (axis, label) in enumerate(coverage.AXES.items()):
        quarters = coverage.quartiles(rows, axis) or []
        ax.bar([q + (i - 0.5) * width for q in range(len(quarters))], [q["ratio"] for q in quarters], width,
               label=f"by {label}")
    ax.axhline(1.0, color="grey", ls="--", lw=0.8)
    ax.set_xticks(range(4), list(coverage.QUARTILES))
    _label(ax, "who was trained: trained share / the run's", "quartile (q1: fastest; by reward, lowest)")


def _x(records: list[dict]) -> list:
    return [r.get("step") for r in records]


def _y(records: list[dict], key: str) -> list:
    return [r.get(key, float("nan")) for r in records]


def _label(ax, title: str, xlabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
