"""Agents for the gateway's tests, written as a user would: the plain openai client, nothing of streamrl."""

from __future__ import annotations

import json
import random

from streamrl.rollout.tool_calls import ParsedReply, ToolCall

ECHO = {"type": "function", "function": {
    "name": "echo", "description": "Echo some text back.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


def every_reply_calls_echo(text: str) -> ParsedReply:
    """A tool parser under which any reply is a call (a tiny random model writes no <tool_call> markup)."""
    return ParsedReply(None, [ToolCall("echo", json.dumps({"text": text[:20]}))])


async def tool_user(client, item, turns: int = 3, fail_rate: float = 0.0):
    """Calls the model ``turns`` times, answering each tool call; 1 point a call, given per turn. Raises
    (after its first call) in a ``fail_rate`` share of its episodes: an agent's own bug."""
    messages = [{"role": "system", "content": "Use the echo tool."}, {"role": "user", "content": item["question"]}]
    rewards = []
    for _ in range(turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[ECHO], max_tokens=6)
        message = reply.choices[0].message
        messages.append(message)  # the reply object as it came back, as agent code does
        for call in message.tool_calls or []:
            text = json.loads(call.function.arguments)["text"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"echo: {len(text)}"})
        rewards.append(float(len(message.tool_calls or [])))
        if random.random() < fail_rate:
            raise RuntimeError("the agent's own bug")
    return sum(rewards), {"turn_rewards": rewards, "calls": len(rewards)}


async def forgetful(client, item):
    """Asks twice, the second time with its first exchange edited out: history the context cannot extend."""
    first = [{"role": "user", "content": item["question"]}]
    reply = await client.chat.completions.create(model="policy", messages=first, max_tokens=5)
    second = [{"role": "user", "content": "Start over: " + item["question"]}]
    await client.chat.completions.create(model="policy", messages=second, max_tokens=5)
    return 0.5 if reply.choices[0].message.content else 0.0


async def raises(client, item):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    raise RuntimeError("the agent's own bug")


async def hangs(client, item):
    import asyncio

    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    await asyncio.sleep(3600)


async def single_turn(client, item, reward: str = "exact_match"):
    """The ``single_turn`` env's episode played through the OpenAI API (the quickstart's task, as an agent)."""
    from streamrl.envs.base import Action
    from streamrl.envs.single_turn import SingleTurn

    env = SingleTurn(reward=reward)
    messages = (await env.reset(item)).messages
    reply = await client.chat.completions.create(model="policy", messages=messages)
    result = await env.step(Action(text=reply.choices[0].message.content or "", token_ids=[]))
    return result.reward, result.info


def odd_replies_call_the_calculator(text: str) -> ParsedReply:
    """A tool parser for the tiny random model: a reply of odd length is a calculator call, any other its answer."""
    if len(text) % 2:
        return ParsedReply(None, [ToolCall("calculator", json.dumps({"expression": "3 * 4 + 5"}))])
    return ParsedReply(text)


async def by_framework(client, item, max_turns: int = 4, log: str | None = None):
    """``item["framework"]``'s example agent (examples/frameworks/), as it is, under a reward of its own; each
    finished episode logged to ``log``."""
    import importlib.util
    from pathlib import Path

    name = {"langgraph": "langgraph_agent", "openai-agents": "openai_agents_agent",
            "pydantic-ai": "pydantic_ai_agent"}[item["framework"]]
    path = Path(__file__).parent.parent / "examples" / "frameworks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, info = await module.solve(client, item, max_turns=max_turns)
    # the tiny model cannot do arithmetic: reward answers whose length is a multiple of 4 instead (an answer has
    # an even length under odd_replies_call_the_calculator), a signal that varies within a group about half the time
    reward = float(len(info["answer"]) % 4 == 0)
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"framework": item["framework"], "reward": reward}) + "\n")
    return reward, {**info, "framework": item["framework"]}
