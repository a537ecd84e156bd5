"""Learner checkpoints: DeepSpeed's (weights, optimizer, scheduler) plus what makes a resume exact.

The replay cursor, the policy version and the RNG states go in DeepSpeed's
``client_state``, written with the weights they belong to: a restarted learner has
the weights that applied exactly the groups up to the cursor, and reads on from there.
DeepSpeed writes the ``latest`` pointer only after every file of a tag is down, so a
learner killed mid-save resumes from the previous checkpoint. PPO's critic is saved under
``critic/`` with the same tag, before the policy: the policy's ``latest`` commits both.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from streamrl.weightsync import Probe

log = logging.getLogger("streamrl.learner")


def save(model: Any, root: Path, *, version: int, cursor: str, critic: Any = None, adapter_only: bool = False) -> None:
    """Collective: every rank calls it. ``critic``: PPO's value model (a DeepSpeed engine), if any.
    ``adapter_only``: a LoRA policy's frozen base is left out (it is the model directory's)."""
    tag = f"version-{version}"
    if critic is not None:
        critic.save_checkpoint(str(root / "critic"), tag=tag)
    state = {"version": version, "cursor": cursor, "torch_rng": torch.get_rng_state()}
    model.save_checkpoint(str(root), tag=tag, client_state=state, exclude_frozen_parameters=adapter_only)


@dataclasses.dataclass(frozen=True)
class Start:
    """The checkpoint a learner begins from: ``version`` under ``root``, or the newest (None)."""

    root: Path
    version: int | None = None


def versions(root: Path) -> list[int]:
    """The versions checkpointed under ``root``, oldest first."""
    return sorted(int(p.name.split("-")[1]) for p in root.glob("version-*") if p.name.split("-")[1].isdigit())


def load(model: Any, root: Path, critic: Any = None, adapter_only: bool = False,
         version: int | None = None) -> dict[str, Any] | None:
    """Restore the checkpoint of ``version`` under ``root``, or the newest (and the critic saved with it); None
    when there is none. Collective. ``adapter_only``: the checkpoint holds a LoRA policy's trained weights alone."""
    if version is None and not (root / "latest").is_file():
        return None
    tag = None if version is None else f"version-{version}"
    path, state = model.load_checkpoint(str(root), tag=tag, load_module_strict=not adapter_only)
    if path is None:
        raise RuntimeError(f"checkpoint {tag or 'latest'} under {root} could not be loaded")
    torch.set_rng_state(state["torch_rng"])
    version = int(state["version"])
    if critic is not None:
        _load_critic(critic, root / "critic", f"version-{version}")
    return {"version": version, "cursor": str(state["cursor"]), "path": path}


def _load_critic(critic: Any, root: Path, tag: str) -> None:
    if not (root / tag).is_dir():  # a run that trained without PPO until now
        log.warning("no critic checkpoint %s under %s: the critic starts from learner.critic_path", tag, root)
        return
    path, _ = critic.load_checkpoint(str(root), tag=tag)
    if path is None:
        raise RuntimeError(f"the critic's checkpoint {root / tag} could not be loaded")


def export_hf(model: Any, tokenizer_dir: str, root: Path, *, version: int, rank: int, zero_stage: int,
              lora: Any = None, base_model: str = "", check: Probe | None = None) -> Path | None:
    """Write the policy as a plain HF directory ``root/version-N`` (then point ``root/latest`` at it).

    Loadable by transformers, vLLM and SGLang; late-joining rollout servers start from it. With ``lora`` (the
    learner's LoRA settings) the directory holds the merged model, and the adapter in PEFT's format under
    ``adapter/`` (from which late joiners serve it over ``base_model``). ``check``: the version's probe, kept as
    ``probe.json`` so that a server starting from the export verifies what it loaded.
    Collective under ZeRO-3 (the shards are gathered); rank 0 writes.
    """
    import os
    import shutil

    import deepspeed
    from transformers import AutoTokenizer

    target = root / f"version-{version}"
    params = list(model.module.parameters())
    gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero_stage == 3 else _nothing()
    with gather:
        if rank != 0:
            return None
        tmp = root / f".version-{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if lora is None:
            model.module.save_pretrained(tmp, safe_serialization=True)
        else:
            from streamrl.learner import adapter

            adapter.export(model.module, lora, tmp, base_model)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
        if check is not None:
            (tmp / "probe.json").write_text(json.dumps(dataclasses.asdict(check)))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # a reader sees the whole directory or none of it
    (root / "latest.tmp").write_text(target.name)
    os.replace(root / "latest.tmp", root / "latest")
    return target


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
