import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.inference.engines.hf import HFEngine
from streamrl.inference.server import create_app

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine(model, max_batch_size=8, tokenizer=tokenizer)
    app = create_app(engine, model_path=tiny_model_dir, tokenizer=tokenizer, token=TOKEN)
    with TestClient(app) as client:
        yield client, model, tokenizer, engine
    engine.shutdown()


def _gen(client, **body):
    return client.post("/generate", json=body)


def test_generate_from_input_ids_returns_sglang_shape(served):
    client, model, _, _ = served
    r = _gen(client, input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 6, "temperature": 0.8, "ignore_eos": True},
             return_logprob=True, rid="abc", stream=False, log_metrics=True, model=None, priority=3)
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == 6 and isinstance(body["text"], str)
    assert meta["id"] == "abc" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 6)
    assert meta["weight_version"] == 0 and meta["weight_versions"] == [{"version": 0, "start": 0, "end": 6}]
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == body["output_ids"] and all(x is None for *_, x in lps)
    with torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5] + body["output_ids"]])).logits[0].float() / 0.8
    ref = torch.log_softmax(logits, -1)
    for i, (lp, t, _) in enumerate(lps):
        assert abs(lp - float(ref[2 + i, t])) <= 1e-4


def test_generate_from_text_and_n_samples(served):
    client, _, tokenizer, _ = served
    r = _gen(client, text="what is 12 plus 7", sampling_params={"max_new_tokens": 4, "n": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    bodies = r.json()
    assert len(bodies) == 3
    assert all(b["meta_info"]["prompt_tokens"] == len(tokenizer("what is 12 plus 7").input_ids) for b in bodies)
    assert len({b["meta_info"]["id"] for b in bodies}) == 3


def test_greedy_is_deterministic_and_stop_tokens_stop(served):
    client, _, _, _ = served
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    a = _gen(client, input_ids=[7, 8, 9], sampling_params=greedy).json()
    b = _gen(client, input_ids=[7, 8, 9], sampling_params=greedy).json()
    assert a["output_ids"] == b["output_ids"]
    stop = a["output_ids"][3]
    c = _gen(client, input_ids=[7, 8, 9], sampling_params={**greedy, "stop_token_ids": [stop]}).json()
    assert c["output_ids"][-1] == stop and c["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_strings_stop_and_are_trimmed_from_text(served):
    client, _, tokenizer, _ = served
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    free = _gen(client, text="the quick", sampling_params=greedy).json()
    stop = free["text"][4:7]
    assert stop.strip(), "the model's output is too short to pick a stop string"
    r = _gen(client, text="the quick", sampling_params={**greedy, "stop": stop}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in r["text"] and len(r["output_ids"]) < 24


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "exactly one of input_ids or text"),
        ({"input_ids": [1], "text": "x"}, "exactly one of input_ids or text"),
        ({"input_ids": []}, "input_ids is empty"),
        ({"input_ids": [10_000]}, "input_ids must be in"),
        ({"input_ids": ["a"]}, "input_ids"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1], "stream": True}, "stream=true is not supported"),
        ({"input_ids": [1], "priority": "soon"}, "priority"),
    ],
)
def test_bad_generate_requests_get_400_with_a_reason(served, body, message):
    client = served[0]
    r = client.post("/generate", json=body)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


def test_non_json_body_gets_400(served):
    r = served[0].post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_info_load_and_metrics_endpoints(served):
    client, _, _, _ = served
    assert client.get("/health").status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = client.get(path).json()
        assert info["is_generation"] is True and info["model_path"]
    for path in ("/get_server_info", "/server_info"):
        assert client.get(path).json()["engine"] == "hf"
    [load] = client.get("/get_load").json()
    assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    _gen(client, input_ids=[1, 2], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    text = client.get("/metrics").text
    assert "streamrl_generated_tokens_total" in text and "streamrl_num_reqs" in text
    busy = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("streamrl_busy_seconds "))
    assert busy > 0  # time spent generating: tokens / busy is the engine's speed while it has work


@pytest.mark.parametrize("path", ["/pause_generation", "/continue_generation", "/flush_cache", "/abort_request",
                                  "/update_weights_from_disk", "/init_weights_update_group",
                                  "/update_weights_from_distributed", "/destroy_weights_update_group"])
def test_control_endpoints_refuse_requests_without_the_token(served, path):
    client = served[0]
    assert client.post(path, json={}).status_code == 401
    assert client.post(path, json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_pause_and_continue_with_the_token(served):
    client, _, _, engine = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        assert client.post("/pause_generation", headers=auth).json() == {"success": True}
        assert not engine._unpaused.is_set()
        assert client.post("/continue_generation", headers=auth).json() == {"success": True}
        assert engine._unpaused.is_set()
    finally:  # the other tests share this server
        engine._unpaused.set()


def test_update_weights_from_disk_swaps_weights_and_version(served, tmp_path):
    client, model, _, engine = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    scaled = AutoModelForCausalLM.from_pretrained(served_path := model.name_or_path)
    with torch.no_grad():
        for p in scaled.parameters():
            p.mul_(1.5)
    scaled.save_pretrained(tmp_path)
    name, param = next(iter(scaled.named_parameters()))
    try:
        r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": 4},
                        headers=auth)
        assert r.status_code == 200, r.text
        assert engine.version == 4
        assert torch.equal(dict(model.named_parameters())[name], param)
        body = _gen(client, input_ids=[1, 2], sampling_params={"max_new_tokens": 2, "ignore_eos": True}).json()
        assert body["meta_info"]["weight_version"] == 4
        bad = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")}, headers=auth)
        assert bad.status_code == 400 and "no *.safetensors" in bad.json()["error"]["message"]
    finally:  # the original weights back, whatever failed: the other tests share this server
        client.post("/update_weights_from_disk", json={"model_path": served_path, "weight_version": 0}, headers=auth)
    original = AutoModelForCausalLM.from_pretrained(served_path)
    assert torch.equal(dict(model.named_parameters())[name], dict(original.named_parameters())[name])


def test_distributed_weight_endpoints_validate_and_fail_clearly_without_a_learner(served):
    from streamrl.buffer.redis_server import free_port

    client = served[0]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    bad = client.post("/update_weights_from_distributed", json={"names": ["a"], "dtypes": [], "shapes": []},
                      headers=auth)
    assert bad.status_code == 400
    early = client.post("/update_weights_from_distributed", json={"names": ["a"], "dtypes": ["float32"],
                                                                  "shapes": [[1]]}, headers=auth)
    assert early.status_code == 400 and "init_weights_update_group first" in early.json()["error"]["message"]
    r = client.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": free_port(),
                                                        "rank_offset": 1, "world_size": 2, "timeout_s": 1},
                    headers=auth)
    assert r.status_code == 500 and "could not join" in r.json()["error"]["message"]
