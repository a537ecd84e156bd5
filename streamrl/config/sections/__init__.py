"""The configuration's sections: one typed tree, one class per part, every field described.

Each part's sections live in its own module (``run``, ``serving``, ``rollout``, ``learner``, ``off_policy``);
``Config`` is the tree's root. It checks every cross-field rule when it is validated: ``streamrl.config.rules``
adds each rule to ``RULES`` (importing ``streamrl.config`` imports it), so this module needs nothing from there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

from pydantic import Field, model_validator

from streamrl.config.sections.base import Section
from streamrl.config.sections.learner import LearnerConfig, LoraConfig, RecordConfig
from streamrl.config.sections.off_policy import (
    DEFAULT_MAX_STALENESS,
    AutoStalenessConfig,
    OffPolicyConfig,
    WeightSyncConfig,
)
from streamrl.config.sections.rollout import EvalConfig, RolloutConfig, SamplingConfig
from streamrl.config.sections.run import (
    LightPlacement,
    ModelConfig,
    Placement,
    PrepareConfig,
    RayConfig,
    RedisConfig,
    RunConfig,
    SuperviseConfig,
)
from streamrl.config.sections.serving import RewardConfig, RouterConfig, ServerConfig

__all__ = ["DEFAULT_MAX_STALENESS", "RULES", "AutoStalenessConfig", "Config", "EvalConfig", "LearnerConfig",
           "LightPlacement", "LoraConfig", "ModelConfig", "OffPolicyConfig", "Placement", "PrepareConfig", "RayConfig",
           "RecordConfig", "RedisConfig", "RewardConfig", "RolloutConfig", "RouterConfig", "Rule", "RunConfig", "SamplingConfig",
           "Section", "ServerConfig", "SuperviseConfig", "WeightSyncConfig", "problems"]

Rule = Callable[["Config"], Iterator[str]]
RULES: list[Rule] = []  # every cross-field rule, in the order streamrl.config.rules defines them


def problems(cfg: Config) -> list[str]:
    return [problem for check in RULES for problem in check(cfg)]


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    mode: Literal["async", "sync"] = Field("async", description="async: generation runs ahead of training (up to "
                                           "off_policy.max_staleness); sync: each step's data comes from its own "
                                           "version, generation waits for training")
    launcher: Literal["local", "ray"] = Field("local", description="where `streamrl up` runs its parts")
    redis: RedisConfig = Field(default_factory=RedisConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    record: RecordConfig = Field(default_factory=RecordConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    supervise: SuperviseConfig = Field(default_factory=SuperviseConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        """Every rule of ``streamrl.config.rules`` at once, so one load reports all that is wrong."""
        found = problems(self)
        if found:
            raise ValueError("\n  ".join(found))
        return self

    @property
    def staleness_bound(self) -> int:
        """The oldest policy lag trained data may have: ``off_policy.max_staleness`` (with ``auto``, the largest
        bound it may take), or 0 under ``mode: sync``."""
        return 0 if self.mode == "sync" else self.off_policy.ceiling

    @property
    def admission_bound(self) -> int:
        """The bound a worker admits under until the learner publishes one: a worker started before the learner
        (on another machine) must not run ahead to the ceiling that ``auto`` may never reach."""
        return 0 if self.mode == "sync" else self.off_policy.initial

    @property
    def learner_widens(self) -> bool:
        """Whether the learner takes every core while admission holds generation (``streamrl.learner.cores``):
        ``supervise.learner_threads: auto``, or unset in an asynchronous run of one learner rank under `streamrl
        up`'s own launcher. It does so only on the CPU."""
        threads = self.supervise.learner_threads
        return threads == "auto" or (threads is None and self.mode == "async" and self.launcher == "local"
                                     and self.learner.nproc == 1)

    @property
    def adapter_slots(self) -> int:
        """Adapter versions a LoRA server holds at once: ``server.max_loras``, or every version a request may
        still run under (the staleness bound's) and the one arriving."""
        return self.server.max_loras or self.staleness_bound + 2

    def redacted(self) -> dict[str, Any]:
        """The config as plain data without secrets (for trackers and logs)."""
        data = self.model_dump(mode="json")
        if data["redis"]["url"] and "@" in data["redis"]["url"]:
            scheme, rest = data["redis"]["url"].split("://", 1)
            data["redis"]["url"] = f"{scheme}://***@{rest.split('@', 1)[1]}"
        for section, key in (("redis", "password"), ("server", "token")):
            if data[section][key]:
                data[section][key] = "***"
        return data
