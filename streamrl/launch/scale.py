"""``streamrl scale RUN servers=N workers=M``: more generation for a run that is going on.

The command writes the counts it wants into the run's Redis; ``streamrl up`` reads them as it watches
its parts and starts those missing. They join as any late joiner does: a server from the learner's
newest export, into the registry (the router routes to it, the next push catches it up); a worker
through the prompt queue and admission, as its siblings. Counts only grow: a part is not taken away
mid-group.
"""

from __future__ import annotations

import json
from pathlib import Path

from streamrl.buffer import Namespace
from streamrl.config import Config, load_config

KINDS = {"servers": "server", "workers": "rollout"}  # what a user asks for -> the kind of part


def parse(requests: list[str]) -> dict[str, int]:
    """``["servers=3", "workers=2"]`` -> ``{"servers": 3, "workers": 2}``, or a ValueError naming what is wrong."""
    wanted = {}
    for request in requests:
        name, _, value = request.partition("=")
        if name not in KINDS or not value.isdigit():
            raise ValueError(f"{request!r}: give servers=N or workers=N (N a whole number)")
        wanted[name] = int(value)
    if not wanted:
        raise ValueError("nothing to scale: give servers=N, workers=N or both")
    return wanted


def running(run_dir: Path) -> dict[str, int]:
    """How many of each the run has started, from ``RUN/parts.json``."""
    parts = json.loads((run_dir / "parts.json").read_text())
    return {name: sum(1 for p in parts.values() if p["kind"] == kind) for name, kind in KINDS.items()}


# Raise each asked-for count, never lower it: two `streamrl scale` commands at once can only add.
_RAISE = """
for i = 1, #ARGV, 2 do
  if tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') < tonumber(ARGV[i + 1]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
"""


def request(run_dir: Path, wanted: dict[str, int]) -> Config:
    """Ask the run in ``run_dir`` for these counts; refuses fewer than it has or was already asked for (returns
    the run's config)."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{config} does not exist: give the directory of a run started by `streamrl up`")
    cfg = load_config(config, [])
    ns = Namespace.open(cfg.redis.url, cfg.run.name, retries=0)
    have, asked = running(run_dir), _asked(ns)
    floor = {name: max(have[name], asked.get(name, 0)) for name in wanted}
    fewer = [f"{name}={n} (the run has or was asked for {floor[name]})" for name, n in wanted.items()
             if n < floor[name]]
    if fewer:
        raise ValueError(f"counts only grow (a part is not taken away mid-group): {', '.join(fewer)}")
    with ns.reachable("ask the run to scale"):
        ns.conn.eval(_RAISE, 1, ns.key("scale"), *(x for item in wanted.items() for x in item))
    return cfg


def _asked(ns: Namespace) -> dict[str, int]:
    """The counts `streamrl scale` asked for so far (``servers``, ``workers``)."""
    with ns.reachable("read the scale request"):
        asked = ns.conn.hgetall(ns.key("scale"))
    return {k.decode(): int(v) for k, v in asked.items() if k.decode() in KINDS}


def wanted(ns: Namespace) -> dict[str, int]:
    """The counts `streamrl scale` asked for, by kind of part."""
    return {KINDS[name]: n for name, n in _asked(ns).items()}
