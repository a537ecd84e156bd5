"""The ``hf`` engine's end of the weight push: the server process joins the learner's group, receives
each bucket, and hands the engine a version's tensors once all of them have come, to swap in at once
between two decode steps (no decode step runs on a mix of two versions, and a push waits for the engine
once, not once per bucket). With a ``Probe`` (it comes with a push's last bucket) the engine scores it on the
new weights before serving them, and puts the old ones back when it fails. A LoRA server's end
(``AdapterReceiver``) takes adapters instead of weights."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from streamrl import adapters
from streamrl.adapters import AdapterSpec
from streamrl.inference.engines.base import Engine
from streamrl.weightsync import (
    CorruptBucket,
    Probe,
    Staging,
    TensorMeta,
    broadcast,
    check_digest,
    make_group,
    unflatten,
)

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """The tensors of one version received so far, and the staging buffers they sit in."""

    version: int
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    keys: list[tuple[str, ...]] = field(default_factory=list)
    checks: list[Future] = field(default_factory=list)  # each bucket's digest check, run while the next arrives


class HostReceiver:
    def __init__(self, engine: Engine, model: torch.nn.Module):
        self.engine = engine
        self.group = None
        self.staging = Staging(depth=2)  # the engine may adopt a received bucket as its weights (no copy)
        # tied weights answer to every name they have; a version is whole once each parameter came once
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        self.required = {n for n, _ in model.named_parameters()}
        self.pending: _Pending | None = None  # the version being received, until whole
        self.probe_gap: float | None = None  # the gap of the last probe that passed
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="digest")

    async def init(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                   group_name: str, timeout_s: float) -> None:
        if self.pending is not None:  # the learner that sent it is gone: its buffers go back to the staging they came from
            log.warning("push of version %d stopped half way by a new weight update group; dropped", self.pending.version)
            self._drop()
        # make_group blocks until the learner has joined too: keep the event loop free meanwhile
        self.staging = Staging("cuda" if backend == "nccl" else "cpu", depth=2)
        self.group = await asyncio.to_thread(make_group, master_address, master_port, rank, world_size,
                                             backend=backend, group_name=group_name, timeout_s=timeout_s)

    async def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int,
                      lora: AdapterSpec | None = None, digest: str | None = None, probe: Probe | None = None) -> int:
        bucket, key, buffer = await self._take(names, dtypes, shapes, version, digest)
        try:
            if lora is not None:
                raise ValueError("this server was started without LoRA support (learner.lora is not set in its "
                                 "config): it takes whole weights; restart it with the learner's config")
            self._check(bucket)
        except (KeyError, ValueError):
            self.staging.untake(key)
            raise
        push = self.pending
        push.keys.append(key)
        push.tensors += unflatten(buffer, bucket)
        # whole: every parameter came; or tensors after a whole push (a state dict's tied head). A push of the
        # served version that brings parameters (a learner resumed from an older checkpoint pushes it again) is a
        # push like any other: whole, then proven, never swapped in a bucket at a time
        came = {n for n, _ in push.tensors}
        whole = came >= self.required or (version == self.engine.version and not came & self.required)
        if probe is not None and not whole:
            self._drop()
            raise ValueError(f"a probe came before version {version} was whole: it belongs to a push's last bucket")
        await self._intact(push, whole)
        if whole:
            self.pending = None
            try:
                self.probe_gap = await self.engine.update_weights(push.tensors, version, probe)
            except Exception:  # refused, or failed its probe: the old weights serve from their buffers, kept
                self.pending = push
                self._drop()
                raise
        return len(bucket)

    async def _take(self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int,
                    digest: str | None) -> tuple[list[TensorMeta], tuple[str, ...], torch.Tensor]:
        """Receive the bucket the learner is broadcasting (even one about to be refused: the learner is sending),
        dropping a push of another version left half way, and the push itself if the bucket arrived corrupted."""
        if self.group is None:
            raise RuntimeError("no weight update group: call /init_weights_update_group first")
        bucket = [TensorMeta(n, d.removeprefix("torch."), tuple(s)) for n, d, s in zip(names, dtypes, shapes)]
        key = tuple(names)
        if self.pending is not None and (self.pending.version != version or key in self.pending.keys):
            # another version, or this one sent again from its start: dropped before the take, so that its
            # buffers go back first, or this take would be handed the buffer the engine serves from (each key's
            # two buffers alternate) and overwrite live weights while it decodes
            log.warning("push of version %d stopped half way; dropped", self.pending.version)
            self._drop()
        buffer = self.staging.take(key, sum(m.nbytes for m in bucket))
        await asyncio.to_thread(broadcast, self.group, buffer)
        push = self.pending = self.pending or _Pending(version)
        if digest is not None:  # hashed while the next bucket arrives; the push waits for it before it applies
            push.checks.append(self.hasher.submit(check_digest, buffer, digest, names, version))
        return bucket, key, buffer

    async def _intact(self, push: _Pending, whole: bool) -> None:
        """Raise ``CorruptBucket`` (dropping the push) once a bucket's digest check failed: at once when one has,
        and, when ``whole``, after waiting for every check (no version is applied before)."""
        try:
            for check in push.checks:
                if whole or check.done():
                    await asyncio.wrap_future(check)
        except CorruptBucket as e:
            self.pending = push
            self._drop()
            log.error("%s: version %d dropped, version %d keeps serving", e, push.version, self.engine.version)
            raise

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
        if adapters.is_adapter(path):
            raise ValueError(f"{path} is a LoRA adapter, and this server was started without LoRA support "
                             "(learner.lora is not set in its config)")
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {path!r}")
        tensors = [item for f in files for item in load_file(f).items()]
        await self.engine.update_weights(tensors, version)
        return len(tensors)

    def destroy(self) -> None:
        self.group = None


class AdapterReceiver(HostReceiver):
    """The push into a LoRA server: each version is a whole adapter. Every bucket is checked against the served
    model before it is kept, and the engine gets the adapter once all of its tensors came (nothing half-loaded)."""

    def __init__(self, engine: Engine, linears: dict[str, tuple[int, int]], max_rank: int):
        self.engine, self.linears, self.max_rank = engine, linears, max_rank
        self.group = None
        self.staging = Staging()
        self.pending: _Pending | None = None
        self.probe_gap: float | None = None
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="digest")

    async def init(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                   group_name: str, timeout_s: float) -> None:
        if backend != "gloo":
            raise ValueError("a LoRA server takes adapters over gloo (weight_sync.backend auto or gloo)")
        await super().init(master_address, master_port, rank, world_size, backend, group_name, timeout_s)

    async def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int,
                      lora: AdapterSpec | None = None, digest: str | None = None, probe: Probe | None = None) -> int:
        bucket, _, buffer = await self._take(names, dtypes, shapes, version, digest)
        if lora is None:
            raise ValueError("this server serves LoRA adapters (learner.lora is set in its config) and takes adapter "
                             "pushes only; restart it without learner.lora to take whole weights")
        try:
            adapters.check(names, shapes, lora, self.linears, self.max_rank)
        except ValueError:
            self.pending = None
            raise
        push = self.pending
        push.tensors += unflatten(buffer, bucket)  # views: the engine is done with them when load_adapter returns
        whole = len(push.tensors) >= lora.tensors
        if probe is not None and not whole:
            self.pending = None
            raise ValueError(f"a probe came before version {version} was whole: it belongs to a push's last bucket")
        await self._intact(push, whole)
        if whole:
            self.pending = None
            self.probe_gap = await self.engine.load_adapter(push.tensors, lora, version, probe)
        return len(names)

    def _drop(self) -> None:
        self.pending = None

    async def load_from_disk(self, path: str, version: int) -> int:
        tensors, spec = adapters.load(path, self.engine.adapter_name)
        adapters.check([n for n, _ in tensors], [list(t.shape) for _, t in tensors], spec, self.linears, self.max_rank)
        await self.engine.load_adapter(tensors, spec, version)
        return len(tensors)
