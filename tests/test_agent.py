"""Agents through the gateway: the real openai client, the real hf engine and tokenizer, token-exact records."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import user_agents as agents
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.generation import SamplingParams
from streamrl.inference.engines.hf import HFEngine
from streamrl.rollout.agent import AgentRunner
from streamrl.rollout.client import GenerateError
from streamrl.rollout.episode import ChatRenderer, EnvFault, EpisodeAborted
from streamrl.rollout.tool_calls import ToolCall, hermes, json_calls, load_parser
from streamrl.testing import learner_logprob_gap

PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0)


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = HFEngine(model, tokenizer=tokenizer)
    yield model, tokenizer, engine
    engine.shutdown()


def _runner(tokenizer, fn, *, parser=agents.every_reply_calls_echo, timeout_s=30.0, **args):
    return AgentRunner(fn, args, renderer=ChatRenderer(tokenizer), parser=parser, temperature=1.0,
                       max_context=1024, max_calls=8, timeout_s=timeout_s)


def _play(engine, runner, item=None):
    calls = []

    async def generate(ids, params):
        out = await engine.generate(f"r{len(calls)}", ids, params)
        calls.append((list(ids), out))
        return out

    async def main():
        try:
            return await runner.play(item or {"question": "what is 12 plus 7"}, generate=generate, params=PARAMS)
        finally:
            await runner.close()

    return asyncio.run(main()), calls


def test_a_tool_calling_agent_is_recorded_token_for_token(parts):
    model, tokenizer, engine = parts
    sample, calls = _play(engine, _runner(tokenizer, agents.tool_user))
    assert len(calls) == 3 and sample.seq_lens is None  # each call extended the one before
    for ids, _ in calls:  # every call generated from exactly the recorded context
        assert sample.tokens[: len(ids)].tolist() == ids
    generated = [t for _, out in calls for t in out.output_ids]
    assert sample.tokens[sample.loss_mask.astype(bool)].tolist() == generated  # the mask is the generated tokens
    assert sample.turn_rewards == [1.0, 1.0, 1.0] and sample.reward == 3.0 and sample.env_info["turns"] == 3
    assert (sample.versions[sample.loss_mask.astype(bool)] == 0).all() and (sample.versions[sample.loss_mask == 0] == -1).all()
    text = tokenizer.decode(sample.tokens.tolist())
    assert '"name": "echo"' in text and "echo: " in text  # the tools and the tool results were rendered
    assert learner_logprob_gap(model, sample) <= 1e-4


def _play_across_a_push(engine, tokenizer, abort_third: bool):
    """The tool user's three calls, a push landing after the first (version 5) and after the second (6); with
    ``abort_third`` the third call's generation is aborted, as a shutting-down server does."""
    runner, calls = _runner(tokenizer, agents.tool_user), []

    async def generate(ids, params):
        i = len(calls)
        engine.version = {0: 0, 1: 5}.get(i, 6)
        task = asyncio.ensure_future(engine.generate(f"a{i}", ids, params))
        if i == 2 and abort_third:
            await asyncio.sleep(0)  # submitted
            engine.abort(f"a{i}")
        out = await task
        calls.append(out)
        return out

    async def main():
        try:
            return await runner.play({"question": "what is 1 plus 1"}, generate=generate, params=PARAMS)
        finally:
            await runner.close()
            engine.version = 0

    return main, calls


def test_tokens_carry_the_version_that_made_them(parts):
    _, tokenizer, engine = parts
    main, calls = _play_across_a_push(engine, tokenizer, abort_third=False)
    sample = asyncio.run(main())
    generated = sample.versions[sample.loss_mask.astype(bool)].tolist()
    assert generated == ([0] * len(calls[0].output_ids) + [5] * len(calls[1].output_ids)
                         + [6] * len(calls[2].output_ids))
    assert sample.env_info["turns"] == 3


def test_an_aborted_call_drops_the_episode_whatever_the_agent_returns(parts):
    """The agent's aborted call gets a 503 and it gives up (the tool user raises): its two answered calls stay
    untouched, and no reward is made up for them: the episode was cut off, not played out, so it is dropped."""
    _, tokenizer, engine = parts
    main, calls = _play_across_a_push(engine, tokenizer, abort_third=True)
    with pytest.raises(EpisodeAborted, match=r"aborted after 2 answered call\(s\)"):
        asyncio.run(main())
    assert [c.finish_type for c in calls][2] == "abort"


