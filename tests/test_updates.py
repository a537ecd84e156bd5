"""One policy version's updates on a single Policy: the loss terms (PTX, PPO's critic), epochs,
minibatches against one proximal policy, the skip on non-finite values, and when the weights may move."""

import numpy as np
import pytest
import torch

from streamrl.learner import batching, packing
from streamrl.testing import synthetic_group


@pytest.fixture(scope="module")
def config(tiny_model_dir, one_rank_world):
    from streamrl.config import load_config

    return load_config(None, [f"model.path={tiny_model_dir}", "learner.lr=0.01", "learner.kl_coef=0.1",
                              "learner.entropy_coef=0.01", "off_policy.correction=decoupled", "learner.ptx_coef=1.0",
                              "learner.ptx_dataset=sft.jsonl"])  # the tests hand the policy its SFT rows


@pytest.fixture(scope="module")
def engine(config, tiny_model_dir):
    from streamrl.learner.policy import Policy

    return Policy(config, tiny_model_dir)


def _shard(advantage=1.0):
    seqs = batching.sequences([synthetic_group(4, 24, prompt_len=6, vocab=200, rng=np.random.default_rng(3))],
                              version=0, algorithm="rloo")
    for s in seqs:
        s.advantages = np.full(len(s), advantage, np.float32)
    return [[seqs[0], seqs[1]], [seqs[2], seqs[3]], []], int(sum(s.mask.sum() for s in seqs))


def _update(engine, shard, n, ptx=None):
    """One update on one minibatch, as ``train`` runs it."""
    from streamrl.learner.updates import train

    return train(engine, [(shard, n, 0)], epochs=1, ptx=ptx)[0]


@pytest.mark.slow
def test_a_step_changes_the_weights_and_reports_entropy_and_kl(config, tiny_model_dir):
    from streamrl.learner.policy import Policy

    engine = Policy(config, tiny_model_dir)  # its own: the first step must start at the reference
    before = [p.detach().clone() for p in engine.module.parameters()]
    shard, n = _shard()
    stats = _update(engine, shard, n)  # the empty third micro-batch joins with a zero loss
    assert stats["skipped"] == 0.0 and stats["tokens"] == n
    assert all(stats[k] > 0 for k in ("forward_s", "backward_s", "optimizer_s"))
    assert stats["entropy"] > 0 and stats["kl"] == pytest.approx(0.0, abs=1e-6)  # still at the reference
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    stats = _update(engine, *_shard())
    assert stats["kl"] > 0  # the policy has moved away from the reference


@pytest.mark.slow
def test_a_non_finite_loss_skips_the_step_and_leaves_the_weights(engine):
    before = [p.detach().clone() for p in engine.module.parameters()]
    stats = _update(engine, *_shard(advantage=float("nan")))
    assert stats["skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert _update(engine, *_shard())["skipped"] == 0.0  # and the next good batch trains


def test_ptx_rows_train_on_completions_only(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from streamrl.learner.ptx import PtxData

    rows = tmp_path / "sft.jsonl"
    rows.write_text('{"prompt": "what is 2 plus 3", "completion": "5"}\n{"text": "the quick brown fox"}\n')
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = PtxData(str(rows), tok)
    sft = data.sequence(0)
    completion = tok("5", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert sft.tokens[-len(completion):].tolist() == completion
    assert sft.mask.tolist() == [0] * (len(sft) - len(completion)) + [1] * len(completion)
    text = data.sequence(1)
    assert text.mask[0] == 0 and text.mask[1:].all()
    assert [s.tokens.tolist() for s in data.for_step(3, 1, 2, 2)] == [data.sequence(14).tokens.tolist(),
                                                                      data.sequence(15).tokens.tolist()]


@pytest.mark.slow
def test_ptx_term_lowers_the_sft_loss(engine, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from streamrl.learner.ptx import PtxData

    rows = tmp_path / "sft.jsonl"
    rows.write_text('{"prompt": "what is 12 plus 7", "completion": "the answer is 19"}\n')
    ptx = PtxData(str(rows), AutoTokenizer.from_pretrained(tiny_model_dir)).for_step(0, 0, 1, 2)
    losses = [_update(engine, *_shard(advantage=0.0), ptx=ptx)["ptx_loss"] for _ in range(5)]
    assert losses[-1] < losses[0]


def test_gae_advantages_run_over_each_packed_sequences_generated_tokens_only():
    from streamrl.learner.critic import gae_advantages

    def seq(mask, reward):
        n = len(mask)
        return batching.TrainSequence(tokens=np.arange(n, dtype=np.int32), mask=np.array(mask, np.uint8),
                                      logprobs=np.zeros(n, np.float32), advantages=np.zeros(n, np.float32),
                                      staleness=0, reward=reward)

    seqs = [seq([0, 1, 0, 1, 1], 1.0), seq([0, 1, 1], 2.0)]  # one packed row: positions 0-4, then 5-7
    # a token's state is valued at the position before it (which has not seen the token); 9s sit where no
    # generated token follows. With gamma = lam = 1 a token's advantage is R - V(its state).
    values = torch.tensor([[0.5, 9.0, 0.25, 0.75, 9.0, 1.0, 1.5, 9.0]])
    adv, ret = gae_advantages(values, seqs, torch.tensor([0, 5, 8]), gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.5, 0.0, 0.75, 0.25, 0.0, 1.0, 0.5]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0, 2.0, 2.0, 0.0]]))  # where values train


