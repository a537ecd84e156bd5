"""The gateway under a fuzzer: requests generated from its own OpenAPI document (schemathesis), valid and not,
get answers or 4xx errors that name the field, never a 5xx; and the episode still records correctly afterwards.

The fuzzer runs in a thread as the episode's agent, against the real gateway, hf engine and tokenizer.
"""

import asyncio
import json
import uuid

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.generation import SamplingParams
from streamrl.inference.engines.hf import HFEngine
from streamrl.rollout.agent import AgentRunner
from streamrl.rollout.chat_api import openapi
from streamrl.rollout.episode import ChatRenderer
from streamrl.rollout.gateway import MAX_BODY
from streamrl.rollout.tool_calls import hermes

EXAMPLES = 80  # per generation mode: CI's bounded budget (about 6 s)


# ChatML as SmolLM2's template (and most others) writes it: content concatenated, so null content would raise
CONCATENATING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = CONCATENATING
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tokenizer=tokenizer)
    yield tokenizer, engine
    engine.shutdown()


def _play(parts, agent):
    tokenizer, engine = parts
    runner = AgentRunner(agent, {}, renderer=ChatRenderer(tokenizer), parser=hermes, temperature=1.0,
                         max_context=256, max_calls=10_000, timeout_s=120)

    async def generate(ids, params):
        return await engine.generate(uuid.uuid4().hex, ids, params)

    async def main():
        try:
            return await runner.play({}, generate=generate, params=SamplingParams(max_new_tokens=4))
        finally:
            await runner.close()

    return asyncio.run(main())


def fuzz(base_url: str, key: str, mode: GenerationMode) -> list[int]:
    """Every status the gateway answered; raises on the first 5xx, naming the request."""
    schema = schemathesis.openapi.from_dict(openapi())
    chat = schema["/e/{episode}/v1/chat/completions"]["POST"]
    episode = base_url.rstrip("/").split("/")[-2]
    root = base_url.split("/e/")[0]
    statuses = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=chat.as_strategy(generation_mode=mode))
    def one(case):
        case.path_parameters = {"episode": episode}  # this episode, with its key: the fuzz is of the body
        case.headers = {**{k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"},
                        "Authorization": f"Bearer {key}"}
        response = case.call(base_url=root)
        statuses.append(response.status_code)
        assert response.status_code < 500, (response.status_code, response.text[:500], case.body)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", error

    one()
    return statuses


def test_fuzzed_requests_never_get_a_5xx_and_the_episode_still_records_correctly(parts):
    tokenizer, _ = parts
    seen, last = {}, {}

    async def agent(client, item):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            seen[mode.value] = await asyncio.to_thread(fuzz, str(client.base_url), client.api_key, mode)
        messages = [{"role": "user", "content": "after the storm"}]  # then an ordinary two-call conversation
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
        await client.chat.completions.create(model="policy", messages=messages)
        last["messages"] = messages
        return 0.0

    sample = _play(parts, agent)
    print({mode: {code: statuses.count(code) for code in set(statuses)} for mode, statuses in seen.items()})
    assert any(s == 200 for s in seen["positive"]) and any(400 <= s < 500 for s in seen["negative"]), seen
    start = int(sample.seq_lens[:-1].sum())  # the conversation after the fuzz is the trajectory's last sequence
    tail = sample.tokens[start:].tolist()
    reply = sample.tokens[start:][sample.loss_mask[start:].astype(bool)].tolist()
    rendered = tokenizer.apply_chat_template(last["messages"], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(tail).startswith(rendered)  # the second call extended the first, token for token
    assert tail[: len(reply)] != reply and len(reply) > 0


def _deep_tool(depth: int) -> dict:
    """A request whose one tool's parameters schema nests ``depth`` levels."""
    inner: dict = {}
    for _ in range(depth):
        inner = {"type": "array", "items": inner}
    return {"model": "p", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": inner}}}}]}


@pytest.mark.parametrize("body, status, where", [
    (b"[" * 100_000 + b"]" * 100_000, 400, "nests deeper than 64"),
    (json.dumps(_deep_tool(80)).encode(), 400, "tools.0.function.parameters.properties"),
    (b'{"model": "p", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "lone surrogate"),
    (b"x" * (MAX_BODY + 1), 413, "larger than 16 MiB"),
    (json.dumps({"model": "p", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
        "function": {"name": "f", "parameters": {"$schema": {}}}}]}).encode(), 400, "not a valid JSON schema"),
    (json.dumps({"model": "p", "messages": [{"role": "user", "content": "x"}], "seed": True}).encode(), 400,
     "seed: Input should be a valid integer"),
])
def test_bodies_the_gateway_cannot_take_get_4xx_that_say_why(parts, body, status, where):
    answers = []

    async def agent(client, item):
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{client.base_url}chat/completions", content=body,
                                headers={"Authorization": f"Bearer {client.api_key}"})
        answers.append((r.status_code, r.json()))
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        return 0.0

    sample = _play(parts, agent)
    code, answer = answers[0]
    assert code == status and where in answer["error"]["message"], answer
    assert sample.env_info["turns"] == 1 and sample.seq_lens is None
