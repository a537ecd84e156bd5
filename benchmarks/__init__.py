"""Throughput studies. Each compares streamrl with a baseline measured in the same run.

``streamrl bench STUDY ARGS...`` calls ``main`` here, which hands ARGS to the study's own parser
(``common.cli``); the product imports none of this until the command runs.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# study name -> module with main(quick, out, ...); its options are main's (common.OPTIONS)
STUDIES = {"queue": "benchmarks.replay_stream", "generate": "benchmarks.generate", "partition": "benchmarks.partition",
           "learner": "benchmarks.learner", "weight-push": "benchmarks.weight_push", "e2e": "benchmarks.e2e",
           "simulate": "benchmarks.simulate", "trl": "benchmarks.against_trl", "soak": "benchmarks.soak",
           "ablation": "benchmarks.ablation", "agent": "benchmarks.agent", "nodes": "benchmarks.nodes",
           "lora": "benchmarks.lora", "trl-tune": "benchmarks.trl_tune",
           "engines": "benchmarks.engines", "stress": "benchmarks.stress", "counterfactual": "benchmarks.counterfactual",
           "coverage": "benchmarks.coverage", "cores": "benchmarks.cores", "report": "benchmarks.report"}  # gathers the studies' results into docs/benchmarks.md


def run_suite(name: str, *, quick: bool, out: Path, **options) -> dict:
    from benchmarks.common import settings

    settings["quick"] = quick
    return importlib.import_module(STUDIES[name]).main(quick=quick, out=out, **options)


def main(argv: list[str], prog: str = "streamrl bench") -> None:
    """Run the study ``argv[0]`` with the rest of ``argv`` as its command line."""
    from benchmarks.common import cli

    name, *rest = argv
    if name not in STUDIES:
        print(f"unknown benchmark {name!r}; available: {', '.join(STUDIES)}", file=sys.stderr)
        raise SystemExit(2)
    study = importlib.import_module(STUDIES[name])
    cli(study.main, study.__doc__, rest, prog=f"{prog} {name}", study=name)
