"""End to end: the whole system, asynchronous vs ``mode: sync``, same config and number of samples.

Each run is a real ``streamrl up`` (every part its own process) of one of two shipped configs:

- ``single-turn`` — ``configs/quickstart.yaml``: reverse a word; compute-bound (generation and training
  share the CPU);
- ``env-latency`` — ``configs/agentic.yaml``: the same task as an agentic loop: every reply goes to a
  checker that takes ~1 s of wall time, and a wrong reply gets feedback and a second try
  (``RetryWithFeedback``), whose success pays half (``discount: 0.5``): at full pay the wrong first reply
  shares the episode's whole reward, and the learner credits it. The config's learner credits each turn
  with its own advantage and takes four PPO minibatches per batch at a quarter of the learning rate, in
  both modes: the settings ``bench ablation`` found best on this task.

With ``--real-model`` the same pair on SmolLM2-135M-Instruct's two-digit addition (``RECIPES["smollm2"]``):
``configs/smollm2.yaml`` (compute-bound: a 135M model generating and training on the same two cores) and
``configs/smollm2-agentic.yaml`` (its replies go to the ~1 s checker, a wrong one gets a second try paying
half); 20 steps a run, 256 held-out questions, eval target 0.5, evaluated online at steps 0, 10 and 20 only
(64 greedy two-turn episodes take the real model's server for over a minute, on the clock). Its sync arm
gives the server and the learner every core each (``Recipe.sync_overrides``): they take turns, and at 135M
each phase runs faster so (the toy's do not). Async runs them side by side, and gives its learner, this pair's
bottleneck, every core too (``Recipe.async_overrides``): on two CPU cores its step on one core took about 1.7×
its step on two, more than overlapping generation with training wins back. Each run records its threads.

Both modes train the same number of samples (``max_steps × groups_per_step × n``) from the same
warm-started model. The clock starts when the rollout worker begins generating (its opening report) —
the last part to start, after the version-0 evaluation; the learner started first and may still be
loading, which stays on the clock — and stops at the learner's last step.
Reported per run: that wall time, samples/s over it, steady-state samples/s (between the ends of
step 2 and the last step, where the queue is as full at both ends), time to a target eval accuracy
(with how many runs reached it), the staleness of every trained sample, the share of finished groups the
learner dropped as past the staleness bound (generated, then thrown away), the final online eval accuracy
(64 prompts), and — off the clock — the final weights' greedy scores on all 512 held-out prompts, the
finer measure of "no loss of final reward": first-try accuracy, and the task's own reward (on the agentic
workload a right second try counts at its discount; on single-turn the two are the same).
The ratio is async samples/s over sync samples/s; who goes first rotates per repeat. Async runs at
max staleness 4 (the headline), 2 and 1: staleness buys throughput and, on a task learnt in a few
dozen steps, can cost final reward — both sides of the trade are in the table — and at ``auto``, where the
learner sets the bound from what it measures (docs/concepts.md); a row gives ``auto``'s samples/s over
the fastest fixed bound's, what letting the learner choose cost (an ``auto`` run keeps the bound each of its
steps trained under, ``bound_by_step``, and each change with its cause, ``changes``), and a table pairs
``auto`` with each fixed bound seed by seed: the geometric mean of its per-seed ratios, with their 95% t
interval (a seed's two runs ran side by side; the fastest bound's median is the best of several noisy ones,
so the row's ratio of medians leans against ``auto``). Runs are 40 steps,
the quickstart's length, by which the synchronous run has converged (held-out ≈ 0.95).
Every run also records its stages' speeds (``stages``), from which ``streamrl bench simulate``
replays it to check the pipeline model.

Seeds and arms can be run one session at a time: ``--first-seed S`` joins the runs of seeds S on to an earlier
run's of the same study, ``--staleness B`` (repeatable) runs sync and only those async arms, ``--sync-only``
sync alone (after its settings changed: its runs replace the same seeds' earlier sync runs), and ``--async-only``
the async arms alone, paired with the sync runs of the same seeds already in the results (on a real model an arm
of 3 seeds takes an hour; sync's runs do not depend on the async arms', so they need not run again).
``--workload W`` (repeatable) runs only that workload; the other's runs stay as they were. The results are
written after every seed, so a study stopped part way keeps the seeds it finished.

    python -m benchmarks.e2e [--quick] [--real-model] [--first-seed S] [--staleness B] [--sync-only | --async-only] [--workload W]
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import (
    ACROSS,
    by_seed,
    cli,
    console,
    earlier_results,
    join_seeds,
    median,
    new_figure,
    one_invocation,
    paired_ratio,
    percent,
    points,
    print_table,
    save_figure,
    this_invocation,
    write_json,
)
from benchmarks.e2e_run import HELD_OUT, RECIPES, TOY, Recipe, one_run, prepare_shared

# max staleness of the async runs: the headline one, the trade-off against reward, and the learner's own choice
STALENESS = (4, 2, 1, "auto")


def medians(rows: list[dict]) -> dict:
    """Medians over repeats; time to target over the runs that reached it, with their count."""
    out = {k: median([x[k] for x in rows if x.get(k) is not None])
           for k in ("samples_per_s", "steady_samples_per_s", "wall_s", "eval_final", "held_out_final",
                     "held_out_reward", "dropped_fraction")}
    reached = [x["time_to_target_s"] for x in rows if x["time_to_target_s"] is not None]
    out.update(time_to_target_s=median(reached), reached_target=f"{len(reached)}/{len(rows)}", runs=len(rows))
    return out


def async_mode(staleness: int | str) -> str:
    return "async" if staleness == STALENESS[0] else f"async-{staleness}" if staleness == "auto" else f"async-s{staleness}"


def run(quick: bool, repeats: int | None = None, recipe: Recipe = TOY, first_seed: int = 0,
        bounds: tuple[int | str, ...] | None = None, with_sync: bool = True,
        workloads: tuple[str, ...] = ()) -> Iterator[dict]:
    """The study's results so far after each seed (every arm run on it), so a run cut short keeps its finished
    seeds. ``bounds``: the async arms run beside sync (None: the study's; empty: sync alone); without sync the
    runs are given unsummarised, for ``more_seeds`` to pair with an earlier run's sync; ``workloads``: the ones
    run (empty: all)."""
    default_repeats, steps, default_bounds = ((1, recipe.quick_steps, STALENESS[:1]) if quick
                                              else (3, recipe.steps, STALENESS))
    repeats, bounds = repeats or default_repeats, default_bounds if bounds is None else bounds
    modes = {**({"sync": 0} if with_sync else {}), **{async_mode(k): k for k in bounds}}  # mode -> max staleness
    results: dict[str, dict[str, list[dict]]] = {w: {m: [] for m in modes} for w in workloads or recipe.workloads}
    invocation = this_invocation()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        console.log("warm start (once, shared by every run)")
        _, prepared = prepare_shared(tmp, recipe)
        order = list(modes)
        for r in range(first_seed, first_seed + repeats):
            for workload in results:
                for mode in order[r % len(order):] + order[:r % len(order)]:  # who goes first rotates
                    system_mode = "sync" if mode == "sync" else "async"  # (sync ignores the staleness bound)
                    row = one_run(tmp / "runs", prepared, workload, system_mode, steps, modes[mode] or STALENESS[0],
                                  seed=r, recipe=recipe, overrides=recipe.overrides(system_mode))
                    results[workload][mode].append({**row, "seed": r, "invocation": invocation})
                    console.log(f"{workload} {mode}: {row['samples_per_s']:.1f} samples/s, wall {row['wall_s']:.0f}s, "
                                f"eval {row['eval_first']:.2f} → {row['eval_final']:.2f}, "
                                f"held-out {row['held_out_final']:.2f}"
                                + (f", bound by step {row['bound_by_step']}" if row["bound_by_step"] else ""))
            yield {"study": "e2e", "max_steps": steps, "max_staleness": (bounds or STALENESS)[0],
                   "sync_overrides": list(recipe.sync_overrides), "async_overrides": list(recipe.async_overrides),
                   "staleness_modes": {m: k for m, k in modes.items() if k}, "target": recipe.target,
                   "held_out": recipe.held_out, "result": recipe.result, "model": recipe.model, "task": recipe.task,
                   "config": next(iter(recipe.workloads.values())), "workloads": recipe.workloads,
                   **(summarise_modes(results) if with_sync else {"runs": results})}


def summarise_modes(results: dict[str, dict[str, list[dict]]]) -> dict:
    """Each workload's medians by mode, and each async mode against sync (held-out paired by seed)."""
    summary = {}
    for workload, by_mode in results.items():
        med = {m: medians(rows) for m, rows in by_mode.items()}
        ratios = {m: {"ratio": med[m]["samples_per_s"] / med["sync"]["samples_per_s"],
                      "one_invocation": one_invocation(by_mode[m], by_mode["sync"]),
                      "steady_ratio": med[m]["steady_samples_per_s"] / med["sync"]["steady_samples_per_s"],
                      # repeat r runs every mode at seed r: the held-out difference is paired by seed
                      **{f"{k}_vs_sync": by_seed(by_mode[m], by_mode["sync"], k)
                         for k in ("held_out_final", "held_out_reward")}}
                  for m in med if m != "sync"}
        summary[workload] = {**med, **ratios.get("async", {}), "ratios": ratios, **auto_vs_best_fixed(med, by_mode),
                             **auto_vs_fixed(by_mode)}
    return {"repeats": len(next(iter(results.values()))["sync"]), "runs": results, "summary": summary}


def auto_vs_best_fixed(med: dict[str, dict], by_mode: dict[str, list[dict]]) -> dict:
    """``auto``'s samples/s over the fastest fixed bound's: what choosing the bound cost against the best
    hand-picked one (empty unless both ran)."""
    auto, fixed = async_mode("auto"), [m for m in med if m not in ("sync", async_mode("auto"))]
    if auto not in med or not fixed:
        return {}
    best = max(fixed, key=lambda m: med[m]["samples_per_s"])
    return {"auto_vs_best_fixed": {"best": best, "ratio": med[auto]["samples_per_s"] / med[best]["samples_per_s"],
                                   "one_invocation": one_invocation(by_mode[auto], by_mode[best])}}


def auto_vs_fixed(by_mode: dict[str, list[dict]]) -> dict:
    """``auto``'s samples/s over each fixed bound's, paired by seed (``paired_ratio``): the fastest fixed bound's
    median is the best of several noisy ones, and a seed's pair ran side by side (empty unless both ran)."""
    auto, paired = by_mode.get(async_mode("auto"), []), {}
    for mode, rows in by_mode.items():
        if mode in ("sync", async_mode("auto")):
            continue
        fixed = {x["seed"]: x for x in rows}
        if pairs := [(x, fixed[x["seed"]]) for x in auto if x["seed"] in fixed]:
            ours, theirs = [a for a, _ in pairs], [b for _, b in pairs]
            paired[mode] = {**paired_ratio([x["samples_per_s"] for x in ours], [x["samples_per_s"] for x in theirs]),
                            "one_invocation": one_invocation(ours, theirs)}
    return {"auto_vs_fixed": paired} if paired else {}


def more_seeds(earlier: dict, new: dict) -> dict:
    """New runs joined to an earlier run's of the same study (steps, workloads): new seeds, or new bounds on
    seeds already run; a (bound, seed) run again replaces its earlier run. Other settings replace it, and an
    arm's other settings (``sync_overrides``, ``async_overrides``) that arm's runs."""
    if any(earlier.get(k) != new.get(k) for k in ("max_steps", "workloads")):
        return new
    if not all("seed" in x for by_mode in earlier["runs"].values() for rows in by_mode.values() for x in rows):
        return new  # written before runs recorded their seed
    # runs that measured another setting of their arm's are dropped
    changed = {arm for arm in ("sync", "async") if earlier.get(f"{arm}_overrides", []) != new.get(f"{arm}_overrides", [])}
    arm_of = {m: "sync" if m == "sync" else "async" for by_mode in earlier["runs"].values() for m in by_mode}
    earlier = {**earlier, "runs": {w: {m: [] if arm_of[m] in changed else rows for m, rows in by_mode.items()}
                                   for w, by_mode in earlier["runs"].items()}}
    runs = {**earlier["runs"], **{w: {**earlier["runs"].get(w, {}), **join_seeds(earlier["runs"].get(w, {}), by_mode)}
                                  for w, by_mode in new["runs"].items()}}  # a workload not run again stays
    modes = {**earlier.get("staleness_modes", {}), **new["staleness_modes"]}
    modes = {async_mode(b): b for b in STALENESS if async_mode(b) in modes}  # the table's order
    for w in runs:
        runs[w] = {m: runs[w][m] for m in ("sync", *modes) if m in runs[w]}
    return {**new, "staleness_modes": modes, **summarise_modes(runs)}


def report(data: dict, out: Path) -> None:
    rows, modes = [], ["sync", *data.get("staleness_modes", {"async": data["max_staleness"]})]
    for workload, s in data["summary"].items():
        for mode in (m for m in modes if m in s):  # an arm run on one workload (--workload) only
            m = s[mode]
            label = mode if mode == "sync" else f"async, max staleness {data['staleness_modes'][mode]}"
            if m.get("runs", data["repeats"]) != data["repeats"]:
                label += f" ({m['runs']} seeds)"
            rows.append([f"{workload} / {label}", m["samples_per_s"], m["steady_samples_per_s"], m["wall_s"],
                         f"{m['time_to_target_s']:.0f} ({m['reached_target']})", m["eval_final"],
                         m["held_out_final"], m["held_out_reward"], percent(m.get("dropped_fraction"))])
        for mode, r in s["ratios"].items():
            rows.append([f"{workload}: {mode} / sync{ACROSS * (not r.get('one_invocation', True))}", r["ratio"],
                         r["steady_ratio"], "", "", "",
                         points(r["held_out_final_vs_sync"]), points(r["held_out_reward_vs_sync"]), ""])
        if best := s.get("auto_vs_best_fixed"):
            rows.append([f"{workload}: {async_mode('auto')} / {best['best']} (the fastest fixed bound)"
                         f"{ACROSS * (not best.get('one_invocation', True))}", best["ratio"], "", "", "", "", "", "", ""])
    model = f"{data['model']}, " if data.get("model") else ""
    held_out, name = data.get("held_out", HELD_OUT), data.get("result", "e2e")
    invocations = sorted({x.get("invocation", "unrecorded") for by_mode in data["runs"].values()
                          for rows_ in by_mode.values() for x in rows_})
    print_table(f"End to end, {model}{data['max_steps']} steps, medians of {data['repeats']}; held-out of a ratio row: "
                "mean difference from sync over seed-paired runs, ± its 95% t interval"
                + (f"; runs from {len(invocations)} invocations ({', '.join(invocations)}): a ratio of two arms "
                   f"that ran a seed in different ones is marked {ACROSS.strip()}" if len(invocations) > 1 else ""),
                ["run", "samples/s", "steady samples/s", "wall s", f"s to eval ≥ {data['target']} (runs)",
                 "final eval (64)", f"held-out first try ({held_out})", "held-out reward", "dropped stale"], rows)
    if changes := [[workload, x["seed"], c] for workload, by_mode in data["runs"].items()
                   for x in by_mode.get(async_mode("auto"), []) for c in x.get("changes", [])]:
        print_table(f"End to end, {model}each change of the auto bound, with its cause", ["workload", "seed", "change"],
                    changes)
    if paired := [[workload, f"{data['staleness_modes'][mode]}{ACROSS * (not p['one_invocation'])}",
                   ", ".join(f"{x:.2f}" for x in p["per_seed"]), p["ratio"], interval(p)]
                  for workload, s in data["summary"].items() for mode, p in s.get("auto_vs_fixed", {}).items()]:
        print_table(f"End to end, {model}auto's samples/s over each fixed bound's, paired by seed",
                    ["workload", "fixed bound", "per seed", "geometric mean", "95% interval"], paired)
    json_path = write_json(out, name, data)
    fig, (ax1, ax2) = new_figure(2, f"Async vs sync, same samples ({data.get('task', TOY.task)})")
    names = list(data["summary"])
    width = 0.8 / len(modes)
    bound = {m: data["staleness_modes"].get(m) for m in modes}
    labels = {m: m if m == "sync" else "async, auto staleness" if bound[m] == "auto" else f"async, staleness ≤ {bound[m]}"
              for m in modes}
    for i, mode in enumerate(modes):
        for ax, key in ((ax1, "samples_per_s"), (ax2, "held_out_final")):  # nan: no bar where the arm did not run
            ax.bar([j + width * i for j in range(len(names))],
                   [data["summary"][w].get(mode, {}).get(key, float("nan")) for w in names], width=width,
                   label=labels[mode])
    for ax in (ax1, ax2):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax1.set_ylabel("samples/s")
    ax2.set_ylabel(f"final greedy accuracy, {held_out} held-out prompts")
    ax2.set_ylim(0, 1.3)  # headroom for the legend (one for both panels: the same colours)
    ax2.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax2.legend(loc="upper center", ncol=2, fontsize=8)
    save_figure(fig, out, name, json_path)


def interval(p: dict) -> str:
    """A ``paired_ratio``'s 95% interval, ``0.85–1.04`` (empty with one pair)."""
    return "" if p["low"] != p["low"] else f"{p['low']:.2f}–{p['high']:.2f}"


def bounds_of(staleness: tuple[str, ...], sync_only: bool = False) -> tuple[int | str, ...] | None:
    """``--staleness`` values as the study's bounds (None: all of them; empty: ``--sync-only``), refusing one it
    does not run."""
    known = {str(b): b for b in STALENESS}
    if unknown := [s for s in staleness if s not in known]:
        raise SystemExit(f"--staleness {', '.join(unknown)}: the study's async arms are {', '.join(known)}")
    if sync_only and staleness:
        raise SystemExit("--sync-only runs no async arm: leave out --staleness")
    return () if sync_only else tuple(known[s] for s in staleness) or None


def same_study(earlier: dict | None, recipe: Recipe, steps: int) -> bool:
    """Whether the earlier results are of this study (its steps and workloads): new runs join them."""
    return bool(earlier) and earlier.get("max_steps") == steps and earlier.get("workloads") == recipe.workloads


def sync_to_pair(earlier: dict | None, recipe: Recipe, steps: int) -> None:
    """Refuses ``--async-only`` unless the results hold sync runs of the same study for its runs to pair with."""
    if not (same_study(earlier, recipe, steps) and all(by_mode.get("sync") for by_mode in earlier["runs"].values())):
        raise SystemExit(f"--async-only pairs its runs with the sync runs of an earlier {recipe.result}.json of "
                         f"{steps} steps, and there is none: run sync too (leave out --async-only)")


def one_workload_joins(earlier: dict | None, recipe: Recipe, steps: int) -> None:
    """Refuses ``--workload`` unless its runs join an earlier study of the same settings, whose other workload's
    runs then stay (``more_seeds`` would replace the study, or drop the runs of an arm whose settings changed)."""
    if not (same_study(earlier, recipe, steps) and all(
            earlier.get(f"{arm}_overrides", []) == list(recipe.overrides(arm)) for arm in ("sync", "async"))):
        raise SystemExit(f"--workload joins an earlier {recipe.result}.json of {steps} steps and the same settings, "
                         "and there is none: run every workload (leave out --workload)")


def main(quick: bool = False, out: Path = Path("benchmarks/results"), repeats: int | None = None,
         real_model: bool = False, first_seed: int = 0, staleness: tuple[str, ...] = (),
         sync_only: bool = False, async_only: bool = False, workload: tuple[str, ...] = ()) -> dict:
    """``real_model``: SmolLM2-135M's pair of workloads (``RECIPES["smollm2"]``) instead of the toy's;
    ``first_seed``: the first repeat's seed (runs of other seeds of the same study, in its results file, join);
    ``staleness``: the async arms to run beside sync (default: all of ``STALENESS``; arms run later join);
    ``sync_only``: the sync arm alone (its runs replace the same seeds' earlier sync runs, the async arms stay);
    ``async_only``: the async arms alone, paired with the earlier sync runs of the same seeds; ``workload``:
    the workloads run (default: both; the other's earlier runs stay)."""
    if sync_only and async_only:
        raise SystemExit("--sync-only and --async-only: choose one")
    recipe = RECIPES["smollm2" if real_model else "toy"]
    if unknown := [w for w in workload if w not in recipe.workloads]:
        raise SystemExit(f"--workload {', '.join(unknown)}: the study's workloads are {', '.join(recipe.workloads)}")
    earlier = earlier_results(out, recipe.result)
    steps = recipe.quick_steps if quick else recipe.steps
    if async_only:
        sync_to_pair(earlier, recipe, steps)
    if workload:
        one_workload_joins(earlier, recipe, steps)
    for data in run(quick, repeats, recipe, first_seed, bounds_of(staleness, sync_only), with_sync=not async_only,
                    workloads=workload):
        data = more_seeds(earlier, data) if earlier else data
        report(data, out)  # after every seed: what ran is kept if the study is cut short
    return data


if __name__ == "__main__":
    cli(main, __doc__)
