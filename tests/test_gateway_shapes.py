"""The message shapes OpenAI's API defines, as frameworks send them; stop strings; ``seed``. Real openai client,
gateway, hf engine and tokenizer."""

import asyncio
import uuid

import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.generation import SamplingParams
from streamrl.inference.engines.hf import HFEngine
from streamrl.rollout.agent import AgentRunner
from streamrl.rollout.episode import ChatRenderer, EnvFault
from streamrl.rollout.tool_calls import ParsedReply, ToolCall, hermes

# ChatML as SmolLM2's template writes it: content concatenated (null content would raise), no tool support
CONCATENATING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = CONCATENATING
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tokenizer=tokenizer)
    yield tokenizer, engine
    engine.shutdown()


def _play(parts, agent, outputs=None, max_new_tokens=8):
    """The episode's sample, and every generation's output ids (into ``outputs`` as they come, if given)."""
    tokenizer, engine = parts
    runner = AgentRunner(agent, {}, renderer=ChatRenderer(tokenizer), parser=hermes, temperature=1.0,
                         max_context=1024, max_calls=64, timeout_s=60)
    outputs = [] if outputs is None else outputs

    async def generate(ids, params):
        out = await engine.generate(uuid.uuid4().hex, ids, params)
        outputs.append(out.output_ids)
        return out

    async def main():
        try:
            return await runner.play({}, generate=generate, params=SamplingParams(max_new_tokens=max_new_tokens))
        finally:
            await runner.close()

    return asyncio.run(main()), outputs


FRAMEWORK_HISTORY = [  # what LangChain and the Agents SDK send back: every shape the API defines for text
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "2 plus 2"}],
     "name": "ada"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "4"}]},
]


def test_null_content_text_parts_developer_tool_and_name_are_rendered_as_the_template_takes_them(parts):
    tokenizer, _ = parts

    async def agent(client, item):
        await client.chat.completions.create(model="policy", messages=FRAMEWORK_HISTORY)
        return 1.0

    sample, outputs = _play(parts, agent)
    as_template_takes_them = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is 2 plus 2", "name": "ada"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
        {"role": "tool", "content": "4", "tool_call_id": "call_1"}]
    rendered = tokenizer.apply_chat_template(as_template_takes_them, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(sample.tokens.tolist()) == rendered + tokenizer.decode(outputs[0])


@pytest.mark.parametrize("part, named", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "part 1 is 'image_url'"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "part 1 is 'input_audio'"),
])
def test_a_part_that_is_not_text_is_refused_by_name(parts, part, named):
    answers = []

    async def agent(client, item):
        content = [{"type": "text", "text": "what is this?"}, part]
        try:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": content}])
        except openai.BadRequestError as e:
            answers.append(e.body)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        return 0.0

    sample, _ = _play(parts, agent)
    assert named in answers[0]["message"] and "only text parts are accepted" in answers[0]["message"]
    assert answers[0]["param"] == "messages.0.content" and sample.env_info["turns"] == 1


def _ends_inside_a_token(tokenizer, ids: list[int]) -> tuple[str, str] | None:
    """(a stop string that ends inside one of ``ids``' tokens and first occurs there, the text before it)."""
    text = tokenizer.decode(ids)
    for k in range(1, len(ids)):
        before, upto = tokenizer.decode(ids[:k]), tokenizer.decode(ids[: k + 1])
        piece = upto[len(before):]
        if upto.startswith(before) and len(piece) >= 2 and before:
            stop = before[-1] + piece[0]
            if text.find(stop) == len(before) - 1:
                return stop, before[:-1]
    return None


def test_a_stop_string_that_ends_inside_a_token_is_left_out_with_what_follows_it(parts):
    tokenizer, _ = parts
    found = []

    async def agent(client, item):
        messages = [{"role": "user", "content": "the quick brown fox"}]
        for seed in range(40):  # a reply with a token of two or more characters after its first
            free = await client.chat.completions.create(model="policy", messages=messages, seed=seed)
            cut = _ends_inside_a_token(tokenizer, outputs[-1])
            if cut and free.choices[0].finish_reason == "stop":
                stop, before = cut
                again = await client.chat.completions.create(model="policy", messages=messages, seed=seed, stop=stop)
                found.append((free.choices[0].message.content, stop, before, again.choices[0].message.content))
                return 1.0
        return 0.0

    outputs = []
    _play(parts, agent, outputs, max_new_tokens=12)
    assert found, "no reply had a token of two or more characters in 40 seeds"
    free, stop, before, content = found[0]
    assert stop in free and stop not in content and content == before  # cut where the stop string began


