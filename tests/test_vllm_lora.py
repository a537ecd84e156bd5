"""The vllm engine as a LoRA server, on vLLM's CPU build: adapter versions pushed the way the learner sends
them (gloo, buckets), each loaded through vLLM's LoRA API under NAME-vN; served logprobs equal a PEFT model's
in fp32; a request keeps the version it started with while the next arrives; versions past the bound are
unloaded; bad adapters change nothing."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_vllm_engine import HAS_VLLM, PROMPTS, TOL, _max_gap, _push, _tempered_logprobs

from streamrl.adapters import AdapterSpec, LoraServing
from streamrl.generation import SamplingParams
from streamrl.inference.engines import load_engine

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM: scripts/test.sh installs "
                                                                          "its CPU build")]
RANK, ALPHA = 8, 16
SLOTS = 3  # off_policy.max_staleness 1: the newest two versions are held, and one slot for the arriving


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from streamrl.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("vllm-lora-tiny"), hidden=256, tied=True)


@pytest.fixture(scope="module")
def engine(model_dir):
    from streamrl.models import load_tokenizer

    engine = load_engine("vllm", model_dir, dtype="float32", max_batch_size=4, kv_cache_gb=0.5,
                         tokenizer=load_tokenizer(model_dir), lora=LoraServing("policy", RANK, SLOTS))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def receiver(engine):
    return engine.weight_receiver()


def adapted(model_dir: str, seed: int, rank: int = RANK):
    """A PEFT model over the base with a random adapter, and the adapter's tensors under their wire names."""
    import peft
    from transformers import AutoModelForCausalLM

    from streamrl.learner.adapter import tensors

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=ALPHA, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in tensors(model):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model.eval(), [(n, p.detach().clone()) for n, p in tensors(model)]


def push_adapter(receiver, named, version, rank=RANK, probe=None):
    _push(receiver, named, version, lora=AdapterSpec(rank, ALPHA, len(named)), probe=probe)


def probe_of(model, n_tokens=96):
    """The learner's probe, scored with the adapter (the PEFT model's forward)."""
    from streamrl.learner import probe
    from streamrl.weightsync import Probe

    ids = [t for prompt in PROMPTS for t in prompt] * 8
    return Probe(ids[:n_tokens], probe.logprobs(model, ids[:n_tokens], torch.device("cpu")), TOL)


def sampled(engine, rid, prompt, n=16, adapter=None):
    return asyncio.run(engine.generate(rid, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True, seed=1),
                                       adapter=adapter))


def test_each_pushed_adapter_version_serves_the_peft_models_logprobs(engine, receiver, model_dir):
    base = engine.version  # the module's engine is shared, and tests run in any order
    for version in (base + 1, base + 2, base + 3):
        model, named = adapted(model_dir, seed=version)
        push_adapter(receiver, named, version)
        assert engine.version == version
        out = sampled(engine, f"v{version}", PROMPTS[0])
        assert set(out.versions) == {version}
        assert _max_gap(_tempered_logprobs(model, PROMPTS[0], out.output_ids, 1.0), out.logprobs) <= TOL
    # versions past the bound are unloaded from vLLM: the newest SLOTS - 1 stay (vLLM's id is the version + 1)
    assert sorted(engine._adapters.held) == [base + 2, base + 3]
    assert set(engine._call(engine._llm.list_loras(), timeout=60)) == {base + 3, base + 4}
    with pytest.raises(ValueError, match="does not hold that adapter version"):
        sampled(engine, "gone", PROMPTS[0], adapter=f"policy-v{base + 1}")
    out = sampled(engine, "pinned", PROMPTS[1], adapter=f"policy-v{base + 2}")  # a held older version, by name
    assert set(out.versions) == {base + 2}
    model, _ = adapted(model_dir, seed=base + 2)
    assert _max_gap(_tempered_logprobs(model, PROMPTS[1], out.output_ids, 1.0), out.logprobs) <= TOL


