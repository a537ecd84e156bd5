"""The adapter versions a LoRA ``vllm`` server holds.

Each version is handed to vLLM's LoRA API (``add_lora``) under its served name ``NAME-vN`` (LoRA id N + 1),
from a directory in PEFT's format that the server writes on its own machine (in shared memory where there is
some): the tensors came over the push channel, and vLLM loads adapters from a path. A request runs under the
version that was newest when it started, or the one it names, to its end; so every token of it carries that
version. A version older than the ``slots - 1`` newest is unloaded once no request runs under it: the data it
would make is past the staleness bound.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from streamrl import adapters
from streamrl.adapters import AdapterSpec, LoraServing

log = logging.getLogger(__name__)


class AdapterVersions:
    def __init__(self, serving: LoraServing, base_model: str):
        self.serving, self.base_model = serving, base_model
        self.held: dict[int, Any] = {}  # version -> vLLM's LoRARequest
        self.running: Counter[int] = Counter()
        shm = Path("/dev/shm")
        self.dir = Path(tempfile.mkdtemp(prefix="streamrl-lora-", dir=shm if shm.is_dir() else None))

    @property
    def newest(self) -> int | None:
        return max(self.held, default=None)

    def pick(self, adapter: str | None) -> tuple[int | None, Any]:
        """The version a request runs under and its LoRARequest: the one named, else the newest (None before
        the first adapter: the base model)."""
        if adapter is None:
            newest = self.newest
            return newest, None if newest is None else self.held[newest]
        for version, request in self.held.items():
            if request.lora_name == adapter:
                return version, request
        names = ", ".join(self.held[v].lora_name for v in sorted(self.held)) or "none yet"
        raise ValueError(f"lora_path {adapter!r}: this server does not hold that adapter version (it holds {names})")

    @contextmanager
    def running_under(self, version: int | None) -> Iterator[None]:
        """Count a request on ``version`` while it runs (a version in use is never unloaded)."""
        if version is None:
            yield
            return
        self.running[version] += 1
        try:
            yield
        finally:
            self.running[version] -= 1

    async def add(self, llm: Any, lora_request_type: type, tensors: list[tuple[str, torch.Tensor]],
                  spec: AdapterSpec, version: int,
                  verify: Callable[[Any], Awaitable[float]] | None = None) -> float | None:
        """Load ``version`` into vLLM; unload what it makes too old. ``verify(request)`` proves the loaded adapter
        (a probe scored with it) before any request may pick it; returns what it returned. A failure leaves the
        held versions as they were."""
        name = spec.served_name(version)
        # a directory of its own each time: vLLM reloads an evicted adapter from its path, mid-request too
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.dir))
        adapters.save(path, tensors, spec, self.base_model)
        request = lora_request_type(lora_name=name, lora_int_id=version + 1, lora_path=str(path))
        if version in self.held:  # the same version again (a catch-up): the new tensors replace it
            await self._unload(llm, self.held.pop(version))
        try:
            await llm.add_lora(request)
        except Exception as e:  # vLLM may keep a half-loaded adapter registered: take it out
            await self._unload(llm, request)
            raise ValueError(f"vLLM refused adapter {name}: {e}") from e
        gap = None
        if verify is not None:
            try:
                gap = await verify(request)
            except BaseException:
                await self._unload(llm, request)
                raise
        self.held[version] = request
        await self.retire(llm)
        return gap

    def retired(self, version: int) -> bool:
        """Whether ``version`` is held past the ``slots - 1`` newest with no request running on it."""
        newest = self.newest
        return (version in self.held and newest is not None and version <= newest - (self.serving.slots - 1)
                and not self.running[version])

    async def retire(self, llm: Any) -> None:
        """Unload the versions older than the ``slots - 1`` newest on which no request runs."""
        for version in sorted(self.held):
            if not self.retired(version):
                continue
            self.running.pop(version, None)
            await self._unload(llm, self.held.pop(version))

    @staticmethod
    async def _unload(llm: Any, request: Any) -> None:
        try:
            await llm.remove_lora(request.lora_int_id)
        except Exception as e:  # it stays in vLLM's cache, and is never asked for again
            log.warning("could not unload adapter %s: %s", request.lora_name, e)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
