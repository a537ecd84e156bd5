"""``max_staleness: auto`` in a run: the controller's bound published to admission, a fresh run's fill and
opening, and the bound each group is judged under."""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

from streamrl.learner.staleness import Change, StalenessController, signals

log = logging.getLogger("streamrl.learner")


class AutoBound:
    """``max_staleness: auto`` at the learner: the controller, the bound published where every worker's
    admission reads it, and the bound each group is judged under (``bound_for``).

    A fresh run fills its pipeline under ``rules.fill``, 1 (or ``low`` if larger): the learner waits for its first
    groups under any bound, and every group admitted beyond them competes with them for the servers (on SmolLM2's
    agentic workload the first step took 306 s under 2 against 177 s under 1); under 0 the second step's groups
    could not start before the first is trained (on the toy's agentic workload that bubble was 6% of a 40-step
    run). That wait is the fill's, so the controller does not judge the first step, and opens the bound once it is
    trained: to ``start``, or where it is empty to the pipeline depth the step measured (``depth``: a bound under
    it starves the learner at once, as the slow start's first raises found step by step; at or past it the bound
    leaves generation free), if generation kept up with the fill: a group's time is its generation and its waits
    on the env (a tool, a checker), and waits take no server, so more groups in flight cover them; but where the
    fill's groups took longer to generate than the ``fill + 1`` steps it admits them for, the servers may limit the
    supply, not the bound: more groups in flight may only queue at them (SmolLM2's agentic groups took 40 s at a
    bound of 1, 90 s at 8 on two shared cores), or be batched (the toy's single-turn ones). The learner will wait
    under the fill's bound either way, so it opens by the one doubling a raise would make after those waits, and
    raises find out whether more pays, each judged by its trial. Nothing is published until then, so a learner
    restarted meanwhile fills afresh. A resumed learner goes on from the bound in force, raising it by one (its
    climb is over, and doubling a bound it had settled at would overshoot), and keeps the bounds its easings and
    reverts left to the groups made before them."""

    def __init__(self, auto: Any, admission: Any):
        self.admission = admission
        published = admission.published()
        fresh, published = published is None, auto.first if published is None else published
        self.controller = StalenessController(auto, bound=min(max(published, auto.low), auto.high), doubling=fresh)
        self._filling = fresh  # until the first step is trained: admission's own default, the fill's, rules
        if not fresh:  # (``Config.admission_bound``)
            admission.set_bound(self.bound)
        # the version an easing or a revert came at -> the bound it left, stored beside the bound in force
        self._kept: dict[int, int] = {} if fresh else admission.kept_bounds()
        # the step from which late groups may be kept (``keeps_late``): the bound in force has stood `cooldown` steps
        # since it was opened or raised without a cut; None after a cut, until the next raise. Stored beside the
        # bound: a resumed learner trusts what the one before it did (a cut before a crash is not forgotten)
        self._trusted_from = admission.late_trusted_from()
        if fresh:
            self._trust(auto.cooldown)

    @property
    def bound(self) -> int:
        """The bound in force: ``rules.fill`` while a fresh run fills its pipeline, then the controller's."""
        return self.controller.rules.fill if self._filling else self.controller.bound

    def bound_for(self, oldest: int) -> int:
        """The bound a group whose oldest token policy version ``oldest`` made is judged under. Easing and
        reverting trade nothing but speed on healthy data, so a group that may have been admitted under the bound
        before them (its tokens date from no later than the move) keeps that bound: nothing admitted is dropped
        for them. A lowering (degraded data) judges every group at once, as a fixed bound would."""
        return max([self.bound, *(old for at, old in self._kept.items() if oldest <= at)])

    def keeps_late(self, oldest: int, version: int) -> bool:
        """Whether a group past its bound (``bound_for``) whose oldest token ``oldest`` made is trained anyway at
        ``version``: with ``late: keep``, at most twice the bound in force old (and ``high``), once that bound
        has stood ``cooldown`` steps without a cut (a raise is trusted only once the data made under it held;
        a cut withdraws the trust until the next raise). The bound then paces admission, and a slow group is not
        starved for being slow; a bound of 0 keeps nothing late."""
        rules, trusted = self.controller.rules, self._trusted_from
        return (rules.late == "keep" and trusted is not None and version >= trusted
                and version - oldest <= min(rules.high, 2 * self.bound))

    def after_step(self, step: int, record: dict) -> dict:
        """Judge a step's record; for its metrics line, the change it made to the next steps' bound (and why)."""
        if self._filling:
            self._filling = False
            return self._open(step, record)
        change = self.controller.observe(step, signals(record))
        if change is not None and change.way in ("lowered", "raised"):
            self._trust(step + self.controller.rules.cooldown if change.way == "raised" else None)
        # a group made at a move's version or before is past the bound the move left once `step - at` passes it
        kept = {at: old for at, old in self._kept.items() if step - at <= old}
        if change is not None and change.way == "lowered":
            kept = {}
        elif change is not None and change.new < change.old:
            kept[step] = change.old
        if kept != self._kept:
            self.admission.set_kept_bounds(kept)
            self._kept = kept
        return {} if change is None else self._publish(change)

    def _open(self, step: int, record: dict) -> dict:
        """After a fresh run's first step: the bound it opens at, for the step's metrics line."""
        rules = self.controller.rules
        measured = depth(record) if rules.start is None else None  # a start given is kept
        generation = None if measured is None else measured * (1 - record.get("env_share", 0.0))
        kept_up = generation is not None and generation <= rules.fill + 1
        if measured is not None:
            opened = math.ceil(measured) - 1  # the depth that keeps the learner fed
            if not kept_up:  # the servers may limit the supply: one doubling finds out
                opened = min(opened, 2 * rules.first)
            self.controller.bound = min(rules.high, max(rules.first, opened))
        if self.bound == rules.fill:  # nothing to open; published, so a restarted learner goes on from it
            self.admission.set_bound(rules.fill)
            return {}
        self._trust(step + rules.cooldown)
        why = f"the first step, its data admitted under {rules.fill}, is trained"
        if measured is not None:
            why += (f"; its groups took {measured:.3g} of its training steps to generate (median), "
                    f"{generation:.2g} of them generating")
            why += (": so many steps of data in flight keep the learner fed" if kept_up else
                    f", more than the {rules.fill + 1} the fill admits them for: the servers, not the bound, may "
                    "limit the supply, so it opens by one doubling, as a raise would, and raises find out if more pays")
        return self._publish(Change(step, rules.fill, self.bound, why, "opened"))

    def _trust(self, at: int | None) -> None:
        self._trusted_from = at
        self.admission.set_late_trusted_from(at)

    def _publish(self, change: Change) -> dict:
        self.admission.set_bound(change.new)
        log.info("%s", change)
        return {"staleness_change": str(change)}


def depth(record: dict) -> float | None:
    """The pipeline depth a step measured, in learner steps: its groups' median generation seconds over its
    training seconds. By Little's law the learner, training a step of groups every ``T`` seconds, finds its next
    step's waiting only if the groups it needs were started ``L`` seconds before, ``L / T`` steps of data in
    flight: a bound ``k`` admits ``k + 1``. None where the step does not say (no group's seconds, or no training)."""
    seconds = [row[0] for row in record.get("groups_read", ()) if row[0] is not None]
    train = record.get("train_s", 0.0)
    return statistics.median(seconds) / train if seconds and train > 0 else None


def env_share(groups) -> float | None:
    """The share of ``groups``' episode seconds spent waiting on their envs (tools, checkers), not generating;
    None where no episode was timed."""
    timings = [s.timings for g in groups for s in g.samples]
    env = sum(t.get("env_s", 0.0) for t in timings)
    total = env + sum(t.get("generate_s", 0.0) for t in timings)
    return env / total if total > 0 else None
