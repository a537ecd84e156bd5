"""Learner throughput: streamrl's DeepSpeed step against a plain PyTorch loop, same model, same batch.

Both sides run the same micro-batches (Karmarkar–Karp under the same token budget),
the same forward, fp32 logprobs and clipped loss, backward and AdamW step; the
difference is streamrl's framework (DeepSpeed engine, boundaries, statistics,
non-finite guard). streamrl runs twice: with ``learner.share_prompts=false`` (the same forward as
the plain loop: the framework's cost alone) and by default (each group's prompt forwarded once per
micro-batch). One process (a world of one, gloo), sides rotated per repeat.

    python -m benchmarks.learner [--quick]      (or: streamrl bench learner)
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import cli, console, median, new_figure, print_table, save_figure, write_json
from streamrl.learner import batch as batching
from streamrl.learner.engine import token_logprobs
from streamrl.learner.losses import PolicyLoss
from streamrl.learner.partition import plan_micro_batches
from streamrl.testing import make_tiny_model, synthetic_group

MODEL = {"hidden": 512, "layers": 8}


def make_shard(groups: int, max_len: int, vocab: int, budget: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    made = [synthetic_group(4, int(np.clip(rng.lognormal(np.log(max_len / 4), 0.7), 32, max_len)), prompt_len=24,
                            vocab=vocab, rng=rng) for _ in range(groups)]
    seqs = batching.sequences(made, version=0, algorithm="rloo")
    plan = plan_micro_batches([len(s) for s in seqs], 1, budget)
    return [[seqs[i] for i in mb] for mb in plan.ranks[0]], int(sum(s.mask.sum() for s in seqs))


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
    import deepspeed
    from transformers import AutoModelForCausalLM

    from streamrl.buffer.redis_server import free_port
    from streamrl.config import load_config
    from streamrl.learner.engine import PolicyEngine

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
    deepspeed.init_distributed(dist_backend="gloo")
    repeats = 3 if quick else 7
    groups, max_len, budget = (4, 256, 1024) if quick else (8, 512, 2048)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", **MODEL)
        base = [f"model.path={model_dir}", "off_policy.correction=none", "learner.lr=1e-5"]
        ours = {"streamrl": PolicyEngine(load_config(None, base), model_dir),
                "streamrl-unshared": PolicyEngine(load_config(None, [*base, "learner.share_prompts=false"]), model_dir)}
        plain = AutoModelForCausalLM.from_pretrained(model_dir).train()
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-5)
        loss_fn = PolicyLoss(correction="none")
        vocab = plain.config.vocab_size
        shard, n = make_shard(groups, max_len, vocab, budget)
        plain_step(plain, optimizer, shard, n, loss_fn)  # warm-up every side
        for engine in ours.values():
            engine.step(shard, n)
        sides = ["plain", *ours]
        samples = {side: [] for side in sides}
        for r in range(repeats):
            shard, n = make_shard(groups, max_len, vocab, budget, seed=r + 1)
            for side in sides[r % 3:] + sides[: r % 3]:
                t0 = time.perf_counter()
                if side == "plain":
                    plain_step(plain, optimizer, shard, n, loss_fn)
                else:
                    ours[side].step(shard, n)
                samples[side].append(sum(len(s) for mb in shard for s in mb) / (time.perf_counter() - t0))
            console.log(f"repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in samples.items()))
    med = {k: median(v) for k, v in samples.items()}
    return {"study": "learner", "repeats": repeats, "model": MODEL, "groups": groups, "samples_per_group": 4,
            "max_len": max_len, "micro_batch_tokens": budget, "torch_threads": torch.get_num_threads(),
            "tokens_per_s": samples, "median": med, "ratio": med["streamrl"] / med["plain"],
            "unshared_ratio": med["streamrl-unshared"] / med["plain"]}


def report(data: dict, out: Path) -> None:
    print_table(f"Learner step tokens/s (fwd+bwd+AdamW), medians of {data['repeats']}",
                ["side", "tokens/s", "vs plain"],
                [["plain PyTorch loop", data["median"]["plain"], 1.0],
                 ["streamrl, share_prompts=false", data["median"]["streamrl-unshared"], data["unshared_ratio"]],
                 ["streamrl (default: shared prompts)", data["median"]["streamrl"], data["ratio"]]])
    json_path = write_json(out, "learner", data)
    fig, (ax,) = new_figure(1, "Learner throughput, same model and micro-batches")
    ax.boxplot([data["tokens_per_s"]["plain"], data["tokens_per_s"]["streamrl-unshared"],
                data["tokens_per_s"]["streamrl"]])
    ax.set_xticks([1, 2, 3], ["plain PyTorch", "streamrl, unshared", "streamrl"])
    ax.set_ylabel("tokens/s")
    save_figure(fig, out, "learner", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results")) -> dict:
    data = run(quick)
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
