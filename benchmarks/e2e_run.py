"""One end-to-end run, as the studies that run the whole system share it (``e2e``, ``ablation``, ``stress``): the
recipes (a model's pair of workloads and how its runs are judged), the warm start every run begins from, a run's
``streamrl up``, and what it measured, read from its metrics (its clock, samples/s, staleness, held-out scores,
each stage's speed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import median
from benchmarks.scoring import held_out
from streamrl.buffer.redis_server import free_port
from streamrl.config import load_config
from streamrl.recipes.reverse import prepare
from streamrl.rollout.evaluate import read_records
from streamrl.rollout.worker import max_groups_in_flight


@dataclass(frozen=True)
class Recipe:
    """A model's pair of workloads (the same task single-turn and agentic) and how its runs are judged."""
    workloads: dict[str, str]  # workload -> config
    steps: int  # learner steps of a run
    quick_steps: int
    target: float  # eval accuracy whose first crossing is timed
    held_out: int  # prompts of the final greedy evaluation, off the clock (the online one scores 64)
    result: str  # the results file's name
    model: str  # as the table's title names it ("": the toy, the study's first)
    task: str  # as the plot's title names it
    evals: int = 4  # online evaluations after the first (each takes the server from the run's own generation)
    sync_overrides: tuple[str, ...] = ()  # the sync arm's own settings, where its best differs from the launcher's
    async_overrides: tuple[str, ...] = ()  # and the async arms'

    def overrides(self, mode: str) -> tuple[str, ...]:
        return self.sync_overrides if mode == "sync" else self.async_overrides


RECIPES = {
    "toy": Recipe({"single-turn": "configs/quickstart.yaml", "env-latency": "configs/agentic.yaml"},
                  steps=40, quick_steps=12, target=0.8, held_out=512, result="e2e", model="", task="quickstart task"),
    "smollm2": Recipe({"single-turn": "configs/smollm2.yaml", "env-latency": "configs/smollm2-agentic.yaml"},
                      steps=20, quick_steps=3, target=0.5, held_out=256, result="e2e_smollm2", model="SmolLM2-135M",
                      task="SmolLM2-135M, two-digit addition", evals=2,
                      # its generation and training take turns, and at 135M each gains from every core: its steps
                      # ran 1.25x faster so on two cores (the toy's lose: the launcher's default is one each)
                      sync_overrides=(f"supervise.threads={os.cpu_count() or 1}",),
                      # the learner is async's bottleneck here: on every core it ran 1.14x the samples/s (agentic)
                      async_overrides=(f"supervise.learner_threads={os.cpu_count() or 1}",)),
}
TOY = RECIPES["toy"]
WORKLOADS, HELD_OUT = TOY.workloads, TOY.held_out  # the toy's, which bench ablation varies


def one_run(run_dir: Path, prepared: Path, workload: str, mode: str, steps: int, staleness: int | str,
            seed: int = 0, overrides: tuple[str, ...] = (), recipe: Recipe = TOY) -> dict:
    argv, name = up_argv(run_dir, prepared, workload, mode, steps, staleness, seed, overrides, recipe)
    out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed ({out.returncode}):\n{out.stdout[-3000:]}")
    return summarise(run_dir / name, recipe)


def up_argv(run_dir: Path, prepared: Path, workload: str, mode: str, steps: int, staleness: int | str,
            seed: int = 0, overrides: tuple[str, ...] = (), recipe: Recipe = TOY,
            name: str | None = None) -> tuple[list[str], str]:
    """The ``streamrl up`` of one run (named ``workload-mode`` unless ``name``), in a fresh run directory that
    starts from ``prepared``."""
    name = name or f"{workload}-{mode}"
    shutil.rmtree(run_dir / name, ignore_errors=True)
    shutil.copytree(prepared, run_dir / name / "prepared")
    return [sys.executable, "-m", "streamrl", "up", recipe.workloads[workload], f"run.dir={run_dir}",
            f"run.name={name}", f"mode={mode}", f"learner.max_steps={steps}",
            f"eval.every={max(1, steps // recipe.evals)}", "eval.size=64", f"off_policy.max_staleness={staleness}",
            f"router.port={free_port()}", f"router.prometheus_port={free_port()}", f"server.base_port={free_port()}",
            "supervise.display=plain", f"run.seed={seed}", *overrides], name


def held_out_rows(prepared: Path, n: int) -> list[dict]:
    return [json.loads(x) for x in (prepared / "eval.jsonl").read_text().splitlines()][:n]


def held_out_scores(run_path: Path, cfg, version: int, n: int) -> dict:
    """The final weights' greedy scores on every held-out prompt: finer than the online eval's 64.

    ``held_out_final`` is first-try accuracy; ``held_out_reward`` the task's own reward, which on the
    agentic workload counts a right second try at its discount (the same as accuracy on single-turn).
    """
    scores = held_out(cfg, run_path / "export" / f"version-{version}", held_out_rows(run_path / "prepared", n))
    return {"held_out_final": scores["accuracy"], "held_out_reward": scores["reward"]}


