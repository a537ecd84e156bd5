"""Finding environments by name: Python entry points (group ``streamrl.envs``), ``module:Class`` or
``path/to/file.py:Class``.

A user adds an environment without touching streamrl: declare it in their own
package's entry points, or name it in the config as ``my_pkg.envs:MyEnv``. An environment is an
``Env`` subclass, or an agent: an async function ``(client, item) -> reward`` (``streamrl.rollout.agent``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
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
        module, _, attr = name.rpartition(":")
        try:
            return getattr(_module_of_file(module) if module.endswith(".py") else importlib.import_module(module), attr)
        except (ImportError, AttributeError, OSError) as e:
            raise ValueError(f"cannot load {what} {name!r}: {e}") from None
    found = _installed(group).get(name)
    if found is None:
        raise ValueError(f"unknown {what} {name!r}; installed: {', '.join(sorted(_installed(group))) or 'none'}; "
                         "or give module:attribute")
    return found.load()


def _module_of_file(path: str):
    """The module in a Python file (an example, a user's script), imported once under its file's stem."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ImportError(f"no such file: {file}")
    name = f"streamrl_plugin_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def is_agent(plugin: Any) -> bool:
    return inspect.iscoroutinefunction(plugin)


def env_plugin(name: str) -> Any:
    """An ``Env`` subclass or an agent function, by name."""
    plugin = load_plugin(name, GROUP, "env")
    if not (is_agent(plugin) or isinstance(plugin, type) and issubclass(plugin, Env)):
        raise ValueError(f"env {name!r} is {plugin!r}: neither a subclass of streamrl.envs.Env nor an agent "
                         "(an async function taking a client and an item)")
    return plugin


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
