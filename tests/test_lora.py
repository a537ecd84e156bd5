"""LoRA: the learner's adapter (PEFT) with its reference, checkpoint and export; adapter-only pushes into real
servers, whose logprobs then equal the learner's; and every adapter a server must refuse."""

import functools

import httpx
import numpy as np
import pytest
import torch

from streamrl import adapters
from streamrl.config import load_config
from streamrl.learner import batching, packing
from streamrl.testing import synthetic_group

LORA = ["learner.lora.rank=4", "learner.lora.alpha=8"]


def lora_config(model_dir: str, *more: str):
    return load_config(None, [f"model.path={model_dir}", "learner.lr=0.01", *LORA, *more])


def randomize_adapter(policy, seed: int = 0) -> None:
    """PEFT starts B at zero (the adapter a no-op): random values make it change the model."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in policy.pushed():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


def _shard():
    group = synthetic_group(4, 24, prompt_len=6, vocab=200, rng=np.random.default_rng(3))
    for i, s in enumerate(group.samples):
        s.reward = float(i % 2)
    seqs = batching.sequences([group], version=0, algorithm="rloo")
    return [seqs[:2], seqs[2:]], int(sum(s.mask.sum() for s in seqs))


def _update(policy, shard, n):
    """One update on one minibatch, as ``train`` runs it."""
    from streamrl.learner.updates import train

    return train(policy, [(shard, n, 0)], epochs=1)[0]


def test_the_kl_reference_is_the_base_with_the_adapter_switched_off(one_rank_world, tiny_model_dir):
    from streamrl.learner.policy import Policy
    from streamrl.learner.reference import Reference

    policy = Policy(lora_config(tiny_model_dir, "learner.kl_coef=0.1"), tiny_model_dir)
    randomize_adapter(policy)
    batch = packing.collate(_shard()[0][0], policy.device)
    base = Reference.load(tiny_model_dir, policy.device, torch.float32, temperature=1.0).logprobs(batch)
    torch.testing.assert_close(policy.reference.logprobs(batch), base, rtol=0, atol=1e-6)
    with torch.no_grad():
        own = packing.token_logprobs(packing.forward(policy.model, batch, bf16=policy.mixed), batch, 1.0)[0]
    assert float((own - base).abs().max()) > 1e-2  # the adapter changes the policy, and is back on after
    assert policy.model.training


def test_only_the_adapter_trains_and_holds_optimizer_state(one_rank_world, tiny_model_dir):
    from streamrl.learner.policy import Policy

    policy = Policy(lora_config(tiny_model_dir, "learner.lora.target_modules=[q_proj,v_proj]"), tiny_model_dir)
    randomize_adapter(policy)
    base = {n: p.detach().clone() for n, p in policy.module.named_parameters() if ".lora_" not in n}
    adapter = {n: p.detach().clone() for n, p in policy.pushed()}
    assert _update(policy, *_shard())["skipped"] == 0.0
    assert all(torch.equal(p, base[n]) for n, p in policy.module.named_parameters() if n in base)
    assert all(not torch.equal(p, adapter[n]) for n, p in policy.pushed())
    layers = policy.module.config.num_hidden_layers
    assert len(adapter) == 2 * 2 * layers  # A and B of q_proj and v_proj in every layer
    assert len(policy.optimizer.state) == len(adapter)
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in adapter)


def test_an_adapter_checkpoint_holds_the_adapter_and_its_optimizer_state_and_resumes(one_rank_world, tiny_model_dir,
                                                                                    tmp_path):
    from streamrl.learner import checkpoint
    from streamrl.learner.policy import Policy

    cfg = lora_config(tiny_model_dir)
    policy = Policy(cfg, tiny_model_dir)
    randomize_adapter(policy)
    _update(policy, *_shard())
    checkpoint.save(policy.model, tmp_path, version=1, cursor="5-0", adapter_only=True)
    saved = sum(f.stat().st_size for f in (tmp_path / "version-1").rglob("*") if f.is_file())
    model_bytes = sum(p.numel() * 4 for p in policy.module.parameters())
    assert saved < model_bytes  # no frozen base in it: the adapter, its two Adam moments and little else

    resumed = Policy(cfg, tiny_model_dir)
    state = checkpoint.load(resumed.model, tmp_path, adapter_only=True)
    assert state["version"] == 1 and state["cursor"] == "5-0"
    for (name, want), (_, got) in zip(policy.pushed(), resumed.pushed(), strict=True):
        assert torch.equal(want, got), name
    moments = [s["exp_avg"] for s in policy.optimizer.state.values()]
    assert [torch.equal(a, b["exp_avg"]) for a, b in zip(moments, resumed.optimizer.state.values())] == [True] * len(
        moments)
    shard, n = _shard()  # and the next step is the same on both
    _update(policy, shard, n)
    _update(resumed, shard, n)
    for (name, want), (_, got) in zip(policy.pushed(), resumed.pushed(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def test_the_export_holds_the_peft_adapter_and_the_merged_model(one_rank_world, tiny_model_dir, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    from streamrl.learner import checkpoint
    from streamrl.learner.policy import Policy

    cfg = lora_config(tiny_model_dir)
    policy = Policy(cfg, tiny_model_dir)
    randomize_adapter(policy)
    target = checkpoint.export_hf(policy.model, tiny_model_dir, tmp_path, version=3, rank=0, zero_stage=0,
                                  lora=cfg.learner.lora, base_model=tiny_model_dir)
    ids = torch.tensor([[5, 9, 13, 21, 34, 55]])
    with torch.no_grad():
        want = policy.module(input_ids=ids.to(policy.device)).logits.cpu()
        merged = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        loaded = peft.PeftModel.from_pretrained(base, target / "adapter")(input_ids=ids).logits
    torch.testing.assert_close(merged, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(loaded, want, rtol=0, atol=1e-6)
    tensors, spec = adapters.load(target / "adapter")
    assert (spec.rank, spec.alpha, spec.tensors) == (4, 8.0, len(policy.pushed()))
    assert sorted(n for n, _ in tensors) == sorted(n for n, _ in policy.pushed())
    assert (tmp_path / "latest").read_text() == "version-3"


def test_an_adapter_that_does_not_fit_the_served_model_is_refused_with_what_is_wrong():
    linears = {"model.layers.0.self_attn.q_proj": (32, 16)}
    spec = adapters.AdapterSpec(rank=4, alpha=8, tensors=2)
    a, b = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    adapters.check([a, b], [[4, 16], [32, 4]], spec, linears, max_rank=8)  # fits
    with pytest.raises(ValueError, match="exceeds this server's largest, 2"):
        adapters.check([a], [[4, 16]], spec, linears, max_rank=2)
    with pytest.raises(ValueError, match="no linear layer 'model.layers.9.mlp.up_proj'"):
        adapters.check(["base_model.model.model.layers.9.mlp.up_proj.lora_A.weight"], [[4, 16]], spec, linears, 8)
    with pytest.raises(ValueError, match=r"needs \[32, 4\]"):
        adapters.check([b], [[64, 4]], spec, linears, 8)
    with pytest.raises(ValueError, match="no LoRA tensor name"):
        adapters.check(["model.layers.0.self_attn.q_proj.weight"], [[32, 16]], spec, linears, 8)
    with pytest.raises(ValueError, match="without its other half"):
        adapters.pairs([(a, torch.zeros(4, 16))])
    pair = adapters.pairs([(a, torch.ones(4, 16)), (b, torch.full((32, 4), 0.5))])["model.layers.0.self_attn.q_proj"]
    base = torch.full((32, 16), 1.0)
    weight = adapters.merged(base, *pair, scale=2.0)
    assert weight.shape == (32, 16) and float(weight[0, 0]) == 1.0 + 2.0 * 4 * 0.5  # W + scale * sum_r B[0,r] A[r,0]
    assert float(base[0, 0]) == 1.0  # the base is kept as it was
    assert adapters.merged(base.bfloat16(), *pair, scale=2.0).dtype == torch.bfloat16


def test_lora_settings_the_servers_cannot_honour_are_refused():
    from streamrl.config import ConfigError

    cases = {
        ("learner.lora.rank=32", "server.max_lora_rank=16"): "server.max_lora_rank 16",
        ("learner.lora.rank=8", "off_policy.max_staleness=3", "server.max_loras=3"): "server.max_loras 3 <",
        ("server.max_lora_rank=16",): "learner.lora is not set",
        ("learner.lora.rank=8", "weight_sync.backend=nccl", "server.engine=vllm"): "travels over gloo",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, list(overrides))
    cfg = load_config(None, ["learner.lora.rank=8", "off_policy.max_staleness=3"])
    assert cfg.adapter_slots == 5 and adapters.LoraServing.of(cfg) == adapters.LoraServing("policy", 8, 5)
    assert load_config(None, ["learner.lora.rank=8"]).learner.lora.target_modules == "all-linear"


def _served_against_learner(url: str, policy, version: int, adapter: str | None = None) -> float:
    """Generate on the server; the largest gap between its logprobs and the learner's for the same tokens."""
    prompt = [5, 6, 7, 8]
    body = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0.8, "ignore_eos": True},
        "return_logprob": True, "lora_path": adapter}).json()
    assert body["meta_info"]["weight_version"] == version, body
    assert {span["version"] for span in body["meta_info"]["weight_versions"]} == {version}
    ids = prompt + body["output_ids"]
    with torch.no_grad():
        logits = policy.module(input_ids=torch.tensor([ids], device=policy.device)).logits[0].float().cpu()
        want = torch.log_softmax(logits / 0.8, -1)
    return max(abs(lp - float(want[len(prompt) - 1 + i, token]))
               for i, (lp, token, _) in enumerate(body["meta_info"]["output_token_logprobs"]))


