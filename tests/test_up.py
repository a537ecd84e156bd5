"""`streamrl up` end to end: every part a real process, one of them SIGKILLed on the way."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from streamrl.buffer.redis_server import free_port
from streamrl.rollout.evaluate import read_records


def _parts(run_path) -> dict:
    try:
        return json.loads((run_path / "parts.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _version(run_path) -> int:
    steps = [r["step"] for r in read_records(run_path / "metrics" / "learner.jsonl") if "loss" in r]
    return max(steps, default=0)


@pytest.mark.slow
def test_up_runs_every_part_survives_a_killed_worker_and_leaves_no_process(tmp_path):
    max_steps, bound = 8, 1
    run_path = tmp_path / "e2e"
    router_port = free_port()
    argv = [sys.executable, "-m", "streamrl", "up", "configs/quickstart.yaml", f"run.dir={tmp_path}", "run.name=e2e",
            "prepare.args.sft_steps=30", "prepare.args.train_size=300", "prepare.args.eval_size=16",
            f"router.port={router_port}", f"router.prometheus_port={free_port()}", f"server.base_port={free_port()}",
            "server.heartbeat_s=0.3", "server.registry_ttl_s=2", "router.sync_every_s=0.3",
            "learner.groups_per_step=4", f"learner.max_steps={max_steps}", "eval.every=4", "eval.size=16",
            f"off_policy.max_staleness={bound}", "rollout.concurrency=16", "rollout.metrics_every_s=1",
            "supervise.display=plain", "supervise.refresh_s=0.3"]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    seen: set[int] = {up.pid}
    try:
        deadline = time.monotonic() + 400
        while not (_parts(run_path).get("learner") and _version(run_path) >= 2):
            assert up.poll() is None, up.stdout.read()
            assert time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.3)
        parts = _parts(run_path)
        seen |= {p["pid"] for p in parts.values()} | {c.pid for c in psutil.Process(up.pid).children(recursive=True)}
        victim = parts["rollout-0"]["pid"]
        os.kill(victim, signal.SIGKILL)
        while _parts(run_path)["rollout-0"]["pid"] == victim:
            assert up.poll() is None, up.stdout.read()
            time.sleep(0.2)
        restarted = _parts(run_path)["rollout-0"]
        assert restarted["restarts"] == 1
        seen.add(restarted["pid"])
        output, _ = up.communicate(timeout=400)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, output[-4000:]
    assert "rollout-0" in output and "restarting (1/3)" in output
    assert "eval accuracy before RL" in output

    learner = [r for r in read_records(run_path / "metrics" / "learner.jsonl") if "loss" in r]
    assert [r["step"] for r in learner] == list(range(1, max_steps + 1))  # the version advanced every step
    assert all(r["staleness_max"] <= bound for r in learner)
    pushes = [r for r in read_records(run_path / "metrics" / "learner.jsonl") if "push_version" in r]
    assert pushes[-1]["push_version"] == max_steps and pushes[-1]["push_targets"] == 1.0
    evals = read_records(run_path / "metrics" / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 4, 8]
    assert evals[0]["eval/version_max"] == 0
    assert evals[-1]["eval/version_min"] == max_steps  # the server answered with the learner's last weights
    assert (run_path / "rollouts" / "step_8.jsonl").read_text().count("\n") == 4
    assert list((run_path / "metrics").glob("rollout-*.jsonl"))
    for name in ("router", "server-0", "rollout-0", "evaluator", "learner"):
        assert (run_path / "logs" / f"{name}.log").is_file()

    time.sleep(0.5)
    left = [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left behind: {left}"


@pytest.mark.slow
def test_up_places_the_parts_on_a_local_ray_cluster(tmp_path):
    run_path = tmp_path / "onray"
    argv = [sys.executable, "-m", "streamrl", "up", "configs/quickstart.yaml", "--ray", "local",
            f"run.dir={tmp_path}", "run.name=onray", "prepare.args.sft_steps=20", "prepare.args.train_size=200",
            "prepare.args.eval_size=8", f"router.port={free_port()}", f"router.prometheus_port={free_port()}",
            f"server.base_port={free_port()}", "learner.groups_per_step=4", "learner.max_steps=3", "eval.every=3",
            "eval.size=8", "rollout.concurrency=16", "supervise.display=plain", "ray.cpus_per_server=0.5",
            "ray.cpus_per_learner_rank=0.5", "ray.cpus_per_part=0.2"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "placing 5 parts on Ray" in out.stdout
    learner = [r for r in read_records(run_path / "metrics" / "learner.jsonl") if "loss" in r]
    assert [r["step"] for r in learner] == [1, 2, 3]
    assert [e["step"] for e in read_records(run_path / "metrics" / "eval.jsonl")] == [0, 3]
    parts = json.loads((run_path / "parts.json").read_text())
    assert set(parts) == {"router", "server-0", "rollout-0", "evaluator", "learner"}
    time.sleep(0.5)
    assert not [p["pid"] for p in parts.values() if psutil.pid_exists(p["pid"])
                and psutil.Process(p["pid"]).status() != psutil.STATUS_ZOMBIE]
