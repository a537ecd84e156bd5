"""Any single-turn task as an agentic loop with a slow checker: a wrong reply gets feedback and another try.

Each reply goes to a checker that takes real wall time (``latency_s``, drawn from a log-normal with
spread ``jitter``), as code execution, a sandbox or a remote tool would. A right reply ends the episode
with its reward; a wrong one gets "That is not right." and the question again, up to ``turns`` replies.
The wrapped env scores every reply; the episode's reward is the last one's, times ``discount`` per
earlier wrong try. With ``discount=1`` a right second try pays as much as a right first one, and every
token of the episode, the wrong first reply's included, shares that reward: the learner then credits
wrong first replies that happened to be followed by a right one. A discount below 1 ranks a first-try
success above a second-try one within the group, as a user of such an agent would.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from streamrl.envs.base import Action, Env, Observation, StepResult
from streamrl.envs.registry import env_class

FEEDBACK = "That is not right."  # what a wrong reply hears, before the question again


class RetryWithFeedback(Env):
    def __init__(self, env: str = "single_turn", env_args: dict[str, Any] | None = None, turns: int = 2,
                 latency_s: float = 1.0, jitter: float = 0.5, discount: float = 1.0):
        if turns < 1 or latency_s < 0 or jitter < 0 or not 0 < discount <= 1:
            raise ValueError(f"retry needs turns >= 1, latency_s >= 0, jitter >= 0 and 0 < discount <= 1; "
                             f"got turns={turns}, latency_s={latency_s}, jitter={jitter}, discount={discount}")
        self.make_inner = lambda: env_class(env)(**(env_args or {}))
        self.max_turns, self.latency_s, self.jitter, self.discount = turns, latency_s, jitter, discount
        self.question: list[dict[str, str]] = []
        self.inner: Env | None = None
        self.turn = 0

    async def reset(self, item: dict[str, Any]) -> Observation:
        self.inner, self.turn = self.make_inner(), 0
        first = await self.inner.reset(item)
        self.question = [m for m in first.messages if m["role"] == "user"][-1:]
        self.item = item
        return first

    async def step(self, action: Action) -> StepResult:
        mu = math.log(self.latency_s) - self.jitter**2 / 2 if self.latency_s > 0 else None  # mean = latency_s
        await asyncio.sleep(random.lognormvariate(mu, self.jitter) if mu is not None else 0.0)
        result = await self.inner.step(action)
        self.turn += 1
        if result.reward >= 1.0 or self.turn >= self.max_turns or not self.question:
            reward = result.reward * self.discount ** (self.turn - 1)
            info = {"correct": result.reward >= 1.0, **result.info, "tries": self.turn}
            return StepResult(reward=reward, done=True, info=info)
        await self.inner.reset(self.item)  # the wrapped env scores the next reply afresh
        retry = f"{FEEDBACK} {self.question[0]['content']}"
        return StepResult(reward=0.0, done=False, observation=Observation(messages=[{"role": "user", "content": retry}]))

    async def close(self) -> None:
        if self.inner is not None:
            await self.inner.close()
