"""The vllm engine against a teacher-forced transformers forward on a tiny Llama.

The first three tests run anywhere; the rest need CUDA and vllm (``pip install streamrl[gpu]``)
and are marked ``gpu``. The engine runs in bfloat16; the reference is an fp32 forward over the
same bf16-rounded weights, so logprobs agree to about 1e-2.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import os
import random

import pytest
import torch

from streamrl.rollout.engines import SamplingParams, load_engine
from streamrl.rollout.engines.vllm import _chunks, _unpack, finish_reason

HAS_VLLM = importlib.util.find_spec("vllm") is not None
TOL = 1e-2  # bf16 engine vs fp32 reference


def gpu(test):
    needs = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_VLLM,
                               reason="needs CUDA and vllm (pip install streamrl[gpu])")
    return pytest.mark.gpu(needs(test))


# ---------------------------------------------------------------------- anywhere


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_load_engine_without_vllm_says_how_to_get_it(tmp_path):
    with pytest.raises(ImportError, match=r"pip install streamrl\[gpu\]` on a CUDA machine"):
        load_engine("vllm", str(tmp_path))


def test_weights_survive_packing_in_chunks():
    tensors = [("a", torch.randn(3, 5).to(torch.bfloat16)), ("b", torch.arange(7)),
               ("c", torch.randn(4, 4)[:, 1]), ("d", torch.tensor(2.5))]
    chunks = list(_chunks(tensors, limit=40))  # a (30 bytes) alone, then b (56) alone, then c + d
    assert [[name for name, *_ in chunk] for chunk in chunks] == [["a"], ["b"], ["c", "d"]]
    unpacked = {name: _unpack(dtype, shape, raw)
                for chunk in chunks for name, dtype, shape, raw in chunk}
    for name, tensor in tensors:
        assert unpacked[name].dtype == tensor.dtype and torch.equal(unpacked[name], tensor)


def test_finish_reasons_take_sglang_shape():
    assert finish_reason("length", None, [1, 2, 3]) == {"type": "length", "length": 3}
    assert finish_reason("stop", 7, [1, 7]) == {"type": "stop", "matched": 7}
    assert finish_reason("stop", "###", [1, 2]) == {"type": "stop", "matched": "###"}
    assert finish_reason("stop", None, [1, 0]) == {"type": "stop", "matched": 0}  # EOS
    assert finish_reason("abort", None, [1]) == {"type": "abort", "message": "aborted"}


# ---------------------------------------------------------------------- on a GPU


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from streamrl.testing import make_tiny_model

    # hidden 256 over 4 heads: head size 64, which every vLLM attention backend supports
    return make_tiny_model(tmp_path_factory.mktemp("vllm-tiny"), hidden=256)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The weights the engine holds (rounded to bf16), run in fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).float().eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    from streamrl.rollout.engines.vllm import VLLMEngine

    # torch.cuda.is_available() above may have touched CUDA in this process: don't fork
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    engine = VLLMEngine(model_dir, dtype="bfloat16", max_batch_size=8,
                        gpu_memory_utilization=0.3, enforce_eager=True)
    yield engine
    engine.shutdown()


def _run(engine, rid, prompt, params):
    return asyncio.run(engine.generate(rid, prompt, params))


def _tempered_logprobs(model, prompt, output, temperature, top_k=-1):
    """Teacher-forced logprobs of ``output`` at ``temperature``; with ``top_k``, renormalised
    over the top k as vLLM's processed_logprobs are."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float() / (temperature or 1.0)
    if top_k != -1:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logprobs = torch.log_softmax(logits, -1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def _max_gap(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_a_teacher_forced_forward(engine, reference, temperature):
    rng = random.Random(0)
    vocab = reference.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 40))] for _ in range(6)]
    params = [SamplingParams(max_new_tokens=rng.randrange(5, 40), temperature=temperature,
                             ignore_eos=True, seed=i) for i in range(6)]

    async def batch():  # concurrent, so requests of different lengths share vLLM's batches
        return await asyncio.gather(*(engine.generate(f"lp{temperature}-{i}", p, sp)
                                      for i, (p, sp) in enumerate(zip(prompts, params))))

    for prompt, sp, out in zip(prompts, params, asyncio.run(batch())):
        assert len(out.output_ids) == sp.max_new_tokens
        assert out.finish_reason == {"type": "length", "length": sp.max_new_tokens}
        want = _tempered_logprobs(reference, prompt, out.output_ids, temperature)
        assert _max_gap(want, out.logprobs) <= TOL