def test_values_train_before_each_token_the_policy_scores_and_never_in_the_sequence_packed_before():
    from streamrl.learner.critic import value_positions

    # the second sequence (positions 5-6) opens with a generated token: not scored, so position 4 is no state of it
    row = {"mask": torch.tensor([[0, 1, 0, 1, 1, 1, 1]]), "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1]])}
    assert value_positions(row).tolist() == [[1, 0, 1, 1, 0, 1, 0]]


@pytest.mark.slow
def test_ppo_critic_learns_the_returns(engine, tiny_model_dir):
    from streamrl.config import load_config
    from streamrl.learner.critic import Critic

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "learner.algorithm=ppo", "learner.critic_lr=0.01"])
    critic = Critic(cfg, tiny_model_dir)
    shard, n = _shard()
    value_losses = []
    for _ in range(6):
        batches = critic.prepare(shard)
        adv = torch.cat([b["advantages"][b["mask"].bool()] for b in batches if b is not None])
        assert abs(float(adv.mean())) < 1e-4 and float(adv.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
        engine.share_prompts(shard, batches)
        stats = engine.update(batches, n)
        value_losses.append(critic.update(batches, n)["value_loss"])
    assert stats["skipped"] == 0.0
    assert value_losses[-1] < value_losses[0]


@pytest.mark.slow
def test_a_checkpoint_holds_the_ppo_critic_and_a_resume_restores_it(engine, tiny_model_dir, tmp_path, caplog):
    from streamrl.config import load_config
    from streamrl.learner import checkpoint
    from streamrl.learner.critic import Critic

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "learner.algorithm=ppo", "learner.critic_lr=0.01"])
    critic = Critic(cfg, tiny_model_dir)
    shard, n = _shard()
    critic.update(critic.prepare(shard), n)  # the head leaves its zero init
    trained = {k: v.detach().clone() for k, v in critic.model.module.state_dict().items()}
    checkpoint.save(engine.model, tmp_path, version=3, cursor="7-0", critic=critic.model)

    fresh = Critic(cfg, tiny_model_dir)
    assert not torch.equal(fresh.model.module.head.weight, trained["head.weight"])
    resumed = checkpoint.load(engine.model, tmp_path, fresh.model)
    assert (resumed["version"], resumed["cursor"]) == (3, "7-0")
    assert all(torch.equal(v, trained[k]) for k, v in fresh.model.module.state_dict().items())
    assert fresh.model.optimizer.state_dict()["state"]  # AdamW's moments came back too

    checkpoint.save(engine.model, tmp_path / "no-critic", version=1, cursor="1-0")  # trained without PPO
    late = Critic(cfg, tiny_model_dir)
    assert checkpoint.load(engine.model, tmp_path / "no-critic", late.model)["version"] == 1
    assert "no critic checkpoint version-1" in caplog.text
    assert not late.model.module.head.weight.any()  # left as learner.critic_path gives it


@pytest.mark.slow
def test_a_mixed_precision_critic_keeps_fp32_weights_and_computes_in_bf16(engine, tiny_model_dir):
    from streamrl.config import load_config
    from streamrl.learner.critic import Critic

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "learner.algorithm=ppo", "model.dtype=bfloat16",
                             "learner.mixed_precision=true"])
    critic = Critic(cfg, tiny_model_dir)
    assert {p.dtype for p in critic.model.module.parameters()} == {torch.float32}
    seen = []  # the dtype a linear layer computes in, inside the critic's forward
    critic.model.module.backbone.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    critic.values(packing.collate(_shard()[0][0], critic.model.device))
    assert seen == [torch.bfloat16]


