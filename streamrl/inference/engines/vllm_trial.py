"""A pushed version on trial in a ``vllm`` engine: served before its probe settles, because vLLM runs no request
while its generation is paused. Until the verdict, a finished request that carries the version waits at the gate;
if the probe fails, every request that ran during the trial is refused (``Withdrawn``): no token made by weights
that failed their probe is ever returned, under any version."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from streamrl.generation import Withdrawn


class Trial:
    """Runs on the engine's loop alone."""

    def __init__(self):
        self.version: int | None = None  # the version on trial
        self.at_gate: set[str] = set()  # finished requests waiting for the verdict
        self.tainted: set[str] = set()  # requests that ran on weights that failed: never returned
        self._settled: asyncio.Condition | None = None  # made on the engine loop, at first use

    async def hold(self, version: int, verdict: Callable[[], Awaitable[float]],
                   running: Callable[[], Iterable[str]]) -> float:
        """Keep ``version`` on trial while ``verdict()`` runs (the probe, and the rollback when it fails); when it
        raises, the requests ``running()`` then, and those at the gate, are tainted."""
        self.version = version
        try:
            return await verdict()
        except BaseException:
            self.tainted = set(running()) | self.at_gate
            raise
        finally:
            self.version = None
            async with self._condition():
                self._condition().notify_all()

    async def gate(self, rid: str, versions: list[int]) -> None:
        """Hold a finished request while a version it carries is on trial; refuse it if it ran on weights that
        failed their probe."""
        self.at_gate.add(rid)
        try:
            async with self._condition():
                await self._condition().wait_for(lambda: self.version is None or self.version not in versions)
        finally:
            self.at_gate.discard(rid)
        if rid in self.tainted:
            self.tainted.discard(rid)
            raise Withdrawn(f"request {rid} ran on pushed weights that failed their probe and were rolled back; "
                            "retry it")

    def _condition(self) -> asyncio.Condition:
        if self._settled is None:
            self._settled = asyncio.Condition()
        return self._settled
