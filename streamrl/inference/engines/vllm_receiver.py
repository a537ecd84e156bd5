"""The server's end of the learner's weight push for a ``vllm`` engine: what a push may and must bring, and
the steering of vLLM's weight-transfer lifecycle (its workers receive; see ``vllm_transfer``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from streamrl.weightsync import CorruptBucket

if TYPE_CHECKING:
    from streamrl.adapters import AdapterSpec
    from streamrl.weightsync import Probe

log = logging.getLogger(__name__)


def model_tensors(model_path: str) -> tuple[dict[str, tuple[str, tuple[int, ...]]], set[str]]:
    """What a push may bring (``name -> (dtype, shape)``: the model's state dict and its checkpoint's
    tensors) and what it must bring before it is applied (the parameters, a tied head once: what the
    learner sends)."""
    model = meta_model(model_path)
    known = {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in model.state_dict().items()}
    return {**checkpoint_metas(model_path), **known}, {name for name, _ in model.named_parameters()}


def meta_model(model_path: str) -> Any:
    """The model's modules without their weights (on the meta device): names and shapes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))


def checkpoint_metas(model_path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``name -> (dtype, shape)`` of every tensor in a model directory's safetensors files."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_path!r}")
    metas = {}
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                sliced = f.get_slice(name)
                metas[name] = (sliced.get_dtype(), tuple(sliced.get_shape()))
    return metas


FLOAT_DTYPES = {"float32", "bfloat16", "float16", "F32", "BF16", "F16"}


def check_tensors(expected: dict[str, tuple[str, tuple[int, ...]]], names: list[str], dtypes: list[str],
                  shapes: list[list[int]]) -> None:
    """Refuse tensors the served model does not have, or has in another shape, or that are no floats."""
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if name not in expected:
            raise ValueError(f"the served model has no tensor {name!r}")
        if tuple(shape) != expected[name][1]:
            raise ValueError(f"{name!r} has shape {list(expected[name][1])} here, not {list(shape)}")
        if dtype.removeprefix("torch.") not in FLOAT_DTYPES:
            raise ValueError(f"{name!r} must be a floating-point tensor, not {dtype}")


def _corrupted(error: Exception, version: int, serving: int) -> None:
    """Raise the worker's ``CorruptBucket``, as vLLM passes it on, as one; anything else goes on as it is."""
    if "arrived corrupted" in str(error) and not isinstance(error, CorruptBucket):
        log.error("%s: version %d dropped, version %d keeps serving", error, version, serving)
        raise CorruptBucket(str(error)) from None


class _Push:
    """The tensors of one version received so far."""

    def __init__(self, version: int):
        self.version = version
        self.names: set[str] = set()


class Steered(Protocol):
    """What the receiver steers: a vLLM engine (``VLLMEngine``), its weights changed one change at a time."""

    version: int
    vllm: Any  # the vLLM names the engine imported
    swap_lock: asyncio.Lock

    @property
    def llm(self) -> Any: ...

    async def on_loop(self, coro: Coroutine) -> Any:
        """Await ``coro`` on the engine's own loop."""

    async def swap(self, apply: Coroutine, version: int) -> None:
        """Run ``apply`` (it changes the weights) with generation frozen, then serve ``version``."""

    async def commit(self, apply: Coroutine, version: int, probe: Probe | None,
                     restore: Callable[[], Coroutine]) -> float | None:
        """``swap``, then prove ``version`` with ``probe``, running ``restore()`` in its place if it fails."""


class VLLMReceiver:
    """The server's end of the weight push for a vLLM engine: vLLM's workers receive, the server steers. It
    holds the push being received; ``expected``/``required``: what a push may and must bring (``model_tensors``)."""

    def __init__(self, engine: Steered, expected: dict[str, tuple[str, tuple[int, ...]]], required: set[str]):
        self.engine, self.expected, self.required = engine, expected, required
        self.push: _Push | None = None
        self.joined = False
        self.probe_gap: float | None = None

    async def init(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                   group_name: str, timeout_s: float) -> None:
        info = {"master_address": master_address, "master_port": master_port, "rank_offset": rank,
                "world_size": world_size, "backend": backend, "group_name": group_name, "timeout_s": timeout_s}
        llm = self.engine.llm
        await self.engine.on_loop(llm.init_weight_transfer_engine(self.engine.vllm.InitRequest(init_info=info)))
        self.joined = True

    async def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int,
                      lora: AdapterSpec | None = None, digest: str | None = None, probe: Probe | None = None) -> int:
        if not self.joined:
            raise RuntimeError("no weight update group: call /init_weights_update_group first")
        return await self.engine.on_loop(self._receive(names, dtypes, shapes, version, lora, digest, probe))

    async def _receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int,
                       lora: AdapterSpec | None, digest: str | None, probe: Probe | None) -> int:
        engine, llm = self.engine, self.engine.llm
        async with engine.swap_lock:
            if self.push is not None and (self.push.version != version or not self.push.names.isdisjoint(names)):
                # another version, or this one sent again from its start (vLLM would keep the first copies)
                log.warning("push of version %d stopped half way; dropped", self.push.version)
                await self._drop(None)
            try:
                if lora is not None:
                    raise ValueError("this server was started without LoRA support (learner.lora is not set in "
                                     "its config): it takes whole weights; restart it with the learner's config")
                check_tensors(self.expected, names, dtypes, shapes)
            except ValueError:
                await self._drop((names, dtypes, shapes))  # take the bucket the learner is sending, then refuse
                raise
            if self.push is None:
                await llm.start_weight_update()
                self.push = _Push(version)
            bucket = {"names": names, "dtype_names": dtypes, "shapes": shapes, "digest": digest}
            try:
                await llm.update_weights(engine.vllm.UpdateRequest(update_info=bucket))
            except BaseException as e:
                self.push = None  # vLLM's worker ends the update when a bucket fails (one arrived corrupted, say)
                if isinstance(e, Exception):
                    _corrupted(e, version, engine.version)
                raise
            self.push.names.update(names)
            # complete: every parameter came; or tensors after a complete push (a state dict's tied head). A push of
            # the served version that brings parameters (a learner resumed from an older checkpoint pushes it
            # again) is a push like any other: whole, then proven, never applied a bucket at a time
            whole = self.push.names >= self.required or (version == engine.version and not self.push.names & self.required)
            if probe is not None and not whole:
                await self._drop(None)
                raise ValueError(f"a probe came before version {version} was whole: it belongs to a push's last "
                                 "bucket")
            if whole:
                self.push = None
                try:
                    self.probe_gap = await engine.commit(llm.finish_weight_update(), version, probe, self._restore)
                except Exception as e:  # a bucket's digest, checked while the next arrived
                    _corrupted(e, version, engine.version)
                    raise
        return len(names)

    async def _restore(self) -> None:
        """Load the weights served before the last push again (the transfer engine kept them)."""
        llm = self.engine.llm
        await llm.start_weight_update()
        await llm.update_weights(self.engine.vllm.UpdateRequest(update_info={"restore": True}))
        await llm.finish_weight_update()

    async def _drop(self, bucket: tuple[list, list, list] | None) -> None:
        """Abandon the push being received, receiving ``bucket`` first if the learner is broadcasting it."""
        engine, llm = self.engine, self.engine.llm
        if self.push is None:
            await llm.start_weight_update()
        names, dtypes, shapes = bucket or ([], [], [])
        info = {"names": names, "dtype_names": dtypes, "shapes": shapes, "discard": True}
        await llm.update_weights(engine.vllm.UpdateRequest(update_info=info))
        await llm.finish_weight_update()  # loads nothing: the push was discarded
        self.push = None

    async def load_from_disk(self, path: str, version: int) -> int:
        """The weights of a checkpoint directory, through the same lifecycle as a push."""
        from streamrl import adapters

        if adapters.is_adapter(path):
            raise ValueError(f"{path} is a LoRA adapter, and this server was started without LoRA support "
                             "(learner.lora is not set in its config)")
        engine = self.engine
        found = checkpoint_metas(path)
        check_tensors(self.expected, list(found), [d for d, _ in found.values()], [list(s) for _, s in found.values()])
        if missing := self.required - found.keys():
            raise ValueError(f"{path!r} lacks {len(missing)} tensors of the served model, e.g. {min(missing)!r}")

        async def reload() -> None:
            llm = engine.llm
            async with engine.swap_lock:
                if self.push is not None:
                    log.warning("push of version %d dropped for the weights in %s", self.push.version, path)
                    await self._drop(None)
                await llm.start_weight_update()
                await llm.update_weights(engine.vllm.UpdateRequest(update_info={"path": path}))
                await engine.swap(llm.finish_weight_update(), version)

        await engine.on_loop(reload())
        return len(found)

    def destroy(self) -> None:
        self.joined = False