def _on_policy(engine, shard):
    """Behaviour logprobs of the current weights, as if the data had just been generated."""
    for s in (s for mb in shard for s in mb):
        b = packing.collate([s], engine.device)
        with torch.no_grad():
            s.logprobs = packing.token_logprobs(packing.forward(engine.module, b), b, 1.0)[0][0].cpu().numpy()
    return shard


@pytest.mark.slow
def test_epochs_reuse_the_proximal_so_the_ratio_is_one_only_on_the_first(engine):
    shard, n = _shard()
    _on_policy(engine, shard)  # behaviour = the current weights
    batches = [packing.collate(mb, engine.device) if mb else None for mb in shard]
    engine.share_prompts(shard, batches)
    first = engine.update(batches, n)
    second = engine.update(batches, n)
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert abs(second["ratio_mean"] - 1.0) > 1e-6  # the weights moved; the proximal did not


def _updates_of(engine, monkeypatch) -> list[dict]:
    """Every update's own statistics, as ``train`` merges them."""
    seen, update = [], engine.update
    monkeypatch.setattr(engine, "update", lambda *a, **kw: seen.append(update(*a, **kw)) or seen[-1])
    return seen


@pytest.mark.slow
def test_later_minibatches_train_against_the_weights_at_the_versions_start(engine, monkeypatch):
    from streamrl.learner.updates import train

    first, n1 = _shard()
    second, n2 = _shard()
    _on_policy(engine, first + second)  # behaviour = proximal = the weights before either update
    seen = _updates_of(engine, monkeypatch)
    stats, landed = train(engine, [(first, n1, 4), (second, n2, 4)], epochs=1)
    assert landed == 2 and stats["updates"] == 2 and stats["tokens"] == n1 + n2
    assert seen[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the first update is on-policy
    # the second: its proximal is still the start weights (weight 1 against behaviour), while the
    # weights it trains have moved (a ratio off 1, which the clip bounds)
    assert seen[1]["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert seen[1]["is_ess"] == pytest.approx(1.0, abs=1e-5)  # the data's weight is against the proximal policy
    assert abs(seen[1]["ratio_mean"] - 1.0) > 1e-6


@pytest.mark.slow
def test_the_push_is_awaited_once_after_the_first_backwards_and_before_any_update(engine, monkeypatch):
    """The learner's previous push reads the weights in the background: ``train`` lets the first minibatch's
    forwards and backwards run beside it, and calls ``before_update`` (the wait) before the optimizer moves them."""
    from streamrl.learner.updates import train

    backwards, backward = [], engine.model.backward
    monkeypatch.setattr(engine.model, "backward", lambda loss: backwards.append(loss) or backward(loss))
    start = [p.detach().clone() for p in engine.module.parameters()]
    calls = []

    def before_update():
        calls.append((len(backwards), all(torch.equal(a, b) for a, b in zip(start, engine.module.parameters()))))

    (first, n1), (second, n2) = _shard(), _shard()
    _, landed = train(engine, [(first, n1, 4), (second, n2, 4)], epochs=2, before_update=before_update)
    assert landed == 2
    assert calls == [(3, True)]  # once: after the first minibatch's three micro-batches, with the weights unmoved


@pytest.mark.slow
def test_a_non_finite_minibatch_stops_the_updates_after_it(engine):
    from streamrl.learner.updates import train

    good, n1 = _shard()
    bad, n2 = _shard(advantage=float("nan"))
    before = [p.detach().clone() for p in engine.module.parameters()]
    stats, landed = train(engine, [(good, n1, 4), (bad, n2, 4), (_shard()[0], n1, 4)], epochs=2)
    assert (landed, stats["updates"], stats["skipped"]) == (1, 1, 1.0)  # the third was never tried
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


@pytest.mark.slow
def test_a_steps_first_forward_stands_in_for_the_proximal_forward(engine):
    shard, n = _shard()
    batches = [packing.collate(mb, engine.device) if mb else None for mb in shard]
    separate = engine.proximal([b for b in batches if b is not None])  # a no-grad eval forward, before the step
    engine.share_prompts(shard, batches)
    engine.update(batches, n)
    for b, want in zip([b for b in batches if b is not None], separate):
        generated = b["mask"].bool()  # the step's forward shares prompts: only generated tokens get logprobs
        assert torch.allclose(b["proximal"][generated], want[generated], atol=1e-5)


def test_a_model_with_dropout_has_a_random_forward():
    from transformers import LlamaConfig, LlamaForCausalLM

    from streamrl.learner.policy import has_dropout

    def tiny(**kw):
        return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2, **kw))

    assert not has_dropout(tiny()) and has_dropout(tiny(attention_dropout=0.1))


