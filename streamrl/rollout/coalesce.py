"""Sibling episodes that ask for the same continuation go out as one request.

The n episodes of a group start from the same prompt, so their first turn is n
identical requests. Sent as one ``/generate`` with ``n`` they cost one HTTP round
trip instead of n, and an engine with a prefix cache prefills the prompt once.
A request waits at most ``window_s`` for siblings; later turns, whose contexts
differ, go out alone after the same short wait. A request with a ``seed`` goes out
alone at once: merged, the second of two siblings would sample with another seed
(a server gives the i-th of n samples ``seed + i``), so identical seeded calls
would be answered differently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from streamrl.generation import Completion, SamplingParams

SendN = Callable[..., Awaitable[list[Completion]]]  # (input_ids, params, n, priority=...)


SIBLINGS_WAIT_S = 0.05  # the longest a request told of siblings waits for the rest: n agent episodes' opening
# calls come ~2 ms apart (what the openai client spends on each), past the usual window


class Coalescer:
    def __init__(self, send_n: SendN, window_s: float):
        self.send_n, self.window_s = send_n, window_s
        self._pending: dict[tuple, list[asyncio.Future]] = {}
        self._timers: dict[tuple, asyncio.TimerHandle] = {}
        self._sending: set[asyncio.Task] = set()

    async def generate(self, input_ids: list[int], params: SamplingParams, priority: int = 0,
                       siblings: int = 1) -> Completion:
        """One completion; ``siblings``: how many identical requests are on their way (the opening calls of a
        group's agent episodes), sent together as soon as all have come, or after ``SIBLINGS_WAIT_S``."""
        if self.window_s <= 0 or params.seed is not None:
            return (await self.send_n(input_ids, params, 1, priority=priority))[0]
        loop = asyncio.get_running_loop()
        key = (tuple(input_ids), params, priority)
        waiter = loop.create_future()
        waiters = self._pending.setdefault(key, [])
        waiters.append(waiter)
        if len(waiters) == 1:
            wait = self.window_s if siblings <= 1 else max(self.window_s, SIBLINGS_WAIT_S)
            self._timers[key] = loop.call_later(wait, self._flush, key)
        elif 1 < siblings <= len(waiters):
            self._timers[key].cancel()
            self._flush(key)
        return await waiter

    def _flush(self, key: tuple) -> None:
        self._timers.pop(key, None)
        waiters = [w for w in self._pending.pop(key) if not w.done()]  # a cancelled episode asks for nothing
        if waiters:
            task = asyncio.create_task(self._send(key, waiters))
            self._sending.add(task)  # keep a reference until it is done
            task.add_done_callback(self._sending.discard)

            def gave_up(_: asyncio.Future) -> None:  # nobody waits for it now: the server aborts it (a hang-up)
                if all(w.cancelled() for w in waiters):
                    task.cancel()

            for w in waiters:
                w.add_done_callback(gave_up)

    async def _send(self, key: tuple, waiters: list[asyncio.Future]) -> None:
        input_ids, params, priority = key
        try:
            outs = await self.send_n(list(input_ids), params, len(waiters), priority=priority)
        except BaseException as e:  # every sibling gets the error (and retries or fails its sample)
            for w in waiters:
                if not w.done():
                    w.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        for w, out in zip(waiters, outs):
            if not w.done():
                w.set_result(out)
