"""Learner throughput: streamrl's DeepSpeed step against a plain PyTorch loop, same model, same batch;
padding waste of the micro-batch plan; ZeRO stages on two ranks.

Both sides run the same micro-batches (streamrl's plan under the same token budget), the same
forward, fp32 logprobs and clipped loss, backward and AdamW step; the difference is streamrl's
framework (DeepSpeed engine, boundaries, statistics, non-finite guard). streamrl runs three times:
with ``learner.share_prompts=false`` (the same forward as the plain loop: the framework's cost
alone), by default (each group's prompt forwarded once per micro-batch), and by default on the
micro-batches of Karmarkar–Karp over the whole batch (streamrl's plan before length bands: the cost
of padding). One process (a world of one, gloo), sides rotated per repeat.

Padding: tokens a plan's right-padded micro-batches compute per real token — length bands, KK over
the whole batch and equal-count splits in arrival order, each with the same number of
micro-batches — and with shared prompts on the banded plan.

ZeRO: stages 0, 2 and 3 under ``torchrun --nproc_per_node 2`` (``benchmarks.learner_zero``): tokens/s
over both ranks, the optimizer state and parameters rank 0 holds, and the peak RSS of a rank.

    python -m benchmarks.learner [--quick]      (or: streamrl bench learner)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import cli, console, median, new_figure, print_table, save_figure, write_json
from streamrl.learner import batch as batching
from streamrl.learner import prefix
from streamrl.learner.engine import token_logprobs
from streamrl.learner.losses import PolicyLoss
from streamrl.learner.partition import karmarkar_karp, plan_micro_batches
from streamrl.testing import make_tiny_model, synthetic_group

MODEL = {"hidden": 512, "layers": 8}
# groups of 4 samples, 24-token prompts, long-tailed lengths up to max_len; budget: padded tokens per micro-batch
SHARD = {"quick": {"groups": 4, "max_len": 256, "budget": 1024}, "full": {"groups": 8, "max_len": 512, "budget": 2048}}
ZERO_STAGES = (0, 2, 3)


def make_sequences(shape: dict, vocab: int, seed: int) -> list[batching.TrainSequence]:
    rng = np.random.default_rng(seed)
    made = [synthetic_group(4, int(np.clip(rng.lognormal(np.log(shape["max_len"] / 4), 0.7), 32, shape["max_len"])),
                            prompt_len=24, vocab=vocab, rng=rng) for _ in range(shape["groups"])]
    return batching.sequences(made, version=0, algorithm="rloo")


def plans(seqs: list[batching.TrainSequence], budget: int) -> dict[str, list[list[int]]]:
    """One rank's micro-batches (sequence indices) by each plan, all with the banded plan's count."""
    lengths = [len(s) for s in seqs]
    banded = plan_micro_batches(lengths, 1, budget).ranks[0]
    k = len(banded)
    return {"length bands (streamrl)": banded, "KK, whole batch": karmarkar_karp(lengths, k),
            "equal count, arrival order": [list(range(i, len(seqs), k)) for i in range(k)]}


def padded_tokens(seqs: list[batching.TrainSequence], mb: list[int], shared: bool = False) -> int:
    """Token slots a right-padded micro-batch computes (with shared prompts: prompts once, then continuations)."""
    if shared and (layout := prefix.layout([seqs[i] for i in mb])) is not None:
        return layout["prompt_ids"].numel() + layout["rest_ids"].numel()
    return len(mb) * max(len(seqs[i]) for i in mb) if mb else 0


def padding(seqs: list[batching.TrainSequence], by_plan: dict[str, list[list[int]]]) -> dict[str, float]:
    real = sum(len(s) for s in seqs)
    out = {name: sum(padded_tokens(seqs, mb) for mb in mbs) / real for name, mbs in by_plan.items()}
    banded = by_plan["length bands (streamrl)"]
    out["length bands, shared prompts"] = sum(padded_tokens(seqs, mb, shared=True) for mb in banded) / real
    return out


def plain_step(model, optimizer, shard, global_tokens, loss_fn) -> None:
    for mb in shard:
        b = batching.collate(mb)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        logp = token_logprobs(logits, b["input_ids"], 1.0)
        per_token, _ = loss_fn(logp, b["logprobs"], None, b["advantages"], b["mask"])
        (per_token.sum() / global_tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def run(quick: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from streamrl.buffer.redis_server import free_port
    from streamrl.config import load_config
    from streamrl.learner.engine import PolicyEngine, init_distributed

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
    init_distributed()
    repeats = 3 if quick else 7
    shape = SHARD["quick" if quick else "full"]
    budget = shape["budget"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", **MODEL)
        base = [f"model.path={model_dir}", "off_policy.correction=none", "learner.lr=1e-5"]
        ours = {"streamrl": PolicyEngine(load_config(None, base), model_dir),
                "streamrl-unshared": PolicyEngine(load_config(None, [*base, "learner.share_prompts=false"]), model_dir)}
        plain = AutoModelForCausalLM.from_pretrained(model_dir).train()
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-5)
        loss_fn = PolicyLoss(correction="none")
        vocab = plain.config.vocab_size

        def shards(seed: int):
            seqs = make_sequences(shape, vocab, seed)
            indices = plans(seqs, budget)
            by_plan = {name: [[seqs[i] for i in mb] for mb in mbs] for name, mbs in indices.items()}
            return seqs, indices, by_plan, int(sum(s.mask.sum() for s in seqs))

        _, _, by_plan, n = shards(0)
        plain_step(plain, optimizer, by_plan["length bands (streamrl)"], n, loss_fn)  # warm-up every side
        for engine in ours.values():
            engine.step(by_plan["length bands (streamrl)"], n)
        sides = ["plain", *ours, "streamrl-whole-kk"]
        samples = {side: [] for side in sides}
        waste = []
        for r in range(repeats):
            seqs, indices, by_plan, n = shards(r + 1)
            waste.append(padding(seqs, indices))
            for side in sides[r % len(sides):] + sides[: r % len(sides)]:
                shard = by_plan["KK, whole batch" if side == "streamrl-whole-kk" else "length bands (streamrl)"]
                t0 = time.perf_counter()
                if side == "plain":
                    plain_step(plain, optimizer, shard, n, loss_fn)
                else:
                    ours["streamrl" if side == "streamrl-whole-kk" else side].step(shard, n)
                samples[side].append(sum(len(s) for s in seqs) / (time.perf_counter() - t0))
            console.log(f"repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in samples.items()))
        zero = {stage: zero_stage(model_dir, stage, steps=2 if quick else 4, quick=quick) for stage in ZERO_STAGES}
    med = {k: median(v) for k, v in samples.items()}
    return {"study": "learner", "repeats": repeats, "model": MODEL, "samples_per_group": 4, **shape,
            "micro_batch_tokens": budget, "torch_threads": torch.get_num_threads(),
            "tokens_per_s": samples, "median": med, "ratio": med["streamrl"] / med["plain"],
            "unshared_ratio": med["streamrl-unshared"] / med["plain"],
            "bands_vs_whole_kk": med["streamrl"] / med["streamrl-whole-kk"],
            "padding": {name: median([w[name] for w in waste]) for name in waste[0]}, "zero": zero}


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
    m = data["median"]
    print_table(f"Learner step tokens/s (fwd+bwd+AdamW), medians of {data['repeats']}",
                ["side", "tokens/s", "vs plain"],
                [["plain PyTorch loop", m["plain"], 1.0],
                 ["streamrl, share_prompts=false", m["streamrl-unshared"], data["unshared_ratio"]],
                 ["streamrl (default: shared prompts)", m["streamrl"], data["ratio"]],
                 ["streamrl on KK micro-batches of the whole batch", m["streamrl-whole-kk"],
                  m["streamrl-whole-kk"] / m["plain"]]])
    print_table(f"Padding: tokens computed per real token (micro-batches of ≤ {data['micro_batch_tokens']} padded "
                f"tokens; medians of {data['repeats']} batches)", ["plan", "computed / real"],
                [[name, v] for name, v in data["padding"].items()])
    zero = data["zero"]
    print_table("ZeRO stages, 2 ranks × 1 thread (gloo)",
                ["stage", "tokens/s", "optimizer state, rank 0 (MB)", "parameters, rank 0 (MB)", "peak RSS (MB)"],
                [[f"ZeRO-{s}", median(z["tokens_per_s"]), z["held_bytes_rank0"]["optimizer_state"] / 2**20,
                  z["held_bytes_rank0"]["parameters"] / 2**20, z["peak_rss_bytes_max"] / 2**20]
                 for s, z in zero.items()])
    json_path = write_json(out, "learner", data)
    fig, (ax1, ax2) = new_figure(2, "Learner throughput, same model and batches")
    sides = {"plain": "plain PyTorch", "streamrl-unshared": "streamrl,\nunshared", "streamrl": "streamrl",
             "streamrl-whole-kk": "streamrl,\nwhole-batch KK"}
    ax1.boxplot([data["tokens_per_s"][k] for k in sides])
    ax1.set_xticks(range(1, len(sides) + 1), list(sides.values()), fontsize=8)
    ax1.set_ylabel("tokens/s (one process)")
    ax2.bar([f"ZeRO-{s}" for s in zero], [median(z["tokens_per_s"]) for z in zero.values()])
    ax2.set_ylabel("tokens/s (2 ranks)")
    save_figure(fig, out, "learner", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results")) -> dict:
    data = run(quick)
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
