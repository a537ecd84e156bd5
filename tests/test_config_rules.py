"""Every combination the code would ignore or mis-handle is refused by name; the shipped configs pass."""

import pytest

from streamrl.config import ConfigError, load_config, rules, sections
from streamrl.config.rules import RULES

# (overrides, what the error must say, the rule that says it)
REFUSED = [
    (["weight_sync.sync_every=4", "off_policy.max_staleness=2"], "weight_sync.sync_every: 4 >",
     "pushes_keep_up_with_staleness"),
    (["mode=sync", "weight_sync.sync_every=2"], "mode=sync needs 1", "pushes_keep_up_with_staleness"),
    (["off_policy.tis_cap=3"], "off_policy.tis_cap applies to correction=tis", "corrections_read_their_own_settings"),
    (["off_policy.correction=tis", "off_policy.behav_weight_cap=5"], "behav_weight_cap applies to correction=decoupled",
     "corrections_read_their_own_settings"),
    (["rollout.shuffle=false"], "rollout.shuffle applies to rollout.dataset", "shuffle_needs_a_dataset"),
    (["server.kv_cache_gb=2"], "server.kv_cache_gb sizes the vllm engine", "engine_settings_fit_the_engine"),
    (["server.gpu_memory_utilization=0.5"], "server.gpu_memory_utilization sizes the vllm engine's share",
     "engine_settings_fit_the_engine"),
    (["server.engine=vllm", "rollout.sampling.top_p=0.9"], "top_p/top_k", "engine_settings_fit_the_engine"),
    (["server.engine=vllm", "rollout.sampling.top_k=20"], "top_p/top_k", "engine_settings_fit_the_engine"),
    (["server.engine=sglang"], "streamrl does not start", "engine_settings_fit_the_engine"),
    (["weight_sync.backend=nccl"], "the hf engine keeps its weights on the CPU", "engine_settings_fit_the_engine"),
    (["rollout.min_group=4", "rollout.sampling.n=3"], "rollout.min_group: 4 > rollout.sampling.n = 3",
     "groups_can_be_trained"),
    (["rollout.sampling.n=1", "rollout.min_group=1"], "needs n >= 2", "groups_can_be_trained"),
    (["rollout.sampling.temperature=0"], "rollout.sampling.temperature: 0", "groups_can_be_trained"),
    (["server.base_port=65535", "server.count=2"], "runs past port 65535", "ports_and_heartbeats_fit"),
    (["server.heartbeat_s=10", "server.registry_ttl_s=10"], "servers would expire", "ports_and_heartbeats_fit"),
    (["rollout.prometheus_port=9100", "rollout.workers=2"], "2 workers would all bind port 9100",
     "ports_and_heartbeats_fit"),
    (["learner.mixed_precision=true"], "set model.dtype=bfloat16", "mixed_precision_needs_bfloat16"),
    (["learner.micro_batch_tokens=1024"], "learner.micro_batch_tokens: 1024 < rollout.max_context = 2048",
     "micro_batches_hold_a_sample"),
    (["learner.minibatches=9", "learner.groups_per_step=8"], "a minibatch is made of whole groups",
     "every_minibatch_gets_a_group"),
    (["learner.lam=0.9"], "learner.lam applies to algorithm=ppo", "settings_of_another_algorithm"),
    (["learner.algorithm=grpo", "learner.whiten_advantages=false"], "whiten_advantages applies to algorithm=ppo",
     "settings_of_another_algorithm"),
    (["learner.critic_path=/somewhere"], "critic_path applies to algorithm=ppo", "settings_of_another_algorithm"),
    (["learner.algorithm=ppo", "learner.credit=turn"], "'turn' is for rloo and grpo", "settings_of_another_algorithm"),
    (["learner.turn_lam=0"], "turn_lam applies to credit=turn", "settings_of_another_algorithm"),
    (["learner.drop_no_signal=true", "learner.algorithm=ppo"], "drop_no_signal is for rloo and grpo",
     "no_signal_is_a_group_baselines_notion"),
    (["learner.drop_no_signal=true", "learner.credit=turn"], "still has a gradient under turn credit",
     "no_signal_is_a_group_baselines_notion"),
    (["learner.drop_no_signal=true", "learner.kl_coef=0.1", "learner.kl_in_reward=true"], "KL penalties differ",
     "no_signal_is_a_group_baselines_notion"),
    (["learner.kl_estimator=k1"], "kl_estimator needs learner.kl_coef > 0", "kl_settings_need_a_kl"),
    (["learner.kl_in_reward=true"], "kl_in_reward needs learner.kl_coef > 0", "kl_settings_need_a_kl"),
    (["learner.kl_coef=0.1", "learner.kl_in_reward=true", "learner.zero_stage=3"], "ZeRO-3",
     "kl_settings_need_a_kl"),
    (["learner.ptx_dataset=sft.jsonl"], "ptx_dataset is mixed in only with learner.ptx_coef > 0", "sft_mix_is_whole"),
    (["learner.ptx_coef=0.5"], "ptx_coef needs learner.ptx_dataset", "sft_mix_is_whole"),
    (["learner.deepspeed_config=ds.json", "learner.grad_clip=0.5"], "set gradient_clipping in that JSON",
     "deepspeed_json_is_used_as_is"),
    (["ray.server.cpus=2"], "ray.server applies to launcher=ray", "launcher_settings_need_their_launcher"),
    (["launcher=ray", "ray.address=10.0.0.1:6379", "server.host=127.0.0.1"],
     "server.host=127.0.0.1: parts that Ray places on other nodes cannot reach", "launcher_settings_need_their_launcher"),
    (["prepare.args={a: 1}"], "prepare.args are the arguments of prepare.fn", "launcher_settings_need_their_launcher"),
    (["launcher=ray", "ray.router.cpus=0"], "ray.router reserves nothing", "launcher_settings_need_their_launcher"),
    (["launcher=ray", "supervise.learner_threads=auto"], "Ray gives each part its own reserved CPUs (ray.learner",
     "learner_threads_widen_one_local_rank"),
    (["learner.nproc=2", "supervise.learner_threads=auto"], "learner.nproc is 2: give each rank a number of threads",
     "learner_threads_widen_one_local_rank"),
    (["router.sync_every_s=10"], "the router's announcement would expire", "ports_and_heartbeats_fit"),
    (["learner.lora.rank=32", "server.max_lora_rank=16"], "the servers would refuse every adapter",
     "adapters_fit_the_servers"),
    (["off_policy.auto.high=4"], "off_policy.auto.high applies to off_policy.max_staleness: auto",
     "auto_settings_need_auto"),
    (["off_policy.max_staleness=auto", "mode=sync"], "mode=sync trains on fresh data alone", "auto_settings_need_auto"),
    (["off_policy.max_staleness=auto", "weight_sync.sync_every=3"], "weight_sync.sync_every: 3 > off_policy.max_"
     "staleness + 1 = 1", "pushes_keep_up_with_staleness"),  # auto at its lowest, 0
]