def prepare_shared(tmp: Path, recipe: Recipe = TOY):
    """The model and data every run starts from (the toy's warm start, with ``held_out`` held-out prompts)."""
    if recipe is RECIPES["smollm2"]:
        from benchmarks.smollm2 import prepare_shared as smollm2

        return smollm2(tmp)
    cfg = load_config("configs/quickstart.yaml", [f"run.dir={tmp}", "run.name=prep"])
    prepare(cfg, **{**cfg.prepare.args, "eval_size": recipe.held_out})
    return cfg, tmp / "prep" / "prepared"


def summarise(run_path: Path, recipe: Recipe = TOY) -> dict:
    cfg = load_config(run_path / "config.yaml")  # as the run saw it
    steps = [r for r in read_records(run_path / "metrics" / "learner.jsonl") if "loss" in r]
    evals = read_records(run_path / "metrics" / "eval.jsonl")
    worker = read_records(run_path / "metrics" / "rollout-worker-0.jsonl")
    # the clock starts at the worker's opening report, written once it has started up (imports, tokenizer,
    # Redis) and begins generating — as TRL's clock starts once its trainer is built
    start = worker[0]["time"]
    n = cfg.rollout.sampling.n
    wall = steps[-1]["time"] - start
    samples = sum(r["groups"] for r in steps) * n
    steady = sum(r["groups"] for r in steps[2:]) * n / (steps[-1]["time"] - steps[1]["time"])
    staleness = Counter()
    for r in steps:
        staleness.update({int(k): v for k, v in r["staleness_hist"].items()})
    reached = [e for e in evals if e["eval/accuracy"] >= recipe.target]
    dropped = sum(r.get("dropped_stale", 0) for r in steps)
    return {"wall_s": wall, "threads": cfg.supervise.threads,  # None: the launcher's own share
            "learner_threads": cfg.supervise.learner_threads,
            "samples": samples, "samples_per_s": samples / wall, "steady_samples_per_s": steady,
            "time_to_target_s": reached[0]["time"] - start if reached else None,
            "eval_first": evals[0]["eval/accuracy"], "eval_final": evals[-1]["eval/accuracy"],
            "staleness": {str(k): staleness[k] for k in sorted(staleness)},
            # generated, finished and then dropped by the learner as past the bound: work the run threw away
            "dropped_stale": dropped, "dropped_fraction": dropped / (dropped + sum(r["groups"] for r in steps)),
            "train_reward_last5": sum(r["reward_mean"] for r in steps[-5:]) / len(steps[-5:]),
            **episode_shape(worker),
            # the bound each step trained under: where `auto` went, kept with the run (fixed: None)
            "bound_by_step": [r["staleness_bound"] for r in steps] if cfg.off_policy.adaptive else None,
            "changes": [r["staleness_change"] for r in steps if "staleness_change" in r],  # with their causes
            **held_out_scores(run_path, cfg, steps[-1]["step"], recipe.held_out),
            "stages": stage_speeds(worker, steps, cfg)}


def episode_shape(worker: list[dict]) -> dict:
    """Mean turns per episode, and mean policy versions an episode's tokens span (weights that changed
    between its turns), over every episode the rollout worker reported."""
    reports = [r for r in worker if r.get("turns_mean")]
    episodes = sum(r["episodes"] for r in reports)
    return {k: sum(r[k] * r["episodes"] for r in reports) / episodes if episodes else None
            for k in ("turns_mean", "version_span_mean")}


def stage_speeds(worker: list[dict], steps: list[dict], cfg) -> dict:
    """What each stage took in this run — the learner over steps 3 on, a group's latency over the whole run:
    the simulator replays the run from these."""
    steady = steps[2:]
    reports = [r for r in worker if r.get("group_s_mean")]
    pushed = sum(r["groups_pushed"] for r in reports)
    mean = sum(r["group_s_mean"] * r["groups_pushed"] for r in reports) / pushed if pushed else None
    square = sum((r.get("group_s_std", 0.0) ** 2 + r["group_s_mean"] ** 2) * r["groups_pushed"] for r in reports)
    n = cfg.rollout.sampling.n
    # an auto bound is replayed at its typical value: the simulator holds one bound
    bound = round(median([r["staleness_bound"] for r in steady])) if cfg.off_policy.adaptive else cfg.staleness_bound
    return {"mode": cfg.mode, "max_staleness": bound, "stale": cfg.off_policy.stale, "n": n,
            "groups_per_step": cfg.learner.groups_per_step, "groups_in_flight": max_groups_in_flight(cfg.rollout),
            "learner_step_s": median([r["train_s"] for r in steady]),
            "push_s": median([r.get("push_s", 0.0) for r in steady]),
            "tokens_per_sample": median([r["tokens_global"] / (r["groups"] * n) for r in steady]),
            "group_s": mean, "group_s_std": max(square / pushed - mean**2, 0.0) ** 0.5 if pushed else None}
