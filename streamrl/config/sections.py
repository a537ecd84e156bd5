"""The configuration's sections: one typed tree, one class per part, every field described.

Unknown keys are errors (``extra="forbid"``), so a typo never silently falls back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from streamrl.config.rules import problems


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    retries: int = Field(8, ge=0, description="reconnect attempts before giving up")
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


class RouterConfig(Section):
    """The sglang-router in front of the rollout servers."""

    host: str | None = Field(None, description="address the router binds, and rollout workers reach it at; empty: "
                             "its node's address on a Ray cluster (ray.address), else 127.0.0.1; announced in Redis")
    port: int = Field(30000, ge=1, le=65535, description="router port")
    policy: Literal["round_robin", "random", "cache_aware", "power_of_two"] = Field(
        "cache_aware", description="how the router picks a server for a request (cache_aware: the one holding the "
                                   "longest shared prefix)")
    request_timeout_s: float = Field(600.0, ge=1, description="longest the router waits on a server for one request "
                                     "(workers wait on the router as long, and 10 s more)")
    prometheus_port: int | None = Field(None, ge=1, le=65535, description="router metrics; default port + 1")
    health_check_interval_s: float = Field(2.0, ge=1, description="seconds between the router's health checks")
    sync_every_s: float = Field(1.0, gt=0, description="how often the worker set follows the registry")


class ServerConfig(Section):
    """Rollout servers (``streamrl serve``): an inference engine behind SGLang's HTTP API."""

    engine: Literal["hf", "vllm", "sglang"] = Field("hf", description="hf (transformers, continuous batching), "
                                                    "vllm (vLLM's engine) or sglang (a stock SGLang server)")
    count: int = Field(1, ge=0, description="rollout servers started by `streamrl up`")
    host: str | None = Field(None, description="address servers bind and register (others reach them at it); empty: "
                             "its node's address on a Ray cluster (ray.address), else 127.0.0.1")
    base_port: int = Field(31000, ge=1, le=65535, description="port of server 0; server i listens on base_port + i")
    max_batch_size: int = Field(64, ge=1, description="sequences a server decodes at once")
    kv_cache_gb: float | None = Field(None, gt=0, description="vllm engine: KV cache size in GiB (default: 2 on a "
                                      "CPU, vLLM's gpu_memory_utilization on a GPU)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vllm engine on a GPU: the share of "
                                                 "the GPU's memory a server may take (vLLM's own default: 0.9); "
                                                 "lower it where servers share a GPU with the learner")
    token: str | None = Field(None, description="bearer token required by control endpoints")
    max_lora_rank: int | None = Field(None, ge=1, description="with learner.lora: the largest adapter rank a "
                                      "server takes (default: learner.lora.rank)")
    max_loras: int | None = Field(None, ge=1, description="with learner.lora on vllm: adapter versions a server "
                                  "holds at once (default: off_policy.max_staleness + 2: every version a "
                                  "request may still run under, and the one arriving)")
    heartbeat_s: float = Field(2.0, gt=0, description="how often a server renews its entry in the registry")
    registry_ttl_s: float = Field(10.0, gt=0, description="a server whose heartbeat is older than this is taken "
                                  "for dead (the router, pushes and workers stop using it)")


class SamplingConfig(Section):
    """How training episodes sample (evaluation is greedy)."""

    n: int = Field(8, ge=1, description="samples per prompt (the group size)")
    max_new_tokens: int = Field(256, ge=1, description="tokens one model call may generate")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; the learner scores tokens at the same "
                               "temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (1: off)")
    top_k: int = Field(-1, ge=-1, description="sample among the k likeliest tokens (-1: off)")


class RolloutConfig(Section):
    """Rollout workers (``streamrl launch-rollout``): they play episodes through the router into the replay stream."""

    env: str = Field("arithmetic", description="env name (entry point), module:Class or file.py:Class; or an agent: "
                     "an async function (client, item) -> reward, named the same ways (docs/agents.md)")
    env_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the env (or agent)")
    dataset: str | None = Field(None, description="JSONL/Parquet file; empty uses the env's generator")
    shuffle: bool = Field(True, description="read the dataset in a new order each epoch, drawn from run.seed (off: "
                          "in file order)")
    workers: int = Field(1, ge=0, description="rollout workers started by `streamrl up`")
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
    prompt_lease_s: float = Field(600.0, gt=0, description="how long a dead worker's claimed prompt is held before another takes it (renewed while it runs)")
    group_lease_s: float = Field(600.0, gt=0, description="how long a dead worker's group holds its admission slot (renewed while it runs)")
    router_url: str | None = Field(None, description="where to send /generate; default: the router section")
    metrics_every_s: float = Field(10.0, gt=0, description="seconds between a worker's metrics records")
    prometheus_port: int | None = Field(None, ge=1, le=65535, description="worker /metrics on 127.0.0.1")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)


