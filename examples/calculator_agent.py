"""A tool-using agent, written against the plain OpenAI client: nothing in ``solve`` knows about streamrl.

It answers "What is a * b + c?" questions with a calculator tool: the model may call
``calculator`` (Hermes-style, ``<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>``),
sees the result, and answers with the number. The reward is 1 for the right number.

Train it (streamrl runs ``solve`` for every episode, handing it a client bound to the episode):

    streamrl up configs/agent.yaml --fresh

The calculator parses arithmetic and never evaluates code (``streamrl.envs.calculator.calculate``); a tool
that runs model-written code belongs in a sandbox (``streamrl.envs.sandbox.run_python``).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

from streamrl.envs.calculator import Calculator, calculate

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression (numbers, + - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]
SYSTEM = ('You can use a calculator. To call it, write <tool_call>{"name": "calculator", "arguments": '
          '{"expression": "2 * 3 + 4"}}</tool_call> and wait for the result. Finish with the number only.')
# One worked exchange: a 135M model imitates it (12 of 16 greedy replies call the tool; none without it)
EXAMPLE = [
    {"role": "user", "content": "What is 5 * 4 + 2?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "5 * 4 + 2"}}'
                                     '</tool_call>'},
    {"role": "tool", "tool_call_id": "example", "content": "22"},
    {"role": "assistant", "content": "22"},
]


async def solve(client, item, max_turns: int = 4):
    """One episode: returns (reward, info)."""
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": item["question"]}]
    calls = 0
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            calls += 1
            try:
                result = calculate(str(json.loads(call.function.arguments).get("expression", "")))
            except (ValueError, AttributeError):
                result = "error: arguments must be a JSON object with an expression"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+", message.content or "")
    correct = bool(numbers) and int(numbers[-1]) == int(item["answer"])
    return float(correct), {"correct": correct, "calls": calls}


def prepare(cfg, *, model_dir: str = "models/smollm2-135m", digits: int = 2, eval_size: int = 128,
            train_size: int = 4000) -> dict:
    """``prepare.fn``: the model (SmolLM2, converted once) and the questions, held-out ones apart."""
    from streamrl.models import convert_smollm2

    if not (Path(model_dir) / "config.json").is_file():
        convert_smollm2(model_dir)
    root = Path(cfg.run.path) / "prepared"
    train, evals = root / "train.jsonl", root / "eval.jsonl"
    if not train.is_file():
        root.mkdir(parents=True, exist_ok=True)
        held_out = {i["question"]: i for i in itertools.islice(Calculator(digits).items(10**6), eval_size)}
        rows = (i for i in Calculator(digits).items(cfg.run.seed) if i["question"] not in held_out)
        evals.write_text("".join(json.dumps(i) + "\n" for i in held_out.values()))
        train.write_text("".join(json.dumps(i) + "\n" for i in itertools.islice(rows, train_size)))
    return {"model.path": model_dir, "rollout.dataset": str(train), "eval.dataset": str(evals)}