@pytest.mark.parametrize(("overrides", "says", "rule"), REFUSED, ids=[" ".join(r[0]) for r in REFUSED])
def test_a_setting_the_code_would_not_honour_is_refused_by_name(overrides, says, rule, monkeypatch):
    with pytest.raises(ConfigError, match="invalid config") as refused:
        load_config(None, overrides)
    assert says in str(refused.value)
    assert "Value error" not in str(refused.value)  # the rule's own words, not pydantic's wrapping
    monkeypatch.setattr(sections, "problems", lambda cfg: [])  # the config as given, unchecked
    assert any(says in problem for problem in getattr(rules, rule)(load_config(None, overrides)))


def test_every_rule_has_a_refusal_here_and_all_problems_come_at_once():
    assert {r.__name__ for r in RULES} == {rule for *_, rule in REFUSED}
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["off_policy.tis_cap=3", "learner.lam=0.9", "learner.ptx_coef=0.5"])
    assert all(s in str(refused.value) for s in ("tis_cap", "learner.lam", "ptx_coef"))


@pytest.mark.parametrize(("overrides"), [
    ["off_policy.correction=tis", "off_policy.tis_cap=3"],
    ["learner.algorithm=ppo", "learner.lam=0.9", "learner.whiten_advantages=false"],
    ["learner.credit=turn", "learner.turn_lam=0"],
    ["learner.kl_coef=0.1", "learner.kl_estimator=k1", "learner.kl_in_reward=true"],
    ["learner.ptx_dataset=sft.jsonl", "learner.ptx_coef=0.5"],
    ["launcher=ray", "ray.server.cpus=2", "ray.server.strategy=STRICT_SPREAD", "ray.learner.labels={gpu: a100}"],
    ["launcher=ray", "server.host=127.0.0.1"],  # a local cluster is one node: loopback reaches every part
    ["server.engine=sglang", "server.count=0"],
    ["server.engine=vllm", "weight_sync.backend=nccl"],
    ["rollout.sampling.n=1", "learner.algorithm=ppo", "rollout.min_group=1"],
    ["learner.micro_batch_tokens=512", "rollout.max_context=512"],
    ["rollout.dataset=train.jsonl", "rollout.shuffle=false"],
    ["off_policy.max_staleness=auto", "off_policy.auto.high=4", "off_policy.auto.low=2", "weight_sync.sync_every=3"],
], ids=lambda o: " ".join(o))
def test_the_same_settings_where_they_apply_are_accepted(overrides):
    load_config(None, overrides)


