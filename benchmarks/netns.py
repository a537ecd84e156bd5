"""A real multi-node Ray cluster on one machine: the head in the root network namespace, every other node in a
Linux network namespace of its own, each with its own IP address.

Why namespaces: Ray replaces 127.0.0.1 (in ``--node-ip-address`` and ``--address``, and in
``ray.cluster_utils.Cluster``) with the machine's outward address, so loopback "nodes" are not separate hosts.
Here each node is a host on a private /24 (``10.213.X.0/24``, X free and derived from the pid):

    root netns         head: ``ray start --head`` on ``.1``, the address of the veth ``srl<tag>``
    netns srl-<tag>-sw a bridge joining the head's veth and each node's veth; being its own namespace, its netfilter
                       is empty, so the host's iptables (``bridge-nf-call-iptables``) never sees node-to-node traffic
    netns srl-<tag>-nK node K: ``eth0`` on ``.K+1`` and ``lo``; ``ip netns exec ... ray start --address <head>``

For tests and benchmarks (``tests/cluster.py`` has a pytest fixture over it). A driver runs in the root namespace
and must have ``RAY_AUTH_MODE=disabled`` (Ray 2.60 turns token auth on by default; every ``ray start`` here runs with it disabled, and a driver that expects a token cannot connect), and
connect to ``head_address`` (not 127.0.0.1, not "auto"): ``cluster.env`` holds both, and the ``netns_cluster``
fixture puts them in ``os.environ``, so a plain ``ray.init()`` or a subprocess given ``os.environ`` connects.

Pin work to a node by its custom resource (``resources={node.name: 1}``; each node has 1000 of it), by Ray's
``node:<ip>`` resource, or by a label (``label_selector={...}``; ``add_node(labels=...)``).

Needs root (``ip netns``); the fixture skips where network namespaces cannot be made. Every process the cluster
starts carries ``STREAMRL_NETNS_CLUSTER=<tag>`` in its environment (Ray passes it down to workers and whatever they
spawn), which is how ``close()`` finds them without touching any other Ray on the machine (never ``ray stop``).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).parent / "ray")
MARKER = "STREAMRL_NETNS_CLUSTER"
# Ray's GCS marks a node dead after `failure_threshold` missed health checks, one every `period_ms` (defaults
# 3000 ms x 5, ~15 s for a killed node); a killed node's namespace answers with RST, so each miss is immediate.
# (And checks start `initial_delay_ms` after a node joins, 5000 by default.)
FAST_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000,
                      "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 1000}
_instances = itertools.count()


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no `ip`, or a container that forbids them)."""


