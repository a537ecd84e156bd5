"""The ``hf`` engine's end of the weight push: the server process joins the learner's group, receives
each bucket, and hands the engine a version's tensors once all of them have come, to swap in at once
between two decode steps (no decode step runs on a mix of two versions, and a push waits for the engine
once, not once per bucket)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from streamrl.rollout.engines.base import Engine
from streamrl.weightsync import Staging, TensorMeta, broadcast, make_group, unpack

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """The tensors of one version received so far, and the staging buffers they sit in."""

    version: int
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    keys: list[tuple[str, ...]] = field(default_factory=list)


class HostReceiver:
    def __init__(self, engine: Engine, model: torch.nn.Module):
        self.engine = engine
        self.group = None
        self.staging = Staging(depth=2)  # the engine may adopt a received bucket as its weights (no copy)
        # tied weights answer to every name they have; a version is whole once each parameter came once
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        self.required = {n for n, _ in model.named_parameters()}
        self.pending: _Pending | None = None  # the version being received, until whole

    async def init(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                   group_name: str, timeout_s: float) -> None:
        # make_group blocks until the learner has joined too: keep the event loop free meanwhile
        self.staging = Staging("cuda" if backend == "nccl" else "cpu", depth=2)
        self.group = await asyncio.to_thread(make_group, master_address, master_port, rank, world_size,
                                             backend=backend, group_name=group_name, timeout_s=timeout_s)

    async def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int) -> int:
        if self.group is None:
            raise RuntimeError("no weight update group: call /init_weights_update_group first")
        bucket = [TensorMeta(n, d.removeprefix("torch."), tuple(s)) for n, d, s in zip(names, dtypes, shapes)]
        key = tuple(names)
        buffer = self.staging.take(key, sum(m.nbytes for m in bucket))
        await asyncio.to_thread(broadcast, self.group, buffer)  # taken even when refused: the learner is sending
        if self.pending is not None and self.pending.version != version:
            log.warning("push of version %d stopped half way; dropped", self.pending.version)
            self._drop()
        try:
            self._check(bucket)
        except (KeyError, ValueError):
            self.staging.untake(key)
            raise
        push = self.pending = self.pending or _Pending(version)
        push.keys.append(key)
        push.tensors += unpack(buffer, bucket)
        # whole: every parameter came; or tensors after a whole push (a state dict's tied head)
        if {n for n, _ in push.tensors} >= self.required or version == self.engine.version:
            self.pending = None
            await self.engine.update_weights(push.tensors, version)
        return len(bucket)

    def _drop(self) -> None:
        for key in self.pending.keys:
            self.staging.untake(key)
        self.pending = None

    def _check(self, bucket: list[TensorMeta]) -> None:
        for m in bucket:
            if m.name not in self.shapes:
                raise KeyError(f"the served model has no parameter {m.name!r}")
            if m.shape != self.shapes[m.name]:
                raise ValueError(f"{m.name!r} has shape {list(self.shapes[m.name])} here, not {list(m.shape)}")

    async def load_from_disk(self, path: str, version: int) -> int:
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {path!r}")
        tensors = [item for f in files for item in load_file(f).items()]
        await self.engine.update_weights(tensors, version)
        return len(tensors)

    def destroy(self) -> None:
        self.group = None
