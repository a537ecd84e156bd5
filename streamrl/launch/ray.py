"""The parts as Ray actors across a cluster's nodes: ``launcher: ray`` (or ``streamrl up --ray ADDRESS``).

Each kind of part has a placement group of its own, a bundle per part (per rank for the learner), sized and
steered by its ``ray.<kind>`` section: CPUs, GPUs, custom resources, node labels, strategy. An actor in each
bundle asks Ray for its node's address, then starts the part's command there as a child process told that
address (``STREAMRL_NODE_IP``), so the part binds and announces an address the other nodes reach. The
learner is a gang: an actor per rank, started with the variables torchrun would set, meeting at rank 0's
node. Redis stays beside ``streamrl up`` (the run's control plane: every part holds its URL), as does the
driver's own supervision; logs go to ``RUN/logs``, which must be on a filesystem every node shares.

A part whose node dies is restarted into the same bundle: Ray moves the bundle to a node with room. Until
one has room the part is *placing* (the supervisor says what it waits for), and a node that joins gets it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import psutil
import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from streamrl.buffer.redis_server import die_with_parent, free_port
from streamrl.config import Config
from streamrl.config.sections import Placement
from streamrl.launch.supervisor import LocalProcesses, Part, kill_tree
from streamrl.node import NODE_IP_ENV

PLACED = ("server", "learner", "rollout", "router", "evaluator")  # kinds Ray places; Redis stays with the driver


@ray.remote(num_cpus=0)
class PartProcess:
    """One process of a part (a learner: one rank), on the node Ray placed this actor on."""

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port(self.node_ip())

    def start(self, argv: list[str], env: dict[str, str], log_path: str, cwd: str) -> int:
        told = {**_gloo_interface(env[NODE_IP_ENV]), **env}
        with open(log_path, "ab") as log:
            # the part dies with this actor (ray.kill, a crash): none outlives its bundle
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **told}, cwd=cwd, start_new_session=True,
                                         preexec_fn=die_with_parent)
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout_s: float) -> int | None:
        if self.proc.poll() is None:  # a reaped process's pid may be another's by now
            kill_tree(self.proc.pid, timeout_s)
        return self.proc.poll()


def _gloo_interface(ip: str) -> dict[str, str]:
    """gloo binds the interface its host name resolves to, which on a multi-homed node (or one whose name
    resolves to another address) is not the one Ray's other nodes reach: name the interface that holds ``ip``."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addresses):
            return {"GLOO_SOCKET_IFNAME": name}
    return {}


def rank_env(ips: list[str], port: int, own_gpus: bool = False) -> list[dict[str, str]]:
    """torchrun's variables for a gang of ranks on nodes ``ips`` (rank order), meeting at rank 0's node. With
    ``own_gpus`` Ray gives each rank its GPUs alone (its own CUDA_VISIBLE_DEVICES), so each is its device 0."""
    env, seen = [], defaultdict(int)
    for rank, ip in enumerate(ips):
        env.append({"RANK": str(rank), "WORLD_SIZE": str(len(ips)), "LOCAL_RANK": "0" if own_gpus else str(seen[ip]),
                    "LOCAL_WORLD_SIZE": str(ips.count(ip)), "MASTER_ADDR": ips[0], "MASTER_PORT": str(port)})
        seen[ip] += 1
    return env


