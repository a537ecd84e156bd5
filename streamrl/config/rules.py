"""Combinations of settings the code would ignore or mis-handle, refused when a config is loaded.

Each rule takes the whole config and returns what is wrong with it (nothing when it is fine), naming the
field and the fix. A rule's docstring is its line in the configuration reference. A rule refuses only a
value the user changed: a default that does not apply to a mode is harmless.
"""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel

from streamrl.config.sections import RULES, Config, Rule


def rule(fn: Rule) -> Rule:
    """Check ``fn`` whenever a ``Config`` is validated (the tree holds the list: it imports nothing from here)."""
    RULES.append(fn)
    return fn


def _changed(section: BaseModel, *names: str) -> list[str]:
    """Which of ``names`` the user set away from their defaults."""
    fields = type(section).model_fields
    return [n for n in names if getattr(section, n) != fields[n].get_default(call_default_factory=True)]


# --------------------------------------------------------------------------- pushes and staleness


@rule
def pushes_keep_up_with_staleness(cfg: Config) -> Iterator[str]:
    """`weight_sync.sync_every` above `off_policy.max_staleness + 1` (with `stale: drop`), or above 1 with
    `mode: sync`: data would be too stale to train on when it arrives."""
    # tokens carry the version of the last *pushed* weights; if pushes are rarer than the staleness
    # bound allows, every group is too old on arrival, is dropped, and the run stalls
    every, bound = cfg.weight_sync.sync_every, cfg.off_policy.floor  # auto: at its lowest too
    if cfg.mode == "sync" and every != 1:
        yield f"weight_sync.sync_every: mode=sync needs 1 (a push after every step), got {every}"
    elif cfg.off_policy.stale == "drop" and every > bound + 1:
        yield (f"weight_sync.sync_every: {every} > off_policy.max_staleness + 1 = {bound + 1}; data would be too "
               "stale to train on; push more often or allow more staleness")


@rule
def auto_settings_need_auto(cfg: Config) -> Iterator[str]:
    """`off_policy.auto.*` without `off_policy.max_staleness: auto`; `auto` under `mode: sync`, whose bound is
    0."""
    off = cfg.off_policy
    changed = _changed(off.auto, *type(off.auto).model_fields)
    if not off.adaptive and changed:
        yield (f"off_policy.auto.{changed[0]} applies to off_policy.max_staleness: auto; max_staleness is "
               f"{off.max_staleness}")
    if off.adaptive and cfg.mode == "sync":
        yield "off_policy.max_staleness: auto moves the bound of async runs; mode=sync trains on fresh data alone"


@rule
def corrections_read_their_own_settings(cfg: Config) -> Iterator[str]:
    """`off_policy.tis_cap` without `correction: tis`; `off_policy.behav_weight_cap` without `correction:
    decoupled`."""
    off = cfg.off_policy
    if off.correction != "tis" and _changed(off, "tis_cap"):
        yield f"off_policy.tis_cap applies to correction=tis; correction is {off.correction!r}"
    if off.correction != "decoupled" and off.behav_weight_cap is not None:
        yield f"off_policy.behav_weight_cap applies to correction=decoupled; correction is {off.correction!r}"


# --------------------------------------------------------------------------- rollout and serving


@rule
def shuffle_needs_a_dataset(cfg: Config) -> Iterator[str]:
    """`rollout.shuffle` without `rollout.dataset`: the env's own generator has no file order to shuffle."""
    if not cfg.rollout.dataset and _changed(cfg.rollout, "shuffle"):
        yield ("rollout.shuffle applies to rollout.dataset; without one the env's generator draws the prompts, "
               "seeded by run.seed")


