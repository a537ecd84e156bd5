"""One typed configuration tree for every streamrl process.

Every process (router, servers, rollout workers, learner) reads the same YAML
file; command-line overrides use dotted paths: ``learner.lr=3e-6``.
Unknown keys are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says why."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="Redis namespace and run-dir name")
    dir: Path = Field(Path("runs"), description="parent of the run directory")
    seed: int = 0

    @property
    def path(self) -> Path:
        return self.dir / self.name


class RedisConfig(Section):
    url: str | None = Field(None, description="redis:// URL; empty starts an embedded redis-server")
    host: str = Field("127.0.0.1", description="bind address of the embedded server")
    port: int = Field(0, ge=0, le=65535, description="port of the embedded server; 0 picks a free one")
    password: str | None = None
    appendfsync: Literal["always", "everysec", "no"] = Field(
        "always", description="embedded Redis: always = no acknowledged write is lost if it is killed")
    retries: int = Field(8, ge=0, description="reconnect attempts before giving up")
    retry_cap_s: float = Field(2.0, gt=0, description="longest wait between reconnect attempts")
    dedupe_ttl_s: int = Field(3600, gt=0, description="how long the id of a put whose reply never arrived is "
                              "remembered (a retry within it is a no-op); acknowledged puts forget it at once")

    def retry(self) -> dict[str, float]:
        """Keyword arguments of ``Namespace.open``: how hard a part tries to reach Redis."""
        return {"retries": self.retries, "retry_cap_s": self.retry_cap_s}

    @model_validator(mode="after")
    def _url_scheme(self) -> RedisConfig:
        if self.url and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must start with redis://, rediss:// or unix://, got {self.url!r}")
        return self


class ModelConfig(Section):
    path: str | None = Field(None, description="local Hugging Face model directory")
    tokenizer: str | None = Field(None, description="tokenizer directory; defaults to the model path")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class RouterConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    policy: Literal["round_robin", "random", "cache_aware", "power_of_two"] = "cache_aware"
    request_timeout_s: float = Field(600.0, gt=0)
    prometheus_port: int | None = Field(None, ge=1, le=65535, description="router metrics; default port + 1")
    health_check_interval_s: float = Field(2.0, ge=1)
    sync_every_s: float = Field(1.0, gt=0, description="how often the worker set follows the registry")


class ServerConfig(Section):
    engine: Literal["hf", "vllm", "sglang"] = "hf"
    count: int = Field(1, ge=0, description="rollout servers started by `streamrl up`")
    host: str = "127.0.0.1"
    base_port: int = Field(31000, ge=1, le=65535)
    max_batch_size: int = Field(64, ge=1)
    kv_cache_gb: float | None = Field(None, gt=0, description="vllm engine: KV cache size in GiB (default: 2 on a "
                                      "CPU, vLLM's gpu_memory_utilization on a GPU)")
    token: str | None = Field(None, description="bearer token required by control endpoints")
    heartbeat_s: float = Field(2.0, gt=0)
    registry_ttl_s: float = Field(10.0, gt=0)


class SamplingConfig(Section):
    n: int = Field(8, ge=1, description="samples per prompt (the group size)")
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)


class RolloutConfig(Section):
    env: str = Field("arithmetic", description="env name (entry point), module:Class or file.py:Class; or an agent: "
                     "an async function (client, item) -> reward, named the same ways (docs/agents.md)")
    env_args: dict[str, Any] = Field(default_factory=dict)
    dataset: str | None = Field(None, description="JSONL/Parquet file; empty uses the env's generator")
    workers: int = Field(1, ge=0)
    concurrency: int = Field(32, ge=1, description="episodes in flight per worker")
    coalesce_ms: float = Field(2.0, ge=0, description="how long a generation waits for sibling episodes with the "
                               "same context, to go out together as one /generate with n (0: never)")
    env_concurrency: int = Field(64, ge=1, description="env steps in flight per worker")
    oldest_first: bool = Field(False, description="a busy server serves the requests of groups admitted at older "
                               "policy versions first, as their data goes stale first (off: first come first served)")
    env_timeout_s: float = Field(60.0, gt=0, description="longest an env reset or step may take; an agent's longest "
                                 "stretch of its own code between model calls")
    tool_parser: str = Field("hermes", description="agents: how tool calls are read from the generated text: hermes "
                             "(<tool_call>{json}</tool_call>), json (the reply is the call), or module:function")
    agent_max_calls: int = Field(32, ge=1, description="agents: model calls an episode may make")
    max_context: int = Field(2048, ge=8, description="longest trajectory context in tokens")
    min_group: int = Field(2, ge=1, description="fewest good samples a group needs to be pushed")
    prompt_lease_s: float = Field(600.0, gt=0, description="how long a claimed prompt is held")
    group_lease_s: float = Field(600.0, gt=0, description="how long an admitted group holds its slot")
    router_url: str | None = Field(None, description="where to send /generate; default: the router section")
    metrics_every_s: float = Field(10.0, gt=0)
    prometheus_port: int | None = Field(None, ge=1, le=65535, description="worker /metrics on 127.0.0.1")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)


class RewardConfig(Section):
    """A reward-model server (``streamrl serve-reward``) and where envs find it."""

    model_path: str | None = Field(None, description="local HF sequence-classification model")
    host: str = "127.0.0.1"
    port: int = Field(32000, ge=1, le=65535)
    max_batch_size: int = Field(32, ge=1)
    max_wait_ms: float = Field(5.0, ge=0, description="how long a batch waits to fill")
    max_length: int = Field(2048, ge=8, description="longest (prompt, response) in tokens; longer is cut from the left")


class OffPolicyConfig(Section):
    max_staleness: int = Field(2, ge=0, description="oldest policy lag a trained token may have")
    stale: Literal["drop", "keep"] = Field("drop", description="what the learner does with data past the bound")
    correction: Literal["none", "tis", "decoupled"] = "decoupled"
    tis_cap: float = Field(2.0, gt=0)
    behav_weight_cap: float | None = Field(None, gt=1, description="decoupled: leave out tokens whose "
                                           "pi_prox / pi_behav exceeds this (AReaL's behav_imp_weight_cap)")


class LearnerConfig(Section):
    nproc: int = Field(1, ge=1, description="data-parallel ranks")
    algorithm: Literal["rloo", "grpo", "ppo"] = "rloo"
    credit: Literal["episode", "turn"] = Field("episode", description="rloo/grpo on multi-turn episodes: one "
                                               "advantage per episode, or one per turn (see turn_lam)")
    turn_gamma: float = Field(1.0, ge=0, le=1, description="credit=turn: discount from one turn to the next")
    turn_lam: float = Field(1.0, ge=0, le=1, description="credit=turn: 1 scores a turn by its own episode's "
                            "later rewards, 0 by the group's mean of them (a lucky retry vouches less)")
    groups_per_step: int = Field(8, ge=1)
    lr: float = Field(1e-5, gt=0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    warmup_steps: int = Field(0, ge=0)
    max_steps: int = Field(100, ge=1)
    epochs: int = Field(1, ge=1, description="passes over each batch (PPO epochs)")
    minibatches: int = Field(1, ge=1, description="optimizer steps per pass, each on a share of the batch's groups "
                             "(PPO minibatches): the clip acts from the second on")
    micro_batch_tokens: int = Field(8192, ge=1, description="tokens of one micro-batch: its sequences concatenated "
                                    "into one row, no padding")
    balance: Literal["tokens", "flops"] = Field("tokens", description="what the partitioner evens out over "
                                                "micro-batches and ranks: tokens, or a FLOP estimate (attention "
                                                "grows with length²)")
    drop_no_signal: bool = Field(False, description="DAPO's dynamic sampling: leave out groups whose rewards are "
                                 "all equal (RLOO and GRPO give them no gradient) and read on until groups_per_step "
                                 "groups with signal")
    share_prompts: bool = Field(True, description="forward each prompt once per micro-batch, not once per sample "
                                "(off: for models whose forward cannot continue from a KV cache)")
    mismatch_warn_kl: float = Field(0.01, ge=0, description="warn when KL(behaviour || learner) on tokens generated "
                                    "at the learner's own version exceeds this (the same weights on both sides: a "
                                    "dtype, chat-template or engine-logprob bug)")
    mixed_precision: bool = Field(False, description="with model.dtype bfloat16: the policy's weights and AdamW stay "
                                  "fp32 and its forwards and backwards run under bfloat16 autocast (the servers "
                                  "serve bfloat16 copies of each push); off, the weights themselves are bfloat16 and "
                                  "an update smaller than their rounding step waits for the fp32 master copy to "
                                  "cross it")
    zero_stage: int = Field(0, ge=0, le=3)
    grad_clip: float = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = Field(None, description="upper clip (DAPO's clip-higher); default clip_eps")
    dual_clip: float | None = Field(None, gt=1, description="bound the loss of negative advantages at c|A|")
    loss_agg: Literal["token", "sequence"] = Field("token", description="mean over all tokens, or of sequence means")
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_coef: float = Field(0.0, ge=0, description="weight of KL to the initial policy (0: none)")
    kl_in_reward: bool = Field(False, description="subtract the KL from rewards instead of adding it to the loss")
    gamma: float = Field(1.0, ge=0, le=1, description="PPO: discount over generated tokens")
    lam: float = Field(0.95, ge=0, le=1, description="PPO: GAE lambda")
    critic_path: str | None = Field(None, description="PPO: value model start (default: the policy)")
    critic_lr: float = Field(1e-5, gt=0)
    value_clip: float = Field(0.2, gt=0)
    whiten_advantages: bool = Field(True, description="PPO: normalise advantages over the global batch")
    entropy_coef: float = Field(0.0, ge=0)
    checkpoint_every: int = Field(50, ge=1, description="optimizer steps between checkpoints")
    resume: Literal["auto", "never"] = Field("auto", description="auto: continue from the newest checkpoint")
    export_every: int = Field(50, ge=1, description="optimizer steps between plain HF exports (and one at the end)")
    tensorboard: bool = Field(False, description="also write metrics to runs/NAME/tensorboard")
    wandb_project: str | None = Field(None, description="also log metrics to this W&B project")
    deepspeed_config: Path | None = Field(None, description="user DeepSpeed JSON, used as is")
    ptx_dataset: str | None = Field(None, description="SFT rows mixed into each step (prompt/completion or text)")
    ptx_coef: float = Field(0.0, ge=0, description="weight of the SFT loss (mean token cross-entropy)")
    ptx_per_rank: int = Field(2, ge=1, description="SFT rows per rank per step")


class WeightSyncConfig(Section):
    sync_every: int = Field(1, ge=1, description="optimizer steps between pushes")
    mode: Literal["pause", "in_flight"] = "in_flight"
    bucket_mb: float = Field(64.0, gt=0)
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = Field(60.0, gt=0, description="how long a push waits for a server before dropping it")
    master_address: str = Field("127.0.0.1", description="learner rank 0's address, as servers reach it")


class PrepareConfig(Section):
    fn: str | None = Field(None, description="module:function (or file.py:function) that `streamrl up` runs first; "
                           "returns overrides")
    args: dict[str, Any] = Field(default_factory=dict)


class EvalConfig(Section):
    dataset: str | None = Field(None, description="held-out rows for rollout.env; empty: no evaluation")
    every: int = Field(10, ge=1, description="learner steps between evaluations (and one at the start and end)")
    size: int = Field(64, ge=1, description="prompts per evaluation (greedy decoding)")
    log_samples: int = Field(4, ge=0, description="trajectories written to rollouts/step_N.jsonl per evaluation")


class SuperviseConfig(Section):
    """How `streamrl up` looks after its parts."""

    restart: list[Literal["redis", "router", "server", "rollout", "learner", "evaluator"]] = Field(
        default_factory=lambda: ["redis", "router", "server", "rollout", "learner", "evaluator"],
        description="parts restarted when they die (Redis from its AOF, the learner from its last checkpoint); "
                    "any other part's death stops the run")
    max_restarts: int = Field(3, ge=0, description="restarts per part before the run is stopped")
    ready_timeout_s: float = Field(180.0, gt=0, description="how long a part may take to become ready")
    display: Literal["auto", "live", "plain"] = Field("auto", description="auto: live on a terminal, else plain")
    refresh_s: float = Field(1.0, gt=0)
    threads: int | None = Field(None, ge=1, description="torch threads per server and learner rank (default: "
                                "cores / (servers + learner ranks))")
    learner_threads: int | None = Field(
        None, ge=1, description="torch threads per learner rank, when not `threads`: a learner-bound run, whose "
                                "servers wait on admission most of the time, may give its learner every core")


class RayConfig(Section):
    """Resources for `launcher: ray`: each part gets a bundle in one placement group."""

    address: str | None = Field(None, description="cluster to join ('auto', ray://...); empty starts a local one")
    cpus_per_server: float = Field(1.0, ge=0)
    gpus_per_server: float = Field(0.0, ge=0)
    cpus_per_learner_rank: float = Field(1.0, ge=0)
    gpus_per_learner_rank: float = Field(0.0, ge=0)
    cpus_per_part: float = Field(0.1, gt=0, description="router, each rollout worker, the evaluator")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    mode: Literal["async", "sync"] = "async"
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
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    supervise: SuperviseConfig = Field(default_factory=SuperviseConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="after")
    def _pushes_keep_up_with_staleness(self) -> Config:
        # tokens carry the version of the last *pushed* weights; if pushes are rarer than the staleness
        # bound allows, every group is too old on arrival, is dropped, and the run stalls
        every, bound = self.weight_sync.sync_every, self.off_policy.max_staleness
        if self.mode == "sync" and every != 1:
            raise ValueError(f"weight_sync.sync_every: mode=sync needs 1 (a push after every step), got {every}")
        if self.off_policy.stale == "drop" and every > bound + 1:
            raise ValueError(f"weight_sync.sync_every: {every} > off_policy.max_staleness + 1 = {bound + 1}; data "
                             "would be too stale to train on; push more often or allow more staleness")
        return self

    @model_validator(mode="after")
    def _engine_settings_fit_the_engine(self) -> Config:
        server, sampling = self.server, self.rollout.sampling
        if server.kv_cache_gb is not None and server.engine != "vllm":
            raise ValueError(f"server.kv_cache_gb sizes the vllm engine's KV cache; engine {server.engine!r} "
                             "does not read it: leave it unset")
        if server.engine == "vllm" and (sampling.top_p < 1 or sampling.top_k != -1):
            raise ValueError("rollout.sampling.top_p/top_k: vLLM reports logprobs renormalised after top-p/top-k "
                             "truncation, which would not match the learner's; use top_p=1 and top_k=-1 with "
                             "server.engine=vllm, or the hf engine")
        return self

    @model_validator(mode="after")
    def _mixed_precision_needs_bfloat16(self) -> Config:
        if self.learner.mixed_precision and self.model.dtype != "bfloat16":
            raise ValueError(f"learner.mixed_precision computes in bfloat16 over fp32 weights; model.dtype is "
                             f"{self.model.dtype!r}: set model.dtype=bfloat16 (float16 would need loss scaling)")
        return self

    @model_validator(mode="after")
    def _every_minibatch_gets_a_group(self) -> Config:
        if self.learner.minibatches > self.learner.groups_per_step:
            raise ValueError(f"learner.minibatches: {self.learner.minibatches} > learner.groups_per_step = "
                             f"{self.learner.groups_per_step}; a minibatch is made of whole groups")
        return self

    @model_validator(mode="after")
    def _turn_credit_needs_a_group_estimator(self) -> Config:
        if self.learner.credit == "turn" and self.learner.algorithm == "ppo":
            raise ValueError("learner.credit: 'turn' is for rloo and grpo; ppo's critic already scores every "
                             "token (learner.gamma, learner.lam)")
        return self

    @model_validator(mode="after")
    def _kl_in_reward_runs_on_rank_zero(self) -> Config:
        if self.learner.kl_in_reward and self.learner.kl_coef > 0 and self.learner.zero_stage == 3:
            raise ValueError("learner.kl_in_reward runs the reference on rank 0 alone, which ZeRO-3's sharded weights "
                             "do not allow: put the KL in the loss (kl_in_reward: false) or use zero_stage < 3")
        return self

    @model_validator(mode="after")
    def _no_signal_is_a_group_baselines_notion(self) -> Config:
        learner = self.learner
        if learner.drop_no_signal and (learner.algorithm == "ppo" or learner.credit == "turn"):
            raise ValueError("learner.drop_no_signal is for rloo and grpo with credit: episode; a group with equal "
                             "rewards still has a gradient under " + ("ppo's critic" if learner.algorithm == "ppo"
                                                                      else "turn credit"))
        return self

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


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML file (or the defaults when ``path`` is None) and apply ``a.b=c`` overrides."""
    where = str(path) if path else "<defaults>"
    tree = _read_yaml(Path(path)) if path else {}
    for item in overrides:
        _apply_override(tree, item)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"invalid config {where}:\n{_describe(e)}") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {e}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level, got {type(tree).__name__}")
    return tree


