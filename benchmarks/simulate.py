"""A discrete-event model of the pipeline, for fleets this machine cannot hold.

Model (every assumption is a parameter):
- Rollout: ``engines`` engines, each running up to ``slots`` groups at once. A group of ``n``
  samples takes ``max(sample lengths) / seq_rate + env_s`` (lengths log-normal, cut at ``max_len``: reasoning tails),
  where ``seq_rate`` is one sequence's decode rate in a full engine
  (``engine_tokens_per_s / (slots × n)``; decoding is memory-bound, so a half-empty engine does
  not decode each sequence much faster — it just produces less).
- A step is ``groups_per_step`` groups, by default one full batch of every engine's slots: the
  size a synchronous system would choose.
- Admission: a group may start while ``accepted + running < (k + V + 1) × G`` (AReaL's rule);
  ``k = 0`` with the learner waiting for its push is the synchronous baseline.
- Learner: a step trains ``G`` groups at ``ranks × rank_tokens_per_s × dp_efficiency`` tokens/s,
  then pushes for ``push_s`` (in flight: the engines keep going; the learner is busy).
- Staleness of a trained group: the learner's version minus the version it was started at. As the
  learner does, a group past ``max_staleness`` when the learner takes it is dropped, and its slot freed:
  groups finish out of order (a slow one is overtaken by later ones), so some are generated in vain
  (with ``off_policy.stale=keep`` they are trained instead).

Calibration and check: the model is first run on this machine's own measured end-to-end runs
(``benchmarks/results/e2e.json``, from ``streamrl bench e2e``). Each run recorded its stages' speeds
— a group's rollout latency, the learner's train and push time per step, tokens per sample, the
groups in flight and the staleness bound — and the model, given only those, predicts the run's
steady samples/s and mean staleness, which are compared with what the run measured. That checks the
pipeline logic (admission, staleness bound, overlap) that the fleet predictions rest on.

The fleet rates are stated assumptions for GPUs, not measurements (a 7B-class policy on H100s:
2,500 generated tokens/s per engine GPU at full batch, 12,000 trained tokens/s per learner GPU, 90%
data-parallel efficiency, a 1.5 s NCCL push); this machine has no GPU to calibrate them against.
Change ``Fleet``'s fields to model another stack. It ignores network contention, KV-cache limits,
the cost of in-flight weight swaps, and stages sharing a device (on this 2-core machine they share
the CPU: the replay takes each stage's speed as measured under that sharing).

    python -m benchmarks.simulate [--quick]      (or: streamrl bench simulate)
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import cli, console, earlier_results, median, new_figure, print_table, save_figure, write_json


@dataclass
class Fleet:
    engines: int
    ranks: int
    engine_tokens_per_s: float = 2500.0
    rank_tokens_per_s: float = 12000.0
    dp_efficiency: float = 0.9
    push_s: float = 1.5
    slots: int = 16              # groups per engine at once (128 sequences: a full decode batch)
    n: int = 8                   # samples per group
    groups_per_step: int = 0     # 0: one full batch of every engine's slots, as synchronous systems size it
    mean_len: float = 1500.0     # generated tokens per sample (log-normal, sigma below)
    sigma: float = 0.8
    max_len: float = 8192.0      # max_new_tokens: the tail is cut here
    env_s: float = 0.0           # environment wall time per group (tools, sandboxes), mean
    env_sigma: float = 0.0       # its log-normal spread (0: every group the same)


def simulate(f: Fleet, max_staleness: int, steps: int, seed: int = 0, keep_late: bool = False) -> dict:
    """Run ``steps`` learner steps; return throughput, staleness and where the time went. ``keep_late``:
    the learner trains groups past the bound instead of dropping them (``off_policy.stale=keep``)."""
    rng = random.Random(seed)
    if not f.groups_per_step:
        f = Fleet(**{**f.__dict__, "groups_per_step": f.engines * f.slots})
    mu = math.log(f.mean_len) - f.sigma**2 / 2
    seq_rate = f.engine_tokens_per_s / (f.slots * f.n)
    learner_rate = f.ranks * f.rank_tokens_per_s * f.dp_efficiency
    bound = lambda v: (max_staleness + v + 1) * f.groups_per_step  # noqa: E731
    events: list[tuple[float, int, str, tuple]] = []
    free_slots, running, accepted, version, now, seq = f.engines * f.slots, 0, 0, 0, 0.0, 0
    ready: list[tuple[int, float]] = []  # (version at start, tokens) of finished groups
    learner_busy, learner_time, stale, step_ends, dropped = False, 0.0, [], [], 0

    def push(t: float, kind: str, data: tuple = ()) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    def start_groups() -> None:
        nonlocal free_slots, running
        while free_slots and accepted + running < bound(version):
            lengths = [min(rng.lognormvariate(mu, f.sigma), f.max_len) for _ in range(f.n)]
            env = rng.lognormvariate(math.log(f.env_s) - f.env_sigma**2 / 2, f.env_sigma) if f.env_s else 0.0
            free_slots, running = free_slots - 1, running + 1
            push(now + max(lengths) / seq_rate + env, "group", (version, sum(lengths)))

    def try_step() -> None:
        nonlocal learner_busy, learner_time, accepted, dropped
        if learner_busy:
            return
        late = 0 if keep_late else sum(version - v > max_staleness for v, _ in ready)
        if late:  # the learner's guard; as in the admission count, they no longer hold slots
            ready[:] = [(v, tok) for v, tok in ready if version - v <= max_staleness]
            accepted, dropped = accepted - late, dropped + late
        if len(ready) < f.groups_per_step:
            return
        batch = [ready.pop(0) for _ in range(f.groups_per_step)]
        stale.extend(version - v for v, _ in batch)
        train = sum(tok for _, tok in batch) / learner_rate
        learner_busy, learner_time = True, learner_time + train + f.push_s
        push(now + train + f.push_s, "step")

    start_groups()
    while len(step_ends) < steps:
        now, _, kind, data = heapq.heappop(events)
        if kind == "group":
            free_slots, running, accepted = free_slots + 1, running - 1, accepted + 1
            ready.append(data)
            try_step()
        else:
            learner_busy, version = False, version + 1
            step_ends.append(now)
            try_step()
        start_groups()
    samples = steps * f.groups_per_step * f.n
    steady = (steps - 2) * f.groups_per_step * f.n / (now - step_ends[1]) if steps > 2 else None  # as e2e's
    return {"samples_per_s": samples / now, "steady_samples_per_s": steady, "seconds": now,
            "learner_busy": learner_time / now,
            "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
            "dropped_fraction": dropped / (dropped + len(stale)),
            "bottleneck": "learner" if learner_time / now > 0.9 else "rollout"}


def replay(stages: dict, steps: int) -> dict:
    """Simulate one measured e2e run from its own stage speeds: one engine, one learner rank.

    A group's measured latency (decoding, queueing in the engine and env time together) becomes its
    duration, drawn log-normally with the measured mean and spread: a synchronous step waits for
    the slowest of its groups, so the spread matters as much as the mean.
    """
    length, slots, n, groups = (stages["tokens_per_sample"], stages["groups_in_flight"], stages["n"],
                                stages["groups_per_step"])
    cv = stages.get("group_s_std", 0.0) / stages["group_s"]
    fleet = Fleet(engines=1, ranks=1, slots=slots, n=n, groups_per_step=groups, mean_len=length, sigma=0.0,
                  max_len=length, engine_tokens_per_s=math.inf, env_s=stages["group_s"],
                  env_sigma=math.sqrt(math.log(1 + cv**2)),
                  rank_tokens_per_s=groups * n * length / stages["learner_step_s"], dp_efficiency=1.0,
                  push_s=stages["push_s"])
    return simulate(fleet, 0 if stages["mode"] == "sync" else stages["max_staleness"], steps,
                    keep_late=stages.get("stale") == "keep")


def check_against(e2e: dict | None) -> list[dict]:
    """Model vs measurement for every workload and mode of a saved e2e study (empty if there is none)."""
    if not e2e:
        return []
    rows = []
    for workload, by_mode in e2e["runs"].items():
        for mode, runs in by_mode.items():
            runs = [r for r in runs if r.get("stages", {}).get("group_s")]
            if not runs:
                continue
            predicted = [replay(r["stages"], e2e["max_steps"]) for r in runs]
            rows.append({"workload": workload, "mode": mode, "runs": len(runs),
                         "measured": median([r["steady_samples_per_s"] for r in runs]),
                         "predicted": median([p["steady_samples_per_s"] for p in predicted]),
                         "measured_staleness": median([mean_staleness(r["staleness"]) for r in runs]),
                         "predicted_staleness": median([p["staleness_mean"] for p in predicted]),
                         # runs recorded before e2e counted drops have no measured share
                         "measured_dropped": median([r["dropped_fraction"] for r in runs if "dropped_fraction" in r]),
                         "predicted_dropped": median([p["dropped_fraction"] for p in predicted])})
    return rows


def mean_staleness(histogram: dict[str, int]) -> float:
    return sum(int(k) * v for k, v in histogram.items()) / sum(histogram.values())


def run(quick: bool, out: Path) -> dict:
    sizes = [8, 64, 256] if quick else [8, 32, 64, 128, 256, 512, 1024]
    steps = 20 if quick else 60
    rows = []
    for gpus in sizes:
        for env_s in (0.0, 30.0):  # compute-bound, and agentic with 30 s of tool time per group
            fleet = Fleet(engines=gpus // 2, ranks=gpus // 2, env_s=env_s)
            a = simulate(fleet, max_staleness=2, steps=steps)
            s = simulate(fleet, max_staleness=0, steps=steps)
            rows.append({"gpus": gpus, "env_s": env_s, "async": a, "sync": s,
                         "ratio": a["samples_per_s"] / s["samples_per_s"]})
    split = []  # where does the learner become the bottleneck? 256 GPUs, more and more of them generating
    for frac in (0.5, 0.75, 0.875, 0.9375):
        engines = int(256 * frac)
        fleet = Fleet(engines=engines, ranks=256 - engines)
        a, s = simulate(fleet, 2, steps), simulate(fleet, 0, steps)
        split.append({"rollout_gpus": engines, "train_gpus": 256 - engines, "async": a, "sync": s,
                      "ratio": a["samples_per_s"] / s["samples_per_s"]})
    return {"study": "simulate", "steps": steps, "split": "half the GPUs generate, half train",
            "assumptions": Fleet(engines=0, ranks=0).__dict__, "rows": rows, "splits": split,
            "check": check_against(earlier_results(out, "e2e"))}


def report(data: dict, out: Path) -> None:
    print_table(f"Simulated samples/s, {data['steps']} steps, {data['split']} (assumptions in the JSON)",
                ["GPUs", "env s/group", "async samples/s", "sync samples/s", "async/sync", "async staleness mean",
                 "async bottleneck"],
                [[r["gpus"], r["env_s"], r["async"]["samples_per_s"], r["sync"]["samples_per_s"], r["ratio"],
                  r["async"]["staleness_mean"], r["async"]["bottleneck"]] for r in data["rows"]])
    print_table("256 GPUs split between rollout and training (env 0 s)",
                ["rollout GPUs", "train GPUs", "async samples/s", "sync samples/s", "async/sync", "learner busy",
                 "async bottleneck"],
                [[r["rollout_gpus"], r["train_gpus"], r["async"]["samples_per_s"], r["sync"]["samples_per_s"],
                  r["ratio"], r["async"]["learner_busy"], r["async"]["bottleneck"]] for r in data["splits"]])
    if data["check"]:
        print_table("The model replaying this machine's e2e runs from their measured stage speeds (medians)",
                    ["workload / mode", "runs", "measured steady samples/s", "model", "model / measured",
                     "measured mean staleness", "model", "measured dropped stale", "model"],
                    [[f"{r['workload']} / {r['mode']}", r["runs"], r["measured"], r["predicted"],
                      r["predicted"] / r["measured"], r["measured_staleness"], r["predicted_staleness"],
                      r.get("measured_dropped", float("nan")), r.get("predicted_dropped", float("nan"))]
                     for r in data["check"]])
    else:
        console.log("no e2e results with stage speeds beside: run `streamrl bench e2e` to check the model")
    json_path = write_json(out, "simulate", data)
    fig, (ax, check) = new_figure(2, "Simulated throughput (max staleness 2 vs synchronous)")
    for env_s, style in ((0.0, "-"), (30.0, "--")):
        rows = [r for r in data["rows"] if r["env_s"] == env_s]
        for mode in ("async", "sync"):
            ax.plot([r["gpus"] for r in rows], [r[mode]["samples_per_s"] for r in rows], "o" + style,
                    label=f"{mode}, env {env_s:.0f}s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("samples/s")
    ax.legend()
    for r in data["check"]:
        check.scatter(r["measured"], r["predicted"], marker="o" if r["mode"] == "sync" else "^")
        check.annotate(f"{r['workload']} {r['mode']}", (r["measured"], r["predicted"]), fontsize=7)
    top = max([v for r in data["check"] for v in (r["measured"], r["predicted"])], default=1.0) * 1.1
    check.plot([0, top], [0, top], "k:", linewidth=1)
    check.set_xlabel("measured steady samples/s (this machine's e2e runs)")
    check.set_ylabel("model's samples/s from the runs' stage speeds")
    save_figure(fig, out, "simulate", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results")) -> dict:
    data = run(quick, out)
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
