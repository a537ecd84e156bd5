"""streamrl's weight-transfer engine for vLLM: the learner's bucketed broadcast, received by vLLM's workers.

vLLM runs weight updates through a pluggable lifecycle (``vllm.distributed.weight_transfer``):
``init_weight_transfer_engine`` → per push ``start_weight_update`` → ``update_weights`` per bucket →
``finish_weight_update``. This module is the worker end of that lifecycle for streamrl's push: each
worker joins the learner's process group (``weightsync.make_group``: gloo on CPU, NCCL on GPU, one code
path) and receives every bucket straight into its device memory, in the layout the learner packs.

A push is applied whole or not at all. Buckets are kept as they arrive while the engine goes on
generating; ``finish_weight_update`` loads them all at once through vLLM's layerwise reload, which
re-processes the checkpoint-format tensors into the backend's layout (oneDNN-packed linears on CPU,
fused or quantised ones on GPU). A push that stops half way is dropped (``discard``) and the old
weights stay. The checkpoint-format tensors of the push loaded before the last one are kept: a push whose
probe fails is undone by loading them again (``restore``; before any push, the model's own files). The cost
is two copies of the weights on the device beside the served ones. A checkpoint directory
(``/update_weights_from_disk``) takes the same path.

Registered under the name ``streamrl`` by the ``vllm.general_plugins`` entry point (``register``), which
vLLM loads in every process it starts.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from streamrl.weightsync import CorruptBucket, Staging, TensorMeta, broadcast, check_digest, make_group, unflatten

BACKEND = "streamrl"  # the name in vLLM's WeightTransferEngineFactory


def register() -> None:
    """The ``vllm.general_plugins`` entry point, run in every process vLLM starts: make
    ``weight_transfer_config={"backend": "streamrl"}`` work, and tie vLLM's processes to their parents."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # vLLM loads plugins once per process, but be safe
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "BroadcastTransferEngine")
    if (parent := multiprocessing.parent_process()) is not None:
        killed_with_parent(parent.pid)


def killed_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent (pid ``parent``) dies (Linux).

    vLLM's engine core and workers otherwise outlive a rollout server that was SIGKILLed (by the OOM killer,
    say), holding the KV cache's memory. SIGKILL, not vLLM's graceful SIGTERM: with the server gone there is
    nothing to drain, and the graceful path waits out whatever the engine is in, a weight bucket's broadcast
    for as long as the push's timeout among them.
    """
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the call: this process was handed to another
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class GroupInfo(WeightTransferInitInfo):
    """The learner's group, as ``/init_weights_update_group`` gives it."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    group_name: str = "weight_update_group"
    timeout_s: float = 60.0


@dataclass
class BucketInfo(WeightTransferUpdateInfo):
    """One bucket of a push; ``discard`` receives it (the learner is sending it) and drops the whole push.

    With ``path`` the tensors come from a checkpoint directory's safetensors files instead.
    """

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    discard: bool = False
    path: str | None = None
    digest: str | None = None  # the bucket's xxh3-128, as the learner hashed it
    restore: bool = False  # load the weights served before the last push again


@dataclass
class Loaded:
    """A push's checkpoint-format tensors (views into staging buffers) and the buffers' keys."""

    tensors: list[tuple[str, torch.Tensor]]
    keys: list[tuple[str, ...]]


