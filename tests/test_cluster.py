"""The network-namespace Ray cluster (benchmarks.netns, the fixture in tests/cluster.py): real Ray nodes with their own
addresses, node death, teardown."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from benchmarks.netns import MARKER, _marked

# A driver that answers one JSON command a line, so one connection sees the cluster change under it.
DRIVER = r"""
import json, subprocess, sys, time
import ray

ray.init(logging_level="ERROR")  # RAY_ADDRESS and RAY_AUTH_MODE come from the cluster's env


def where():
    return ray.util.get_node_ip_address()


def spawn():  # a process of the user's code that outlives its worker: kill_node must get it too
    return subprocess.Popen(["sleep", "600"], start_new_session=True).pid


def answer(cmd, arg):
    if cmd == "nodes":
        return [{"ip": n["NodeManagerAddress"], "name": n["NodeName"], "alive": n["Alive"]} for n in ray.nodes()]
    if cmd in ("where", "spawn"):
        return ray.get(ray.remote(globals()[cmd]).options(**arg).remote(), timeout=60)
    if cmd == "wait_dead":
        start = time.monotonic()
        while [n["Alive"] for n in ray.nodes() if n["NodeManagerAddress"] == arg] != [False]:
            assert time.monotonic() - start < 60, f"{arg} still alive"
            time.sleep(0.1)
        return time.monotonic() - start


print("=" + json.dumps("ready"), flush=True)  # "=": Ray prints its notices to this stdout too
for line in sys.stdin:
    print("=" + json.dumps(answer(*json.loads(line))), flush=True)
"""


class Driver:
    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.answer() == "ready"

    def __call__(self, cmd: str, arg=None):
        self.proc.stdin.write(json.dumps([cmd, arg]) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def answer(self):
        while (line := self.proc.stdout.readline())[:1] != "=":
            assert line, "the driver died"
        return json.loads(line[1:])

    def close(self):
        self.proc.kill()
        self.proc.wait()


def tcp_reachable(src, dst) -> bool:
    """Whether a process on node `src` can open a TCP connection to one listening on node `dst`."""
    server = subprocess.Popen(dst.command([sys.executable, "-c", (
        "import socket; s = socket.create_server(('0.0.0.0', 0)); print(s.getsockname()[1], flush=True); "
        "s.settimeout(20); s.accept()")]), stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        client = subprocess.run(src.command([sys.executable, "-c", (
            f"import socket; socket.create_connection(({dst.ip!r}, {port}), timeout=5)")]), capture_output=True)
        return client.returncode == 0
    finally:
        server.kill()
        server.wait()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _has_marker(pid: int) -> bool:
    try:
        return MARKER in psutil.Process(pid).environ()
    except psutil.Error:
        return False


def test_a_cluster_finds_the_children_of_its_processes_that_set_their_titles():
    """Ray's agents and workers set their process titles, which overwrites what /proc/PID/environ reads: a
    teardown that looked for the marker alone would leave them running (ray::DashboardAgent outlived its cluster)."""
    titled = "import setproctitle, time; setproctitle.setproctitle('ray::Titled'); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", (
        f"import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', {titled!r}]); child.wait()")],
        env={**os.environ, MARKER: (tag := f"{os.getpid()}-titled")})
    try:
        deadline = time.monotonic() + 30
        while not (children := psutil.Process(parent.pid).children()) or children[0].cmdline()[0] != "ray::Titled":
            assert time.monotonic() < deadline, "the titled child did not start"
            time.sleep(0.05)
        child = children[0].pid
        assert not _has_marker(child) and _has_marker(parent.pid)
        assert _marked(tag) == {parent.pid: tag, child: tag}
    finally:
        for proc in psutil.Process(parent.pid).children(recursive=True) + [psutil.Process(parent.pid)]:
            proc.kill()
        parent.wait()


@pytest.mark.slow
def test_nodes_in_namespaces_are_separate_hosts(netns_cluster):
    cluster = netns_cluster
    n1 = cluster.add_node(1, labels={"zone": "one"})
    driver = Driver(dict(os.environ))  # the fixture put the cluster's env in os.environ
    try:
        n2 = cluster.add_node(1)  # joins while a driver is connected
        nodes = driver("nodes")
        assert sorted(n["ip"] for n in nodes if n["alive"]) == sorted(n.ip for n in cluster.nodes)
        assert len({n.ip for n in cluster.nodes}) == 3
        assert tcp_reachable(n1, n2) and tcp_reachable(n2, n1) and tcp_reachable(cluster.head, n2)

        for node in cluster.nodes:
            assert driver("where", {"resources": {node.name: 1}}) == node.ip
        assert driver("where", {"label_selector": {"zone": "one"}}) == n1.ip

        orphan = driver("spawn", {"resources": {n1.name: 1}})
        cluster.kill_node(n1)
        assert driver("wait_dead", n1.ip) < 60
        assert gone(orphan)
        assert {n["ip"]: n["alive"] for n in driver("nodes")} == {n.ip: n.alive for n in cluster.nodes}
    finally:
        driver.close()

    started = list(_marked(cluster.tag))  # the head's processes, with the agents whose titles hide their marker
    assert any(not _has_marker(pid) for pid in started)
    cluster.close()
    assert [pid for pid in started if not gone(pid)] == []
    assert f"srl-{cluster.tag}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert cluster.uplink not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert not cluster.root.exists()
    for proc in psutil.process_iter():
        try:
            assert str(cluster.root) not in " ".join(proc.cmdline()) and proc.environ().get(MARKER) != cluster.tag
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
