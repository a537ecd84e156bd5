"""Real processes: rollout servers, the registry in a real redis-server, and the real sglang-router."""

import asyncio
import json
import logging
import signal
import time

import httpx
import pytest

from streamrl.buffer import ServerRegistry
from streamrl.config import load_config
from streamrl.generation import SamplingParams
from streamrl.rollout.client import GenerateClient, GenerateError
from streamrl.rollout.evaluate import Evaluator

pytestmark = pytest.mark.slow


def _served(url: str) -> float:
    return _counted(url, "ok")


def _router_workers(url: str) -> set[str]:
    return {w["url"] for w in httpx.get(url + "/workers").json()["workers"]}


def _until(predicate, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


async def _burst(router_url: str, n: int) -> list:
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    async with GenerateClient(router_url, retries=6, backoff_s=0.2) as client:
        return await asyncio.gather(*(client.generate([1, 2, 3], params) for _ in range(n)))


def test_router_spreads_requests_drops_dead_servers_and_adds_new_ones(cluster):
    (a, a_proc), (b, _) = cluster.servers(2)
    router_url, _ = cluster.router()
    _until(lambda: _router_workers(router_url) == {a, b})

    outs = asyncio.run(_burst(router_url, 24))
    assert all(len(o.output_ids) == 4 and o.finish_type == "length" for o in outs)
    assert all(o.versions == [0] * 4 and len(o.logprobs) == 4 for o in outs)
    assert _served(a) > 0 and _served(b) > 0

    a_proc.send_signal(signal.SIGKILL)
    outs = asyncio.run(_burst(router_url, 12))  # requests keep succeeding while a is dying
    assert len(outs) == 12
    _until(lambda: _router_workers(router_url) == {b})
    _until(lambda: [s.url for s in ServerRegistry(cluster.ns).alive()] == [b])  # the router may drop a first

    c, _ = cluster.server()  # joins at run time
    _until(lambda: _router_workers(router_url) == {b, c})
    before = _served(c)
    asyncio.run(_burst(router_url, 12))
    assert _served(c) > before


def test_n_samples_of_one_context_come_back_through_the_router_from_one_request(cluster):
    url, _ = cluster.server()
    router_url, _ = cluster.router()
    _until(lambda: _router_workers(router_url) == {url})
    before = _latency_count(url)

    async def sample():
        async with GenerateClient(router_url) as client:
            return await client.generate_n([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True), 4)

    outs = asyncio.run(sample())
    assert len(outs) == 4 and all(len(o.output_ids) == 6 == len(o.logprobs) for o in outs)
    assert len({tuple(o.output_ids) for o in outs}) > 1  # independent samples, not one copied
    assert _latency_count(url) == before + 1 and _served(url) >= 4


def _latency_count(url: str) -> float:
    """Requests the server answered (its latency histogram observes each request once)."""
    text = httpx.get(url + "/metrics").text
    line = next((x for x in text.splitlines() if x.startswith("streamrl_request_latency_seconds_count")), None)
    return float(line.split()[-1]) if line else 0.0


def _counted(url: str, status: str) -> float:
    text = httpx.get(url + "/metrics").text
    line = next((x for x in text.splitlines() if x.startswith(f'streamrl_requests_total{{status="{status}"}}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_a_caller_that_hangs_up_aborts_its_generation_at_the_server(cluster):
    """Directly and through sglang-router: a generation its caller gave up on (an agent gone, a client timeout)
    is aborted at the server instead of holding a batch slot to its last token."""
    url, _ = cluster.server()
    router_url, _ = cluster.router()
    _until(lambda: _router_workers(router_url) == {url})

    async def hang_up(target: str) -> None:
        async with GenerateClient(target, retries=0) as client:
            call = asyncio.ensure_future(client.generate([5, 6, 7], SamplingParams(max_new_tokens=1000, ignore_eos=True)))
            await asyncio.to_thread(_until, lambda: httpx.get(url + "/get_load").json()[0]["num_reqs"] == 1)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)

    for n, target in enumerate((url, router_url), start=1):
        asyncio.run(hang_up(target))
        _until(lambda: httpx.get(url + "/get_load").json()[0]["num_reqs"] == 0)
        assert _counted(url, "hung_up") == n and _counted(url, "ok") == 0  # aborted, never run to its end


def test_client_raises_on_4xx_without_retrying(cluster):
    url, _ = cluster.server()

    async def bad():
        async with GenerateClient(url, retries=3) as client:
            await client.generate([10_000], SamplingParams(max_new_tokens=2))

    t0 = time.monotonic()
    with pytest.raises(GenerateError, match="refused the request: HTTP 400") as refused:
        asyncio.run(bad())
    assert refused.value.status == 400  # the gateway answers an agent's refused call with a 400 of its own
    assert time.monotonic() - t0 < 2


def test_an_evaluation_rides_out_a_router_without_servers(cluster, tmp_path, caplog):
    """The router answers 503 while no server is up: the evaluator tries again (bounded) instead of dying."""
    router_url, _ = cluster.router()
    rows = tmp_path / "eval.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{a} + 1 =", "answer": a + 1}) + "\n" for a in range(3)))
    cfg = load_config(None, [*cluster.common, f"rollout.router_url={router_url}", f"eval.dataset={rows}",
                             "rollout.sampling.max_new_tokens=4"])
    evaluator = Evaluator(cfg, cfg.redis.url)

    async def run():
        async with GenerateClient(router_url, retries=1, backoff_s=0.1) as evaluator.client:
            with pytest.raises(GenerateError, match="no_available_workers"):  # out of patience
                await evaluator._evaluate_patiently(0, patience_s=1.0, pause_s=0.4)
            attempt = asyncio.ensure_future(evaluator._evaluate_patiently(0, pause_s=0.4))
            await asyncio.sleep(1.0)
            assert not attempt.done()
            await asyncio.to_thread(cluster.server)  # joins the registry; the router follows it
            return await attempt

    with caplog.at_level(logging.WARNING, logger="streamrl.evaluate"):
        record = asyncio.run(run())
    assert record["eval/prompts"] == 3 and record["eval/version_min"] == 0
    assert "evaluation at step 0 failed, trying again" in caplog.text


