"""SmolLM2-135M-Instruct learning two-digit addition (``configs/smollm2.yaml``) as the studies that run it share
it: prepared once (model, training rows, held-out questions), its env played for another trainer's prompts and
rewards, one ``streamrl up`` run of it timed from its metrics, and the final weights' greedy held-out score."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.common import median
from benchmarks.scoring import held_out
from streamrl.buffer.redis_server import free_port
from streamrl.config import Config, load_config
from streamrl.envs.base import Action
from streamrl.envs.registry import env_factory
from streamrl.launch.local import prepare
from streamrl.rollout.evaluate import read_records

CONFIG = "configs/smollm2.yaml"


def prepare_shared(tmp: Path) -> tuple[Config, Path]:
    """The recipe's model, training rows and held-out questions, made once for every run."""
    overrides = [f"run.dir={tmp}", "run.name=prep"]
    return prepare(load_config(CONFIG, overrides), CONFIG, overrides), tmp / "prep" / "prepared"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def play(cfg: Config, items: list[dict], replies: list[str] | None = None) -> list:
    """The env's first observation of each item; with ``replies``, the env's verdict on each reply instead."""
    make = env_factory(cfg.rollout.env, cfg.rollout.env_args)

    async def one(item, reply):
        env = make()
        first = await env.reset(item)
        return first.messages if reply is None else await env.step(Action(text=reply, token_ids=[]))

    async def every():
        return await asyncio.gather(*(one(i, r) for i, r in zip(items, replies or [None] * len(items))))

    return asyncio.run(every())


def score_final(cfg: Config, model_dir: Path, held_out_items: list[dict]) -> float:
    """Greedy accuracy of the saved weights, in fp32 whatever was trained: both sides load the same way (TRL's
    model in memory would run under the bf16 autocast accelerate wraps around its forward for training)."""
    return held_out(cfg, model_dir, held_out_items)["accuracy"]


def streamrl_run(cfg: Config, prepared: Path, runs: Path, *, steps: int, seed: int, precision: str,
                 overrides: tuple[str, ...] = (), config: str = CONFIG, name: str | None = None) -> dict:
    name = name or f"streamrl-{seed}"
    shutil.rmtree(runs / name, ignore_errors=True)
    shutil.copytree(prepared, runs / name / "prepared")
    argv = [sys.executable, "-m", "streamrl", "up", config, f"run.dir={runs}", f"run.name={name}",
            f"run.seed={seed}", f"learner.max_steps={steps}", f"eval.every={steps}",
            f"learner.export_every={steps}", f"router.port={free_port()}", f"router.prometheus_port={free_port()}",
            f"server.base_port={free_port()}", "supervise.display=plain",
            *(["model.dtype=bfloat16", "learner.mixed_precision=true"] if precision == "bf16" else []), *overrides]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}")
    path = runs / name
    trained = [r for r in read_records(path / "metrics" / "learner.jsonl") if "loss" in r]
    start = read_records(path / "metrics" / "rollout-worker-0.jsonl")[0]["time"]  # the worker begins generating
    evals = read_records(path / "metrics" / "eval.jsonl")
    samples = sum(r["groups"] for r in trained) * cfg.rollout.sampling.n
    wall = trained[-1]["time"] - start
    return {"wall_s": wall, "window": [start, trained[-1]["time"]], "samples": samples,
            "samples_per_s": samples / wall,
            "completion_tokens": sum(r["tokens_global"] for r in trained) / samples,
            "train_reward_last5": sum(r["reward_mean"] for r in trained[-5:]) / len(trained[-5:]),
            "train_rewards": [r["reward_mean"] for r in trained],
            "step_train_s": median([r["train_s"] for r in trained]),  # the learner's compute a step
            "learner_waiting": sum(r["wait_s"] for r in trained) / wall,  # its share of the clock spent on data
            "eval_online_final": evals[-1]["eval/accuracy"],
            "evals": [[e["time"] - start, e["step"], e["eval/accuracy"]] for e in evals],  # seconds, step, accuracy
            "held_out_final": score_final(cfg, path / "export" / f"version-{trained[-1]['step']}",
                                          rows(prepared / "eval.jsonl"))}
