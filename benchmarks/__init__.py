"""Throughput studies. Each compares streamrl with a baseline measured in the same run."""

from __future__ import annotations

import importlib
from pathlib import Path

# study name -> module with main(quick, out)
MODULES = {"queue": "benchmarks.replay_stream", "generate": "benchmarks.generate", "partition": "benchmarks.partition",
           "learner": "benchmarks.learner", "weight-push": "benchmarks.weight_push", "e2e": "benchmarks.e2e",
           "simulate": "benchmarks.simulate", "trl": "benchmarks.against_trl", "soak": "benchmarks.soak",
           "ablation": "benchmarks.ablation", "agent": "benchmarks.agent", "nodes": "benchmarks.nodes",
           "lora": "benchmarks.lora", "trl-tune": "benchmarks.trl_tune",
           "engines": "benchmarks.engines", "stress": "benchmarks.stress"}


def run_suite(name: str, *, quick: bool, out: Path, **options) -> dict:
    from benchmarks.common import settings

    settings["quick"] = quick
    return importlib.import_module(MODULES[name]).main(quick=quick, out=out, **options)