def test_mixed_precision_is_deepspeeds_autocast_and_a_given_json_must_enable_it(tmp_path):
    """DeepSpeed's forward turns off an autocast around it on a GPU: the bf16 compute must be its own."""
    import json

    from streamrl.config import load_config
    from streamrl.learner.policy import deepspeed_config

    mixed = ["model.dtype=bfloat16", "learner.mixed_precision=true"]
    autocast = deepspeed_config(load_config(None, mixed))["torch_autocast"]
    assert autocast == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}  # fp32 reduces
    assert not deepspeed_config(load_config(None, []))["torch_autocast"]["enabled"]
    given = tmp_path / "ds.json"
    given.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    with pytest.raises(ValueError, match="has no torch_autocast section enabled"):
        deepspeed_config(load_config(None, [*mixed, f"learner.deepspeed_config={given}"]))
    given.write_text(json.dumps({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}))
    assert deepspeed_config(load_config(None, [*mixed, f"learner.deepspeed_config={given}"]))["torch_autocast"]


@pytest.mark.slow
def test_mixed_precision_computes_in_bf16_and_keeps_updates_bf16_weights_round_away(engine, tiny_model_dir):
    """An AdamW step of lr 1e-6 moves each weight by about 1e-6, under half the bf16 rounding step of a
    weight of 0.02: bf16 weights stay put (their fp32 master moved); fp32 weights under autocast move."""
    from streamrl.config import load_config
    from streamrl.learner.policy import Policy

    def changed_after_a_step(mixed: bool) -> tuple[Policy, float]:
        cfg = load_config(None, [f"model.path={tiny_model_dir}", "learner.lr=1e-6", "model.dtype=bfloat16",
                                 f"learner.mixed_precision={mixed}"])
        policy = Policy(cfg, tiny_model_dir)
        before = [p.detach().clone() for p in policy.module.parameters()]
        assert _update(policy, *_shard())["skipped"] == 0.0
        moved = sum(int((a != b).sum()) for a, b in zip(before, policy.module.parameters()))
        return policy, moved / sum(a.numel() for a in before)

    mixed, moved = changed_after_a_step(True)
    assert {p.dtype for p in mixed.module.parameters()} == {torch.float32} and moved > 0.5  # all but unused embedding rows
    shard, _ = _shard()
    assert packing.forward(mixed.model, packing.collate(shard[0], mixed.device), bf16=mixed.mixed).dtype == torch.bfloat16
    plain, moved = changed_after_a_step(False)
    assert {p.dtype for p in plain.module.parameters()} == {torch.bfloat16} and moved < 0.05


@pytest.mark.parametrize("optimizer, lora, ess_lr", [("sgd", False, False), ("adamw", False, False),
                                                     ("adamw", True, False), ("sgd", False, True), ("adamw", False, True)])