def _play_aborted(engine, runner) -> list:
    """Play one episode whose every call is aborted as soon as it starts; the calls' completions."""
    calls = []

    async def generate(ids, params):
        task = asyncio.ensure_future(engine.generate(f"b{len(calls)}", ids, params))
        await asyncio.sleep(0)
        engine.abort(f"b{len(calls)}")
        calls.append(await task)
        return calls[-1]

    async def main():
        try:
            return await runner.play({"question": "what is 1 plus 1"}, generate=generate, params=PARAMS)
        finally:
            await runner.close()

    with pytest.raises(EpisodeAborted, match="aborted before any call was answered"):
        asyncio.run(main())
    return calls


def test_an_aborted_first_call_ends_the_episode_with_nothing_to_train_on(parts):
    _, tokenizer, engine = parts
    calls = _play_aborted(engine, _runner(tokenizer, agents.tool_user))  # the first of the agent's three calls
    assert len(calls) == 1 and calls[0].finish_type == "abort"  # no call after it


def test_an_agent_that_stalls_after_an_aborted_call_is_dropped_as_aborted_not_as_an_env_fault(parts):
    """The agent waits out the 503 (a retry loop, a backoff) past `env_timeout_s`: the abort, not the agent,
    cut the episode short, so the worker counts it `failed_aborted`, not `failed_env`."""
    _, tokenizer, engine = parts

    async def agent(client, item):
        import openai

        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        await asyncio.sleep(30)

    _play_aborted(engine, _runner(tokenizer, agent, timeout_s=0.5))


def test_a_call_the_model_server_refuses_is_a_400_and_leaves_the_episode_as_it_was(parts):
    """A prompt past the model's own context, refused by the server behind the router (a 4xx), is the call's
    fault: the agent gets a 400 naming it, nothing is recorded, and its next call is served as if it never was."""
    _, tokenizer, engine = parts
    seen = {}

    async def agent(client, item):
        import openai

        long = [{"role": "user", "content": "x " * 300}]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="policy", messages=long)
        seen["refusal"] = refused.value.body
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        return 1.0 if reply.choices[0].message.content is not None else 0.0

    async def generate(ids, params):
        if len(ids) > 200:  # what the server behind the router answers for a prompt past its model's context
            raise GenerateError("http://router/generate refused the request: HTTP 400: prompt past the model's "
                                "context", status=400)
        return await engine.generate(f"c{len(ids)}", ids, params)

    runner = _runner(tokenizer, agent)

    async def main():
        try:
            return await runner.play({"question": "q"}, generate=generate, params=PARAMS)
        finally:
            await runner.close()

    sample = asyncio.run(main())
    assert seen["refusal"]["type"] == "invalid_request_error" and "past the model's context" in seen["refusal"]["message"]
    assert sample.env_info["failed_calls"] == 1 and sample.env_info["turns"] == 1
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    assert sample.tokens[: len(prompt)].tolist() == prompt


def test_an_agent_that_edits_its_history_starts_a_new_sequence_the_learner_scores_apart(parts):
    model, tokenizer, engine = parts
    sample, calls = _play(engine, _runner(tokenizer, agents.forgetful))
    assert sample.seq_lens is not None and len(sample.seq_lens) == 2
    first, second = calls[0][0], calls[1][0]
    assert sample.tokens[: len(first)].tolist() == first
    assert sample.tokens[sample.seq_lens[0]: sample.seq_lens[0] + len(second)].tolist() == second
    assert learner_logprob_gap(model, sample) <= 1e-4


def test_a_raising_or_hanging_agent_is_an_env_fault(parts):
    _, tokenizer, engine = parts
    with pytest.raises(EnvFault, match="the agent raised RuntimeError: the agent's own bug"):
        _play(engine, _runner(tokenizer, agents.raises))
    with pytest.raises(EnvFault, match="without calling the model"):
        _play(engine, _runner(tokenizer, agents.hangs, timeout_s=1.0))


