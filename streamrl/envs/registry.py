"""Finding environments by name: Python entry points (group ``streamrl.envs``) or ``module:Class``.

A user adds an environment without touching streamrl: declare it in their own
package's entry points, or name it in the config as ``my_pkg.envs:MyEnv``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from streamrl.envs.base import Env

GROUP = "streamrl.envs"


def available() -> list[str]:
    return sorted(_installed(GROUP))


@functools.cache
def _installed(group: str) -> dict[str, EntryPoint]:
    """A group's entry points, read once per process: the scan reads every installed package's
    metadata, and a worker builds an env (and its reward function) for every episode."""
    return {ep.name: ep for ep in entry_points(group=group)}


@functools.cache
def load_plugin(name: str, group: str, what: str) -> Any:
    """``module:attr``, or the entry point called ``name`` in ``group``; errors say what was looked for.
    Resolved once per process (an env may look up its reward function in every episode)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load {what} {name!r}: {e}") from None
    found = _installed(group).get(name)
    if found is None:
        raise ValueError(f"unknown {what} {name!r}; installed: {', '.join(sorted(_installed(group))) or 'none'}; "
                         "or give module:attribute")
    return found.load()


def env_class(name: str) -> type[Env]:
    cls = load_plugin(name, GROUP, "env")
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise ValueError(f"env {name!r} is {cls!r}, not a subclass of streamrl.envs.Env")
    return cls


def env_factory(name: str, args: dict[str, Any] | None = None) -> Callable[[], Env]:
    """A zero-argument constructor: one fresh env per episode."""
    cls = env_class(name)
    args = dict(args or {})
    cls(**args)  # fail now, with the config's words, rather than in the first episode
    return lambda: cls(**args)