def test_a_seed_samples_choice_i_with_seed_plus_i_and_the_same_seed_answers_alike(parts):
    replies = {}

    async def agent(client, item):
        messages = [{"role": "user", "content": "the lazy dog"}]
        two = await client.chat.completions.create(model="policy", messages=messages, seed=11, n=2)
        replies["n2"] = [c.message.content for c in two.choices]
        for seed in (11, 12, 11):
            one = await client.chat.completions.create(model="policy", messages=messages, seed=seed)
            replies.setdefault("n1", []).append(one.choices[0].message.content)
        return 0.0

    _play(parts, agent)
    assert replies["n1"][0] == replies["n1"][2] == replies["n2"][0]  # same seed, same messages: the same reply
    assert replies["n1"][1] == replies["n2"][1]  # choice 1 of seed 11 is seed 12's reply


def _two_calls(text):
    return ParsedReply(None, [ToolCall("echo", '{"text": "a"}'), ToolCall("add", '{"a": 1, "b": 2}')])


TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in ("echo", "add")]


@pytest.mark.parametrize("choice, parallel, names", [
    (None, None, ["echo", "add"]),
    ("required", None, ["echo", "add"]),  # smolagents sends it on every call: calls are read as with auto
    ({"type": "function", "function": {"name": "add"}}, None, ["add"]),
    ("auto", False, ["echo"]),
    ("none", None, []),
])
def test_tool_choice_and_parallel_tool_calls_choose_the_calls_returned(parts, choice, parallel, names):
    tokenizer, engine = parts
    got = []

    async def agent(client, item):
        extra = {k: v for k, v in (("tool_choice", choice), ("parallel_tool_calls", parallel)) if v is not None}
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "go"}],
                                                     tools=TOOLS, **extra)
        got.append([c.function.name for c in reply.choices[0].message.tool_calls or []])
        return 0.0

    runner = AgentRunner(agent, {}, renderer=ChatRenderer(tokenizer), parser=_two_calls, temperature=1.0,
                         max_context=1024, max_calls=4, timeout_s=60)

    async def main():
        try:
            await runner.play({}, generate=lambda ids, p: engine.generate(uuid.uuid4().hex, ids, p),
                              params=SamplingParams())
        finally:
            await runner.close()

    asyncio.run(main())
    assert got == [names]


def test_deeply_nested_tool_call_arguments_are_kept_as_text_not_a_server_error(parts):
    async def agent(client, item):
        history = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]
        await client.chat.completions.create(model="policy", messages=history)
        return 1.0

    sample, _ = _play(parts, agent)
    assert sample.env_info["turns"] == 1


def test_messages_the_chat_template_refuses_get_a_400(tiny_model_dir, parts):
    _, engine = parts
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}"
                               "{% endif %}" + CONCATENATING)
    refused = []

    async def agent(client, item):
        try:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        except openai.BadRequestError as e:
            refused.append(e.body)
        await client.chat.completions.create(model="policy", messages=[
            {"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
        return 0.0

    sample, _ = _play((tokenizer, engine), agent)
    assert refused[0]["param"] == "messages" and "system first" in refused[0]["message"]
    assert sample.env_info["turns"] == 1 and sample.env_info["failed_calls"] == 1


def test_the_episodes_own_client_gets_the_http_doors_answers(parts):
    """413 for size, 404 off the routes, and a 500 naming the engine's failure (even a ConnectionError)."""
    tokenizer, engine = parts
    seen = []

    async def agent(client, item):
        for call in (lambda: client.chat.completions.create(model="policy", messages=[
                         {"role": "user", "content": "x" * (17 * 2**20)}]),
                     lambda: client.with_options(base_url=str(client.base_url).replace("/v1", "/v2")).models.list(),
                     lambda: client.chat.completions.create(model="policy", messages=[
                         {"role": "user", "content": "engine down"}])):
            try:
                await call()
            except openai.APIStatusError as e:
                seen.append((e.status_code, e.body["message"]))
        return 0.0

    async def generate(ids, params):
        raise ConnectionRefusedError("the router is gone")

    runner = AgentRunner(agent, {}, renderer=ChatRenderer(tokenizer), parser=hermes, temperature=1.0,
                         max_context=1024, max_calls=8, timeout_s=60)

    async def main():
        try:
            await runner.play({}, generate=generate, params=SamplingParams())
        finally:
            await runner.close()

    with pytest.raises(EnvFault, match="without a successful call"):
        asyncio.run(main())
    assert [status for status, _ in seen] == [413, 404, 500], seen
    assert "larger than 16 MiB" in seen[0][1] and "ConnectionRefusedError: the router is gone" in seen[2][1]
