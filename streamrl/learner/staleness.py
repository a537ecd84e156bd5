"""The staleness bound chosen from what the learner measures (``off_policy.max_staleness: auto``).

After each step the controller reads the step's signals and may move the admission bound ``k`` within
``[low, high]``, as TCP moves its window: in a fresh run doubling up from ``start`` (in force from the second
step: ``auto_bound.AutoBound`` fills the pipeline under ``fill``; by default the depth the first step measured,
``auto_bound.depth``) until the bound first comes down, additive up from then on (and after a restart),
multiplicative down:

- **down**, to ``max(low, floor(k / 2))``, or lower where the ESS says the data drifts faster (``afford``), as
  soon as the off-policy data degrades: the normalised effective sample
  size of the importance weights ``ESS = (sum w)^2 / (n sum w^2)`` falls under ``ess_floor``, their second moment
  ``E[w^2]`` (M2PO's quantity) passes ``m2_ceiling``, the clip fraction passes ``clip_ceiling``, or the gradient
  norm per share of groups with a signal passes ``spike`` times its running mean (an exponential mean of every
  step's, judged from the ``StalenessController.warmup``-th step on, on steps with at least
  ``StalenessController.spike_groups`` groups with a signal) on data off-policy enough to explain it (ESS under
  ``ess_raise``). A shallow ESS dip (the ESS alone under its floor, by so little that the drift it implies still
  affords data half the bound old) cuts only on a second degraded step in a row: a single one is the small batch's
  noise, which fixed bounds train through. A raise on trial is cut without waiting for the cooldown (no data made
  under a looser bound is left to drain: what arrives is the raise's verdict), and, as a raise that did not pay,
  backs raises off as a revert does. Per share of groups with a signal: a group whose rewards are all equal adds
  no gradient but counts in the loss's mean, so near convergence the norm shrinks with the share, and a step that
  draws more groups with a signal than the last few would read as a spike;
- **up**, to ``max(2k, 1)`` until the bound has first come down and to ``k + 1`` after (never past
  ``high``), when the learner waited for data for more than ``wait_share`` of each of the last ``patience`` steps
  (of the last step while the bound doubles, once ``patience`` steps have run under it: each raise is judged
  before the next, against those steps),
  the bound held data back through each wait (it turned workers away at admission for at least ``held_share`` of
  it, or the learner dropped a group as stale: else generation, not the bound, starved the learner, and a raise
  would only put more groups in flight), and the data was healthy throughout, with margin: ESS at least
  ``ess_raise`` (above ``ess_floor``) and the clip fraction at most half its ceiling;
- **eased** down, to ``k - 1``, when the learner waited for under ``idle_share`` of each of the last
  ``patience`` steps: it is the bottleneck, so a smaller bound trains fresher data at the same speed. Easing
  stops one above the bound the learner last starved at (where the last raise started), so the bound settles
  where the learner is fed, and never eases to 0 (only a cut goes there: under 0 generation cannot overlap
  training, and the learner waits for every step's data). That bet is tried, as a raise is: the learner can be
  the bottleneck and still be slowed by a smaller pipeline (on a shared machine its step also waits for the cores;
  SmolLM2's agentic runs eased 2 -> 1 and went on at fixed 1's pace, 0.8x fixed 2's). It is judged once the
  groups admitted under the old bound are trained (``old`` steps: until then they feed the learner as before),
  and nothing but a cut moves the bound before the verdict;
- **reverted**, back to the bound a raise or an easing started from, when it did not pay: the learner's median
  step time (waiting and training) over the steps of its trial (``max(cooldown, patience)`` steps) is not at
  least ``raise_gain`` under (an easing's: not over) its median over the steps before it under the old bound (at
  most ``StalenessController.window`` each side), by more than the steps' own noise moves that difference
  (``median_noise``): a verdict the noise could have made keeps the raise (a toy step's time deviates from its
  median by 30-45% of it; a trial after a raise from 1 to 2 read as slow as the steps before it in the median
  raise, though a bound of 2 trains 1.1x the samples/s of 1, and a verdict without the margin reverted a third of
  the raises). Medians, so that a stall (a preemption, a slow disk, servers
  stopped for a while) in one step of three cannot decide the verdict. The learner waited because generation is
  at capacity, not because the bound held it back (on a shared machine more groups in flight slow both sides
  down), so raises stop at that bound: for ``revert_hold`` steps after the first raise that did not pay, twice as
  long after each further one in a row (back off: the run changes, but a verdict retried on an unchanged run
  comes out the same and costs two changes). A raise that pays ends the back-off. An easing that did not pay
  shows that the learner starves under the eased bound: easing stops above it until a cut.

Only a lowering drops data made under the old bound, as a fixed bound would; easing and reverting are moves for
speed on healthy data, so the groups that may have been admitted before them keep the old bound
(``auto_bound.AutoBound.bound_for``): a bound that overshot comes back down without dropping anything.

It does not oscillate: the margins between the thresholds that lower and raise it, the ``patience`` steps a move
waits for, the floor a raise leaves for easing, the ceiling a reverted raise leaves for raising, and the
``cooldown`` steps after any change but a cut of a raise on trial (the data admitted under the old bound drains
meanwhile, so a change is judged on data made under it) keep it from flipping on noise.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from streamrl.buffer.admission import RETRY_S
from streamrl.config.sections import AutoStalenessConfig


@dataclass(frozen=True)
class Signals:
    """One learner step's measurements."""

    wait_share: float  # the share of the step the learner spent waiting for data
    ess: float  # normalised effective sample size of the importance weights, in (0, 1]
    second_moment: float  # E[w^2] of the importance weights: 1 on-policy
    clip_frac: float
    grad_norm: float
    step_s: float = 0.0  # the step's seconds, waiting for data and training: what a raise must shorten
    held_share: float = 1.0  # the share of the wait the bound turned workers away (1: it dropped a group as stale)
    signal_share: float = 1.0  # the share of the trained groups with a learning signal (rewards not all equal)
    signal_groups: int | None = None  # how many trained groups had one (None: not counted)
    age: int = 0  # the oldest trained sequence's staleness, in policy versions (0: on-policy, or not known)

    @property
    def norm_per_signal(self) -> float | None:
        """The gradient norm per share of groups with a signal: a group whose rewards are all equal adds nothing to
        the gradient but counts in the loss's mean, so near convergence the norm shrinks with the share, and a step
        that happens to draw more groups with a signal is no spike. None: no group had one, or the norm is not
        finite (the step's update was skipped: no later norm is judged against it)."""
        return self.grad_norm / self.signal_share if self.signal_share > 0 and math.isfinite(self.grad_norm) else None


