"""Which GPUs each part of ``streamrl up`` sees: one ``CUDA_VISIBLE_DEVICES`` per part.

The learner's ranks take the first GPUs and each ``vllm`` server one of its own after them (``hf``
servers compute on the CPU). NCCL cannot join two processes on one GPU (it reports a duplicate GPU), so
more learner ranks than GPUs are refused, and servers that must share learner rank 0's GPU receive
their weights over gloo. Under Ray each bundle gets its GPUs from Ray instead.
"""

from __future__ import annotations

import os

from streamrl.config import Config, ConfigError


def visible_gpus() -> list[str]:
    """The GPUs ``streamrl up`` hands out: ``CUDA_VISIBLE_DEVICES``'s entries where it is set, else every
    device torch sees."""
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in listed.split(",")] if listed else [str(i) for i in range(count)]
    return ids[:count]


def gpu_plan(cfg: Config, gpus: list[str]) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` by part: the learner's ranks the first ``learner.nproc`` GPUs, each ``vllm``
    server one of its own after them. Empty, so that every part sees every GPU, without GPUs, under Ray
    (which sets them per bundle) or when there are too few to go round; refused when the learner's ranks
    alone are too many (NCCL cannot put two ranks of a group on one GPU)."""
    nproc, servers = cfg.learner.nproc, _gpu_servers(cfg)
    if cfg.launcher == "ray" or not gpus:
        return {}
    if nproc > len(gpus):
        raise ConfigError(f"learner.nproc: {nproc} ranks, but {len(gpus)} GPU(s) visible, and NCCL cannot put two "
                          f"ranks of one group on one GPU: set learner.nproc <= {len(gpus)}")
    if len(gpus) < nproc + servers:
        return {}
    return {"learner": ",".join(gpus[:nproc]), **{f"server-{i}": gpus[nproc + i] for i in range(servers)}}


def share_gpus(cfg: Config, gpus: list[str], plan: dict[str, str]) -> str | None:
    """Where ``gpu_plan`` found too few GPUs for vllm servers of their own: they share learner rank 0's, and the
    push goes over gloo (NCCL cannot join two processes on one GPU). Returns what the display says, or None."""
    servers = _gpu_servers(cfg)
    if not gpus or plan or not servers or cfg.launcher == "ray":
        return None
    if cfg.weight_sync.backend == "nccl":
        raise ConfigError(f"weight_sync.backend: nccl, but the {servers} vllm server(s) share learner rank 0's GPU "
                          f"({len(gpus)} GPU(s) for {cfg.learner.nproc} rank(s) and {servers} server(s)), and NCCL "
                          "cannot join two processes on one GPU: use backend auto or gloo, or more GPUs")
    cfg.weight_sync.backend = "gloo"
    return (f"{len(gpus)} GPU(s) for {cfg.learner.nproc} learner rank(s) and {servers} vllm server(s): the servers "
            "share the first GPU with learner rank 0, weights go over gloo; set server.gpu_memory_utilization (e.g. "
            "0.5) to leave the learner room")


def _gpu_servers(cfg: Config) -> int:
    """Servers that compute on a GPU: vllm ones (hf servers keep to the CPU)."""
    return cfg.server.count if cfg.server.engine == "vllm" else 0
