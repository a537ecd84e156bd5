"""One rank of the learner study's ZeRO arm; ``benchmarks.learner`` runs it under torchrun, once per stage.

    python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.learner_zero MODEL STAGE STEPS OUT [--quick]

Every rank builds the same shards (same seeds), plans them over the world as the learner does and
trains its own micro-batches; rank 0 writes tokens/s (all ranks' tokens over rank 0's step time:
the step's all-reduce makes the ranks finish together), the optimizer state each rank holds, and the
largest peak RSS of any rank.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch


def held_bytes(engine) -> dict[str, int]:
    """Optimizer state and parameters this rank holds (ZeRO-1/2 partition the first, ZeRO-3 both)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer ZeRO wraps
    state = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
    params = sum((p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * p.element_size()
                 for p in engine.module.parameters())
    return {"optimizer_state": state, "parameters": params}


def main(model_dir: str, stage: int, steps: int, out: Path, quick: bool) -> None:
    import torch.distributed as dist

    from benchmarks.learner import ZERO_SHAPE, zero_sequences
    from streamrl.config import load_config
    from streamrl.learner.batching import Shard
    from streamrl.learner.partition import plan_micro_batches
    from streamrl.learner.policy import Policy, init_distributed
    from streamrl.learner.updates import train

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(None, [f"model.path={model_dir}", "off_policy.correction=none", "learner.lr=1e-5",
                             f"learner.zero_stage={stage}"])
    engine = Policy(cfg, model_dir)
    shape = ZERO_SHAPE["quick" if quick else "full"]
    seconds, tokens = [], []
    for r in range(steps + 1):  # the first is a warm-up
        seqs = zero_sequences(shape, engine.module.config.vocab_size, seed=100 + r)
        plan = plan_micro_batches([len(s) for s in seqs], world, shape["budget"])
        shard = [[seqs[i] for i in mb] for mb in plan.ranks[rank]]
        dist.barrier()
        t0 = time.perf_counter()
        train(engine, [Shard(shard, int(sum(s.mask.sum() for s in seqs)), 0)], epochs=1)
        if r:
            seconds.append(time.perf_counter() - t0)
            tokens.append(sum(len(s) for s in seqs))
    held = held_bytes(engine.model)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.write_text(json.dumps({"stage": stage, "world": world, "torch_threads": torch.get_num_threads(),
                                   "tokens_per_s": [t / s for t, s in zip(tokens, seconds)],
                                   "held_bytes_rank0": held, "peak_rss_bytes_max": float(rss.item())}))
    dist.barrier()


if __name__ == "__main__":
    model, stage, steps, out = sys.argv[1:5]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main(model, int(stage), int(steps), Path(out), "--quick" in sys.argv[5:])