def test_versions_read_streamrl_spans_and_stock_sglang_labels():
    from streamrl.rollout.client import _versions

    spans = [{"start": 0, "end": 2, "version": 3}, {"start": 2, "end": 3, "version": 4}]
    assert _versions({"weight_versions": spans}, 3) == [3, 3, 4]
    assert _versions({"weight_version": "default"}, 2) == [0, 0]  # SGLang's label for the weights it started with
    assert _versions({"weight_version": "7"}, 2) == [7, 7]  # an update labelled by a streamrl push
    with pytest.raises(ValueError):  # a label that names no version is a malformed response (GenerateError)
        _versions({"weight_version": "v2-final"}, 1)


def test_a_server_whose_push_failed_its_probe_leaves_the_router_until_a_version_passes(cluster, tiny_model_dir):
    """The router sends a withdrawn server nothing: it leaves the router's workers (it announces version -1) and
    comes back once a later push passes; the other server serves meanwhile."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.learner import probe
    from streamrl.learner.push import WeightPusher
    from streamrl.weightsync import Probe

    (a, _), (b, _) = cluster.servers(2)
    router_url, _ = cluster.router()
    _until(lambda: _router_workers(router_url) == {a, b})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    ids = list(range(3, 67))
    cfg = load_config(None, [*cluster.common, "weight_sync.timeout_s=30"])
    pusher = WeightPusher(cfg, ServerRegistry(cluster.ns, ttl_s=cfg.server.registry_ttl_s))
    wrong = Probe(ids, [lp + 0.5 for lp in probe.logprobs(model, ids, torch.device("cpu"))], 1e-4)
    pusher.refresh()  # joins both servers' groups (a push to ``only`` some looks for no servers)
    stats = pusher.push(named, 1, only=[a], check=wrong)
    assert (stats["push_rejected"], stats["push_targets"]) == (1.0, 0.0)
    _until(lambda: _router_workers(router_url) == {b})
    outs = asyncio.run(_burst(router_url, 8))  # all served by b, at its version
    assert len(outs) == 8 and all(o.versions == [0] * 4 for o in outs)
    right = Probe(ids, probe.logprobs(model, ids, torch.device("cpu")), 1e-4)
    assert pusher.push(named, 1, only=[a], check=right)["push_targets"] == 1.0
    _until(lambda: _router_workers(router_url) == {a, b})
