"""Micro-batch balance: Karmarkar–Karp vs equal-count and sorted-greedy splits.

The figure of merit is the largest micro-batch over its lower bound
``max(longest sequence, total / parts)``: 1.0 is perfect; the slowest rank sets the
step time, so every point above 1 is idle time on the other ranks.

    python -m benchmarks.partition [--quick]      (or: streamrl bench partition)
"""

from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np

from benchmarks.common import cli, new_figure, print_table, save_figure, write_json
from streamrl.learner.partition import karmarkar_karp


def reasoning(rng, n):
    """Long-tailed single-turn lengths: most answers short, a few very long chains of thought."""
    return np.clip(rng.lognormal(6.5, 1.0, n), 32, 16384).astype(int)


def multi_turn(rng, n):
    """Agentic episodes: short failures and long multi-turn successes."""
    short = rng.integers(200, 800, n)
    long = rng.integers(3000, 8000, n)
    return np.where(rng.random(n) < 0.3, long, short)


def uniform(rng, n):
    return rng.integers(64, 1024, n)


DISTRIBUTIONS = {"reasoning": reasoning, "multi-turn": multi_turn, "uniform": uniform}


def equal_count(lengths, parts, rng):
    order = rng.permutation(len(lengths))
    return [order[i::parts].tolist() for i in range(parts)]


def sorted_greedy(lengths, parts, rng=None):
    """Longest first, each to the currently lightest part (LPT)."""
    heap = [(0, p) for p in range(parts)]
    out = [[] for _ in range(parts)]
    for i in np.argsort(lengths)[::-1]:
        load, p = heapq.heappop(heap)
        out[p].append(int(i))
        heapq.heappush(heap, (load + int(lengths[i]), p))
    return out


METHODS = {"equal": equal_count, "LPT": sorted_greedy,
           "KK": lambda lengths, parts, rng: karmarkar_karp(lengths.tolist(), parts)}


def imbalance(lengths, parts_idx) -> float:
    loads = [int(lengths[p].sum()) if p else 0 for p in parts_idx]
    return max(loads) / max(int(lengths.max()), lengths.sum() / len(parts_idx))


def run(quick: bool) -> dict:
    rng = np.random.default_rng(0)
    trials = 50 if quick else 500
    cases = []
    for name, draw in DISTRIBUTIONS.items():
        for n, parts in ((64, 8), (256, 16)):
            samples = {m: [] for m in METHODS}
            for _ in range(trials):
                lengths = draw(rng, n)
                for m, split in METHODS.items():
                    samples[m].append(imbalance(lengths, split(lengths, parts, rng)))
            cases.append({"distribution": name, "sequences": n, "parts": parts,
                          "median": {m: float(np.median(v)) for m, v in samples.items()},
                          "within_5pct": {m: float(np.mean(np.array(v) <= 1.05)) for m, v in samples.items()},
                          "samples": samples})
    return {"study": "partition", "trials": trials, "cases": cases}


def report(data: dict, out: Path) -> None:
    rows = [[c["distribution"], f"{c['sequences']}→{c['parts']}", *(f"{c['median'][m]:.3f}" for m in METHODS),
             f"{c['within_5pct']['KK']:.0%} / {c['within_5pct']['equal']:.0%}"]
            for c in data["cases"]]
    print_table(f"Largest micro-batch / lower bound, medians of {data['trials']} draws "
                "(equal: equal-count, LPT: sorted greedy, KK: Karmarkar-Karp)",
                ["lengths", "seqs→parts", *METHODS, "≤1.05 KK/equal"], rows)
    json_path = write_json(out, "partition", data)
    fig, (ax,) = new_figure(1, "Micro-batch imbalance (max / lower bound), lower is better")
    x = np.arange(len(data["cases"]))
    for k, m in enumerate(METHODS):
        ax.bar(x + (k - 1) * 0.27, [c["median"][m] for c in data["cases"]], 0.27, label=m)
    ax.set_xticks(x, [f"{c['distribution']}\n{c['sequences']}→{c['parts']}" for c in data["cases"]])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylabel("median imbalance")
    ax.legend()
    save_figure(fig, out, "partition", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results")) -> dict:
    data = run(quick)
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