def test_a_reward_that_is_not_a_number_is_refused(parts):
    _, tokenizer, engine = parts

    async def says_yes(client, item):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        return "yes"

    with pytest.raises(EnvFault, match="expected a finite reward"):
        _play(engine, _runner(tokenizer, says_yes))


def test_sampling_fields_map_and_n_choices_follow_the_one_continued(parts):
    model, tokenizer, engine = parts

    async def picks_the_second(client, item):
        assert [m.id async for m in client.models.list()] == ["policy"]
        messages = [{"role": "user", "content": item["question"]}]
        reply = await client.chat.completions.create(model="policy", messages=messages, n=3, max_completion_tokens=4,
                                                     seed=7, stop=["zz"], top_p=0.9, temperature=1.0)
        assert len(reply.choices) == 3 and all(c.finish_reason in ("stop", "length") for c in reply.choices)
        assert reply.usage.completion_tokens <= 12
        messages += [reply.choices[1].message, {"role": "user", "content": "and then?"}]
        streamed = await client.chat.completions.create(model="policy", messages=messages, stream=True,
                                                        stream_options={"include_usage": True})
        chunks = [c async for c in streamed]
        assert chunks[-1].usage.total_tokens > 0 and chunks[-2].choices[0].finish_reason in ("stop", "length")
        return 1.0

    sample, calls = _play(engine, _runner(tokenizer, picks_the_second, parser=hermes))
    assert sample.seq_lens is None and len(calls) == 4  # three choices, then the call that continued one
    second_choice = calls[1][1].output_ids
    start = len(calls[0][0])
    assert sample.tokens[start: start + len(second_choice)].tolist() == second_choice
    assert calls[3][0][: start + len(second_choice)] == sample.tokens[: start + len(second_choice)].tolist()