@rule
def engine_settings_fit_the_engine(cfg: Config) -> Iterator[str]:
    """`server.kv_cache_gb` or `server.gpu_memory_utilization` with an engine other than vllm;
    `rollout.sampling.top_p` / `top_k` with vllm,
    whose logprobs come renormalised after truncation; `weight_sync.backend: nccl` with the hf engine, which runs
    on the CPU; `server.engine: sglang` for servers streamrl starts."""
    server, sampling = cfg.server, cfg.rollout.sampling
    if server.kv_cache_gb is not None and server.engine != "vllm":
        yield (f"server.kv_cache_gb sizes the vllm engine's KV cache; engine {server.engine!r} does not read it: "
               "leave it unset")
    if server.gpu_memory_utilization is not None and server.engine != "vllm":
        yield (f"server.gpu_memory_utilization sizes the vllm engine's share of a GPU; engine {server.engine!r} does "
               "not read it: leave it unset")
    if server.engine == "vllm" and (sampling.top_p < 1 or sampling.top_k != -1):
        yield ("rollout.sampling.top_p/top_k: vLLM reports logprobs renormalised after top-p/top-k truncation, which "
               "would not match the learner's; use top_p=1 and top_k=-1 with server.engine=vllm, or the hf engine")
    if server.engine == "hf" and cfg.weight_sync.backend == "nccl":
        yield ("weight_sync.backend: nccl moves weights GPU to GPU, and the hf engine keeps its weights on the CPU: "
               "use backend auto or gloo, or server.engine=vllm")
    if server.engine == "sglang" and server.count > 0:
        yield ("server.engine: sglang names stock SGLang servers, which streamrl does not start: serve with "
               "engine hf or vllm (`streamrl serve` speaks SGLang's API), or set server.count=0")


@rule
def groups_can_be_trained(cfg: Config) -> Iterator[str]:
    """`rollout.min_group` above `rollout.sampling.n`; `sampling.n` of 1 with rloo or grpo (a group of one has
    no baseline); `sampling.temperature` 0 (greedy samples cannot train; evaluation is greedy already)."""
    sampling, learner = cfg.rollout.sampling, cfg.learner
    if cfg.rollout.min_group > sampling.n:
        yield (f"rollout.min_group: {cfg.rollout.min_group} > rollout.sampling.n = {sampling.n}; no group could "
               "ever be pushed")
    if sampling.n < 2 and learner.algorithm in ("rloo", "grpo"):
        yield (f"rollout.sampling.n: {learner.algorithm} compares the samples of a group, so it needs n >= 2 "
               "(or use algorithm=ppo)")
    if sampling.temperature == 0:
        yield ("rollout.sampling.temperature: 0 makes every sample of a group the same greedy reply, which the "
               "learner cannot learn from; evaluation is greedy already")


@rule
def ports_and_heartbeats_fit(cfg: Config) -> Iterator[str]:
    """`server.base_port + server.count - 1` past 65535; `server.heartbeat_s` or `router.sync_every_s` (the
    router's announcement) not below `server.registry_ttl_s`; `rollout.prometheus_port` with several workers (they
    would share it)."""
    server = cfg.server
    if server.base_port + max(server.count, 1) - 1 > 65535:
        yield f"server.base_port: {server.base_port} + {server.count} servers runs past port 65535"
    if server.heartbeat_s >= server.registry_ttl_s:
        yield (f"server.heartbeat_s: {server.heartbeat_s} >= server.registry_ttl_s = {server.registry_ttl_s}; "
               "servers would expire between heartbeats")
    if cfg.router.sync_every_s >= server.registry_ttl_s:
        yield (f"router.sync_every_s: {cfg.router.sync_every_s} >= server.registry_ttl_s = {server.registry_ttl_s}; "
               "the router's announcement would expire between its renewals")
    if cfg.rollout.prometheus_port is not None and cfg.rollout.workers > 1:
        yield (f"rollout.prometheus_port: {cfg.rollout.workers} workers would all bind port "
               f"{cfg.rollout.prometheus_port}; leave it unset or run one worker per config")


# --------------------------------------------------------------------------- learner


@rule
def mixed_precision_needs_bfloat16(cfg: Config) -> Iterator[str]:
    """`learner.mixed_precision` without `model.dtype: bfloat16`."""
    if cfg.learner.mixed_precision and cfg.model.dtype != "bfloat16":
        yield (f"learner.mixed_precision computes in bfloat16 over fp32 weights; model.dtype is "
               f"{cfg.model.dtype!r}: set model.dtype=bfloat16")


@rule
def micro_batches_hold_a_sample(cfg: Config) -> Iterator[str]:
    """`learner.micro_batch_tokens` below `rollout.max_context`: a long sample would fit no micro-batch."""
    if cfg.learner.micro_batch_tokens < cfg.rollout.max_context:
        yield (f"learner.micro_batch_tokens: {cfg.learner.micro_batch_tokens} < rollout.max_context = "
               f"{cfg.rollout.max_context}; a sample that long would fit no micro-batch")


