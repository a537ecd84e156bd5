from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.buffer.redis_server import free_port
from streamrl.weightsync import TensorMeta, broadcast, buckets, make_group, metas, pack, unpack


def test_buckets_keep_order_and_size_and_round_trip_bytes():
    tensors = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.int64)), ("c", torch.randn(100)),
               ("d", torch.randn(2, dtype=torch.bfloat16))]
    layout = buckets(metas(tensors), bucket_bytes=100)
    assert [[m.name for m in b] for b in layout] == [["a", "b"], ["c"], ["d"]]  # c alone: bigger than a bucket
    assert TensorMeta("x", "float32", (3, 4)).nbytes == 48
    for bucket in layout:
        chosen = [t for n, t in tensors if n in {m.name for m in bucket}]
        back = unpack(pack(chosen), bucket)
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
            broadcast(group, pack([tensors[m.name] for m in bucket]))
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