def _gateway_call(engine, tokenizer, body, *, raw=None, auth=True):
    """One request to a fresh episode's endpoint, as raw HTTP: what a hostile client can send."""
    answer = {}

    async def agent(client, item):
        headers = {"Authorization": f"Bearer {client.api_key}"} if auth else {}
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{client.base_url}chat/completions", headers=headers,
                                content=raw if raw is not None else json.dumps(body))
        answer.update(status=r.status_code, body=r.json())
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        return 0.0

    _play(engine, _runner(tokenizer, agent))
    return answer["status"], answer["body"]


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, raw, where", [
    (None, b"{not json", "not valid JSON"),
    (None, b"[1, 2]", "must be a JSON object"),
    ({"model": "policy", "messages": [{"role": "wizard", "content": "hi"}]}, None, "messages.0.role"),
    ({"model": "policy", "messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 12}}}}}]}, None, "not a valid JSON schema"),
    ({"model": "policy", "messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, None, "type object"),
    ({"model": "policy", "messages": USER, "max_tokens": 10_000}, None, "max_tokens can be at most"),
    ({"model": "policy", "messages": USER, "logprobs": True}, None, "logprobs: unsupported field"),
    ({"model": "policy", "messages": USER, "temperature": 0.3}, None, "differs from the run's"),
    ({"model": "policy", "messages": USER, "tool_choice": "sometimes"}, None, "tool_choice"),
    ({"model": "policy", "messages": [{"role": "tool", "content": "x"}]}, None, "tool_call_id"),
    ({"model": "policy", "messages": []}, None, "messages"),
])
def test_hostile_requests_get_openai_shaped_400s(parts, body, raw, where):
    _, tokenizer, engine = parts
    status, answer = _gateway_call(engine, tokenizer, body, raw=raw)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    assert where in answer["error"]["message"]


def test_a_call_without_the_episodes_key_is_refused(parts):
    _, tokenizer, engine = parts
    status, answer = _gateway_call(engine, tokenizer, {"model": "policy", "messages": USER}, auth=False)
    assert status == 401 and "API key" in answer["error"]["message"]


def test_hermes_and_json_parsers_read_calls_and_leave_the_rest_as_content():
    text = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert hermes(text).content == "Let me add." and hermes(text).calls == [ToolCall("add", '{"a": 1, "b": 2}')]
    two = hermes('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": "{}"}</tool_call>')
    assert two.content is None and [c.name for c in two.calls] == ["a", "b"] and two.calls[1].arguments == "{}"
    broken = 'x <tool_call>{"name": "add", "arguments": </tool_call>'
    assert hermes(broken).content == broken and hermes(broken).calls == []
    assert json_calls('```json\n{"name": "f", "parameters": {"q": "x"}}\n```').calls == [ToolCall("f", '{"q": "x"}')]
    assert json_calls('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]').content is None
    assert json_calls("The answer is 4").calls == [] and json_calls('{"name": 3}').content == '{"name": 3}'
    assert load_parser("hermes") is hermes and load_parser(f"{Path(agents.__file__)}:every_reply_calls_echo")
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        load_parser("nope")


@pytest.mark.slow
@pytest.mark.timeout(600)  # the session's warm start (~90 s) counts here when this test is the first to ask for it
def test_the_quickstart_played_by_an_agent_learns_with_up(tmp_path, quickstart_prepared):
    """`streamrl up` with the quickstart's task played through the gateway: it trains, evaluates and learns."""
    import os
    import shutil
    import subprocess
    import sys

    from streamrl.buffer.redis_server import free_port
    from streamrl.rollout.evaluate import read_records

    shutil.copytree(quickstart_prepared, tmp_path / "agent" / "prepared")  # the recipe's warm start, made once
    argv = [sys.executable, "-m", "streamrl", "up", "configs/quickstart.yaml", f"run.dir={tmp_path}", "run.name=agent",
            f"rollout.env={Path(agents.__file__)}:single_turn", "learner.max_steps=20", "eval.every=20",
            f"router.port={free_port()}", f"router.prometheus_port={free_port()}", f"server.base_port={free_port()}",
            "supervise.display=plain"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout[-4000:]
    evals = read_records(tmp_path / "agent" / "metrics" / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 20]
    assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"] + 0.1, evals
    workers = read_records(tmp_path / "agent" / "metrics" / "rollout-worker-0.jsonl")
    assert sum(r.get("episodes", 0) for r in workers) >= 20 * 16 * 8 and not any(
        r.get("failed_env") for r in workers)


def test_an_agent_needs_a_dataset_and_an_env_must_be_a_class_or_an_agent(redis_server, tiny_model_dir):
    from streamrl.config import load_config
    from streamrl.envs.registry import env_plugin
    from streamrl.rollout.worker import RolloutWorker

    here = Path(agents.__file__)
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"rollout.env={here}:tool_user"])
    with pytest.raises(ValueError, match="has no dataset of its own: set rollout.dataset"):
        RolloutWorker(cfg, "w", redis_url=redis_server.url)
    with pytest.raises(ValueError, match="neither a subclass of streamrl.envs.Env nor an agent"):
        env_plugin(f"{here}:every_reply_calls_echo")
    assert env_plugin(f"{here}:tool_user").__name__ == "tool_user"  # the file, imported as a module of its own


def test_agent_settings_with_an_env_are_refused_by_name(tiny_model_dir):
    from streamrl.config import load_config
    from streamrl.rollout.worker import episode_player

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    for setting in ("rollout.tool_parser=json", "rollout.agent_max_calls=4"):
        cfg = load_config(None, ["rollout.env=arithmetic", setting])
        with pytest.raises(ValueError, match=f"{setting.split('=')[0]} apply to agents; rollout.env 'arithmetic'"):
            episode_player(cfg, renderer)
    make_env, agent = episode_player(load_config(None, ["rollout.env=arithmetic"]), renderer)
    assert agent is None and make_env() is not None


def test_the_shipped_agent_config_names_the_example_as_an_agent():
    from streamrl.config import load_config
    from streamrl.envs.registry import env_plugin, is_agent

    root = Path(__file__).parent.parent
    cfg = load_config(str(root / "configs" / "agent.yaml"), [])
    assert is_agent(env_plugin(str(root / cfg.rollout.env)))
    assert cfg.rollout.tool_parser == "hermes" and load_parser(cfg.rollout.tool_parser) is hermes