@pytest.mark.slow
def test_adapter_pushes_into_an_hf_server_serve_the_learners_logprobs_and_bad_ones_change_nothing(
        one_rank_world, cluster, redis_server, tiny_model_dir, caplog):
    """The real learner (DeepSpeed, PEFT) pushes adapter versions over gloo into a LoRA server, which serves
    each with the learner's logprobs. A server started without LoRA, an adapter of the wrong shape, one of a
    rank above the server's, and a request for a version the server no longer holds are refused with what was
    wrong, and the server goes on serving what it served. A server joining later serves the exported adapter."""
    from streamrl.buffer import ServerRegistry
    from streamrl.learner import checkpoint
    from streamrl.learner.policy import Policy
    from streamrl.learner.push import WeightPusher

    url, _ = cluster.server(*LORA)
    plain, _ = cluster.server()
    cfg = lora_config(tiny_model_dir, f"redis.url={redis_server.url}", f"run.name={cluster.run}",
                      f"run.dir={cluster.run_path.parent}", "weight_sync.timeout_s=30")
    policy = Policy(cfg, tiny_model_dir)
    pusher = WeightPusher(cfg, ServerRegistry(cluster.ns, ttl_s=1.5))
    for version in (1, 2, 3):
        randomize_adapter(policy, seed=version)
        stats = pusher.push([(n, p.detach()) for n, p in policy.pushed()], version)
        assert stats["push_targets"] == 1  # the server without LoRA refused it
        assert _served_against_learner(url, policy, version) <= 1e-4
    assert "started without LoRA support" in caplog.text
    assert httpx.get(f"{plain}/get_server_info").json()["weight_version"] == 0

    def refused(tensors, spec_cfg) -> str:
        caplog.clear()
        stats = WeightPusher(spec_cfg, ServerRegistry(cluster.ns, ttl_s=1.5)).push(tensors, 4, only=None)
        assert stats["push_targets"] == 0
        return caplog.text

    zeros = functools.partial(torch.zeros, device=policy.device)  # beside the learner's tensors (a GPU's too)
    wide = [(n, zeros(p.shape[0], p.shape[1] + 1) if ".lora_A" in n else p.detach()) for n, p in policy.pushed()]
    assert "at rank 4 needs" in refused(wide, cfg)
    rank8 = lora_config(tiny_model_dir, f"redis.url={redis_server.url}", f"run.name={cluster.run}",
                        "learner.lora.rank=8", "weight_sync.timeout_s=30")
    big = [(n, zeros(8, p.shape[1]) if ".lora_A" in n else zeros(p.shape[0], 8)) for n, p in policy.pushed()]
    assert "exceeds this server's largest, 4" in refused(big, rank8)
    assert _served_against_learner(url, policy, 3) <= 1e-4  # still version 3, whole
    r = httpx.post(f"{url}/generate", json={"input_ids": [5, 6], "lora_path": "policy-v2"})
    assert r.status_code == 400 and "holds policy-v3 alone" in r.text
    assert _served_against_learner(url, policy, 3, adapter="policy-v3") <= 1e-4

    checkpoint.export_hf(policy.model, tiny_model_dir, cluster.run_path / "export", version=3, rank=0, zero_stage=0,
                         lora=cfg.learner.lora, base_model=tiny_model_dir)
    late, _ = cluster.server(*LORA)
    assert _served_against_learner(late, policy, 3) <= 1e-4


