"""Multi-turn code use: the model may run Python, sees its output, then answers.

A call is a fenced block (```python ... ```); it runs in the sandbox (``streamrl.envs.sandbox``:
a separate process with time, memory and file limits) and its output, error or the limit it hit
comes back as a user turn. A reply without code is the answer, scored like ``arithmetic``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from streamrl.envs.arithmetic import Arithmetic, last_number
from streamrl.envs.base import Action, Env, Observation, StepResult
from streamrl.envs.sandbox import Limits, run_python

CODE = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)
INSTRUCTION = "You may run Python by writing a ```python``` block; end with the number only."


class PythonTool(Env):
    def __init__(self, digits: int = 3, ops: str = "+-*", max_turns: int = 3, wall_s: float = 5.0,
                 cpu_s: int = 5, memory_mb: int = 256):
        self.questions = Arithmetic(digits, ops)
        self.max_turns = max_turns
        self.limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb)
        self.answer: int | None = None

    def items(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        return self.questions.items(seed)

    async def reset(self, item: dict[str, Any]) -> Observation:
        self.answer = int(item["answer"])
        return Observation(messages=[{"role": "user", "content": f"{item['question']} {INSTRUCTION}"}])

    async def step(self, action: Action) -> StepResult:
        call = CODE.search(action.text)
        if call is None:
            got = last_number(action.text)
            return StepResult(reward=float(got == self.answer), done=True, info={"parsed": got})
        outcome = await run_python(call.group(1), self.limits)
        if outcome.killed:
            text = f"killed: exceeded the {outcome.killed} limit"
        elif outcome.returncode != 0:
            text = f"error (exit {outcome.returncode}):\n{outcome.stderr.strip()[-500:]}"
        else:
            text = outcome.stdout.strip()[:500] or "(no output)"
        return StepResult(reward=0.0, done=False, observation=Observation(messages=[{"role": "user", "content": text}]),
                          info={"ran_code": True, "code_ok": outcome.ok})