def test_a_step_is_the_textbook_clipped_and_decayed_policy_gradient_step(config, tiny_model_dir, optimizer, lora,
                                                                         ess_lr):
    """One Policy step (packed rows, shared prompts, DeepSpeed) moves the weights exactly as the plain step
    does: one forward per sequence, the token-mean loss -A * pi/pi_old over every generated token, the
    gradient clipped to its norm bound, then torch's optimizer with the configured weight decay. With LoRA the
    plain step is a plain PEFT model's: only the adapter moves. With ``off_policy.ess_lr`` the data is stale
    (its behaviour logprobs are off the policy's): each token's term carries its importance weight
    w = pi / pi_behav, and the learning rate is scaled by the weights' effective sample size
    (sum w)^2 / (n sum w^2), its square root under AdamW."""
    from transformers import AutoModelForCausalLM

    from streamrl.config import load_config
    from streamrl.learner.policy import Policy

    adapter = ["learner.lora.rank=4", "learner.lora.alpha=8", "learner.lora.target_modules=[q_proj,v_proj,down_proj]"]
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"learner.optimizer={optimizer}", "learner.lr=0.01",
                             "learner.weight_decay=0.5", "learner.grad_clip=0.05", f"off_policy.ess_lr={ess_lr}",
                             *(adapter if lora else [])])
    policy = Policy(cfg, tiny_model_dir)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(policy.device)
    if lora:
        import peft

        plain = peft.get_peft_model(plain, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                             "down_proj"]))
        torch.manual_seed(0)
        with torch.no_grad():  # B starts at zero in PEFT, which would leave A's gradient zero: both made random
            for (name, p), (_, q) in zip(policy.module.named_parameters(), plain.named_parameters(), strict=True):
                if ".lora_" in name:
                    p.copy_(torch.randn_like(p) * 0.1)
                    q.copy_(p)
        assert {n for n, p in policy.module.named_parameters() if p.requires_grad} == {
            n for n, p in plain.named_parameters() if p.requires_grad} and policy.pushed()
    groups = [synthetic_group(4, 20 + 4 * g, prompt_len=6, vocab=200, rng=np.random.default_rng(g), prompt_id=f"p{g}")
              for g in range(2)]
    for group in groups:
        for i, s in enumerate(group.samples):
            s.reward = float(i % 3)  # each group has signal
    seqs = batching.sequences(groups, version=0, algorithm="rloo")
    tokens = int(sum(s.mask.sum() for s in seqs))
    loss, weight_sum, square_sum, noise = 0.0, 0.0, 0.0, np.random.default_rng(7)
    for s in seqs:  # the behaviour logprobs are the policy's own (on-policy: every weight is one) or off them
        ids = torch.as_tensor(s.tokens.astype("int64"), device=policy.device)[None]
        logp = torch.log_softmax(plain(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
        behaviour = logp.detach() + torch.as_tensor(noise.normal(0, 0.5, len(logp)) * ess_lr, dtype=torch.float32,
                                                    device=policy.device)
        s.logprobs = np.r_[0.0, behaviour.cpu().numpy()].astype(np.float32) * s.mask
        generated = torch.as_tensor(s.mask[1:], dtype=torch.float32, device=policy.device)
        advantages = torch.as_tensor(s.advantages[1:], device=policy.device)
        weight = torch.exp(logp.detach() - behaviour)
        loss = loss - (weight * advantages * torch.exp(logp - logp.detach()) * generated).sum() / tokens
        weight_sum += float((weight * generated).sum())
        square_sum += float((weight**2 * generated).sum())
    loss.backward()
    ess = weight_sum**2 / (tokens * square_sum)
    scale = ess ** {"sgd": 1.0, "adamw": 0.5}[optimizer] if ess_lr else 1.0
    norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.learner.grad_clip))
    assert norm > cfg.learner.grad_clip
    trained = [p for p in plain.parameters() if p.requires_grad]
    {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer](trained, lr=cfg.learner.lr * scale,
                                                                      weight_decay=cfg.learner.weight_decay).step()

    stats = _update(policy, [seqs[:5], seqs[5:]], tokens)
    assert stats["skipped"] == 0.0 and stats["grad_norm"] == pytest.approx(norm, rel=1e-4)  # before the clip
    assert stats["entropy"] > 0  # measured without an entropy bonus in the loss
    # on-policy data: every importance weight is one, so the whole batch is its effective sample
    assert stats["is_ess"] == pytest.approx(ess, abs=1e-5) and (ess < 0.85 if ess_lr else ess == 1.0)
    assert stats.get("lr_scale", 1.0) == pytest.approx(scale, rel=1e-5) and ("lr_scale" in stats) == ess_lr
    if not ess_lr:
        assert stats["is_second_moment"] == pytest.approx(1.0, abs=1e-4)
    expected = dict(plain.named_parameters())
    # Adam divides each gradient by its own size: an element whose gradient is near zero moves by up to the
    # learning rate on a rounding difference (1.6e-5 on an H100); the decay missing would move some by 4e-4
    tolerance = {"sgd": 1e-6, "adamw": 1e-4}[optimizer]
    for name, p in policy.module.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name].detach(), rtol=0, atol=tolerance)


@pytest.mark.slow
def test_scoring_the_probe_between_updates_leaves_training_as_it_was(config, tiny_model_dir):
    """The learner scores the push's probe between two steps: the weights after the next update are the same
    bit for bit as without it (no optimizer, mode or RNG state touched)."""
    from streamrl.learner import probe
    from streamrl.learner.policy import Policy

    weights = []
    for scored in (False, True):
        torch.manual_seed(0)
        policy = Policy(config, tiny_model_dir)
        _update(policy, *_shard())
        if scored:
            assert len(probe.logprobs(policy.model, list(range(3, 60)), policy.device)) == 56
            assert policy.model.training  # back in the mode it was in
        _update(policy, *_shard(advantage=-0.5))
        weights.append([p.detach().clone() for p in policy.module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))
