"""Any GEM environment (``pip install streamrl[gem]``, the gem-llm package) as a streamrl env.

GEM envs are Gym-like over text: ``reset(seed) -> (observation, info)`` and
``step(action_text) -> (observation, reward, terminated, truncated, info)``. Each
observation (with the instruction GEM keeps in ``info["suffix"]``) becomes a user turn.
GEM calls are synchronous, so they run in a thread and never block the worker's loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

from streamrl.envs.base import Action, Env, Observation, StepResult


class GemEnv(Env):
    """``rollout.env=gem`` with ``rollout.env_args={env_id: "game:GuessTheNumber-v0-easy"}``."""

    def __init__(self, env_id: str, max_turns: int = 16, **gem_kwargs: Any):
        try:
            import gem
        except ImportError:
            raise ValueError("the gem env needs the gem-llm package: pip install 'streamrl[gem]'") from None
        try:
            self.env = gem.make(env_id, **gem_kwargs)
        except Exception as e:  # unknown id, bad kwargs: say which
            raise ValueError(f"gem.make({env_id!r}) failed: {e}") from None
        self.env_id, self.max_turns = env_id, max_turns

    def items(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        return ({"seed": seed * 1_000_003 + i} for i in itertools.count())

    async def reset(self, item: dict[str, Any]) -> Observation:
        observation, info = await asyncio.to_thread(self.env.reset, seed=item.get("seed"))
        return _user_turn(observation, info)

    async def step(self, action: Action) -> StepResult:
        observation, reward, terminated, truncated, info = await asyncio.to_thread(self.env.step, action.text)
        done = bool(terminated or truncated)
        return StepResult(reward=float(reward), done=done, observation=None if done else _user_turn(observation, info),
                          info={k: v for k, v in (info or {}).items() if k != "suffix"})


def _user_turn(observation: Any, info: dict[str, Any] | None) -> Observation:
    suffix = (info or {}).get("suffix")
    text = f"{observation}\n{suffix}" if suffix else str(observation)
    return Observation(messages=[{"role": "user", "content": text}])
