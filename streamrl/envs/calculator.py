"""Multi-turn tool use: the model may call a calculator, sees its result, then answers.

A call is ``<calc>EXPR</calc>``; the result comes back as a user turn (tokens the
policy did not generate: loss mask 0). The expression is parsed, never ``eval``-ed:
only numbers, + - * / // % and parentheses, with bounded size.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Iterator
from typing import Any

from streamrl.envs.arithmetic import last_number
from streamrl.envs.base import Action, Env, Observation, StepResult

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expr: str) -> str:
    """Evaluate plain arithmetic; errors come back as text the model can read."""
    if len(expr) > 200:
        return "error: expression too long"
    try:
        value = _eval(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if abs(left) > 1e12 or abs(right) > 1e12:
            raise ValueError("numbers too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / // % ( ) are allowed")


class Calculator(Env):
    """Three-number arithmetic the model may delegate to ``<calc>``; reward 1 for the right final answer."""

    max_turns = 4

    def __init__(self, digits: int = 3, tool_penalty: float = 0.0):
        self.digits, self.tool_penalty = digits, tool_penalty
        self.answer: int | None = None
        self.turns = self.calls = 0

    def items(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        rng = random.Random(seed)
        hi = 10**self.digits - 1
        while True:
            a, b, c = (rng.randint(1, hi) for _ in range(3))
            yield {"question": f"What is {a} * {b} + {c}?", "answer": a * b + c}

    async def reset(self, item: dict[str, Any]) -> Observation:
        self.answer, self.turns, self.calls = int(item["answer"]), 0, 0
        prompt = (f"{item['question']} You may use a calculator by writing <calc>expression</calc>; "
                  "its result will be shown to you. Finish with the number only.")
        return Observation(messages=[{"role": "user", "content": prompt}])

    async def step(self, action: Action) -> StepResult:
        self.turns += 1
        call = CALL.search(action.text)
        if call and self.turns < self.max_turns:
            self.calls += 1
            result = calculate(call.group(1))
            return StepResult(reward=-self.tool_penalty, done=False,
                              observation=Observation(messages=[{"role": "user", "content": f"Result: {result}"}]),
                              info={"call": call.group(1), "result": result})
        correct = last_number(action.text) == self.answer
        return StepResult(reward=float(correct), done=True, info={"correct": correct, "calls": self.calls})
