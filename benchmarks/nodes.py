"""One node or two: the quickstart placed by `streamrl up --ray` on a Ray cluster of hosts simulated on this
machine (network namespaces, ``benchmarks.netns``), every part on one node, against generation (servers, rollout
workers, router, evaluator) on one node and the learner on another.

Both arms run on the same cores of one machine, so spreading buys no compute: the ratio measures what crossing
nodes costs (weight pushes, Redis and the router over links between hosts, rank-0 addresses found per node),
not a speed-up. Samples/s counts every trained sample from the rollout worker's first report to the last step.
Needs root (network namespaces).

    python -m benchmarks.nodes [--quick]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import cli, console, median, new_figure, print_table, save_figure, write_json
from benchmarks.netns import NetnsCluster
from streamrl.buffer.redis_server import free_port
from streamrl.config import load_config
from streamrl.recipes.reverse import prepare
from streamrl.rollout.evaluate import read_records

KINDS = ("server", "rollout", "router", "evaluator", "learner")
ARMS = {"one node": {kind: "a" for kind in KINDS},
        "two nodes": {**{kind: "a" for kind in KINDS}, "learner": "b"}}  # arm -> the node of each kind of part


def one_run(cluster: NetnsCluster, runs: Path, prepared: Path, arm: str, steps: int, seed: int) -> dict:
    name = arm.replace(" ", "-")
    shutil.rmtree(runs / name, ignore_errors=True)
    shutil.copytree(prepared, runs / name / "prepared")
    placement = [f"ray.{kind}.labels={{host: {host}}}" for kind, host in ARMS[arm].items()]
    argv = [sys.executable, "-m", "streamrl", "up", "configs/quickstart.yaml", "--ray", cluster.head_address,
            f"run.dir={runs}", f"run.name={name}", f"run.seed={seed}", f"learner.max_steps={steps}",
            f"eval.every={steps}", f"router.port={free_port()}", f"server.base_port={free_port()}",
            "supervise.display=plain", "ray.server.cpus=0.5", "ray.learner.cpus=0.5", *placement]
    out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **cluster.env, "COLUMNS": "200"})
    if out.returncode != 0:
        raise RuntimeError(f"{arm} failed ({out.returncode}):\n{out.stdout[-3000:]}")
    return summarise(runs / name)


def summarise(run_path: Path) -> dict:
    cfg = load_config(run_path / "config.yaml")
    steps = [r for r in read_records(run_path / "metrics" / "learner.jsonl") if "loss" in r]
    worker = read_records(run_path / "metrics" / "rollout-worker-0.jsonl")
    pushes = [r["push_s"] for r in read_records(run_path / "metrics" / "learner.jsonl") if "push_s" in r]
    wall = steps[-1]["time"] - worker[0]["time"]
    samples = sum(r["groups"] for r in steps) * cfg.rollout.sampling.n
    evals = read_records(run_path / "metrics" / "eval.jsonl")
    return {"wall_s": wall, "samples_per_s": samples / wall, "push_s": median(pushes),
            "eval_final": evals[-1]["eval/accuracy"]}


def run(quick: bool, repeats: int | None = None) -> dict:
    repeats, steps = repeats or (1 if quick else 3), 12 if quick else 40
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp, NetnsCluster() as cluster:
        tmp = Path(tmp)
        cluster.add_node(2, labels={"host": "a"})
        cluster.add_node(2, labels={"host": "b"})
        console.log("warm start (once, shared by every run)")
        cfg = load_config("configs/quickstart.yaml", [f"run.dir={tmp}", "run.name=prep"])
        prepare(cfg, **cfg.prepare.args)
        order = list(ARMS)
        for r in range(repeats):
            for arm in order[r % 2:] + order[:r % 2]:  # who goes first alternates
                row = one_run(cluster, tmp / "runs", cfg.run.path / "prepared", arm, steps, seed=r)
                results[arm].append(row)
                console.log(f"{arm}: {row['samples_per_s']:.1f} samples/s, wall {row['wall_s']:.0f}s, "
                            f"push {row['push_s']:.3f}s, eval {row['eval_final']:.2f}")
    summary = {arm: {k: median([row[k] for row in rows]) for k in rows[0]} for arm, rows in results.items()}
    return {"study": "nodes", "repeats": repeats, "max_steps": steps, "arms": ARMS, "runs": results,
            "summary": summary, "ratio": summary["two nodes"]["samples_per_s"] / summary["one node"]["samples_per_s"]}


def report(data: dict, out: Path) -> None:
    rows = [[arm, s["samples_per_s"], s["wall_s"], s["push_s"], s["eval_final"]] for arm, s in data["summary"].items()]
    rows.append(["two nodes / one node", data["ratio"], "", "", ""])
    print_table(f"The quickstart on Ray, {data['max_steps']} steps, medians of {data['repeats']} (one machine: "
                "the ratio is the cost of crossing nodes)", ["placement", "samples/s", "wall s", "push s", "final eval"],
                rows)
    json_path = write_json(out, "nodes", data)
    fig, (ax,) = new_figure(1, "The quickstart on one node and on two (one machine's cores)")
    ax.bar(list(data["summary"]), [s["samples_per_s"] for s in data["summary"].values()])
    ax.set_ylabel("samples/s")
    save_figure(fig, out, "nodes", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results"), repeats: int | None = None) -> dict:
    data = run(quick, repeats)
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