@pytest.mark.slow
def test_an_adapter_push_the_hf_server_merges_wrong_fails_its_probe_and_the_version_before_stays(
        one_rank_world, cluster, redis_server, tiny_model_dir):
    """The learner's probe runs with its adapter, the hf server's on the weights it merged: an adapter push whose
    tensors are not the learner's (two swapped, or the last version's again) is refused and rolled back, and the
    right one then serves the learner's logprobs."""
    from faults import FAULTS

    from streamrl.buffer import ServerRegistry
    from streamrl.learner import probe
    from streamrl.learner.policy import Policy
    from streamrl.learner.push import WeightPusher
    from streamrl.weightsync import Probe

    url, _ = cluster.server(*LORA)
    cfg = lora_config(tiny_model_dir, f"redis.url={redis_server.url}", f"run.name={cluster.run}",
                      f"run.dir={cluster.run_path.parent}", "weight_sync.timeout_s=30")
    policy = Policy(cfg, tiny_model_dir)
    pusher = WeightPusher(cfg, ServerRegistry(cluster.ns, ttl_s=1.5))
    ids = list(range(3, 99))
    old = [(n, p.detach().clone()) for n, p in policy.pushed()]  # PEFT's start: B is zero
    for version, fault in enumerate(["swapped", "kept_old_weights"], start=1):
        randomize_adapter(policy, seed=10 + version)
        new = [(n, p.detach().clone()) for n, p in policy.pushed()]
        check = Probe(ids, probe.logprobs(policy.model, ids, policy.device), 1e-4)
        cluster.listed(url)
        stats = pusher.push(FAULTS[fault](new, old), version, check=check)
        assert (stats["push_rejected"], stats["push_targets"]) == (1.0, 0.0), fault
        assert httpx.get(f"{url}/server_info", timeout=10).json()["weight_version"] == version - 1
        cluster.listed(url)
        stats = pusher.push(new, version, check=check)
        assert (stats["push_rejected"], stats["push_targets"]) == (0.0, 1.0), fault
        assert _served_against_learner(url, policy, version) <= 1e-4
        old = new
