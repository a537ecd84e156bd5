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


def request(run_dir: Path, wanted: dict[str, int]) -> Config:
    """Ask the run in ``run_dir`` for these counts; refuses fewer than it has (returns the run's config)."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{config} does not exist: give the directory of a run started by `streamrl up`")
    have = running(run_dir)
    fewer = [f"{name}={n} (it has {have[name]})" for name, n in wanted.items() if n < have[name]]
    if fewer:
        raise ValueError(f"streamrl scale only adds parts: {', '.join(fewer)}")
    cfg = load_config(config, [])
    ns = Namespace.open(cfg.redis.url, cfg.run.name, retries=0)
    with ns.reachable("ask the run to scale"):
        ns.conn.hset(ns.key("scale"), mapping=wanted)
    return cfg


def wanted(ns: Namespace) -> dict[str, int]:
    """The counts `streamrl scale` last asked for (``servers``, ``workers``), by kind of part."""
    with ns.reachable("read the scale request"):
        asked = ns.conn.hgetall(ns.key("scale"))
    return {KINDS[k.decode()]: int(v) for k, v in asked.items() if k.decode() in KINDS}
