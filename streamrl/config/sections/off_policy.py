"""How data crosses from generation to training: how stale it may be (a fixed bound or one the learner
moves), how the loss corrects for its age, and how the learner's weights reach the servers.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from streamrl.config.sections.base import Section

DEFAULT_MAX_STALENESS = 2  # the fixed bound's default


class AutoStalenessConfig(Section):
    """With `off_policy.max_staleness: auto`, how the learner moves the bound (docs/concepts.md): up while it
    waits for data the bound held back, on healthy off-policy data (doubled until the bound first comes down, by
    one after), halved when that data degrades, eased down by one while it never waits, put back where a raise
    did not speed it up (for `revert_hold` steps) or an easing slowed it down."""

    low: int = Field(0, ge=0, description="smallest bound: where cuts for degraded data stop (0: on-policy, the "
                     "only bound that holds a fast-moving policy, e.g. at a high learning rate)")
    high: int = Field(8, ge=1, description="largest bound")
    start: int | None = Field(None, ge=0, description="the bound once a fresh run's first step is trained (its "
                              "data comes in under 1, or low if larger, or start if smaller; empty: the pipeline "
                              "depth that step measured, its groups' median generation seconds over its training "
                              "seconds, less one, at least 1 (or low if larger) and at most high; where the part "
                              "of them spent generating, not waiting on the env, took more than the fill's bound + 1 "
                              "steps, at most one doubling of 1 (or low if larger); raises double it from there)")
    wait_share: float = Field(0.1, ge=0, lt=1, description="a step that waited for data longer than this share "
                              "of it counts towards a raise (see held_share)")
    held_share: float = Field(0.5, ge=0, le=1, description="a wait counts towards a raise only if the bound turned "
                              "workers away for at least this share of it, or a group was dropped as stale (0: any "
                              "wait counts)")
    idle_share: float = Field(0.02, ge=0, lt=1, description="a step that waited for data under this share of it "
                              "counts towards easing the bound down by one; an easing is taken back if it made the learner's median step "
                              "longer, judged as a raise is (0: never ease)")
    ess_floor: float = Field(0.8, gt=0, lt=1, description="lower when the importance weights' effective sample "
                             "size (a share of the tokens) falls under this: at once, or on the second step in a row "
                             "where it is the only sign and the drift it implies affords data half the bound old")
    ess_raise: float = Field(0.9, gt=0, le=1, description="raise only while the effective sample size is at least this")
    m2_ceiling: float = Field(1.5, gt=1, description="lower when the importance weights' second moment passes this")
    clip_ceiling: float = Field(0.1, gt=0, lt=1, description="lower when the clip fraction passes this")
    spike: float = Field(3.0, gt=1, description="lower when the gradient norm per share of groups with a signal "
                         "passes this many times its running mean (of about the last 3 steps, judged from the 6th, on "
                         "steps with at least 4 groups with a signal, so never with learner.groups_per_step under 4) "
                         "while ESS is under ess_raise")
    raise_gain: float = Field(0.0, ge=0, lt=1, description="a raise is kept unless the learner's median step time "
                              "over its trial (max(cooldown, patience) steps) exceeds (1 - raise_gain) x its median "
                              "over the steps before it by more than those steps' noise (0: unless it made it longer); "
                              "else the bound goes back and raises stop there for `revert_hold` steps")
    revert_hold: int = Field(12, ge=1, description="steps after a revert before raises may pass its bound again; "
                             "doubled for each further raise in a row that did not pay")
    patience: int = Field(2, ge=1, description="steps in a row that must call for a raise (the last one while "
                          "the bound doubles), or for easing; a raise also needs this many steps under the bound")
    cooldown: int = Field(3, ge=1, description="steps after a change before the next")
    late: Literal["keep", "drop"] = Field("keep", description="a group that comes back past the bound in force (a "
                                          "slow one: long answers, a slow tool): keep trains it under the "
                                          "correction if it is at most twice that bound (and high) old and the bound "
                                          "has stood `cooldown` steps since it was opened or raised with no cut "
                                          "since; drop drops it, as a fixed bound does (off_policy.stale: drop only)")

    @model_validator(mode="after")
    def _ordered(self) -> AutoStalenessConfig:
        if self.low > self.high:
            raise ValueError(f"off_policy.auto.low {self.low} > high {self.high}")
        if not self.low <= self.first <= self.high:
            raise ValueError(f"off_policy.auto.start {self.start} is outside [low {self.low}, high {self.high}]: "
                             "set off_policy.auto.start within them")
        if 0 < self.idle_share >= self.wait_share:  # else a step could count towards both a raise and easing
            raise ValueError(f"off_policy.auto.idle_share {self.idle_share} must be under wait_share {self.wait_share}: "
                             "set it lower, or 0 to never ease")
        if self.ess_floor >= self.ess_raise:
            raise ValueError(f"off_policy.auto.ess_floor {self.ess_floor} must be under ess_raise {self.ess_raise}")
        return self

    @property
    def first(self) -> int:
        """The controller's first bound, opened once a fresh run's first step is trained (its data comes in under
        ``fill``): ``start``, or where it is empty the least the measured depth opens at (``staleness.depth``)."""
        return max(self.low, 1) if self.start is None else self.start

    @property
    def fill(self) -> int:
        """The bound a fresh run fills its pipeline under, until its first step is trained: 1, the least under which
        the next step's groups start while one trains (or low if larger, or start if smaller)."""
        return min(self.first, max(self.low, 1))