class RewardConfig(Section):
    """The reward-model server `streamrl serve-reward` starts (the `reward_model` env takes its URL from
    `rollout.env_args.url`)."""

    model_path: str | None = Field(None, description="local HF sequence-classification model")
    host: str = Field("127.0.0.1", description="address the reward server binds")
    port: int = Field(32000, ge=1, le=65535, description="reward server port")
    max_batch_size: int = Field(32, ge=1, description="(prompt, response) pairs scored in one forward")
    max_wait_ms: float = Field(5.0, ge=0, description="how long a batch waits to fill")
    max_length: int = Field(2048, ge=8, description="longest (prompt, response) in tokens; longer is cut from the left")


DEFAULT_MAX_STALENESS = 2  # the fixed bound's default


class AutoStalenessConfig(Section):
    """With `off_policy.max_staleness: auto`, how the learner moves the bound (docs/concepts.md): up while it
    waits for data the bound held back, on healthy off-policy data (doubled until the bound first comes down, by
    one after), halved when that data degrades, eased down by one while it never waits, put back where a raise
    did not speed it up (for `revert_hold` steps)."""

    low: int = Field(1, ge=0, description="smallest bound")
    high: int = Field(8, ge=1, description="largest bound")
    start: int | None = Field(None, ge=0, description="the bound once a fresh run's first step is trained (its "
                              "data comes in under low; empty: low, and raises double it from there)")
    wait_share: float = Field(0.1, ge=0, lt=1, description="a step that waited for data longer than this share "
                              "of it counts towards a raise (see held_share)")
    held_share: float = Field(0.5, ge=0, le=1, description="a wait counts towards a raise only if the bound turned "
                              "workers away for at least this share of it, or a group was dropped as stale (0: any "
                              "wait counts)")
    idle_share: float = Field(0.02, ge=0, lt=1, description="a step that waited for data under this share of it "
                              "counts towards easing the bound down by one (0: never ease)")
    ess_floor: float = Field(0.8, gt=0, lt=1, description="lower when the importance weights' effective sample "
                             "size (a share of the tokens) falls under this")
    ess_raise: float = Field(0.9, gt=0, le=1, description="raise only while the effective sample size is at least this")
    m2_ceiling: float = Field(1.5, gt=1, description="lower when the importance weights' second moment passes this")
    clip_ceiling: float = Field(0.1, gt=0, lt=1, description="lower when the clip fraction passes this")
    spike: float = Field(3.0, gt=1, description="lower when the gradient norm passes this many times its running "
                         "mean (of about the last 3 steps, judged from the 6th) while ESS is under ess_raise")
    raise_gain: float = Field(0.0, ge=0, lt=1, description="a raise is kept only if it cut the learner's mean "
                              "step time by this share (its cooldown's last `patience` steps against the "
                              "`patience` before it; 0: unless it made it longer); else the bound goes back and "
                              "raises stop there for `revert_hold` steps")
    revert_hold: int = Field(12, ge=1, description="steps after a revert before raises may pass its bound again")
    patience: int = Field(2, ge=1, description="steps in a row that must call for a raise (the last one while "
                          "the bound doubles), or for easing; a raise also needs this many steps under the bound")
    cooldown: int = Field(3, ge=1, description="steps after a change before the next")

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
        ``low``)."""
        return self.low if self.start is None else self.start


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
        """The bound in force until the learner publishes one (``auto``: low, the bound a fresh run fills its
        pipeline under before the learner opens it to ``start``)."""
        return self.auto.low if self.adaptive else self.max_staleness


class LoraConfig(Section):
    """A LoRA adapter trained in place of the whole model (PEFT): only the adapter trains and is pushed; the
    base with the adapter switched off is the KL reference. Unset by default (full fine-tuning); setting any of
    its fields (`learner.lora.rank=16`) turns it on."""

    rank: int = Field(16, ge=1, description="rank r of each adapter matrix pair")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: the update is (alpha / rank) * B @ A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="modules that get an adapter: PEFT's names (e.g. [q_proj, v_proj]) or "
                                  "all-linear (every linear layer but the output head)")
    name: str = Field("policy", pattern=r"^[A-Za-z0-9_.]+$", description="adapter name on the servers: "
                      "version N is served as NAME-vN")


class LearnerConfig(Section):
    """The DeepSpeed learner (``streamrl launch-learner``): algorithm, loss, optimizer and its cadence."""

    nproc: int = Field(1, ge=1, description="data-parallel ranks `streamrl up` starts (under torchrun, its world size)")
    algorithm: Literal["rloo", "grpo", "ppo"] = Field("rloo", description="advantage estimator: rloo (leave-one-out "
                                                     "group baseline), grpo (group mean and std), ppo (a critic)")
    credit: Literal["episode", "turn"] = Field("episode", description="rloo/grpo on multi-turn episodes: one "
                                               "advantage per episode, or one per turn (see turn_lam)")
    turn_gamma: float = Field(1.0, ge=0, le=1, description="credit=turn: discount from one turn to the next")
    turn_lam: float = Field(1.0, ge=0, le=1, description="credit=turn: 1 scores a turn by its own episode's "
                            "later rewards, 0 by the group's mean of them (a lucky retry vouches less)")
    groups_per_step: int = Field(8, ge=1, description="groups in one learner step's batch (a step makes one policy "
                                 "version: epochs x minibatches optimizer steps)")
    lr: float = Field(1e-5, gt=0, description="learning rate (constant after warmup)")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="optimizer of the policy (a PPO critic uses AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="weight decay of the policy's and critic's optimizers "
                                "(AdamW's is decoupled)")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear learning-rate warmup")
    max_steps: int = Field(100, ge=1, description="learner steps (policy versions); the run ends after the last")
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
    skip_zero_advantage: bool = Field(True, description="leave out of the forwards and backwards the sequences "
                                      "whose advantage is zero on every generated token (a group without signal) "
                                      "where that makes their gradient zero: rloo or grpo, no entropy bonus, no KL "
                                      "term in the loss. They still count in the loss's mean: the update is the same")
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
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage")
    grad_clip: float = Field(1.0, gt=0, description="largest gradient norm")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip")
    clip_eps_high: float | None = Field(None, gt=0, description="upper clip (DAPO's clip-higher); default clip_eps")
    dual_clip: float | None = Field(None, gt=1, description="bound the loss of negative advantages at c|A|")
    loss_agg: Literal["token", "sequence"] = Field("token", description="mean over all tokens, or of sequence means")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="estimator of KL to the initial policy "
                                                    "(Schulman's k1, k2, k3)")
    kl_coef: float = Field(0.0, ge=0, description="weight of KL to the initial policy (0: none)")
    kl_in_reward: bool = Field(False, description="subtract the KL from rewards instead of adding it to the loss")
    gamma: float = Field(1.0, ge=0, le=1, description="PPO: discount over generated tokens")
    lam: float = Field(0.95, ge=0, le=1, description="PPO: GAE lambda")
    critic_path: str | None = Field(None, description="PPO: value model start (default: the policy)")
    critic_lr: float = Field(1e-5, gt=0, description="PPO: critic learning rate")
    value_clip: float = Field(0.2, gt=0, description="PPO: clip of the value update")
    whiten_advantages: bool = Field(True, description="PPO: normalise advantages over the global batch")
    entropy_coef: float = Field(0.0, ge=0, description="weight of an entropy bonus (0: none)")
    checkpoint_every: int = Field(50, ge=1, description="learner steps between checkpoints")
    resume: Literal["auto", "never"] = Field("auto", description="auto: continue from the newest checkpoint")
    export_every: int = Field(50, ge=1, description="learner steps between plain HF exports (and one at the end)")
    tensorboard: bool = Field(False, description="also write metrics to runs/NAME/tensorboard")
    wandb_project: str | None = Field(None, description="also log metrics to this W&B project")
    deepspeed_config: Path | None = Field(None, description="user DeepSpeed JSON, used as is")
    ptx_dataset: str | None = Field(None, description="SFT rows mixed into each step (prompt/completion or text)")
    ptx_coef: float = Field(0.0, ge=0, description="weight of the SFT loss (mean token cross-entropy)")
    ptx_per_rank: int = Field(2, ge=1, description="SFT rows per rank per step")
    lora: LoraConfig | None = Field(None, description="train a LoRA adapter instead of every weight (empty: "
                                    "full fine-tuning)")


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
    master_address: str | None = Field(None, description="learner rank 0's address, as servers reach it; empty: its "
                                       "node's address on a Ray cluster (ray.address), else 127.0.0.1")


class PrepareConfig(Section):
    """A recipe's preparation step (data, model) run by `streamrl up` before the parts start."""

    fn: str | None = Field(None, description="module:function (or file.py:function) that `streamrl up` runs first; "
                           "returns overrides")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of prepare.fn")


class EvalConfig(Section):
    """Held-out evaluation (``streamrl evaluate``) as the learner's version moves."""

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
    refresh_s: float = Field(1.0, gt=0, description="seconds between display refreshes")
    threads: int | None = Field(None, ge=1, description="torch threads per server and learner rank (default: "
                                "cores / (servers + learner ranks))")
    learner_threads: int | None = Field(
        None, ge=1, description="torch threads per learner rank, when not `threads`: a learner-bound run, whose "
                                "servers wait on admission most of the time, may give its learner every core")


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