class BroadcastTransferEngine(WeightTransferEngine[GroupInfo, BucketInfo]):
    init_info_cls = GroupInfo
    update_info_cls = BucketInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.group = None
        self.received: list[tuple[str, torch.Tensor]] = []
        # two buffers per bucket layout, in turn: the last push loaded, and the one before it (for a restore)
        self.staging = Staging(str(self.device), depth=2)
        self.taken: list[tuple[str, ...]] = []  # the buffers of the push being received
        self.loaded = Loaded([], [])  # the push loaded last
        self.before: Loaded | None = None  # the one before it (None: the model's own files)
        self.restoring = False
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="digest")
        self.checks: list[Future] = []  # the digest checks of the push being received

    def init_transfer_engine(self, init_info: GroupInfo) -> None:
        parallel = self.parallel_config  # one rank per worker of every data-parallel replica, after the learner
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        if rank >= init_info.world_size:
            raise ValueError(f"worker rank {rank} does not fit a group of world_size {init_info.world_size}")
        self.group = make_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                backend=init_info.backend, group_name=init_info.group_name,
                                timeout_s=init_info.timeout_s)

    def start_weight_update(self) -> None:
        self.received, self.taken, self.checks, self.restoring = [], [], [], False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class also syncs torch.accelerator, which raises on a machine without one
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: BucketInfo) -> None:
        if update_info.restore:
            self.received, self.restoring = self._before(), True
            return
        if update_info.path is not None:
            for file in sorted(Path(update_info.path).glob("*.safetensors")):
                self.received += load_file(file, device=str(self.device)).items()
            return
        if self.group is None:
            raise RuntimeError("no weight update group: init_weight_transfer_engine first")
        bucket = [TensorMeta(n, d.removeprefix("torch."), tuple(s))
                  for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True)]
        key = tuple(update_info.names)
        buffer = self.staging.take(key, sum(m.nbytes for m in bucket))
        self.taken.append(key)
        if bucket:  # an empty bucket only drops the push: the learner is sending nothing
            broadcast(self.group, buffer)
        if update_info.discard:
            self._forget()
            return
        if update_info.digest is not None:  # hashed while the next bucket arrives; checked before the push loads
            self.checks.append(self.hasher.submit(check_digest, buffer, update_info.digest, update_info.names))
        self._intact(wait=False)
        self.received += unflatten(buffer, bucket)

    def _intact(self, wait: bool) -> None:
        """Raise ``CorruptBucket`` (and drop the push: the weights served stay) once a bucket's digest check
        failed: at once when one has, and with ``wait`` after every check finished."""
        try:
            for check in self.checks:
                if wait or check.done():
                    check.result()
        except CorruptBucket:
            self._forget()
            raise

    def _forget(self) -> None:
        """Drop the push being received; its buffers are taken again next (not those kept for a restore)."""
        for key in reversed(self.taken):
            self.staging.untake(key)
        self.received, self.taken, self.checks = [], [], []

    def _before(self) -> list[tuple[str, torch.Tensor]]:
        """The weights served before the last push: kept in their buffers, or before any push the model's files."""
        if self.before is not None:
            return self.before.tensors
        files = sorted(Path(self.model_config.model).glob("*.safetensors"))
        return [item for file in files for item in load_file(file, device=str(self.device)).items()]

    def finish_weight_update(self) -> None:
        """Load the whole push (nothing when it was discarded) and re-process it into the backend's layout."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        self._intact(wait=True)
        received, self.received, self.checks = self.received, [], []
        if not received:
            return
        if self.restoring:  # the undone push's buffers are taken next; the restored ones are the last loaded
            for key in reversed(self.loaded.keys):
                self.staging.untake(key)
            self.loaded, self.before = self.before or Loaded([], []), None
        else:
            self.before, self.loaded = self.loaded if self.loaded.tensors else None, Loaded(received, self.taken)
        self.taken = []
        initialize_layerwise_reload(self.model)
        self.model.load_weights(received)
        finalize_layerwise_reload(self.model, self.model_config)
        reprocess_tied(self.model)

    def shutdown(self) -> None:
        self.group = None
        self.received, self.taken = [], []
        self.staging = Staging(str(self.device), depth=2)
        self.loaded, self.before = Loaded([], []), None


def reprocess_tied(model: torch.nn.Module) -> None:
    """Process a tied parameter again for every layer that shares it.

    vLLM's layerwise reload processes a tied parameter for the first layer holding it only; on CPU the tied
    head's logits GEMM keeps a packed copy of the old embeddings unless its own processing runs again.
    """
    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
    for modules in holders.values():
        for module in modules[1:]:
            if (method := getattr(module, "quant_method", None)) is not None:
                if hasattr(module, "_already_called_process_weights_after_loading"):
                    delattr(module, "_already_called_process_weights_after_loading")
                method.process_weights_after_loading(module)