@gpu
def test_top_k_logprobs_are_renormalised_over_the_kept_tokens(engine, reference):
    """The documented gap: with truncation vLLM reports the nucleus-renormalised logprob."""
    prompt = [3, 14, 15, 92, 65]
    out = _run(engine, "topk", prompt, SamplingParams(max_new_tokens=30, temperature=0.8, top_k=20,
                                                      ignore_eos=True, seed=1))
    kept = _tempered_logprobs(reference, prompt, out.output_ids, 0.8, top_k=20)
    full = _tempered_logprobs(reference, prompt, out.output_ids, 0.8)
    assert _max_gap(kept, out.logprobs) <= TOL
    assert all(k > f + 0.1 for k, f in zip(kept, full))


@gpu
def test_greedy_and_seeded_runs_repeat(engine):
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True, seed=7)
    for params in (greedy, seeded):
        a = _run(engine, "rep-a", [5, 17, 42, 9, 100, 3], params)
        b = _run(engine, "rep-b", [5, 17, 42, 9, 100, 3], params)
        assert a.output_ids == b.output_ids


@gpu
def test_stop_token_ids_and_max_new_tokens(engine):
    greedy = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    free_run = _run(engine, "free", [4, 8, 15], greedy).output_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    out = _run(engine, "stop", [4, 8, 15], SamplingParams(
        max_new_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=(stop_at,)))
    assert out.output_ids == free_run[: first + 1]
    assert out.finish_reason == {"type": "stop", "matched": stop_at}

    out = _run(engine, "len", [4, 8, 15], SamplingParams(max_new_tokens=7, ignore_eos=True))
    assert len(out.output_ids) == len(out.logprobs) == len(out.versions) == 7
    assert out.finish_reason == {"type": "length", "length": 7}


@gpu
def test_pause_resume_and_abort(engine):
    long = SamplingParams(max_new_tokens=900, ignore_eos=True)

    async def paused_then_resumed():
        engine.pause()
        task = asyncio.create_task(engine.generate("paused", [1, 2, 3], long))
        await asyncio.sleep(0.5)
        assert not task.done() and engine.load()["num_reqs"] == 1
        engine.resume()
        return await task

    assert asyncio.run(paused_then_resumed()).finish_reason["type"] == "length"

    async def aborted():
        task = asyncio.create_task(engine.generate("doomed", [1, 2, 3], long))
        await asyncio.sleep(0.2)
        engine.abort()  # every tracked request
        return await task

    out = asyncio.run(aborted())
    assert out.finish_reason["type"] == "abort" and len(out.output_ids) < 900
    assert engine.load() == {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


@gpu
def test_update_weights_mid_request_splits_versions(engine, reference):
    torch.manual_seed(1)
    new = copy.deepcopy(reference)
    with torch.no_grad():
        for p in new.parameters():  # perturb, then round to bf16 as the engine will
            p.copy_((p + 0.02 * torch.randn_like(p)).to(torch.bfloat16).float())
    prompt = [5, 17, 42, 9]
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    before = _run(engine, "w-before", prompt, greedy)
    old = engine.version

    def weights(model):
        return [(name, t.to(torch.bfloat16)) for name, t in model.state_dict().items()]

    async def swap_mid_request():
        task = asyncio.create_task(engine.generate(
            "w-long", prompt, SamplingParams(max_new_tokens=800, ignore_eos=True, seed=5)))
        await asyncio.sleep(0.3)
        await engine.update_weights(weights(new), old + 1)
        return await task

    try:
        out = asyncio.run(swap_mid_request())
        spans = out.version_spans()
        assert [s["version"] for s in spans] == [old, old + 1]
        cut = spans[1]["start"]
        # tokens before the swap came from the old weights, all after it from the new ones
        assert _max_gap(_tempered_logprobs(reference, prompt, out.output_ids, 1.0)[:cut],
                        out.logprobs[:cut]) <= TOL
        assert _max_gap(_tempered_logprobs(new, prompt, out.output_ids, 1.0)[cut:],
                        out.logprobs[cut:]) <= TOL
        after = _run(engine, "w-after", prompt, greedy)
        assert after.versions == [old + 1] * 16 and after.output_ids != before.output_ids
    finally:  # the other tests expect the original weights
        asyncio.run(engine.update_weights(weights(reference), engine.version + 1))
