"""The run's own sections: its name and directory, its model, its Redis, the recipe's preparation,
and how `streamrl up` supervises and places (on Ray) its parts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from streamrl.config.sections.base import Section


class RunConfig(Section):
    """The run's name and where its directory goes: ``dir/name`` holds its config, logs, metrics and exports."""

    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="Redis namespace and run-dir name")
    dir: Path = Field(Path("runs"), description="parent of the run directory")
    seed: int = Field(0, description="seeds the env's prompt generator, the dataset's order and a recipe's data: runs "
                      "with one seed see the same prompts")

    @property
    def path(self) -> Path:
        return self.dir / self.name


class RedisConfig(Section):
    """The Redis that joins every part: the replay stream, the prompt queue, the registry and the ledger."""

    url: str | None = Field(None, description="redis://, rediss:// or unix:// URL; empty starts an embedded "
                               "redis-server")
    host: str | None = Field(None, description="bind address of the embedded server; empty: `streamrl up`'s node on a "
                             "Ray cluster (ray.address), else 127.0.0.1")
    port: int = Field(0, ge=0, le=65535, description="port of the embedded server; 0 picks a free one")
    password: str | None = Field(None, description="embedded server: password it requires (then in its URL)")
    appendfsync: Literal["always", "everysec", "no"] = Field(
        "always", description="embedded Redis: always = no acknowledged write is lost if it is killed")
    retries: int = Field(8, ge=0, description="retries of a command that lost its connection, before giving up "
                         "(redis-py's Retry); each retry's reconnect is retried as often, so a server that accepts "
                         "connections and drops them is tried up to (retries + 1)^2 times")
    retry_cap_s: float = Field(2.0, gt=0, description="longest wait between reconnect attempts")
    dedupe_ttl_s: int = Field(3600, gt=0, description="how long the id of a put whose reply never arrived is "
                              "remembered (a retry within it is a no-op); acknowledged puts forget it at once")

    @field_validator("appendfsync", mode="before")
    @classmethod
    def _bare_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML reads a bare `no` as false

    def retry(self) -> dict[str, float]:
        """Keyword arguments of ``Namespace.open``: how hard a part tries to reach Redis."""
        return {"retries": self.retries, "retry_cap_s": self.retry_cap_s}

    @model_validator(mode="after")
    def _url_scheme(self) -> RedisConfig:
        if self.url and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must start with redis://, rediss:// or unix://, got {self.url!r}")
        return self


class ModelConfig(Section):
    """The policy: a local Hugging Face model directory."""

    path: str | None = Field(None, description="local Hugging Face model directory")
    tokenizer: str | None = Field(None, description="tokenizer directory; defaults to the model path")
    # no float16: the learner has no loss scaling, so it would train fp32 beside fp16 servers
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="weights the servers generate with and the "
                                                  "learner trains (see learner.mixed_precision)")


class PrepareConfig(Section):
    """A recipe's preparation step (data, model) run by `streamrl up` before the parts start."""

    fn: str | None = Field(None, description="module:function (or file.py:function) that `streamrl up` runs first; "
                           "returns overrides")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of prepare.fn")


class SuperviseConfig(Section):
    """How `streamrl up` looks after its parts."""

    restart: list[Literal["redis", "router", "server", "rollout", "learner", "evaluator"]] = Field(
        default_factory=lambda: ["redis", "router", "server", "rollout", "learner", "evaluator"],
        description="parts restarted when they die (Redis from its AOF, the learner from its last checkpoint); "
                    "any other part's death stops the run")
    max_restarts: int = Field(3, ge=0, description="restarts per part before the run is stopped")
    ready_timeout_s: float = Field(180.0, gt=0, description="how long a part may take to become ready")
    display: Literal["auto", "live", "plain"] = Field("auto", description="auto: live on a terminal, else plain")
    refresh_s: float = Field(1.0, gt=0, description="seconds between display refreshes")
    threads: int | None = Field(None, ge=1, description="torch threads per server and learner rank (default: "
                                "cores / (servers + learner ranks))")
    learner_threads: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        None, description="torch threads per learner rank, when not `threads`: a number, or auto: the learner's "
                          "share while the servers generate and every core once admission holds generation, until "
                          "its next version (one rank, on the CPU; each step's switch is recorded for replay); unset: "
                          "auto in an async run of one learner rank under the local launcher, else the share")
    server_nice: Annotated[int, Field(ge=0, le=19)] | Literal["auto"] = Field(
        0, description="the niceness of the servers' processes where they share this machine's CPU with the "
                       "learner (no GPU): 0 shares the cores evenly; auto renices them to 10 while the learner sets "
                       "the pace (it waits under 10% of its steps) and back to 0 while generation does (lowering "
                       "takes root), unless the learner's threads take every core; a number holds them at it")


class Placement(Section):
    """Where Ray may put one kind of part and what each one reserves (a learner: each rank)."""

    cpus: float = Field(1.0, ge=0, description="CPUs each one reserves")
    gpus: float = Field(0.0, ge=0, description="GPUs each one reserves (Ray sets its CUDA_VISIBLE_DEVICES)")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources each one reserves "
                                        "(`ray start --resources`), e.g. {inference: 1}")
    labels: dict[str, str] = Field(default_factory=dict, description="node labels its node must carry (`ray start "
                                   "--labels`), e.g. {gpu: a100}")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray's placement group strategy among the parts of this kind (PACK: on as few nodes "
                            "as have room)")

    def bundle(self) -> dict[str, float]:
        """What one of these reserves, as a Ray bundle."""
        wanted = {"CPU": self.cpus, "GPU": self.gpus, **self.resources}
        return {name: amount for name, amount in wanted.items() if amount > 0}


class LightPlacement(Placement):
    """Where Ray may put one kind of light part (no model: it reserves a tenth of a CPU by default)."""

    cpus: float = Field(0.1, ge=0, description="CPUs each one reserves")


class RayConfig(Section):
    """`launcher: ray`: the cluster, and per kind of part what it reserves and where it may go."""

    address: str | None = Field(None, description="cluster to join ('auto', HOST:PORT, ray://...); empty starts a "
                                "local one")
    server: Placement = Field(default_factory=Placement, description="each rollout server")
    learner: Placement = Field(default_factory=Placement, description="each learner rank")
    rollout: LightPlacement = Field(default_factory=LightPlacement, description="each rollout worker")
    router: LightPlacement = Field(default_factory=LightPlacement, description="the router")
    evaluator: LightPlacement = Field(default_factory=LightPlacement, description="the evaluator")