def test_a_request_keeps_its_version_while_the_next_arrives(engine, receiver, model_dir):
    start = engine.version + 1
    old, named = adapted(model_dir, seed=200)
    push_adapter(receiver, named, start)
    new, named = adapted(model_dir, seed=100)
    prompt = PROMPTS[2]

    async def push_mid_request():
        task = asyncio.create_task(engine.generate("long", prompt, SamplingParams(
            max_new_tokens=400, ignore_eos=True, seed=5)))
        while engine.load()["num_tokens"] < len(prompt) + 20:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(push_adapter, receiver, named, start + 1)
        after = await engine.generate("after", prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
        return await task, after

    out, after = asyncio.run(push_mid_request())
    assert set(out.versions) == {start} and len(out.output_ids) == 400  # to the end on the version it began with
    assert _max_gap(_tempered_logprobs(old, prompt, out.output_ids, 1.0), out.logprobs) <= TOL
    assert set(after.versions) == {start + 1}
    assert _max_gap(_tempered_logprobs(new, prompt, after.output_ids, 1.0), after.logprobs) <= TOL


@pytest.mark.parametrize("fault", ["shape", "module", "rank"])
def test_an_adapter_the_server_cannot_take_is_refused_and_nothing_changes(engine, receiver, model_dir, fault):
    version = engine.version
    held = sorted(engine._adapters.held)
    before = sampled(engine, f"before-{fault}", PROMPTS[0])
    _, named = adapted(model_dir, seed=7, rank=16 if fault == "rank" else RANK)
    name, tensor = named[-1]  # the bad tensor comes last: earlier buckets were fine
    named[-1] = {"shape": (name, tensor[:, :-1]), "module": (name.replace("layers.1", "layers.9"), tensor),
                 "rank": (name, tensor)}[fault]
    message = {"shape": "needs", "module": "no linear layer", "rank": "exceeds this server's largest, 8"}[fault]
    with pytest.raises(ValueError, match=message):
        push_adapter(receiver, named, version + 1, rank=16 if fault == "rank" else RANK)
    assert engine.version == version and sorted(engine._adapters.held) == held
    again = sampled(engine, f"after-{fault}", PROMPTS[0])
    assert again.output_ids == before.output_ids and again.versions == before.versions


@pytest.mark.parametrize("fault", ["swapped", "kept_old_weights", "half_applied"])
def test_an_adapter_that_fails_its_probe_is_never_picked_and_the_next_passes(engine, receiver, model_dir, fault):
    """The probe runs with the adapter a request would use: an adapter loaded wrong is unloaded before any request
    picks it; the newest verified version serves on. (Rounded to bf16, an adapter of this size moves no logprob
    past the tolerance: that fault is harmless here and not tested.)"""
    from faults import FAULTS

    from streamrl.weightsync import ProbeMismatch

    version = engine.version + 1
    old_model, old = adapted(model_dir, seed=300)
    push_adapter(receiver, old, version, probe=probe_of(old_model))
    assert receiver.probe_gap <= TOL
    new_model, new = adapted(model_dir, seed=301)
    with pytest.raises(ProbeMismatch, match=f"version {version + 1} failed its probe"):
        push_adapter(receiver, FAULTS[fault](new, old), version + 1, probe=probe_of(new_model))
    assert max(engine._adapters.held) == version
    out = sampled(engine, f"after-lora-{fault}", PROMPTS[0])
    assert set(out.versions) == {version}
    assert _max_gap(_tempered_logprobs(old_model, PROMPTS[0], out.output_ids, 1.0), out.logprobs) <= TOL
    push_adapter(receiver, new, version + 1, probe=probe_of(new_model))
    assert set(sampled(engine, f"passed-lora-{fault}", PROMPTS[0]).versions) == {version + 1}


def test_a_late_joiner_serves_the_exported_adapter(engine, receiver, model_dir, tmp_path):
    from streamrl import adapters

    model, named = adapted(model_dir, seed=42)
    version = engine.version + 1
    adapters.save(tmp_path / "adapter", named, AdapterSpec(RANK, ALPHA, len(named)), model_dir)
    assert asyncio.run(receiver.load_from_disk(str(tmp_path / "adapter"), version)) == len(named)
    out = sampled(engine, "from-disk", PROMPTS[1])
    assert set(out.versions) == {version}
    assert _max_gap(_tempered_logprobs(model, PROMPTS[1], out.output_ids, 1.0), out.logprobs) <= TOL
