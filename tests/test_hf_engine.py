import contextlib
import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.generation import SamplingParams
from streamrl.inference.engines.hf import HFEngine


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture
def engine(model):
    engine = HFEngine(model, max_batch_size=4)
    yield engine
    engine.shutdown()


def _teacher_forced_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), -1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, -1), (0.7, 0.9, -1), (1.3, 1.0, 20)])
def test_logprobs_match_a_teacher_forced_forward_under_continuous_batching(model, engine, temperature, top_p, top_k):
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 30))] for _ in range(10)]
    params = [SamplingParams(max_new_tokens=rng.randrange(3, 25), temperature=temperature, top_p=top_p,
                             top_k=top_k, ignore_eos=True, seed=i) for i in range(10)]
    # 10 requests through 4 slots: sequences of different lengths join and leave the batch
    futures = [engine.submit(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for prompt, sp, future in zip(prompts, params, futures):
        out = future.result(60)
        assert len(out.output_ids) == sp.max_new_tokens and out.finish_reason["type"] == "length"
        want = _teacher_forced_logprobs(model, prompt, out.output_ids, temperature)
        assert max(abs(a - b) for a, b in zip(want, out.logprobs)) <= 1e-4


def test_requests_arriving_at_any_time_stay_correct_as_rows_join_and_leave_in_place(model):
    # Arrivals in bursts and lulls: prompts wider and narrower than the batch join it, the batch's buffers
    # grow, and finished rows are filled by rows moved from the end.
    engine = HFEngine(model, max_batch_size=6)
    rng = random.Random(1)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in [45] + rng.choices([1, 3, 8, 20, 45], k=39)]
    params = [SamplingParams(max_new_tokens=rng.randrange(1, 30), temperature=1.0, ignore_eos=True, seed=i)
              for i in range(40)]
    futures = []
    try:
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            futures.append(engine.submit(str(i), prompt, sp))
            if i == 0 or rng.random() < 0.3:  # the first alone: the batch grows rows for the next ones
                time.sleep(rng.choice([0.001, 0.01, 0.05]))
        for prompt, sp, future in zip(prompts, params, futures):
            out = future.result(60)
            assert len(out.output_ids) == sp.max_new_tokens
            want = _teacher_forced_logprobs(model, prompt, out.output_ids, 1.0)
            assert max(abs(a - b) for a, b in zip(want, out.logprobs)) <= 1e-4
    finally:
        engine.shutdown()


def test_samples_of_one_prompt_share_one_prefill_and_stay_correct(model, engine):
    shared, other = [7, 3, 99, 41, 8], [12, 5]
    widths = []  # rows of each forward: the prefill is the one with more than one column
    hook = model.register_forward_pre_hook(lambda _, args, kw: widths.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    engine.pause()  # queue everything, so one admission sees all of it
    prompts = [shared, shared, other, shared]
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, seed=i) for i in range(4)]
    futures = [engine.submit(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    engine.resume()
    outs = [f.result(30) for f in futures]
    hook.remove()
    assert [w for w in widths if w[1] > 1] == [(2, len(shared))]  # two distinct prompts, one forward
    for prompt, out in zip(prompts, outs):
        want = _teacher_forced_logprobs(model, prompt, out.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(want, out.logprobs)) <= 1e-4
    assert len({tuple(o.output_ids) for o in (outs[0], outs[1], outs[3])}) > 1  # shared KV, independent draws


def test_greedy_matches_transformers_generate(model, engine):
    prompt = [5, 17, 42, 9, 100, 3]
    out = engine.submit("g", prompt, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)).result(30)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.output_ids == ref


def test_same_seed_same_sample(engine):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    a = engine.submit("a", [1, 2, 3], params).result(30)
    b = engine.submit("b", [1, 2, 3], params).result(30)
    assert a.output_ids == b.output_ids


def test_stop_tokens_and_eos_finish_with_stop(model, engine):
    greedy = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    free_run = engine.submit("r", [4, 8, 15], greedy).result(30).output_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    out = engine.submit("s", [4, 8, 15], SamplingParams(max_new_tokens=30, temperature=0,
                                                        stop_token_ids=(stop_at,))).result(30)
    assert out.output_ids == free_run[: first + 1]
    assert out.finish_reason == {"type": "stop", "matched": stop_at}

    eos_engine = HFEngine(model, eos_token_ids=(stop_at,))
    try:
        out = eos_engine.submit("e", [4, 8, 15], SamplingParams(max_new_tokens=30, temperature=0)).result(30)
        assert out.output_ids[-1] == stop_at and out.finish_reason["type"] == "stop"
    finally:
        eos_engine.shutdown()


def test_abort_finishes_running_and_waiting_requests(engine):
    long = SamplingParams(max_new_tokens=1000, temperature=1.0, ignore_eos=True)
    futures = [engine.submit(f"r{i}", [1, 2, 3], long) for i in range(6)]  # 4 run, 2 wait
    time.sleep(0.3)
    engine.abort("r0")
    assert futures[0].result(10).finish_reason["type"] == "abort"
    engine.abort()
    outs = [f.result(10) for f in futures[1:]]
    assert all(o.finish_reason["type"] == "abort" for o in outs)


def test_waiting_requests_join_by_priority_then_arrival(model):
    one = HFEngine(model, max_batch_size=1)  # one at a time: the order they join is the order they finish
    try:
        one.pause()  # nothing joins until all are queued
        done = []
        futures = {rid: one.submit(rid, [1, 2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True), priority=p)
                   for rid, p in (("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1))}
        for rid, future in futures.items():
            future.add_done_callback(lambda _, rid=rid: done.append(rid))
        one.abort("c")  # leaves the others their places
        assert futures["c"].result(10).finish_reason["type"] == "abort"
        one.resume()
        for future in futures.values():
            future.result(30)
        assert done == ["c", "b", "d", "a", "e"]
    finally:
        one.shutdown()


def wait_for_first_tokens(engine: HFEngine) -> None:
    """Until a running request has tokens: long before the last of a 1000-token one (a fixed sleep let a fast
    machine finish a 300-token request first)."""
    while not any(seq.out.output_ids for seq in engine._rows):
        time.sleep(0.001)


def test_weight_swap_between_steps_tags_later_tokens_with_the_new_version(model, engine):
    future = engine.submit("long", [1, 2, 3], SamplingParams(max_new_tokens=1000, temperature=1.0, ignore_eos=True))
    new = [(name, p.detach() * 1.01) for name, p in model.named_parameters()]
    wait_for_first_tokens(engine)
    engine.swap_weights(new, version=1).result(10)
    out = future.result(60)
    spans = out.version_spans()
    assert [s["version"] for s in spans] == [0, 1]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 1000
    name, tensor = new[0]
    assert torch.equal(dict(model.named_parameters())[name], tensor)


def test_pause_holds_generation_and_weights_can_be_swapped_meanwhile(model, engine):
    running = engine.submit("r", [1, 2], SamplingParams(max_new_tokens=1000, ignore_eos=True))
    wait_for_first_tokens(engine)
    engine.pause()
    waiting = engine.submit("p", [1, 2], SamplingParams(max_new_tokens=5, ignore_eos=True))
    time.sleep(0.4)  # unpaused, the 5-token request would have finished by now
    assert not waiting.done() and not running.done()
    engine.swap_weights([(n, p.detach().clone()) for n, p in model.named_parameters()], version=2).result(5)
    engine.resume()
    assert len(waiting.result(10).output_ids) == 5
    out = running.result(30)
    assert [s["version"] for s in out.version_spans()] == [0, 2]


def test_bad_requests_are_refused(model, engine):
    with pytest.raises(ValueError, match="input_ids is empty"):
        engine.submit("x", [], SamplingParams())
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, "):
        engine.submit("x", [model.config.vocab_size], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.swap_weights([("nope", torch.zeros(1))], version=1).result(10)


def test_a_request_longer_than_the_context_is_refused_with_the_reason(engine):
    with pytest.raises(ValueError, match="3 prompt tokens \\+ max_new_tokens 1022 exceed the model's context of 1024"):
        engine.submit("too-long", [1, 2, 3], SamplingParams(max_new_tokens=1022))
    assert engine.submit("fits", [1, 2, 3], SamplingParams(max_new_tokens=4)).result(30).output_ids


@contextlib.contextmanager
def _pushes_into(engine: HFEngine, model):
    """The learner's end of pushes into ``engine``'s receiver over a real gloo group on loopback: yields
    ``send(bucket, version)``, ``version(scale)`` (the model's first weights times ``scale``, in 64 kB buckets) and
    ``rejoin()`` (a new group, as a restarted learner makes)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from streamrl.buffer.redis_server import free_port
    from streamrl.weightsync import broadcast, buckets, flatten, make_group, metas

    receiver, loop, group = engine.weight_receiver(), asyncio.new_event_loop(), None
    base = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    with ThreadPoolExecutor(1) as pool:
        def rejoin() -> None:
            nonlocal group
            port = free_port()
            learner = pool.submit(make_group, "127.0.0.1", port, 0, 2, group_name="push", timeout_s=60)
            loop.run_until_complete(receiver.init("127.0.0.1", port, 1, 2, "gloo", "push", 60))
            group = learner.result()

        def send(named: list, version: int) -> int:
            cast = pool.submit(broadcast, group, flatten([t for _, t in named]))
            got = loop.run_until_complete(receiver.receive([n for n, _ in named], [str(t.dtype) for _, t in named],
                                                           [list(t.shape) for _, t in named], version))
            cast.result()
            return got

        def version(scale: float) -> list[list]:
            named = [(n, t * scale) for n, t in base]
            tensors = dict(named)
            return [[(m.name, tensors[m.name]) for m in b] for b in buckets(metas(named), bucket_bytes=64 * 1024)]

        rejoin()
        try:
            yield send, version, rejoin
        finally:
            loop.close()


def test_a_push_is_swapped_in_whole_or_not_at_all(model, engine):
    """The receiver holds a version's buckets until every parameter came: half a push (the learner died)
    leaves the served weights as they were, the next version lands whole, a bucket the model cannot take is
    refused after its broadcast (the learner is sending it)."""
    served = {n: p.detach().clone() for n, p in model.named_parameters()}
    with _pushes_into(engine, model) as (send, version, _):
        half = version(2.0)
        assert len(half) > 2
        for bucket in half[:-1]:
            send(bucket, version=1)
        assert engine.version == 0
        assert all(torch.equal(p, served[n]) for n, p in model.named_parameters())  # nothing swapped in yet
        whole = version(3.0)
        for bucket in whole:
            send(bucket, version=2)
        assert engine.version == 2
        assert all(torch.equal(p, served[n] * 3.0) for n, p in model.named_parameters())
        with pytest.raises(KeyError, match="no parameter 'nope'"):
            send([("nope", torch.zeros(3))], version=3)
        wrong = whole[0][0][0]
        with pytest.raises(ValueError, match=f"'{wrong}' has shape"):
            send([(wrong, torch.zeros(3))], version=3)
        assert engine.version == 2 and all(torch.equal(p, served[n] * 3.0) for n, p in model.named_parameters())


def test_the_push_after_one_stopped_half_way_never_writes_into_the_weights_being_served(model, engine):
    """The engine serves from the buffers a push arrived in, each bucket's two buffers in turn: the bucket after
    a push stopped half way (by the learner dying, or rejoining with a new group) must land in the other one,
    never in the one decoding reads while the push is received (and that a failed push would be rolled back to).
    A push of the served version itself is gathered whole like any other."""
    base = {n: p.detach().clone() for n, p in model.named_parameters()}

    def serving(scale: float) -> bool:
        return all(torch.equal(p, base[n] * scale) for n, p in model.named_parameters())

    with _pushes_into(engine, model) as (send, version, rejoin):
        for bucket in version(2.0):
            send(bucket, version=1)
        assert engine.version == 1 and serving(2.0)  # served from the buffers it arrived in
        for bucket in version(3.0)[:-1]:
            send(bucket, version=2)  # stopped half way
        send(version(4.0)[0], version=3)
        assert engine.version == 1 and serving(2.0)  # version 3's first bucket went elsewhere
        for bucket in version(4.0)[1:]:
            send(bucket, version=3)
        assert engine.version == 3 and serving(4.0)

        for bucket in version(5.0)[:-1]:
            send(bucket, version=4)  # stopped half way by a new group
        rejoin()
        for bucket in version(6.0):
            send(bucket, version=5)
        assert engine.version == 5 and serving(6.0)
        send(version(7.0)[0], version=6)
        assert engine.version == 5 and serving(6.0)

        for bucket in version(8.0)[:-1]:
            send(bucket, version=5)  # the served version again, as a learner resumed from a checkpoint pushes it
        assert engine.version == 5 and serving(6.0)  # gathered whole first, as any push is, not swapped in by bucket
        send(version(8.0)[-1], version=5)
        assert engine.version == 5 and serving(8.0)

        for bucket in version(9.0)[:2]:
            send(bucket, version=6)  # stopped half way, then sent again from its start on the same group
        send(version(9.0)[0], version=6)
        assert engine.version == 5 and serving(8.0)
        for bucket in version(9.0)[1:]:
            send(bucket, version=6)
        assert engine.version == 6 and serving(9.0)


def _learner_probe(learner, ids, tolerance=1e-4):
    from streamrl.learner import probe
    from streamrl.weightsync import Probe

    return Probe(ids, probe.logprobs(learner, ids, torch.device("cpu")), tolerance)


@pytest.mark.parametrize("fault", ["swapped", "transposed", "rounded_to_bf16", "kept_old_weights", "half_applied"])
def test_a_version_whose_weights_fail_the_probe_is_never_served(model, engine, fault):
    """The learner's weights as a faulty loader would leave them: the probe catches it before a decode step runs
    on them, the weights served before are put back, and no token carries the version; the clean push passes."""
    import copy

    from faults import FAULTS

    from streamrl.weightsync import ProbeMismatch

    learner = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn_like(p))
    old = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    new = [(n, p.detach().clone()) for n, p in learner.named_parameters()]
    check = _learner_probe(learner, list(range(3, 131)))
    running = engine.submit("long", [1, 2, 3], SamplingParams(max_new_tokens=1000, ignore_eos=True))
    wait_for_first_tokens(engine)
    with pytest.raises(ProbeMismatch, match=r"version 1 failed its probe: .* \(off by .*; allowed .*\)"):
        engine.swap_weights(FAULTS[fault](new, old), 1, check).result(30)
    assert engine.version == 0
    assert all(torch.equal(p, dict(old)[n]) for n, p in model.named_parameters())  # the old weights, back
    assert engine.swap_weights([(n, t.clone()) for n, t in new], 2, _learner_probe(learner, check.input_ids)
                               ).result(30) <= 1e-4
    out = running.result(60)
    assert [s["version"] for s in out.version_spans()] == [0, 2]  # never 1