class RayPart:
    """A Popen look-alike over the actors of one part. While Ray has not placed every actor, the part is
    ``placing`` and counts as alive; then it starts, and any process's exit is the part's (a learner's ranks
    live and die together, as under torchrun)."""

    def __init__(self, part: Part, actors: list[Any], cwd: str, bundles: tuple[PlacementGroup, list[int]], asks: str,
                 loopback: bool = False, own_gpus: bool = False):
        self.part, self.actors, self.cwd, self.bundles, self.asks = part, actors, cwd, bundles, asks  # group, indices
        self.loopback = loopback  # a cluster of this machine alone: parts keep to 127.0.0.1
        self.own_gpus = own_gpus  # Ray gives each process GPUs of its own
        self.look_after = time.monotonic() + 2  # an actor takes a moment to start even where there is room
        self.placed = [actor.node_ip.remote() for actor in actors]
        self.pid: int | None = None
        self.host: str | None = None  # the node of its first process (a learner's rank 0)
        self.hosts: list[str] = []    # the node of each process
        self.returncode: int | None = None

    @property
    def placing(self) -> bool:
        return self.pid is None and self.returncode is None

    def poll(self) -> int | None:
        if self.returncode is None and self.placing:
            self._start_when_placed()
        if self.returncode is None and not self.placing:
            self._poll_processes()
        return self.returncode

    def _start_when_placed(self) -> None:
        done, _ = ray.wait(self.placed, num_returns=len(self.placed), timeout=0)
        if len(done) < len(self.placed):
            return
        try:
            ips = ["127.0.0.1"] * len(self.placed) if self.loopback else ray.get(self.placed)
            envs = [{**self.part.env, NODE_IP_ENV: ip} for ip in ips]
            if self.part.kind == "learner":
                port = ray.get(self.actors[0].free_port.remote(), timeout=30)
                envs = [{**env, **ranks} for env, ranks in zip(envs, rank_env(ips, port, self.own_gpus))]
            log = str(self.part.log_path.resolve())
            pids = ray.get([a.start.remote(self.part.argv, e, log, self.cwd) for a, e in zip(self.actors, envs)],
                           timeout=60)
        except ray.exceptions.RayError:  # an actor (or its node) died on the way: the supervisor restarts us
            self.returncode = -9
            return
        self.pid, self.host, self.hosts = pids[0], ips[0], ips

    def _poll_processes(self) -> None:
        try:
            codes = ray.get([actor.poll.remote() for actor in self.actors], timeout=30)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            return  # slow to answer, or unreachable until Ray decides whether its node is dead: ask again
        except ray.exceptions.RayError:  # an actor, or its node, is gone: so is the part
            self.returncode = -9
            return
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            self.returncode = failed[0]
        elif all(code == 0 for code in codes):
            self.returncode = 0

    def waiting_for(self) -> str | None:
        """What the part waits for while Ray has no room for it; None while its bundles are placed (its actors
        are merely starting), or when asked again within two seconds."""
        if time.monotonic() < self.look_after:
            return None
        self.look_after = time.monotonic() + 2
        group, indices = self.bundles
        placed = placement_group_table(group)["bundles_to_node_id"]
        if all(placed.get(i) for i in indices):
            return None
        nodes = ", ".join(f"{n.ip} {_fmt(n.resources)}" for n in alive_nodes())
        return (f"Ray to place it: it asks {self.asks}; free now {_fmt(ray.available_resources())} (alive nodes: "
                f"{nodes}). It starts as soon as a node has room, one that joins the cluster included")

    def stop(self, timeout_s: float) -> None:
        stop_together([self], timeout_s)


def stop_together(parts: list[RayPart], timeout_s: float) -> None:
    """SIGTERM every started process of these parts at once, wait for them together, then drop the actors
    (which kills what is left: each process dies with its actor)."""
    stops = [actor.stop.remote(timeout_s) for p in parts if not p.placing for actor in p.actors]
    if stops:  # wait returns a dead actor's answer (its error) at once, without cutting the others' short
        ray.wait(stops, num_returns=len(stops), timeout=timeout_s + 30)
    for p in parts:
        for actor in p.actors:
            ray.kill(actor)
        if p.returncode is None:
            p.returncode = -15


@dataclass(frozen=True)
class Node:
    ip: str
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)


def alive_nodes() -> list[Node]:
    return [Node(n["NodeManagerAddress"], {k: v for k, v in n["Resources"].items() if not k.startswith("node:")},
                 {k: v for k, v in n.get("Labels", {}).items() if not k.startswith("ray.io/")})
            for n in ray.nodes() if n["Alive"]]


