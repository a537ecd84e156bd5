"""The environment protocol: an async, Gym-like episode over chat messages or token ids.

An env is reset from a dataset item and gives the first observation; the policy
answers; ``step`` scores the answer and either ends the episode or returns the
next observation (a tool result, a game's feedback). Observations are chat
messages (rendered with the model's chat template) or raw token ids (inserted as
they are). Envs know nothing of Redis, routers or the learner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, str]  # {"role": ..., "content": ...}


@dataclass
class Observation:
    """What the policy sees next: chat messages to append, or token ids to insert verbatim."""

    messages: list[Message] = field(default_factory=list)
    token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if (self.token_ids is None) == (not self.messages):
            raise ValueError("an Observation has either messages or token_ids")


@dataclass
class Action:
    """The policy's turn: its text and the exact token ids it generated."""

    text: str
    token_ids: list[int]
    finish_reason: str = "stop"


@dataclass
class StepResult:
    reward: float = 0.0
    done: bool = True
    observation: Observation | None = None  # required when not done
    info: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    """Subclass, implement ``reset`` and ``step``; give ``items`` to generate its own dataset."""

    max_turns: int = 1

    @abstractmethod
    async def reset(self, item: dict[str, Any]) -> Observation:
        """Start an episode from one dataset item."""

    @abstractmethod
    async def step(self, action: Action) -> StepResult:
        """Score the policy's action; end the episode or say what it sees next."""

    def items(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        """The env's own dataset, for runs that name no dataset file."""
        raise NotImplementedError(f"{type(self).__name__} has no built-in dataset: set rollout.dataset")

    async def close(self) -> None:
        """Release what the episode held (subprocesses, connections)."""