def _apply_override(tree: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.field=value")
    parts = key.strip().split(".")
    node: dict[str, Any] = tree
    model: type[BaseModel] | None = Config  # None once inside a free-form dict field
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if model is not None:
            if part not in model.model_fields:
                name = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {item!r}: {name}: {_unknown(parts[: depth + 1], model.model_fields)}")
            annotation = model.model_fields[part].annotation
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
            if not last and model is None and get_origin(annotation) is not dict:
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: depth + 1])} is a value, not a section")
        if last:
            node[part] = _parse_value(raw)
            return
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[: depth + 1])} is not a mapping in the file")
        node = child


def _parse_value(raw: str) -> Any:
    """YAML scalars, so that ``lr=1e-5``, ``x=true`` and ``xs=[1,2]`` get their natural types."""
    try:
        return yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        return raw


def _unknown(path: list[str], fields: dict[str, Any]) -> str:
    close = difflib.get_close_matches(path[-1], list(fields), n=1)
    hint = f" (did you mean {'.'.join(path[:-1] + close)!r}?)" if close else ""
    return f"unknown key{hint}; allowed here: {', '.join(fields) or 'nothing'}"


def _fields_at(path: list[str]) -> dict[str, Any]:
    model: Any = Config
    for part in path:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return {}
        model = field.annotation
    return model.model_fields if isinstance(model, type) and issubclass(model, BaseModel) else {}


def _describe(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            path = [str(p) for p in err["loc"]]
            lines.append(f"  {loc}: {_unknown(path, _fields_at(path[:-1]))}")
            continue
        got = err.get("input")
        lines.append(f"  {loc}: {err['msg']} (got {got!r})")
    return "\n".join(lines)


def dump_config(config: Config) -> str:
    """The resolved config as YAML, written beside every run for reproducibility."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
