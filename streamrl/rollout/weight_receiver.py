"""The ``hf`` engine's end of the weight push: the server process joins the learner's group, receives
each bucket and hands the tensors to the engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

from safetensors.torch import load_file

from streamrl.rollout.engines.base import Engine
from streamrl.weightsync import Staging, TensorMeta, broadcast, make_group, unpack


class HostReceiver:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.group = None
        self.staging = Staging(depth=2)  # the engine may adopt a received bucket as its weights (no copy)

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
        buffer = self.staging.take(tuple(names), sum(m.nbytes for m in bucket))
        await asyncio.to_thread(broadcast, self.group, buffer)
        await self.engine.update_weights(unpack(buffer, bucket), version)
        return len(bucket)

    async def load_from_disk(self, path: str, version: int) -> int:
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {path!r}")
        tensors = [item for f in files for item in load_file(f).items()]
        await self.engine.update_weights(tensors, version)
        return len(tensors)

    def destroy(self) -> None:
        self.group = None
