"""The common RLVR case: one prompt from a dataset row, one reply, a pluggable reward function."""

from __future__ import annotations

import asyncio
from typing import Any

from streamrl.envs.base import Action, Env, Observation, StepResult
from streamrl.envs.rewards import INLINE, reward_fn


class SingleTurn(Env):
    """Rows carry ``prompt`` (text) or ``messages``, plus whatever the reward function reads."""

    def __init__(self, reward: str = "exact_match", system: str | None = None):
        self.score = reward_fn(reward)
        self.system = system
        self.item: dict[str, Any] = {}

    async def reset(self, item: dict[str, Any]) -> Observation:
        if "messages" in item:
            messages = list(item["messages"])
        elif "prompt" in item:
            messages = [{"role": "user", "content": str(item["prompt"])}]
        else:
            raise ValueError("a single-turn dataset row needs 'prompt' or 'messages'")
        self.item = item
        system = [{"role": "system", "content": self.system}] if self.system else []
        return Observation(messages=system + messages)

    async def step(self, action: Action) -> StepResult:
        if self.score in INLINE:
            reward = self.score(self.item, action.text)
        else:  # plain (maybe slow) Python: kept off the event loop
            reward = await asyncio.to_thread(self.score, self.item, action.text)
        return StepResult(reward=float(reward), done=True)