@dataclass(frozen=True)
class Change:
    step: int
    old: int
    new: int
    cause: str
    way: str  # raised, lowered (degraded data), eased (an idle learner), reverted (a raise that did not pay) or
    # opened (from the fill's bound to start or the measured depth after a fresh run's first step)

    def __str__(self) -> str:
        return f"max staleness {self.way} {self.old} -> {self.new} at step {self.step}: {self.cause}"


@dataclass(frozen=True)
class Trial:
    """A move on trial: judged by the learner's median step time over ``max(cooldown, patience)`` steps under it,
    after the first ``drain``, against ``before``, the steps under ``old`` that led to it."""

    step: int
    old: int
    before: list[float]
    way: str  # raised (it must shorten the step by raise_gain) or eased (it must not lengthen it)

    @property
    def drain(self) -> int:
        """Steps left out of the verdict: an easing's first ``old`` still train groups admitted under the old
        bound (``AutoBound.bound_for``), so the smaller pipeline starves the learner, if it does, only after them."""
        return self.old if self.way == "eased" else 0


class StalenessController:
    """Moves the bound by ``rules`` (the ``off_policy.auto`` settings: their defaults when not given), from
    ``bound`` (default: ``rules.first``); ``doubling``: whether raises double it (a fresh run's slow start)."""

    # The gradient norm's running mean: a memory of about 3 steps, so that a spike is a jump from the last few
    # norms, not the growth a learning policy's norm shows over a run (SmolLM2's grew 30x in 20 steps, from
    # near 0 while few groups had any signal), judged once it holds `warmup` norms.
    smoothing, warmup = 0.7, 5
    # A step's norm is judged for a spike only when at least this many of its groups carry a signal: the norm of
    # fewer is their own, and spreads far wider. Per share of groups with a signal, over 5,084 steps (past step 50)
    # of 24 300-step quickstarts, 16%, 10% and 6% of the steps with 1, 2 and 3 such groups read over 3x the median;
    # 2% or fewer with 4 or more.
    spike_groups = 4
    window = 5  # the most steps each side of a raise whose median step time judges it

    def __init__(self, rules: AutoStalenessConfig | None = None, bound: int | None = None, doubling: bool = True):
        self.rules = r = rules or AutoStalenessConfig()
        self.bound = r.first if bound is None else bound
        if not r.low <= self.bound <= r.high:
            raise ValueError(f"staleness bounds: need low {r.low} <= start {self.bound} <= high {r.high}")
        self._grad_mean: float | None = None
        self._grad_norms = 0  # how many the mean holds
        self._healthy_waits = 0  # consecutive steps that waited for data the bound held back, on healthy data
        self._idle_steps = 0  # consecutive steps that (almost) did not wait
        self._fed_floor = r.low  # easing's floor: one above the bound the learner last waited at
        self._ceiling = (r.high, 0)  # raises stop at this bound until this step: where a raise that did not pay
        # went back to, for `revert_hold` steps doubled for each raise in a row that did not pay (`_reverts`)
        self._reverts = 0
        self._step_s: deque[float] = deque(maxlen=self.window)  # the last steps' seconds
        self._steps_at_bound = 0  # steps judged under the bound in force: a raise's trial needs `patience` of them
        self._trial: Trial | None = None  # the last raise or easing, until it is judged
        self._doubling = doubling  # raises double the bound until it first comes down: the climb from low is short
        self._last_change = -(10**9)
        self._dipped = False  # the last step's data was degraded: a shallow dip now is its second reading

    def observe(self, step: int, s: Signals) -> Change | None:
        """Take a step's signals; the change of the bound they call for, if any (already applied)."""
        r, symptoms = self.rules, self._symptoms(s)
        symptom = symptoms[0] if symptoms else None
        cause = symptom
        if self._shallow(s, symptoms):  # one shallow dip is noise: wait for the next step's reading
            cause = f"{symptom}, the second degraded step in a row" if self._dipped else None
        self._dipped = symptom is not None
        self._track_grad_norm(s)
        self._step_s.append(s.step_s)
        self._steps_at_bound += 1
        healthy = symptom is None and s.ess >= r.ess_raise and s.clip_frac <= r.clip_ceiling / 2
        starved = s.wait_share > r.wait_share and s.held_share >= r.held_share  # by the bound, not by generation
        self._healthy_waits = self._healthy_waits + 1 if healthy and starved else 0
        self._idle_steps = self._idle_steps + 1 if s.wait_share < r.idle_share else 0
        cooling = step - self._last_change < r.cooldown
        # a raise on trial is cut at once: its data is the verdict, and no data made under a looser bound drains
        raising = self._trial is not None and self._trial.way == "raised"
        if cause is not None and self.bound > r.low and (not cooling or raising):
            self._fed_floor = r.low  # the data, not the supply, was the problem: what fed the learner is unknown
            new, cause = self._cut(s, cause)
            if raising:  # the raise brought data too far off-policy: it did not pay
                cause += self._back_off(step, self._trial.old)
            return self._move(step, new, "lowered", cause)
        if cooling:
            return None
        if self._trial and step - self._trial.step >= self._trial.drain + max(r.cooldown, r.patience):
            if (change := self._judge(step)) is not None:
                return change
        if self._may_raise(step):
            self._fed_floor = self.bound + 1  # the bound below starved the learner
            return self._move(step, min(self._raise_ceiling(step), max(2 * self.bound, 1) if self._doubling
                                        else self.bound + 1), "raised",
                              f"the learner waited {s.wait_share:.0%} of its step for data the bound held back "
                              f"{_count(self._healthy_waits, 'step')} running, ESS {s.ess:.2f}")
        if (symptom is None and self._idle_steps >= r.patience and self.bound > max(self._fed_floor, 1)
                and self._trial is None):  # each move is judged before the next
            return self._move(step, self.bound - 1, "eased", f"the learner waited under {r.idle_share:.1%} of its step for "
                                                    f"data {_count(r.patience, 'step')} running: fresher data, same speed")
        return None

    def _judge(self, step: int) -> Change | None:
        """The verdict on the move on trial: back to its old bound if it made the learner's median step longer than
        it may (a raise by ``raise_gain`` less, an easing not at all) by more than the steps' noise."""
        t, self._trial = self._trial, None
        after, gain = self._last_step_s(step - t.step - t.drain), self.rules.raise_gain if t.way == "raised" else 0.0
        was, now, noise = statistics.median(t.before), statistics.median(after), median_noise(t.before, after)
        if now - was * (1 - gain) <= noise:  # no slower than the noise alone would read it: kept
            if t.way == "raised":
                self._reverts = 0
            return None
        move, promise = ("raising", "speed the learner up") if t.way == "raised" else ("easing", "keep the learner as fast")
        verdict = (f"{move} it at step {t.step} did not {promise}: {was:.3g} s a step before, {now:.3g} s after (median"
                   + (f"; their noise {noise:.2g} s" if noise else "") + ")")
        if t.way == "raised":
            return self._move(step, t.old, "reverted", verdict + self._back_off(step, t.old))
        self._fed_floor = t.old  # the eased bound starved the learner: easing stops above it until a cut
        return self._move(step, t.old, "reverted", verdict + f"; easing stops at {t.old}")

    def _cut(self, s: Signals, cause: str) -> tuple[int, str]:
        """Where a lowering goes, and its cause: half the bound, as TCP halves its window on a loss, or where the
        ESS fell under the floor, the age the data's own drift affords (``afford``) if that is lower: an ESS far
        under the floor is no overshoot that halving corrects (data one version old read 0.27 at lr 5e-4)."""
        r, half = self.rules, self.bound // 2
        if s.ess < r.ess_floor and (affords := afford(s.ess, s.age, r.ess_floor)) is not None and affords < half:
            return max(r.low, affords), (f"{cause} on data up to {_count(s.age, 'version')} old; at that drift, "
                                         f"data keeps an ESS of {r.ess_floor} up to {_count(affords, 'version')} old")
        return max(r.low, half), cause

    def _shallow(self, s: Signals, symptoms: list[str]) -> bool:
        """Whether ``symptoms`` are a shallow ESS dip, cut only on a second degraded step in a row: the ESS alone is
        under its floor, by so little that the drift it implies affords data at least half the bound old (a cut
        would only halve it; ``_cut``). Such dips come one at a time (a small batch's ESS is noisy) and fixed bounds
        train through them, while a cut drops every group older than the new bound. A deep dip, or one of the
        other symptoms, cuts at once."""
        if len(symptoms) != 1 or s.ess >= self.rules.ess_floor:
            return False
        affords = afford(s.ess, s.age, self.rules.ess_floor)
        return affords is not None and affords >= max(1, self.bound // 2)

    def _back_off(self, step: int, old: int) -> str:
        """Stop raises at ``old``, the bound a raise that did not pay started from, for ``revert_hold`` steps,
        doubled for each further one in a row; the clause that says so."""
        self._reverts += 1
        hold = self.rules.revert_hold * 2 ** (self._reverts - 1)
        self._ceiling = (old, step + hold)
        return f"; raises stop at {old} for {hold} steps"

    def _may_raise(self, step: int) -> bool:
        """Whether the held, healthy waits call for a raise now. While the bound doubles, the last step's wait is
        enough: each raise is judged (its trial) before the next, against `patience` steps under the bound it
        leaves, so the climb is short and cannot run past a raise that did not pay. Not while an easing is on
        trial: a learner it starves waits, its steps lengthen, and the verdict takes it back (a raise judged
        against the steps still fed under the old bound would compare that bound with itself)."""
        r = self.rules
        waits = self._healthy_waits >= (1 if self._doubling else r.patience)
        return (waits and self._trial is None and self._steps_at_bound >= r.patience
                and self.bound < self._raise_ceiling(step))

    def _raise_ceiling(self, step: int) -> int:
        bound, until = self._ceiling
        return bound if step < until else self.rules.high

    def _symptoms(self, s: Signals) -> list[str]:
        """How the step's data is degraded, if it is: the first one says why a cut is made."""
        r, found = self.rules, []
        if s.ess < r.ess_floor:
            found.append(f"ESS {apart(s.ess, r.ess_floor)} < {r.ess_floor}")
        if s.second_moment > r.m2_ceiling:
            found.append(f"E[w^2] {apart(s.second_moment, r.m2_ceiling)} > {r.m2_ceiling}")
        if s.clip_frac > r.clip_ceiling:
            found.append(f"clip fraction {apart(s.clip_frac, r.clip_ceiling)} > {r.clip_ceiling}")
        if spike := self._spike(s):
            found.append(spike)
        return found

    def _spike(self, s: Signals) -> str | None:
        """A jump of the gradient norm per share of groups with a signal over its running mean."""
        r = self.rules
        # a spike on data the weights show near on-policy is the policy's own (a rare group with signal, on the
        # toy near convergence): a smaller bound would not change it
        norm, few = s.norm_per_signal, s.signal_groups is not None and s.signal_groups < self.spike_groups
        if (norm is not None and not few and self._grad_norms >= self.warmup and norm > r.spike * self._grad_mean
                and s.ess < r.ess_raise):
            per = "" if s.signal_share == 1 else f" / {s.signal_share:.0%} of groups with a signal = {norm:.3g}"
            return (f"gradient norm {s.grad_norm:.3g}{per} > {r.spike} x its running mean {self._grad_mean:.3g}, "
                    f"ESS {s.ess:.2f}")
        return None

    def _track_grad_norm(self, s: Signals) -> None:
        # a spike enters the mean too: a norm that stays up is the new level, not a spike on every later step
        norm = s.norm_per_signal
        if norm is None:  # no group had a signal, or no update was made: the norm says nothing of the data's age
            return
        self._grad_mean = norm if self._grad_mean is None else (
            self.smoothing * self._grad_mean + (1 - self.smoothing) * norm)
        self._grad_norms += 1

    def _last_step_s(self, steps: int) -> list[float]:
        """The seconds of the last ``steps`` steps (at most ``window``)."""
        return list(self._step_s)[-max(1, min(steps, self.window)):]

    def _move(self, step: int, new: int, way: str, cause: str) -> Change:
        """Apply a change. A raise or an easing goes on trial against the steps under the bound it leaves; any
        other move ends a trial (it is not judged on steps under another bound). A ceiling stays: no move says that
        a raise past it would now pay."""
        change = Change(step, self.bound, new, cause, way)
        self._doubling = self._doubling and new > self.bound
        self._trial = (Trial(step, self.bound, self._last_step_s(self._steps_at_bound), way)
                       if way in ("raised", "eased") else None)
        self.bound, self._last_change, self._healthy_waits, self._idle_steps = new, step, 0, 0
        self._steps_at_bound = 0
        return change


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}" if n == 1 else f"{n} {unit}s"


