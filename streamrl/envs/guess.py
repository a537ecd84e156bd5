"""A multi-turn game: guess a secret number in [1, high] with higher/lower feedback each turn."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from streamrl.envs.arithmetic import last_number
from streamrl.envs.base import Action, Env, Observation, StepResult


class GuessNumber(Env):
    """Reward 1 for finding the number, less for each extra turn; 0 if the turns run out."""

    def __init__(self, high: int = 100, max_turns: int = 7):
        if high < 2 or max_turns < 1:
            raise ValueError("guess needs high >= 2 and max_turns >= 1")
        self.high, self.max_turns = high, max_turns
        self.secret, self.turns = 0, 0

    def items(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        rng = random.Random(seed)
        while True:
            yield {"secret": rng.randint(1, self.high)}

    async def reset(self, item: dict[str, Any]) -> Observation:
        self.secret, self.turns = int(item["secret"]), 0
        return Observation(messages=[{"role": "user", "content": (
            f"I am thinking of a number between 1 and {self.high}. Guess it: reply with one number. "
            f"I will say higher or lower. You have {self.max_turns} guesses.")}])

    async def step(self, action: Action) -> StepResult:
        self.turns += 1
        guess = last_number(action.text)
        if guess == self.secret:
            return StepResult(reward=1.0 - 0.1 * (self.turns - 1), done=True, info={"turns": self.turns, "won": True})
        if self.turns >= self.max_turns:
            return StepResult(reward=0.0, done=True, info={"turns": self.turns, "won": False})
        hint = "not a number" if guess is None else "higher" if guess < self.secret else "lower"
        return StepResult(done=False, observation=Observation(messages=[{"role": "user", "content": hint.capitalize()}]),
                          info={"guess": guess})