@rule
def every_minibatch_gets_a_group(cfg: Config) -> Iterator[str]:
    """`learner.minibatches` above `learner.groups_per_step`: a minibatch is made of whole groups."""
    if cfg.learner.minibatches > cfg.learner.groups_per_step:
        yield (f"learner.minibatches: {cfg.learner.minibatches} > learner.groups_per_step = "
               f"{cfg.learner.groups_per_step}; a minibatch is made of whole groups")


@rule
def settings_of_another_algorithm(cfg: Config) -> Iterator[str]:
    """PPO's settings (`gamma`, `lam`, `critic_path`, `critic_lr`, `value_clip`, `whiten_advantages`) without
    `algorithm: ppo`; `credit: turn` with ppo, whose critic already scores every token; `turn_gamma` /
    `turn_lam` without `credit: turn`."""
    learner = cfg.learner
    if learner.algorithm != "ppo":
        for name in _changed(learner, "gamma", "lam", "critic_path", "critic_lr", "value_clip", "whiten_advantages"):
            yield f"learner.{name} applies to algorithm=ppo; algorithm is {learner.algorithm!r}"
    if learner.credit == "turn" and learner.algorithm == "ppo":
        yield ("learner.credit: 'turn' is for rloo and grpo; ppo's critic already scores every token "
               "(learner.gamma, learner.lam)")
    if learner.credit != "turn":
        for name in _changed(learner, "turn_gamma", "turn_lam"):
            yield f"learner.{name} applies to credit=turn; credit is {learner.credit!r}"


@rule
def no_signal_is_a_group_baselines_notion(cfg: Config) -> Iterator[str]:
    """`learner.drop_no_signal` with ppo, `credit: turn` or the KL in the reward, where a group of equal rewards
    still has a gradient."""
    learner = cfg.learner
    if learner.drop_no_signal and (learner.algorithm == "ppo" or learner.credit == "turn"):
        yield ("learner.drop_no_signal is for rloo and grpo with credit: episode; a group with equal rewards still "
               "has a gradient under " + ("ppo's critic" if learner.algorithm == "ppo" else "turn credit"))
    elif learner.drop_no_signal and learner.kl_in_reward:
        yield ("learner.drop_no_signal with learner.kl_in_reward: a group with equal rewards still has a gradient, "
               "its samples' KL penalties differ")


@rule
def kl_settings_need_a_kl(cfg: Config) -> Iterator[str]:
    """`learner.kl_estimator` or `kl_in_reward` with `kl_coef` 0 (no reference model runs); `kl_in_reward` under
    `zero_stage: 3` (the reference runs on rank 0 alone)."""
    learner = cfg.learner
    if learner.kl_coef == 0:
        for name in _changed(learner, "kl_estimator", "kl_in_reward"):
            yield f"learner.{name} needs learner.kl_coef > 0 (0 runs no reference model)"
    elif learner.kl_in_reward and learner.zero_stage == 3:
        yield ("learner.kl_in_reward runs the reference on rank 0 alone, which ZeRO-3's sharded weights do not "
               "allow: put the KL in the loss (kl_in_reward: false) or use zero_stage < 3")


@rule
def sft_mix_is_whole(cfg: Config) -> Iterator[str]:
    """`learner.ptx_dataset` without `ptx_coef` > 0, or `ptx_coef` / `ptx_per_rank` without `ptx_dataset`."""
    learner = cfg.learner
    if learner.ptx_dataset and learner.ptx_coef == 0:
        yield "learner.ptx_dataset is mixed in only with learner.ptx_coef > 0: set its weight"
    if not learner.ptx_dataset:
        for name in _changed(learner, "ptx_coef", "ptx_per_rank"):
            yield f"learner.{name} needs learner.ptx_dataset (the SFT rows to mix in)"


@rule
def deepspeed_json_is_used_as_is(cfg: Config) -> Iterator[str]:
    """`learner.grad_clip` with `learner.deepspeed_config`: the JSON is used as is, so put it there."""
    if cfg.learner.deepspeed_config is not None and _changed(cfg.learner, "grad_clip"):
        yield ("learner.grad_clip: learner.deepspeed_config is used as is; set gradient_clipping in that JSON "
               "instead")


# --------------------------------------------------------------------------- launching


