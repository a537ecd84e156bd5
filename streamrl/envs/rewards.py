"""Reward functions: ``fn(item, response) -> float``, found like envs are.

By name through the entry-point group ``streamrl.rewards``, or as ``module:function``.
Built-in: ``exact_match`` (the reply, stripped, equals ``item["answer"]``) and
``last_number`` (the last integer in the reply equals ``item["answer"]``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from streamrl.envs.arithmetic import last_number as _last_number

RewardFn = Callable[[dict[str, Any], str], float]
GROUP = "streamrl.rewards"


def exact_match(item: dict[str, Any], response: str) -> float:
    return float(response.strip() == str(item["answer"]).strip())


def last_number(item: dict[str, Any], response: str) -> float:
    return float(_last_number(response) == int(item["answer"]))


def reward_fn(name: str) -> RewardFn:
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load reward function {name!r}: {e}") from None
    else:
        found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
        if not found:
            names = sorted(ep.name for ep in entry_points(group=GROUP))
            raise ValueError(f"unknown reward function {name!r}; installed: {', '.join(names)}; or give module:function")
        fn = found[0].load()
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is {fn!r}, not callable")
    return fn
