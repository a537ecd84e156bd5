"""The learner's threads where it shares the machine's CPU with the servers (``Config.learner_widens``).

While the servers generate, the learner keeps its share of the cores: a second thread beside a generating
server gains nothing, as the learner's threads wait on the one that shares a core. Once generation is held under
the version the step trains from (admission is full, no group runs, and that version's push has landed), no server
generates until the learner publishes its next version, so the learner takes every core for the rest of its step
(at 135M on two cores, a forward and backward ran 1.9x faster on two threads than on one). The evaluator's
requests are not admitted: an evaluation that falls in a widened phase shares the cores with it.

The step is cut into phases (each micro-batch's forward, its backward, the optimizer's step), and the first
phase trained on every core goes into the run's record: a replay runs each phase on the threads the run did,
as a sum over two threads is not, bit for bit, the sum over one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def machine_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Cores:
    """The thread count of each phase of a step: ``share`` until generation is ``held``, then ``every``.

    ``held`` is asked at each phase until it says yes (None: never; a replay follows the recorded phase
    instead). ``end()`` closes the step: back to ``share``, and the phase it widened at (or None).
    """

    def __init__(self, share: int, every: int, held: Callable[[], bool] | None = None):
        self.share, self.every, self.held = share, every, held
        self._phase, self.wide_from, self._follow = 0, None, None

    def follow(self, phase: int | None) -> None:
        """Widen this step at ``phase``, as the run recorded (None: not at all)."""
        self._follow = phase

    def phase(self) -> None:
        """A phase begins: from the first at which generation is held, the learner computes on every core."""
        at, self._phase = self._phase, self._phase + 1
        if self.wide_from is not None or self.every == self.share:
            return
        if at == self._follow or (self.held is not None and self._follow is None and self.held()):
            self.wide_from = at
            torch.set_num_threads(self.every)

    def end(self) -> int | None:
        """The step is over: its phase that widened (None: none), and the learner back on its share."""
        wide_from = self.wide_from
        if wide_from is not None:
            torch.set_num_threads(self.share)
        self._phase, self.wide_from, self._follow = 0, None, None
        return wide_from
