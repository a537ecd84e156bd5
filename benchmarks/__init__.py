"""Throughput studies. Each compares streamrl with a baseline measured in the same run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def _queue(quick: bool, out: Path) -> None:
    from benchmarks.replay_stream import main

    main(quick=quick, out=out)


SUITES: dict[str, Callable[..., None]] = {"queue": _queue}
