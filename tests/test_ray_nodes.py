"""`streamrl up` on a Ray cluster of several nodes, each a network namespace with an address of its own
(tests/cluster.py): parts placed where the config says, addresses found from the nodes they land on, a
learner's ranks meeting across nodes, lost nodes survived, servers added to a running run."""

import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import torch

from benchmarks.netns import NetnsCluster, NetnsUnavailable, free_port_block
from streamrl.buffer.redis_server import free_port
from streamrl.rollout.evaluate import read_records

pytestmark = pytest.mark.slow
ENV = {"COLUMNS": "200"}


def _parts(run_path) -> dict:
    try:
        return json.loads((run_path / "parts.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _steps(run_path) -> list[int]:
    return [r["step"] for r in read_records(run_path / "metrics" / "learner.jsonl") if "loss" in r]


def _until(what, check, up, log, run_path, timeout_s: float = 300) -> None:
    """Wait until ``check()``; fails with what the run printed and its parts' logs if it stopped or timed out."""
    start = time.monotonic()
    while not check():
        assert up.poll() is None, f"the run stopped while waiting for {what}:\n{_tails(log, run_path)}"
        assert time.monotonic() - start < timeout_s, f"no {what} after {timeout_s:.0f}s:\n{_tails(log, run_path)}"
        time.sleep(0.3)


def _tails(log, run_path) -> str:
    """The end of `streamrl up`'s output and of each part's log (CI keeps no run directory)."""
    logs = [log, *sorted((run_path / "logs").glob("*.log"))]
    return "\n".join(f"--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:]) for p in logs)


def _requests_served(url: str) -> float:
    try:
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:  # placed, not listening yet
        return 0.0
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith('streamrl_requests_total{status="ok"}'))


def test_a_learner_of_two_ranks_on_two_nodes_computes_the_update_of_one_rank(netns_cluster, tiny_model_dir, tmp_path):
    """The learner's gang as `streamrl up` starts it on Ray (an actor per rank, torchrun's variables, meeting at
    rank 0's node), on two nodes: the step equals one rank's (tests/ddp_equivalence.py, gloo)."""
    import ray

    from streamrl.config import load_config
    from streamrl.launch.ray import RayActors
    from streamrl.launch.supervisor import Part

    b, c = netns_cluster.add_node(1), netns_cluster.add_node(1)
    script = str(__import__("pathlib").Path(__file__).parent / "ddp_equivalence.py")
    one = subprocess.run([sys.executable, script, tiny_model_dir, str(tmp_path / "1.pt"), "token", "0", "0", "0", "0"],
                         env={**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    cfg = load_config(None, ["launcher=ray", f"ray.address={netns_cluster.head_address}", "learner.nproc=2",
                             "ray.learner.strategy=STRICT_SPREAD", "server.count=0", "rollout.workers=0",
                             f"run.dir={tmp_path}"])  # the learner alone
    launcher = RayActors(cfg)
    try:
        part = Part("learner", "learner", [sys.executable, script, tiny_model_dir, str(tmp_path / "2.pt"), "token",
                                           "0", "0", "0", "0"], tmp_path / "learner.log")
        launcher.place([part])
        proc = launcher.spawn(part)
        deadline = time.monotonic() + 300
        while proc.poll() is None:
            assert time.monotonic() < deadline, (tmp_path / "learner.log").read_text()[-3000:]
            time.sleep(0.5)
        assert proc.returncode == 0, (tmp_path / "learner.log").read_text()[-3000:]
        hosts = proc.hosts
    finally:
        launcher.close()
    assert not ray.is_initialized()
    assert len(set(hosts)) == 2 and set(hosts) <= {netns_cluster.head.ip, b.ip, c.ip}
    (one, one_stats), (two, two_stats) = (torch.load(tmp_path / f"{n}.pt").values() for n in (1, 2))
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-6), k
    assert two_stats == pytest.approx(one_stats, rel=1e-5, abs=1e-7)  # the step's figures, of both ranks' tokens


def test_a_placement_no_node_can_hold_is_refused_before_anything_starts(netns_cluster, tmp_path):
    netns_cluster.add_node(2, labels={"role": "gen"})
    run = subprocess.run([sys.executable, "-m", "streamrl", "up", "configs/quickstart.yaml", "--ray",
                          netns_cluster.head_address, f"run.dir={tmp_path}", "run.name=refused",
                          "prepare.args.sft_steps=1", "prepare.args.train_size=20", "prepare.args.eval_size=4",
                          "ray.server.gpus=1", "ray.learner.labels={role: train}", "supervise.display=plain"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, **ENV})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "this Ray cluster cannot hold the run" in run.stdout
    assert "ray.server: each of 1 asks {CPU: 1, GPU: 1}, which no node has" in run.stdout
    assert "ray.learner: each of 1 asks {CPU: 1} on a node labelled {'role': 'train'}, which no node has" in run.stdout
    assert f"{netns_cluster.head.ip} {{CPU: 1, head: 1000}}" in run.stdout  # what the cluster has
    assert not (tmp_path / "refused" / "redis").exists() and not (tmp_path / "refused" / "parts.json").exists()


@pytest.mark.timeout(900)
def test_the_quickstart_across_nodes_learns_scales_and_survives_losing_its_generation_and_learner_nodes(
        quickstart_prepared, tmp_path):
    """Servers and the worker on a node of their own, the learner's two ranks on two others (the head, where
    `streamrl up` and Redis run, is one). Mid-run: a second server and worker are added (`streamrl scale`) and
    serve and push groups; the generation node dies and its parts wait until a node that can hold them joins; a
    learner node dies and the learner resumes from its checkpoint on a new one. The run learns and its ledger
    balances: nothing lost, nothing trained twice."""
    try:
        cluster = NetnsCluster(head_labels={"role": "train"}).start()
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    try:
        _run_across_nodes(cluster, quickstart_prepared, tmp_path)
    finally:
        cluster.close()


def _run_across_nodes(cluster: NetnsCluster, prepared, tmp_path) -> None:
    gen = cluster.add_node(2, labels={"role": "gen"})
    train = cluster.add_node(1, labels={"role": "train"})
    run_path, log = tmp_path / "spread", tmp_path / "up.log"
    shutil.copytree(prepared, run_path / "prepared")
    groups_per_step, steps, base_port = 16, 40, free_port_block(2)  # servers on the gen node, one added
    argv = [sys.executable, "-m", "streamrl", "up", "configs/quickstart.yaml", "--ray", cluster.head_address,
            f"run.dir={tmp_path}", "run.name=spread", f"router.port={free_port()}", f"server.base_port={base_port}",
            "learner.nproc=2", "learner.checkpoint_every=5", "ray.learner.strategy=STRICT_SPREAD",
            "ray.learner.labels={role: train}", "ray.learner.cpus=0.5", "ray.server.labels={role: gen}",
            "ray.server.cpus=0.5", "ray.rollout.labels={role: gen}", "server.heartbeat_s=0.5",
            "server.registry_ttl_s=3", "router.sync_every_s=0.5", "supervise.display=plain",
            "supervise.max_restarts=5", "rollout.env=streamrl.testing:Unhurried", "rollout.env_args.delay_s=1"]
    with log.open("w") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **cluster.env, **ENV})
    said = lambda text: text in log.read_text(errors="replace")  # noqa: E731
    try:
        _until("step 3", lambda: len(_steps(run_path)) >= 3, up, log, run_path)
        parts = _parts(run_path)
        assert parts["server-0"]["host"] == parts["rollout-0"]["host"] == gen.ip
        assert sorted(parts["learner"]["hosts"]) == sorted([cluster.head.ip, train.ip])

        scale = subprocess.run([sys.executable, "-m", "streamrl", "scale", str(run_path), "servers=2", "workers=2"],
                               capture_output=True, text=True, timeout=60)
        assert scale.returncode == 0, scale.stderr
        _until("server-1", lambda: _parts(run_path).get("server-1", {}).get("host"), up, log, run_path)
        added = f"http://{_parts(run_path)['server-1']['host']}:{base_port + 1}"
        _until("requests served by server-1", lambda: _requests_served(added) > 0, up, log, run_path)
        _until("groups from rollout-1", lambda: any(r.get("groups_pushed") for r in read_records(
            run_path / "metrics" / "rollout-worker-1.jsonl")), up, log, run_path)

        cluster.kill_node(gen)  # both servers and the worker go with it, and no node left can hold them
        died, step_at_death = time.monotonic(), len(_steps(run_path))
        _until("the parts to wait for a node", lambda: said("waits for Ray to place it"), up, log, run_path, 90)
        joined = cluster.add_node(2, labels={"role": "gen"})
        _until("progress after the generation node's death", lambda: len(_steps(run_path)) > step_at_death + 1,
               up, log, run_path)
        gen_back = time.monotonic() - died
        assert _parts(run_path)["server-0"]["host"] == joined.ip

        cluster.add_node(1, labels={"role": "train"})  # room for the learner's rank before its node dies
        died, step_at_death = time.monotonic(), len(_steps(run_path))
        cluster.kill_node(train)
        _until("progress after the learner node's death", lambda: len(_steps(run_path)) > step_at_death + 1,
               up, log, run_path)
        learner_back = time.monotonic() - died
        up.wait(timeout=900)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, _tails(log, run_path)
    print(f"progress again {gen_back:.0f} s after the generation node died (a new node joined on notice), "
          f"{learner_back:.0f} s after a learner node died")
    assert _parts(run_path)["learner"]["restarts"] >= 1
    assert "resumed from" in (run_path / "logs" / "learner.log").read_text()
    evals = read_records(run_path / "metrics" / "eval.jsonl")
    assert evals[-1]["eval/accuracy"] >= 0.9 and evals[-1]["eval/version_min"] == steps
    doctor = subprocess.run([sys.executable, "-m", "streamrl", "doctor", str(run_path)], capture_output=True,
                            text=True, env={**os.environ, **cluster.env, **ENV})
    assert doctor.returncode == 0 and "balanced" in doctor.stdout, doctor.stdout + doctor.stderr
    trained = next(line for line in doctor.stdout.splitlines() if line.strip("│ ").startswith("trained"))
    assert trained.split()[-2] == str(steps * groups_per_step)  # each step's groups counted once