def _fmt(resources: dict[str, float]) -> str:
    """Resources as a user asks for them: without Ray's own bookkeeping (memory, node and bundle markers)."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())
                           if not k.startswith(("node:", "memory", "object_store_memory", "bundle_group_"))) + "}"


def _fits(bundle: dict[str, float], node: Node, labels: dict[str, str]) -> bool:
    return (all(_selects(node.labels.get(k), v) for k, v in labels.items())
            and all(node.resources.get(k, 0.0) >= v for k, v in bundle.items()))


def _selects(value: str | None, selector: str) -> bool:
    """Ray's label selector on one key: ``v``, ``!v``, ``in(a,b)``, ``!in(a,b)`` (a missing key is never ``v``,
    always ``!v``). Ray does not strip spaces after the commas, nor does this."""
    negated, selector = selector.startswith("!"), selector.removeprefix("!")
    allowed = selector[3:-1].split(",") if selector.startswith("in(") and selector.endswith(")") else [selector]
    return (value in allowed) != negated


def _choosy(place: Placement) -> bool:
    """Whether this kind may go only to some nodes."""
    return bool(place.labels or place.resources or place.gpus)


def asked(cfg: Config) -> dict[str, int]:
    """How many bundles each kind asks for: one per part, one per learner rank."""
    return {"server": cfg.server.count, "learner": cfg.learner.nproc, "rollout": cfg.rollout.workers,
            "router": 1, "evaluator": 1 if cfg.eval.dataset else 0}


def unplaceable(requests: dict[str, tuple[int, Placement]], nodes: list[Node]) -> list[str]:
    """Why the cluster ``nodes`` can never hold these requests (``kind: (bundles, placement)``); nothing if it
    may. Only what no packing can satisfy is refused: a run that fits is never turned away."""
    problems = []
    cluster = ", ".join(f"{n.ip} {_fmt(n.resources)}{f' labels {n.labels}' if n.labels else ''}" for n in nodes)
    total: dict[str, float] = defaultdict(float)
    for kind, (count, place) in requests.items():
        if not count:
            continue
        bundle = place.bundle()
        for name, amount in bundle.items():
            total[name] += amount * count
        hosts = [n for n in nodes if _fits(bundle, n, place.labels)]
        where = f" on a node labelled {place.labels}" if place.labels else ""
        if not hosts:
            problems.append(f"ray.{kind}: each of {count} asks {_fmt(bundle)}{where}, which no node has")
        elif place.strategy == "STRICT_PACK" and not any(
                _fits({k: v * count for k, v in bundle.items()}, n, place.labels) for n in hosts):
            problems.append(f"ray.{kind}: STRICT_PACK puts all {count} on one node, {count} × {_fmt(bundle)}{where}, "
                            "which no node has")
        elif place.strategy == "STRICT_SPREAD" and len(hosts) < count:
            problems.append(f"ray.{kind}: STRICT_SPREAD puts each of {count} on a node of its own, but only "
                            f"{len(hosts)} node(s) have {_fmt(bundle)}{where}")
    have = {k: sum(n.resources.get(k, 0.0) for n in nodes) for k in total}
    short = {k: v for k, v in total.items() if v > have[k] + 1e-9}
    if short:
        problems.append(f"the run asks {_fmt(total)} in all; the cluster has {_fmt(have)}")
    if problems:
        problems.append(f"the cluster: {cluster or 'no alive node'}")
    return problems


class RayActors:
    """Launcher: every part of each kind in a bundle of that kind's placement group."""

    def __init__(self, cfg: Config):
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            # "local" starts a cluster of our own: None would join any cluster already running on this machine
            ray.init(address=cfg.ray.address or "local", include_dashboard=False, log_to_driver=False,
                     **({"num_cpus": os.cpu_count()} if cfg.ray.address is None else {}))
        self.cfg, self.cwd = cfg, os.getcwd()
        # the driver's node, where Redis binds. A local cluster is this machine alone: its parts keep to loopback
        # (Ray would name the machine's outward address, and every part would listen there)
        self.loopback = cfg.ray.address is None
        self.node_ip = "127.0.0.1" if self.loopback else ray.util.get_node_ip_address()
        self.groups: list[PlacementGroup] = []
        self.slots: dict[str, tuple[PlacementGroup, int]] = {}  # part name -> its group, its first bundle there
        self.local = LocalProcesses()
        requests = {kind: (n, getattr(cfg.ray, kind)) for kind, n in asked(cfg).items()}
        problems = unplaceable(requests, alive_nodes())
        if problems:
            self.close()
            raise RuntimeError("this Ray cluster cannot hold the run (reserve less in ray.<kind>, or add nodes):\n  "
                               + "\n  ".join(problems))

    def place(self, parts: list[Part], settle_s: float = 15.0) -> None:
        """Reserve a placement group per kind for ``parts`` (the run's, or those `streamrl scale` adds).

        Ray places each group as it comes, so the kinds that may go only to some nodes (labels, GPUs, custom
        resources) are reserved first, each given ``settle_s`` to land: a kind that may go anywhere must not
        take the room on the only nodes another can use.
        """
        by_kind: dict[str, list[Part]] = defaultdict(list)
        for part in parts:
            if part.kind in PLACED:
                by_kind[part.kind].append(part)
        for kind in sorted(by_kind, key=lambda k: not _choosy(getattr(self.cfg.ray, k))):
            place: Placement = getattr(self.cfg.ray, kind)
            per_part = self.cfg.learner.nproc if kind == "learner" else 1
            count = len(by_kind[kind]) * per_part
            selectors = {"bundle_label_selector": [place.labels] * count} if place.labels else {}  # Ray >= 2.49
            group = placement_group([place.bundle()] * count, strategy=place.strategy, **selectors)
            self.groups.append(group)
            for i, part in enumerate(by_kind[kind]):
                self.slots[part.name] = (group, i * per_part)
            ray.wait([group.ready()], timeout=settle_s)  # not placed in time: it waits, and says so when spawned

    def spawn(self, part: Part) -> Any:
        if part.kind not in PLACED:  # Redis: beside this process, bound to its node's address
            proc = self.local.spawn(part)
            proc.host = self.node_ip
            return proc
        if isinstance(part.proc, RayPart):  # a restart: the old actors give their bundles back first
            part.proc.stop(timeout_s=10)
        group, first = self.slots[part.name]
        place: Placement = getattr(self.cfg.ray, part.kind)
        bundle = place.bundle()
        actors = [PartProcess.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=first + i),
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}).remote()
            for i in range(self.cfg.learner.nproc if part.kind == "learner" else 1)]
        labels = f" on a node labelled {place.labels}" if place.labels else ""
        return RayPart(part, actors, self.cwd, (group, [first + i for i in range(len(actors))]),
                       f"{len(actors)} × {_fmt(bundle)}{labels}", self.loopback, place.gpus > 0)

    def stop_all(self, parts: list[Part], timeout_s: float) -> None:
        self.local.stop_all([p for p in parts if not isinstance(p.proc, RayPart)], timeout_s)
        stop_together([p.proc for p in parts if isinstance(p.proc, RayPart)], timeout_s)

    def close(self) -> None:
        for group in self.groups:
            remove_placement_group(group)
        if self.owns_ray:
            ray.shutdown()