@rule
def launcher_settings_need_their_launcher(cfg: Config) -> Iterator[str]:
    """`ray.*` without `launcher: ray`; under Ray on a cluster (`ray.address`), an address pinned to loopback
    (parts on other nodes cannot reach it: leave it empty and each part announces its node's address); a
    `ray.<kind>` that reserves nothing; any `supervise.server_nice` but 0 under Ray; `prepare.args` without
    `prepare.fn`."""
    if cfg.launcher != "ray":
        for name in _changed(cfg.ray, *type(cfg.ray).model_fields):
            yield f"ray.{name} applies to launcher=ray (or `streamrl up CONFIG --ray ADDRESS`)"
    elif cfg.ray.address is not None:
        pinned = [f"{name}={host}" for name, host in (("redis.host", cfg.redis.host), ("server.host", cfg.server.host),
                                                     ("router.host", cfg.router.host),
                                                     ("weight_sync.master_address", cfg.weight_sync.master_address))
                  if host in ("127.0.0.1", "localhost", "0.0.0.0", "::1")]
        if pinned:
            yield (f"{', '.join(pinned)}: parts that Ray places on other nodes cannot reach a loopback or wildcard "
                   "address; leave it empty, and each part binds and announces the address of the node it lands on")
    for kind in ("server", "learner", "rollout", "router", "evaluator"):
        if cfg.launcher == "ray" and not getattr(cfg.ray, kind).bundle():
            yield f"ray.{kind} reserves nothing (cpus 0, no gpus or resources): Ray places no empty bundle"
    if cfg.launcher == "ray" and cfg.supervise.server_nice != 0:
        yield ("supervise.server_nice applies to servers `streamrl up` starts on its own machine; Ray gives each "
               "part its own reserved CPUs (ray.server.cpus)")
    if cfg.prepare.args and not cfg.prepare.fn:
        yield "prepare.args are the arguments of prepare.fn, which is not set"


@rule
def learner_threads_widen_one_local_rank(cfg: Config) -> Iterator[str]:
    """`supervise.learner_threads: auto` under Ray (each part has its reserved CPUs) or with more than one learner
    rank (each would widen onto the same cores)."""
    if cfg.supervise.learner_threads != "auto":
        return
    if cfg.launcher == "ray":
        yield ("supervise.learner_threads=auto widens the learner onto the cores of the machine `streamrl up` shares "
               "with its servers; Ray gives each part its own reserved CPUs (ray.learner.cpus)")
    if cfg.learner.nproc > 1:
        yield (f"supervise.learner_threads=auto widens one learner rank, and learner.nproc is {cfg.learner.nproc}: "
               "give each rank a number of threads instead")


# --------------------------------------------------------------------------- LoRA


@rule
def adapters_fit_the_servers(cfg: Config) -> Iterator[str]:
    """`server.max_lora_rank` or `server.max_loras` without `learner.lora`; an adapter rank above
    `server.max_lora_rank`; fewer adapter slots than `off_policy.max_staleness + 1`; LoRA with stock SGLang
    servers, or with `weight_sync.backend: nccl` (adapters travel over gloo)."""
    lora, server = cfg.learner.lora, cfg.server
    if lora is None:
        for name in _changed(server, "max_lora_rank", "max_loras"):
            yield f"server.{name} sizes a server's LoRA adapters, and learner.lora is not set: leave it unset"
        return
    if server.max_lora_rank is not None and lora.rank > server.max_lora_rank:
        yield (f"learner.lora.rank {lora.rank} > server.max_lora_rank {server.max_lora_rank}: the servers would "
               "refuse every adapter; raise server.max_lora_rank or lower the rank")
    if server.max_loras is not None and server.max_loras < cfg.staleness_bound + 1:
        yield (f"server.max_loras {server.max_loras} < off_policy.max_staleness + 1 = {cfg.staleness_bound + 1}: "
               "a server must hold every adapter version a running request may still use; raise it or leave it "
               "unset")
    if server.engine == "sglang":
        yield "learner.lora: streamrl pushes adapters to its own hf and vllm servers; use server.engine hf or vllm"
    if cfg.weight_sync.backend == "nccl":
        yield ("weight_sync.backend: nccl with learner.lora: an adapter is small and travels over gloo to the "
               "server's process; use backend auto or gloo")
