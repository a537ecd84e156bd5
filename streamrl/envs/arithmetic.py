"""Single-turn arithmetic with a verifiable answer: exact-answer reward plus a small format reward."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

from streamrl.envs.base import Action, Env, Observation, StepResult

INSTRUCTION = "Answer with the number only."
_NUMBER = re.compile(r"-?\d+")


def last_number(text: str) -> int | None:
    found = _NUMBER.findall(text)
    return int(found[-1]) if found else None


class Arithmetic(Env):
    """``a op b`` with ``digits``-digit operands; reward 1 for the right number, +0.1 for a bare number."""

    def __init__(self, digits: int = 2, ops: str = "+-", format_reward: float = 0.1):
        if digits < 1 or not ops or set(ops) - set("+-*"):
            raise ValueError("arithmetic needs digits >= 1 and ops drawn from '+-*'")
        self.digits, self.ops, self.format_reward = digits, ops, format_reward
        self.answer: int | None = None

    def items(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        rng = random.Random(seed)
        hi = 10**self.digits - 1
        while True:
            a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(self.ops)
            yield {"question": f"What is {a} {op} {b}?", "answer": eval_op(a, op, b)}

    async def reset(self, item: dict[str, Any]) -> Observation:
        self.answer = int(item["answer"])
        return Observation(messages=[{"role": "user", "content": f"{item['question']} {INSTRUCTION}"}])

    async def step(self, action: Action) -> StepResult:
        got = last_number(action.text)
        correct = got == self.answer
        formatted = re.fullmatch(r"\s*-?\d+\s*", action.text) is not None
        reward = float(correct) + (self.format_reward if formatted else 0.0)
        return StepResult(reward=reward, done=True, info={"correct": correct, "parsed": got})


def eval_op(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b