def test_a_bare_no_in_yaml_is_appendfsync_no(tmp_path):
    (tmp_path / "c.yaml").write_text("redis:\n  appendfsync: no\n")
    assert load_config(tmp_path / "c.yaml").redis.appendfsync == "no"
    assert load_config(None, ["redis.appendfsync=no"]).redis.appendfsync == "no"


def test_float16_is_not_a_model_dtype():
    with pytest.raises(ConfigError, match="model.dtype: Input should be 'float32' or 'bfloat16'"):
        load_config(None, ["model.dtype=float16"])


def test_auto_pushes_over_nccl_only_into_vllm_on_a_gpu_learner(monkeypatch):
    import torch

    from streamrl.learner.push import transport

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert transport(load_config(None, ["server.engine=vllm"])) == "nccl"
    assert transport(load_config(None, ["server.engine=hf"])) == "gloo"  # its weights live on the CPU
    assert transport(load_config(None, ["server.engine=vllm", "weight_sync.backend=gloo"])) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert transport(load_config(None, ["server.engine=vllm"])) == "gloo"


def test_an_auto_bound_spans_its_range_and_a_fixed_one_is_its_own():
    auto = load_config(None, ["off_policy.max_staleness=auto", "off_policy.auto.low=2", "off_policy.auto.high=6"])
    assert (auto.off_policy.floor, auto.off_policy.ceiling, auto.staleness_bound) == (2, 6, 6)
    assert auto.admission_bound == 2  # workers admit under the fill's bound (low, here) until the learner publishes one
    # a fresh run fills under 1, the least under which the next step's groups start while one trains (or start
    # if smaller: 0 keeps even the fill on-policy)
    assert load_config(None, ["off_policy.max_staleness=auto", "off_policy.auto.start=4"]).admission_bound == 1
    assert load_config(None, ["off_policy.max_staleness=auto", "off_policy.auto.start=0"]).admission_bound == 0
    assert load_config(None, ["off_policy.max_staleness=auto"]).admission_bound == 1
    assert auto.adapter_slots == 8  # a LoRA server holds every version the largest bound may need
    fixed = load_config(None, ["off_policy.max_staleness=3"])
    assert (fixed.off_policy.floor, fixed.off_policy.ceiling, fixed.staleness_bound, fixed.admission_bound) == (3,) * 4
    assert load_config(None, ["mode=sync"]).admission_bound == 0
    for bad, says in ((["off_policy.max_staleness=often"], "Input should be 'auto'"),
                      (["off_policy.max_staleness=auto", "off_policy.auto.low=5", "off_policy.auto.high=4"],
                       "off_policy.auto.low 5 > high 4"),
                      (["off_policy.max_staleness=auto", "off_policy.auto.ess_floor=0.95"], "must be under ess_raise")):
        with pytest.raises(ConfigError, match="invalid config") as refused:
            load_config(None, bad)
        assert says in str(refused.value)
