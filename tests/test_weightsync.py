from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.buffer.redis_server import free_port
from streamrl.weightsync import (
    CorruptBucket,
    TensorMeta,
    broadcast,
    buckets,
    check_digest,
    digest,
    flatten,
    make_group,
    metas,
    unflatten,
)


def test_buckets_keep_order_and_size_and_round_trip_bytes():
    tensors = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.int64)), ("c", torch.randn(100)),
               ("d", torch.randn(2, dtype=torch.bfloat16))]
    layout = buckets(metas(tensors), bucket_bytes=100)
    assert [[m.name for m in b] for b in layout] == [["a", "b"], ["c"], ["d"]]  # c alone: bigger than a bucket
    assert TensorMeta("x", "float32", (3, 4)).nbytes == 48
    for bucket in layout:
        chosen = [t for n, t in tensors if n in {m.name for m in bucket}]
        back = unflatten(flatten(chosen), bucket)
        for (name, got), want in zip(back, chosen):
            assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.slow
def test_a_push_makes_the_server_generate_with_the_learners_weights(cluster, tiny_model_dir):
    url, _ = cluster.server()
    learner = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    named = list(learner.state_dict().items())
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        joining = pool.submit(make_group, "127.0.0.1", port, 0, 2, timeout_s=60)
        r = httpx.post(f"{url}/init_weights_update_group", timeout=90, json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2})
        assert r.status_code == 200, r.text
        group = joining.result()
        layout = buckets(metas(named), bucket_bytes=64 * 1024)
        assert len(layout) > 1
        tensors = dict(named)
        for bucket in layout:
            sent = pool.submit(httpx.post, f"{url}/update_weights_from_distributed", timeout=90, json={
                "names": [m.name for m in bucket], "dtypes": [m.dtype for m in bucket],
                "shapes": [list(m.shape) for m in bucket], "weight_version": 1})
            broadcast(group, flatten([tensors[m.name] for m in bucket]))
            assert sent.result().status_code == 200
    body = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 12, "temperature": 0.8, "ignore_eos": True},
        "return_logprob": True}).json()
    assert body["meta_info"]["weight_version"] == 1
    ids = [5, 6, 7] + body["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(learner(torch.tensor([ids])).logits[0].float() / 0.8, -1)
    for i, (lp, token, _) in enumerate(body["meta_info"]["output_token_logprobs"]):
        assert abs(lp - float(ref[2 + i, token])) <= 1e-5
    assert httpx.post(f"{url}/destroy_weights_update_group", timeout=10).status_code == 200


@pytest.mark.slow
def test_the_learner_pushes_to_every_registered_server_and_survives_a_dead_one(cluster, tiny_model_dir):
    import json
    import signal
    import subprocess
    import sys

    import numpy as np

    from streamrl.buffer import PolicyVersion, ReplayStream
    from streamrl.testing import synthetic_group

    (a, _), (b, b_proc) = cluster.servers(2)
    stream, rng = ReplayStream(cluster.ns), np.random.default_rng(0)
    for _ in range(12):
        stream.put(synthetic_group(4, int(rng.integers(20, 40)), prompt_len=8, vocab=200, rng=rng))

    def learn(steps: int) -> None:
        import os

        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                  "MASTER_PORT")}
        out = subprocess.run([sys.executable, "-m", "streamrl", "launch-learner", *cluster.common,
                              "learner.groups_per_step=4", "learner.lr=0.01", "off_policy.max_staleness=9",
                              "learner.export_every=1", "weight_sync.sync_every=1", "weight_sync.timeout_s=5",
                              "weight_sync.bucket_mb=0.05", "--steps", str(steps)],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:]

    learn(2)
    records = [json.loads(line) for line in (cluster.run_path / "metrics" / "learner.jsonl").open()]
    pushes = [r for r in records if "push_version" in r]  # each push reported once it is done
    assert [(r["push_version"], r["push_targets"]) for r in pushes] == [(1, 2.0), (2, 2.0)]
    # step 2's line carries version 1's push, which ran beside that step: the learner waited for at most all of it
    assert 0 <= pushes[0]["push_wait_s"] <= pushes[0]["push_s"] and pushes[0]["step"] == 2
    for url in (a, b):
        assert httpx.get(f"{url}/get_server_info").json()["weight_version"] == 2
    assert PolicyVersion(cluster.ns).get() == 2  # published once its push landed
    pushed = AutoModelForCausalLM.from_pretrained(cluster.run_path / "export" / "version-2").eval()
    body = httpx.post(f"{a}/generate", timeout=60, json={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 10, "ignore_eos": True},
        "return_logprob": True}).json()
    with torch.no_grad():
        ref = torch.log_softmax(pushed(torch.tensor([[5, 6, 7] + body["output_ids"]])).logits[0].float(), -1)
    for i, (lp, token, _) in enumerate(body["meta_info"]["output_token_logprobs"]):
        assert abs(lp - float(ref[2 + i, token])) <= 1e-5

    late, _ = cluster.server()  # joins after training began: starts from the newest export, says so
    assert httpx.get(f"{late}/get_server_info").json()["weight_version"] == 2
    greedy = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0}}
    outputs = [httpx.post(f"{u}/generate", timeout=60, json=greedy).json()["output_ids"] for u in (a, late)]
    assert outputs[0] == outputs[1]  # the same weights, the same greedy tokens

    b_proc.send_signal(signal.SIGKILL)  # dies; its registry entry lives on for a moment
    b_proc.wait()
    learn(3)
    last = json.loads((cluster.run_path / "metrics" / "learner.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["push_targets"] >= 1.0
    assert last["push_s"] < 30  # the dead server cost at most its timeout, not a hang
    assert httpx.get(f"{a}/get_server_info").json()["weight_version"] == 3


@pytest.mark.slow
def test_a_generation_running_across_an_in_flight_push_switches_version_at_the_swapped_token(cluster, tiny_model_dir):
    import time

    from streamrl.buffer import ServerRegistry
    from streamrl.config import load_config
    from streamrl.learner.push import WeightPusher

    url, _ = cluster.server()
    registry = ServerRegistry(cluster.ns, ttl_s=1.5)
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    pusher = WeightPusher(load_config(None, [*cluster.common, "weight_sync.mode=in_flight"]), registry)
    prompt, length = [5, 6, 7], 900
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, f"{url}/generate", timeout=300, json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": length, "ignore_eos": True},
            "return_logprob": True})
        while httpx.get(f"{url}/get_load").json()[0]["num_tokens"] < len(prompt) + 40:
            time.sleep(0.01)
        seen = []  # the server's version when the pusher says the push landed (admission counts it from then)
        pusher.start(list(new.state_dict().items()), version=1,
                     landed=lambda _: seen.append(httpx.get(f"{url}/get_server_info").json()["weight_version"]))
        stats = pusher.wait()
        body = running.result().json()
    assert stats["push_targets"] == 1.0 and seen == [1]
    meta = body["meta_info"]
    assert meta["completion_tokens"] == length and meta["finish_reason"]["type"] == "length"
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [0, 1], spans
    k = spans[1]["start"]  # the first token sampled from the new weights
    assert 40 <= k < length and spans[1]["end"] == length
    ids, got = prompt + body["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]]
    with torch.no_grad():  # before the swap: the old weights alone
        before = torch.log_softmax(old(torch.tensor([ids])).logits[0].float(), -1)
        # from the swap on: the new weights, over the KV cache the old ones wrote up to the swap
        head = old(torch.tensor([ids[: len(prompt) + k - 1]]), use_cache=True)
        tail = new(torch.tensor([ids[len(prompt) + k - 1:]]), past_key_values=head.past_key_values)
        after = torch.log_softmax(tail.logits[0].float(), -1)
    for i, token in enumerate(body["output_ids"]):
        want = before[len(prompt) - 1 + i, token] if i < k else after[i - k, token]
        assert abs(got[i] - float(want)) <= 1e-5, (i, k)


def test_a_digest_names_a_bucket_whose_bytes_changed():
    buffer = flatten([torch.randn(64), torch.randn(8, 8)])
    sent = digest(buffer)
    check_digest(buffer, sent, ["a", "b"], 3)  # the same bytes pass
    check_digest(buffer, None, ["a", "b"], 3)  # no digest sent: nothing to check
    flipped = buffer.clone()
    flipped[100] ^= 1
    swapped = flatten([buffer[256:], buffer[:256]])  # the same bytes, two tensors' places exchanged
    for bad in (flipped, swapped):
        with pytest.raises(CorruptBucket, match=r"bucket of version 3 \('a' and 1 more\) arrived corrupted"):
            check_digest(bad, sent, ["a", "b"], 3)


@pytest.mark.slow
def test_a_bucket_corrupted_on_the_wire_is_refused_and_the_old_weights_keep_serving(cluster, tiny_model_dir,
                                                                                    monkeypatch):
    from streamrl.buffer import ServerRegistry
    from streamrl.config import load_config
    from streamrl.learner import push
    from streamrl.learner.push import WeightPusher

    # a heartbeat late on a loaded machine must not read as the server gone: this test is about the bucket
    url, _ = cluster.server("server.registry_ttl_s=30")
    cfg = load_config(None, [*cluster.common, "weight_sync.bucket_mb=0.05", "weight_sync.timeout_s=30"])
    pusher = WeightPusher(cfg, ServerRegistry(cluster.ns, ttl_s=cfg.server.registry_ttl_s))
    learner = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    named = [(n, p.detach()) for n, p in learner.named_parameters()]
    greedy = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0}}

    def served() -> tuple[int, list[int]]:
        body = httpx.post(f"{url}/generate", timeout=60, json=greedy).json()
        return body["meta_info"]["weight_version"], body["output_ids"]

    before = served()
    sent, wire = [], push.broadcast

    def flip_a_bit_of_the_third_bucket(group, buffer):
        sent.append(buffer)
        if len(sent) == 3:  # after the learner took its digest: the bytes change on their way
            buffer = buffer.clone()
            buffer[len(buffer) // 2] ^= 1
        wire(group, buffer)

    monkeypatch.setattr(push, "broadcast", flip_a_bit_of_the_third_bucket)
    assert pusher.push(named, 1)["push_targets"] == 0.0  # the server refused the bucket and left the push
    assert served() == before and before[0] == 0  # the old weights, under their own version, keep serving
    monkeypatch.setattr(push, "broadcast", wire)
    stats = pusher.push(named, 1)
    assert stats["push_targets"] == 1.0, stats  # it joins again; the clean push lands whole
    version, tokens = served()
    with torch.no_grad():
        logits = learner(torch.tensor([[5, 6, 7, *tokens]])).logits[0]
    assert version == 1 and logits[2:-1].argmax(-1).tolist() == tokens  # greedy under the learner's weights


def test_a_probe_passes_within_its_tolerance_and_names_the_worst_token():
    from streamrl.weightsync import Probe, ProbeMismatch

    check = Probe([1, 2, 3, 4, 5], [-1.0, -2.0, -0.5, -40.0], 1e-4)
    # allowed: 1e-4 up to |logprob| 1, then 1e-4 of its size (4e-3 at -40): the gap is the share used, x 1e-4
    assert check.check([-1.00005, -2.0, -0.49991, -40.0039], 7) == pytest.approx(9.75e-5)
    with pytest.raises(ProbeMismatch, match=r"version 7 failed its probe: .* probe token 2 is -2\.000300, the "
                                            r"learner's -2\.000000 \(off by 3\.00e-04; allowed 2\.00e-04\)"):
        check.check([-1.0, -2.0003, -0.5, -40.0], 7)
    with pytest.raises(ProbeMismatch, match=r"token 4 .* allowed 4\.00e-03"):
        check.check([-1.0, -2.0, -0.5, -40.005], 7)
    with pytest.raises(ProbeMismatch, match="off by nan"):
        check.check([-1.0, float("nan"), -0.5, -40.0], 7)
    with pytest.raises(ProbeMismatch, match="scored 2 tokens, the learner 4"):
        check.check([-1.0, -2.0], 7)


@pytest.mark.slow
def test_a_server_refuses_every_faulty_push_by_its_probe_and_takes_no_generation_until_one_passes(cluster,
                                                                                                  tiny_model_dir):
    """Each loader fault (tests/faults.py) reaches the server with intact bytes: its probe fails, the push is
    rejected (409), the server rolls back and answers generation with 503 until a clean push passes; the clean
    push then serves the learner's function under its version."""
    from faults import FAULTS

    from streamrl.buffer import ServerRegistry
    from streamrl.config import load_config
    from streamrl.learner import probe
    from streamrl.learner.push import WeightPusher
    from streamrl.weightsync import Probe

    url, _ = cluster.server()
    cfg = load_config(None, [*cluster.common, "weight_sync.bucket_mb=0.05", "weight_sync.timeout_s=30"])
    pusher = WeightPusher(cfg, ServerRegistry(cluster.ns, ttl_s=cfg.server.registry_ttl_s))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    old = [(n, p.detach().clone()) for n, p in base.named_parameters()]
    greedy = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0}}
    ids = list(range(3, 259))
    for version, fault in enumerate(FAULTS, start=1):
        torch.manual_seed(version)
        with torch.no_grad():
            for p in base.parameters():
                p.add_(0.05 * torch.randn_like(p))
        new = [(n, p.detach().clone()) for n, p in base.named_parameters()]
        check = Probe(ids, probe.logprobs(base, ids, torch.device("cpu")), 1e-4)
        stats = pusher.push(FAULTS[fault](new, old), version, check=check)
        assert (stats["push_rejected"], stats["push_targets"]) == (1.0, 0.0), fault
        info = httpx.get(f"{url}/server_info", timeout=10).json()
        assert info["weight_version"] == version - 1 and f"version {version} failed its probe" in info["withdrawn"]
        refused = httpx.post(f"{url}/generate", timeout=60, json=greedy)
        assert refused.status_code == 503 and "withdrawn from generation" in refused.text, fault
        stats = pusher.push(new, version, check=check)  # the same version, loaded right: it passes
        assert (stats["push_rejected"], stats["push_targets"]) == (0.0, 1.0), fault
        assert stats["push_probe_gap"] <= 1e-4
        body = httpx.post(f"{url}/generate", timeout=60, json=greedy).json()
        with torch.no_grad():
            logits = base(torch.tensor([[5, 6, 7, *body["output_ids"]]])).logits[0]
        assert body["meta_info"]["weight_version"] == version, fault
        assert logits[2:-1].argmax(-1).tolist() == body["output_ids"], fault  # greedy under the learner's weights
        old = new
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert f"streamrl_probe_failures {float(len(FAULTS))}" in metrics and "streamrl_withdrawn 0.0" in metrics


