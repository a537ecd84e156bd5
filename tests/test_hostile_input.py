"""Hostile input, generated: every reader answers with its own clear error (or a dead letter), never a crash.

Property-based (hypothesis) over the wire codec, the replay reader, the config loader, dataset
files and env outputs; schemathesis over the rollout server's OpenAPI schema, in process.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from streamrl.buffer import StreamReader
from streamrl.config import ConfigError, load_config
from streamrl.dataset import DatasetError, load_rows
from streamrl.envs.base import Env, Observation, StepResult
from streamrl.protocol import Group, WireError, decode_group, encode_group
from streamrl.testing import synthetic_group

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
    max_leaves=30)


@FAST
@given(st.binary(max_size=512))
def test_random_bytes_are_a_group_or_a_wire_error(payload):
    try:
        group = decode_group(payload)
    except WireError:
        return
    assert isinstance(group, Group)
    wire = encode_group(group)  # what decodes is a group the wire takes again, unchanged
    assert encode_group(decode_group(wire)) == wire


@FAST
@given(msgpack_values)
def test_any_msgpack_value_is_a_group_or_a_wire_error(value):
    try:
        group = decode_group(msgpack.packb(value))
    except WireError:
        return
    assert isinstance(group, Group)


@FAST
@given(st.data())
def test_a_mutated_group_decodes_to_a_valid_group_or_a_wire_error(data):
    raw = msgpack.unpackb(encode_group(synthetic_group(2, 16, prompt_len=4)), raw=False)
    key = data.draw(st.sampled_from(sorted(raw)))
    raw[key] = data.draw(msgpack_values)
    try:
        group = decode_group(msgpack.packb(raw))
    except WireError:
        return
    wire = encode_group(group)  # what decodes is a group the wire takes again, unchanged
    assert encode_group(decode_group(wire)) == wire


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from([b"d", b"gid", b"v_min", b"v_max", b"ntok", b"schema", b"x"]),
                              st.binary(max_size=40), min_size=1, max_size=7))
def test_the_replay_reader_dead_letters_whatever_a_stranger_appends(ns, fields):
    good = synthetic_group(2, 8, prompt_len=2)
    from streamrl.buffer import ReplayStream

    ReplayStream(ns).put(good)
    bad_id = ns.conn.xadd(ns.key("groups"), fields).decode()
    reader = StreamReader(ns)
    seen = []
    while entries := reader.read(10):
        seen += entries
    assert good.group_id in [e.group.group_id for e in seen]
    assert reader.cursor == bad_id  # moved past the bad entry, which is either valid or in the dead letters
    dead = [f[b"src"].decode() for _, f in ns.conn.xrange(ns.key("dead"))]
    assert bad_id in dead or bad_id in [e.id for e in seen]
    ns.conn.delete(ns.key("groups"), ns.key("dead"), ns.key("dead_ids"))


overrides = st.builds(lambda k, v: f"{k}={v}", st.sampled_from(
    ["learner.lr", "rollout.sampling.n", "mode", "run.name", "rollout.env_args", "server.count", "nope.field",
     "learner", "off_policy.max_staleness", "weight_sync.sync_every", ""]),
    st.text(max_size=12) | st.integers().map(str) | st.floats().map(str))


@FAST
@given(st.lists(overrides | st.text(max_size=15), max_size=4))
def test_any_override_gives_a_config_or_a_config_error(items):
    try:
        load_config(None, items)
    except ConfigError as e:
        assert str(e)


@FAST
@given(st.text(max_size=200))
def test_any_yaml_file_gives_a_config_or_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text)
    try:
        load_config(path, [])
    except ConfigError as e:
        assert str(e)


@FAST
@given(st.binary(max_size=300))
def test_any_jsonl_file_gives_rows_or_a_dataset_error_naming_the_line(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_bytes(content)
    try:
        rows = load_rows(path)
    except DatasetError as e:
        assert str(path) in str(e)
        return
    assert all(isinstance(r, dict) for r in rows)


class Scripted(Env):
    """An env whose reset/step return whatever the test hands it."""

    def __init__(self, result):
        self.result = result

    async def reset(self, item):
        return self.result

    async def step(self, action):
        return self.result


@FAST
@given(msgpack_values | st.builds(StepResult, reward=st.floats(), done=st.booleans())
       | st.builds(Observation, messages=st.just([{"role": "user", "content": "hi"}])))
def test_whatever_an_env_returns_is_used_or_is_an_env_fault(result):
    from streamrl.rollout.worker import EnvFault, GuardedEnv

    env = GuardedEnv(Scripted(result), asyncio.Semaphore(1), timeout_s=5)

    async def both():
        for call, kind in ((env.reset({}), Observation), (env.step(None), StepResult)):
            try:
                out = await call
            except EnvFault:
                continue
            assert isinstance(out, kind)
            if kind is StepResult:
                assert math.isfinite(out.reward)

    asyncio.run(both())


def test_an_env_that_hangs_is_an_env_fault_after_its_time_limit_and_its_close_does_not_hang_the_episode():
    from streamrl.rollout.worker import EnvFault, GuardedEnv

    class Hangs(Env):
        async def reset(self, item):
            await asyncio.sleep(60)

        async def step(self, action):
            await asyncio.sleep(60)

        async def close(self):
            await asyncio.sleep(60)

    env = GuardedEnv(Hangs(), asyncio.Semaphore(1), timeout_s=0.2)

    async def play():
        for call in (env.reset({}), env.step(None)):
            with pytest.raises(EnvFault, match="timed out after"):
                await call
        await env.close()  # logged, not raised

    started = time.monotonic()
    asyncio.run(play())
    assert time.monotonic() - started < 5


# ----------------------------------------------------------------------------- the HTTP API

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e .[dev])")


@pytest.fixture(scope="module")
def server_app(tiny_model_dir):
    from transformers import AutoTokenizer

    from streamrl.inference.engines import load_engine
    from streamrl.inference.server import create_app

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = load_engine("hf", tiny_model_dir, dtype="float32", max_batch_size=64, tokenizer=tokenizer)
    engine.max_length = 24  # a short context keeps every generated request cheap
    yield create_app(engine, model_path=tiny_model_dir, tokenizer=tokenizer, token="secret")
    engine.shutdown()


def test_every_endpoint_answers_generated_requests_without_a_server_error(server_app):
    from hypothesis import HealthCheck as HC
    from hypothesis import settings as hsettings

    schema = schemathesis.openapi.from_asgi("/openapi.json", server_app)
    failures, seen = [], []
    for operation in schema.get_all_operations():
        op = operation.ok()

        # no shrinking: a failure is reported as found, and the test's time stays bounded
        @hsettings(max_examples=25, deadline=None, suppress_health_check=list(HC), derandomize=True,
                   phases=[Phase.explicit, Phase.generate])
        @given(case=op.as_strategy())
        def check(case):
            response = case.call()
            seen.append((case.path, response.status_code))
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path}: {response.status_code} {response.text[:200]}")
            if case.path in CONTROL:
                assert response.status_code == 401, f"{case.path} answered without the token"

        check()
    assert not failures, "\n".join(failures[:10])
    assert {path for path, _ in seen} >= CONTROL | {"/generate"}
    assert Counter(status for _, status in seen)[400] > 10  # the malformed bodies were refused, not served


CONTROL = {"/abort_request", "/pause_generation", "/continue_generation", "/flush_cache", "/update_weights_from_disk",
           "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"}


@settings(max_examples=60, deadline=None, phases=[Phase.explicit, Phase.generate], derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(ids=st.lists(st.integers(-3, 700), min_size=0, max_size=12), new=st.integers(-1, 30),
       temperature=st.floats(-1, 3) | st.just(0.0), top_p=st.floats(-0.5, 1.5), top_k=st.integers(-2, 50),
       n=st.integers(-1, 4), stop=st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2),
       stop_ids=st.none() | st.lists(st.integers(-2, 700), max_size=3), seed=st.none() | st.integers(-1, 2**40),
       start=st.integers(-2, 14), top=st.integers(-1, 3) | st.just(10**6))
def test_generate_bodies_near_the_valid_range_are_served_correctly_or_refused(server_app, ids, new, temperature,
                                                                             top_p, top_k, n, stop, stop_ids, seed,
                                                                             start, top):
    from fastapi.testclient import TestClient

    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": top,
            "sampling_params": {"max_new_tokens": new, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                                "n": n, "stop": stop, "stop_token_ids": stop_ids, "sampling_seed": seed}}
    reply = TestClient(server_app).post("/generate", json=body)
    assert reply.status_code in (200, 400), reply.text
    if reply.status_code == 400:
        assert reply.json()["error"]["message"]
        return
    outs = reply.json() if isinstance(reply.json(), list) else [reply.json()]
    assert len(outs) == n
    for out in outs:
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert min(new, 1) <= len(out["output_ids"]) == len(lps) <= new  # max_new_tokens 0 scores the prompt
        assert all(math.isfinite(lp) and lp <= 1e-6 for lp in lps)
        scored = out["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in scored] == (ids[start:] if start >= 0 else [])
        assert [lp is None for lp, _, _ in scored] == [i == 0 for i in range(len(scored))]
        assert all(math.isfinite(lp) and lp <= 1e-6 for lp, _, _ in scored[1:])

