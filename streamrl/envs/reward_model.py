"""RLHF: a single-turn env whose reward comes from a reward-model server (``streamrl serve-reward``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from streamrl.envs.base import Action, Env, Observation, StepResult


class RewardModelEnv(Env):
    """Items carry ``prompt`` (text) or ``messages``; the reply is scored by the server at ``url``."""

    def __init__(self, url: str = "http://127.0.0.1:32000", timeout_s: float = 60.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.messages: list[dict[str, str]] = []

    def items(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        raise NotImplementedError("the reward-model env needs prompts: set rollout.dataset to a JSONL file")

    async def reset(self, item: dict[str, Any]) -> Observation:
        if "messages" in item:
            self.messages = list(item["messages"])
        elif "prompt" in item:
            self.messages = [{"role": "user", "content": str(item["prompt"])}]
        else:
            raise ValueError("a reward-model dataset row needs 'prompt' or 'messages'")
        return Observation(messages=self.messages)

    async def step(self, action: Action) -> StepResult:
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            reply = await client.post(f"{self.url}/score",
                                      json={"pairs": [{"prompt": self.messages, "response": action.text}]})
        reply.raise_for_status()
        score = float(reply.json()["scores"][0])
        return StepResult(reward=score, done=True, info={"rm_score": score})