def signals(record: dict) -> Signals:
    """A learner step's signals, from its metrics record. A worker held at admission retries every ``RETRY_S``,
    so the refusals while the learner waited measure how long the bound held workers back. A step whose updates
    were all skipped has no gradient norm: NaN, never a spike nor part of the running mean."""
    wait, train = record.get("wait_s", 0.0), record.get("train_s", 0.0)
    held_s = record.get("admission_refused", 0) * RETRY_S
    held = 1.0 if record.get("dropped_stale", 0) else min(1.0, held_s / max(wait, 1e-9))
    groups = record.get("groups", 0)
    silent = record.get("groups_no_signal", 0) - record.get("dropped_no_signal", 0)  # trained without a signal
    signal = groups - silent if groups else None  # trained with one (None: no group counted)
    return Signals(wait_share=wait / max(wait + train, 1e-9), ess=record.get("is_ess", 1.0),
                   second_moment=record.get("is_second_moment", 1.0), clip_frac=record.get("clip_frac", 0.0),
                   grad_norm=record.get("grad_norm", math.nan), step_s=wait + train, held_share=held,
                   signal_share=signal / groups if signal is not None else 1.0, signal_groups=signal,
                   age=record.get("staleness_max", 0))


def median_noise(before: list[float], after: list[float]) -> float:
    """The standard error of the difference between the medians of ``before`` and ``after``: what their steps'
    spread alone moves it by. The spread is the median absolute deviation of each step from its own side's median
    (times 1.4826, the standard deviation of normal noise), so that one stalled step moves it no further than any
    other; a median of ``n`` steps varies ``sqrt(pi / 2 n)`` of that. 0 where the steps do not vary."""
    residuals = [abs(x - mid) for side in (before, after) for mid in [statistics.median(side)] for x in side]
    sigma = 1.4826 * statistics.median(residuals)
    return sigma * math.sqrt(math.pi / 2 * (1 / len(before) + 1 / len(after)))