def test_waves_hold_at_most_the_share_and_at_least_one_server():
    from streamrl.learner.push import waves

    assert waves(["a", "b", "c", "d"], 0.5) == [["a", "b"], ["c", "d"]]
    assert waves(["a", "b", "c"], 0.5) == [["a"], ["b"], ["c"]]
    assert waves(["a", "b", "c"], 1.0) == [["a", "b", "c"]]
    assert waves(["a"], 0.1) == [["a"]] and waves([], 0.5) == []


@pytest.mark.slow
def test_a_push_reaches_the_fleet_in_waves_and_no_two_servers_pause_together(cluster, tiny_model_dir):
    from streamrl.buffer import ServerRegistry
    from streamrl.config import load_config
    from streamrl.learner.push import WeightPusher

    urls = [url for url, _ in cluster.servers(2)]
    cfg = load_config(None, [*cluster.common, "weight_sync.max_paused_share=0.5"])
    pusher = WeightPusher(cfg, ServerRegistry(cluster.ns, ttl_s=cfg.server.registry_ttl_s))
    named = [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()]
    for version in (1, 2, 3):
        assert pusher.push(named, version)["push_targets"] == 2.0
    spans = sorted(span for url in urls for span in httpx.get(f"{url}/server_info", timeout=10).json()["weight_pauses"])
    assert len(spans) == 6
    assert all(earlier[1] <= later[0] for earlier, later in zip(spans, spans[1:]))  # one server at a time