class OffPolicyConfig(Section):
    """How old (in policy versions) trained data may be, and how the loss corrects for its age."""

    max_staleness: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        DEFAULT_MAX_STALENESS, description="oldest policy lag a trained token may have; auto: the learner moves "
                                           "it within off_policy.auto's bounds")
    auto: AutoStalenessConfig = Field(default_factory=AutoStalenessConfig)
    stale: Literal["drop", "keep"] = Field("drop", description="what the learner does with data past the bound")
    correction: Literal["none", "tis", "decoupled"] = Field(
        "decoupled", description="none: PPO ratio against the behaviour policy; tis: ratio against the proximal "
                                 "policy, truncated importance weight; decoupled: the same, weight not truncated")
    tis_cap: float = Field(2.0, gt=0, description="correction=tis: largest importance weight")
    behav_weight_cap: float | None = Field(None, gt=1, description="decoupled: leave out tokens whose "
                                           "pi_prox / pi_behav exceeds this (AReaL's behav_imp_weight_cap)")
    ess_lr: bool = Field(False, description="scale each update's learning rate by the effective sample size of "
                         "its importance weights pi_prox / pi_behav: by its square root under AdamW, by itself under "
                         "SGD (data further off-policy moves the weights less; VCPO)")

    @property
    def adaptive(self) -> bool:
        return self.max_staleness == "auto"

    @property
    def ceiling(self) -> int:
        """The largest bound in force at any time."""
        return self.auto.high if self.adaptive else self.max_staleness

    @property
    def floor(self) -> int:
        """The smallest bound in force at any time."""
        return self.auto.low if self.adaptive else self.max_staleness

    @property
    def initial(self) -> int:
        """The bound in force until the learner publishes one (``auto``: the bound a fresh run fills its pipeline
        under, ``auto.fill``, before the learner opens it)."""
        return self.auto.fill if self.adaptive else self.max_staleness


class WeightSyncConfig(Section):
    """Pushing the learner's weights to the rollout servers."""

    sync_every: int = Field(1, ge=1, description="learner steps between pushes")
    mode: Literal["pause", "in_flight"] = Field("in_flight", description="in_flight: servers keep generating and "
                                                "switch weights between two decode steps; pause: they stop for the push")
    bucket_mb: float = Field(64.0, gt=0, description="size of one broadcast (tensors are packed into buckets)")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="transport: auto is nccl from a CUDA "
                                                     "learner into vllm servers, else gloo (also where `streamrl up` "
                                                     "puts servers on the learner's GPU)")
    timeout_s: float = Field(60.0, gt=0, description="how long a push waits for a server before dropping it")
    max_paused_share: float = Field(0.5, gt=0, le=1, description="the share of the servers that take a push at once "
                                    "(at least one): the push goes to the fleet in waves, and the servers of the "
                                    "other waves keep generating while one applies it; 1: every server at once")
    verify: bool = Field(True, description="commit a pushed version on a server only once it is proven: each "
                         "bucket's digest on arrival, then a probe (the logprobs of a fixed token sequence from the "
                         "run's data) computed by the learner and by the server on the applied weights; a server "
                         "that fails rolls back and takes no generation until a later version passes")
    probe_tokens: int = Field(256, ge=2, le=8192, description="the probe's length in tokens (the first sequences the "
                              "learner trains on, concatenated)")
    probe_tolerance: float | None = Field(None, gt=0, le=1, description="how far the server's probe logprob of a "
                                          "token may be from the learner's: this times max(1, |learner's|); empty: "
                                          "1e-4 when model.dtype is float32, 0.1 under bfloat16")

    def tolerance(self, dtype: str) -> float:
        """``probe_tolerance`` resolved for weights served in ``dtype``."""
        if self.probe_tolerance is not None:
            return self.probe_tolerance
        return 1e-4 if dtype == "float32" else 0.1
    master_address: str | None = Field(None, description="learner rank 0's address, as servers reach it; empty: its "
                                       "node's address on a Ray cluster (ray.address), else 127.0.0.1")
