"""Reward functions: ``fn(item, response) -> float``, found like envs are.

By name through the entry-point group ``streamrl.rewards``, or as ``module:function``.
Built-in: ``exact_match`` (the reply, stripped, equals ``item["answer"]``) and
``last_number`` (the last integer in the reply equals ``item["answer"]``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streamrl.envs.arithmetic import last_number as _last_number
from streamrl.envs.registry import load_plugin

RewardFn = Callable[[dict[str, Any], str], float]
GROUP = "streamrl.rewards"


def exact_match(item: dict[str, Any], response: str) -> float:
    return float(response.strip() == str(item["answer"]).strip())


def last_number(item: dict[str, Any], response: str) -> float:
    return float(_last_number(response) == int(item["answer"]))


# String comparisons: cheaper to run on the event loop than to hand to a thread (which any other
# reward function gets, being plain and perhaps slow Python).
INLINE: frozenset[RewardFn] = frozenset({exact_match, last_number})


def reward_fn(name: str) -> RewardFn:
    fn = load_plugin(name, GROUP, "reward function")
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is {fn!r}, not callable")
    return fn