@dataclass
class Node:
    name: str
    ip: str
    netns: str | None  # None: the head, in the root namespace
    temp_dir: Path
    num_cpus: int
    resources: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    ifname: str = "eth0"  # its interface on the cluster's subnet, for GLOO_SOCKET_IFNAME and the like
    alive: bool = True

    def command(self, args: list[str]) -> list[str]:
        """`args` run on this node: inside its namespace."""
        return ["ip", "netns", "exec", self.netns, *args] if self.netns else list(args)


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports, held open together so none repeats."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_block(size: int) -> int:
    """The first port of `size` consecutive free ports between Ray's default worker ports (10002-19999) and the
    ephemeral range: no process on any node takes one unasked (the head's worker ports; servers' base ports, which
    an outgoing connection on a node could otherwise hold when the server binds there)."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - size)
        try:
            for port in range(base, base + size):
                with socket.socket() as s:
                    s.bind(("", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no block of {size} free ports in 20000-32000")


def _netns_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _marked(tag: str | None = None) -> dict[int, str]:
    """{pid: tag} of every process carrying a cluster's marker (`tag`'s alone if given) in its environment, and of
    their descendants: a Python process that sets its title (Ray's agents and workers, through setproctitle)
    overwrites the memory /proc/PID/environ reads, so its marker shows only on its parent."""
    found = {}
    for proc in psutil.process_iter():
        try:
            if (value := proc.environ().get(MARKER)) and tag in (None, value):
                found[proc.pid] = value
                found.update((child.pid, value) for child in proc.children(recursive=True))
        except (psutil.Error, OSError):
            continue
    return found


def _kill_until_gone(list_pids, timeout: float = 15.0) -> None:
    """SIGKILL whatever `list_pids()` returns until it returns nothing (a dying tree may still fork)."""
    deadline = time.monotonic() + timeout
    while pids := [p for p in list_pids() if p != os.getpid()]:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes survive SIGKILL: {pids}")
        time.sleep(0.05)


def _netns_pids(netns: str) -> list[int]:
    try:
        return [int(p) for p in _ip("netns", "pids", netns).split()]
    except RuntimeError:  # the namespace is gone
        return []


def _orphaned(tag: str) -> bool:
    return not psutil.pid_exists(int(tag.split("-")[0]))


def _reap_stale() -> None:
    """Remove what runs whose process died without closing (a killed pytest) left: processes, namespaces."""
    _kill_until_gone(lambda: [pid for pid, tag in _marked().items() if _orphaned(tag)])
    for line in _ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        if (m := re.fullmatch(r"srl-(\d+-\d+)-\w+", name)) and _orphaned(m.group(1)):
            _kill_until_gone(lambda name=name: _netns_pids(name))
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _free_subnet(prefix: str) -> str:
    """A /24 under `prefix` that no address or route of the root namespace touches; starts from the pid so that
    two runs at once try different ones first."""
    used = _ip("-4", "-o", "addr") + _ip("-4", "route")
    start = os.getpid() % 256
    for i in range(256):
        subnet = f"{prefix}.{(start + i) % 256}"
        if f"{subnet}." not in used:
            return subnet
    raise RuntimeError(f"no free /24 under {prefix}")


class NetnsCluster:
    """A Ray head in the root namespace plus nodes in namespaces; ``with NetnsCluster() as c: c.add_node(1)``."""

    def __init__(self, head_cpus: int = 1, head_resources: dict | None = None, head_labels: dict | None = None,
                 system_config: dict | None = None, object_store_memory: int = 200 * 2**20,
                 subnet_prefix: str = "10.213"):
        self.tag = f"{os.getpid()}-{next(_instances)}"
        self.head_cpus, self.head_resources, self.head_labels = head_cpus, head_resources, head_labels
        self.system_config = FAST_HEALTH_CHECKS if system_config is None else system_config
        self.object_store_memory = object_store_memory
        self.subnet_prefix = subnet_prefix
        self.nodes: list[Node] = []
        self.head_address = self.subnet = ""
        self.switch = f"srl-{self.tag}-sw"
        self.uplink = f"srl{self.tag}"  # the head's veth, the one link in the root namespace (<= 15 chars)
        self.root: Path | None = None
        self._hosts = itertools.count(1)
        self._closed = False

    # ---- lifecycle

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> NetnsCluster:
        try:
            self._make_switch()
            self.root = Path(tempfile.mkdtemp(prefix="srl", dir="/tmp"))  # short: Ray's socket paths max 107
            self._start_head()
        except BaseException:
            self.close()
            raise
        return self

    @property
    def env(self) -> dict[str, str]:
        """What a driver process needs (besides running in the root namespace)."""
        return {"RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": self.head_address}

    @property
    def head(self) -> Node:
        return self.nodes[0]

    # ---- network

    def _make_switch(self) -> None:
        if os.geteuid() != 0 or not shutil.which("ip"):
            raise NetnsUnavailable("network namespaces need root and iproute2's `ip`")
        try:
            _reap_stale()
            self.subnet = _free_subnet(self.subnet_prefix)
            _ip("netns", "add", self.switch)
            _ip("netns", "exec", self.switch, "true")  # a container may allow `add` but not the mount `exec` needs
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            _ip("link", "add", self.uplink, "type", "veth", "peer", "name", "uplink", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", "uplink", "master", "br0", "up")
            _ip("addr", "add", f"{self.subnet}.{next(self._hosts)}/24", "dev", self.uplink)
            _ip("link", "set", self.uplink, "up")
        except RuntimeError as e:
            raise NetnsUnavailable(f"cannot build the namespaces' network: {e}") from e

    def _make_host(self, name: str) -> tuple[str, str]:
        """A namespace plugged into the bridge; returns (namespace, ip)."""
        netns, ip = f"srl-{self.tag}-{name}", f"{self.subnet}.{next(self._hosts)}"
        _ip("netns", "add", netns)
        _ip("-n", self.switch, "link", "add", f"p-{name}", "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("-n", self.switch, "link", "set", f"p-{name}", "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")  # Ray's processes also talk to themselves over loopback
        return netns, ip

    # ---- ray

    def _ray_start(self, node: Node, *args: str) -> None:
        node.temp_dir.mkdir(parents=True)
        args = [RAY, "start", "--node-ip-address", node.ip, "--temp-dir", str(node.temp_dir),
                "--num-cpus", str(node.num_cpus), "--disable-usage-stats",
                "--object-store-memory", str(self.object_store_memory), "--node-name", node.name, *args]
        if node.resources:
            args += ["--resources", json.dumps(node.resources)]
        if node.labels:
            args += ["--labels", ",".join(f"{k}={v}" for k, v in node.labels.items())]
        env = {**os.environ, **self.env, MARKER: self.tag, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS")  # `ray start` takes it from its arguments
        proc = subprocess.run(node.command(args), env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise RuntimeError(f"ray start ({node.name}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")

    def _start_head(self) -> None:
        ip = f"{self.subnet}.1"
        node = Node("head", ip, None, self.root / "head", self.head_cpus, {"head": 1000, **(self.head_resources or {})},
                    self.head_labels or {}, ifname=self.uplink)
        # every port the head listens on, chosen free: Ray's fixed defaults (8265, 10001, 52365) would collide
        # with any other Ray on this machine
        port, nm, om, client, dash, agent, agent_grpc, env_agent, metrics = _free_ports(9)
        workers = free_port_block(100)
        self.head_address = f"{ip}:{port}"
        self._ray_start(node, "--head", "--port", str(port), "--include-dashboard=false",
                        "--node-manager-port", str(nm), "--object-manager-port", str(om),
                        "--ray-client-server-port", str(client), "--dashboard-port", str(dash),
                        "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
                        "--runtime-env-agent-port", str(env_agent), "--metrics-export-port", str(metrics),
                        "--min-worker-port", str(workers), "--max-worker-port", str(workers + 99),
                        "--system-config", json.dumps(self.system_config))
        self.nodes.append(node)

    def add_node(self, num_cpus: int = 1, resources: dict | None = None, labels: dict | None = None,
                 name: str | None = None) -> Node:
        """A new host joining the running cluster (registered with the GCS when this returns). It has `resources`
        plus 1000 of a resource named after it."""
        name = name or f"n{len(self.nodes)}"
        # it names a namespace and a link (`p-<name>`, 15 chars at most); "sw" is the switch's
        assert re.fullmatch(r"\w{1,13}", name) and name not in {"sw", *(n.name for n in self.nodes)}, name
        netns, ip = self._make_host(name)
        node = Node(name, ip, netns, self.root / name, num_cpus, {name: 1000, **(resources or {})}, labels or {})
        self.nodes.append(node)  # before `ray start`, so close() cleans up after a failed one
        # its own port space: Ray's default ports cannot collide with anything here
        self._ray_start(node, "--address", self.head_address)
        return node

    def _namespaces(self) -> list[str]:
        """Ours, by name rather than from self.nodes, to get one whose add_node failed half-way too."""
        try:
            listing = _ip("netns", "list")
        except (OSError, RuntimeError):  # no `ip`, or not allowed: then there are none
            return []
        return [name for line in listing.splitlines() if (name := line.split(" ")[0]).startswith(f"srl-{self.tag}-")]

    # ---- failures

    def kill_node(self, node: Node, unplug: bool = False) -> None:
        """The node dies: SIGKILL every process in its namespace (Ray's and whatever Ray's workers started). Its
        namespace stays until close() and answers connections with RST, like a host whose processes crashed
        (the GCS notices after `health_check_failure_threshold` checks); `unplug` also pulls its cable (the veth
        goes), like a host powered off: connections hang until `health_check_timeout_ms`."""
        if node.netns is None:
            root = _netns_of(os.getpid())
            _kill_until_gone(lambda: [pid for pid in _marked(self.tag) if _netns_of(pid) == root])
        else:
            _kill_until_gone(lambda: _netns_pids(node.netns))
            if unplug:
                _ip("-n", self.switch, "link", "del", f"p-{node.name}")
        node.alive = False

    def close(self) -> None:
        """Kill everything the cluster started and remove its links, namespaces and temp dir; safe to repeat."""
        if self._closed:
            return
        self._closed = True
        errors = []
        namespaces = self._namespaces()
        steps = [lambda ns=ns: _kill_until_gone(lambda: _netns_pids(ns)) for ns in namespaces]
        steps.append(lambda: _kill_until_gone(lambda: list(_marked(self.tag))))
        # deleted here, as `ip netns del` removes the namespace's links only later, in the background
        steps.append(lambda: subprocess.run(["ip", "link", "del", self.uplink], capture_output=True))
        steps += [lambda ns=ns: subprocess.run(["ip", "netns", "del", ns], capture_output=True) for ns in namespaces]
        if self.root:
            steps.append(lambda: shutil.rmtree(self.root, ignore_errors=True))
        for step in steps:  # every step, whatever failed before it
            try:
                step()
            except Exception as e:
                errors.append(e)
        if errors:
            raise RuntimeError(f"cluster teardown: {errors}")
