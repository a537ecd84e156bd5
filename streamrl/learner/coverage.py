"""Who gets trained: the share of finished groups the learner trained, by quartile of how long a group took to
generate and by quartile of its prompt's difficulty (the group's mean reward).

An asynchronous run drops the groups that finish past the staleness bound, and the groups that take longest are
the hard prompts, the long answers, the slow tools. A run can so train on an easier, shorter distribution than
its data's. Each quartile's figure is its trained share over the whole run's: 1.0 is no bias, 0.6 in the slowest
quartile means slow groups were trained 40% less often than the average group.

Every group the learner reads counts, trained or dropped (stale, no signal, dead-lettered, or its update skipped).
Groups a worker abandoned before finishing never reach the learner: the ledger counts them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

QUARTILES = ("q1", "q2", "q3", "q4")
AXES = {"time": "generation time", "reward": "mean reward (difficulty: q1 hardest)"}


Row = tuple[float | None, float, int]  # a group read: its generation seconds, mean reward, and 1 if trained


def facts(group) -> tuple[float | None, float]:
    """A group's generation seconds (the worker's, from its first episode's start to its put; None where the
    worker did not say) and its mean reward, rounded for the metrics line."""
    seconds = group.meta.get("group_s")
    return (round(float(seconds), 3) if isinstance(seconds, (int, float)) and math.isfinite(seconds) else None,
            round(float(np.mean([s.reward for s in group.samples])), 4))


def quartiles(rows: Iterable[Row], axis: str) -> list[dict] | None:
    """Per quartile of ``axis`` ("time": generation seconds, "reward": mean reward) over ``rows`` of (seconds,
    reward, trained): its bounds, groups, trained share and that share over the whole's (the ratio). None with
    fewer than 8 groups that have the figure."""
    column = 0 if axis == "time" else 1
    data = np.array([(r[column], r[2]) for r in rows if r[column] is not None], float).reshape(-1, 2)
    if len(data) < 8:
        return None
    order = np.argsort(data[:, 0], kind="stable")  # equal values keep their order: quartiles of equal size
    overall = data[:, 1].mean()
    out = []
    for part in np.array_split(order, 4):
        values, trained = data[part, 0], data[part, 1]
        out.append({"low": float(values.min()), "high": float(values.max()), "groups": len(part),
                    "trained_share": float(trained.mean()),
                    "ratio": float(trained.mean() / overall) if overall else math.nan})
    return out


def metrics(rows: list[Row]) -> dict[str, float]:
    """The metrics line's figures: ``coverage_time_q1`` ... ``coverage_reward_q4`` (each quartile's ratio)."""
    out = {}
    for axis in AXES:
        for name, q in zip(QUARTILES, quartiles(rows, axis) or []):
            out[f"coverage_{axis}_{name}"] = q["ratio"]
    return out


def from_file(path, upto: int) -> list[Row]:
    """``from_lines`` of a metrics file's steps up to ``upto`` (what a resumed learner carries on from)."""
    import json

    if not path.is_file():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if '"groups_read"' in x]
    return from_lines([r for r in lines if r["step"] <= upto])


def from_lines(lines: list[dict]) -> list[Row]:
    """Every group read over a run, from its metrics lines (``groups_read``); a step written twice (a learner
    killed after it, resumed before it) counts once, as its last line has it."""
    by_step = {r["step"]: r for r in lines if "groups_read" in r}
    return [tuple(row) for r in by_step.values() for row in r["groups_read"]]


def summary(rows: list[Row], axis: str) -> str | None:
    """One line naming each quartile's ratio, e.g. ``generation time: q1 (0.8-1.2 s) 1.05 · ... · q4 (3.1-9.8 s)
    0.62``."""
    found = quartiles(rows, axis)
    if found is None:
        return None
    unit = " s" if axis == "time" else ""
    return f"{AXES[axis]}: " + " · ".join(f"{name} ({q['low']:.3g}-{q['high']:.3g}{unit}) {q['ratio']:.2f}"
                                          for name, q in zip(QUARTILES, found))