def afford(ess: float, age: int, floor: float) -> int | None:
    """The age, in policy versions, at which data would read ``floor``, given an ESS measured on data up to
    ``age`` versions old. Importance weights log-normal with ``Var(log w) = sigma^2`` have ``ESS = exp(-sigma^2)``;
    a policy that drifts a little with each update has ``sigma^2`` growing with the versions between the two
    policies, ``c`` a version. The oldest data's weights vary most, so ``ESS >= exp(-c age)``, ``c >= -ln(ESS) / age``
    (the drift is at least that fast), and data ``a`` versions old reads at least ``floor`` only while
    ``a <= age ln(floor) / ln(ESS)``: the bound the evidence affords at most. None where the data was on-policy (its
    ESS does not grow with age: inference against training numerics) or the ESS is not under 1."""
    if age < 1 or not 0 <= ess < 1:
        return None
    return 0 if ess == 0 else math.floor(age * math.log(floor) / math.log(ess))


def apart(value: float, limit: float) -> str:
    """``value`` to two decimals, or to as many more as it takes not to read as the ``limit`` it crossed (an ESS of
    0.7996 under 0.8 reads 0.7996, not 0.80)."""
    for digits in range(2, 8):
        if float(text := f"{value:.{digits}f}") != limit:
            return text
    return repr(value)