@pytest.mark.slow
@pytest.mark.parametrize("loads_right", [True, False])
def test_a_server_starting_from_an_export_verifies_it_with_the_probe_written_beside_it(cluster, tiny_model_dir,
                                                                                       loads_right):
    """A late joiner serves the learner's export only if its weights, as loaded, reproduce the probe the learner
    exported with them; otherwise it starts withdrawn (503s; version -1 in the registry, so the learner's
    catch-up reaches it)."""
    import dataclasses
    import json
    import shutil

    from streamrl.buffer import ServerRegistry
    from streamrl.learner import probe
    from streamrl.weightsync import Probe

    export = cluster.run_path / "export"
    shutil.copytree(tiny_model_dir, export / "version-3")
    (export / "latest").write_text("version-3")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    if not loads_right:  # what the learner exported is not what the server loads
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
    ids = list(range(3, 99))
    check = Probe(ids, probe.logprobs(model, ids, torch.device("cpu")), 1e-4)
    (export / "version-3" / "probe.json").write_text(json.dumps(dataclasses.asdict(check)))
    url, _ = cluster.server()
    reply = httpx.post(f"{url}/generate", timeout=60, json={"input_ids": [5, 6, 7],
                                                            "sampling_params": {"max_new_tokens": 4}})
    info = httpx.get(f"{url}/server_info", timeout=10).json()
    registry = ServerRegistry(cluster.ns, ttl_s=1.5)
    announced = registry.alive()[0].weight_version
    if loads_right:
        assert reply.status_code == 200 and reply.json()["meta_info"]["weight_version"] == 3
        assert info["withdrawn"] is None and announced == 3
    else:
        assert reply.status_code == 503 and "version 3 failed its probe" in reply.text
        assert "version 3 failed its probe" in info["withdrawn"] and announced == -1


def test_a_server_that_answers_without_scoring_the_probe_counts_as_unverified_not_verified():
    from streamrl.learner.push import Verdicts

    verdicts = Verdicts()
    verdicts.scored("http://a", httpx.Response(200, json={"success": True, "probe_gap": 3e-6}), 4)
    verdicts.scored("http://b", httpx.Response(200, json={"success": True}), 4)  # a stock SGLang server's reply
    assert verdicts.gaps == [3e-6] and verdicts.unverified == ["http://b"] and not verdicts.rejected
