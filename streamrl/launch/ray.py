"""The same parts as Ray actors: ``launcher: ray`` (or ``streamrl up --ray ADDRESS``).

One placement group holds a bundle per part (CPUs and GPUs from the ``ray`` config section:
per server, per learner rank, and a small share for the router, workers and evaluator). Each
part's actor starts the part's command on its node as a child process, so the part is exactly
the process ``streamrl up`` would start locally; the supervisor drives the actors through the
same interface (pid, poll, stop). Logs go to ``RUN/logs`` — a shared filesystem across nodes.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from streamrl.config import Config
from streamrl.launch.supervisor import Part, kill_tree


@ray.remote(num_cpus=0)
class PartProcess:
    """Runs one part's command on the node Ray placed it on."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str, cwd: str):
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **env}, cwd=cwd, start_new_session=True)

    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout_s: float) -> int | None:
        kill_tree(self.proc.pid, timeout_s)
        return self.proc.poll()


class RayProcess:
    """A Popen look-alike over a ``PartProcess`` actor."""

    def __init__(self, actor: Any, timeout_s: float):
        self.actor = actor
        self.pid: int = ray.get(actor.pid.remote(), timeout=timeout_s)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = ray.get(self.actor.poll.remote(), timeout=30)
            except ray.exceptions.GetTimeoutError:  # slow to answer is not dead: ask again next time
                return None
            except ray.exceptions.RayError:  # the actor (or its node) is gone: so is the part
                self.returncode = -9
        return self.returncode


def bundle(part: Part, cfg: Config) -> dict[str, float]:
    r = cfg.ray
    if part.kind == "server":
        wanted = {"CPU": r.cpus_per_server, "GPU": r.gpus_per_server}
    elif part.kind == "learner":
        wanted = {"CPU": r.cpus_per_learner_rank * cfg.learner.nproc, "GPU": r.gpus_per_learner_rank * cfg.learner.nproc}
    else:
        wanted = {"CPU": r.cpus_per_part}
    return {k: v for k, v in wanted.items() if v > 0}


class RayActors:
    """Launcher: every part in its own bundle of one placement group."""

    def __init__(self, cfg: Config, parts: list[Part]):
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            ray.init(address=cfg.ray.address, include_dashboard=False, log_to_driver=False,
                     **({"num_cpus": os.cpu_count()} if cfg.ray.address is None else {}))
        self.index = {part.name: i for i, part in enumerate(parts)}
        self.bundles = [bundle(p, cfg) for p in parts]
        self.group = placement_group(self.bundles, strategy=cfg.ray.strategy)
        ready, _ = ray.wait([self.group.ready()], timeout=cfg.supervise.ready_timeout_s)
        if not ready:
            remove_placement_group(self.group)
            raise RuntimeError(f"Ray could not reserve {self.bundles} "
                               f"(cluster: {ray.cluster_resources()}); lower the ray.* resource settings")
        self.cwd = os.getcwd()
        self.timeout_s = cfg.supervise.ready_timeout_s

    def spawn(self, part: Part) -> RayProcess:
        if isinstance(part.proc, RayProcess):  # a restart: the old actor must give its bundle back first
            self.stop_all([part], timeout_s=10)
        i = self.index[part.name]
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i)
        # the actor holds its bundle's CPUs and GPUs; Ray sets CUDA_VISIBLE_DEVICES, the part inherits it
        actor = PartProcess.options(scheduling_strategy=strategy, num_cpus=self.bundles[i].get("CPU", 0),
                                    num_gpus=self.bundles[i].get("GPU", 0)).remote(
            part.argv, part.env, str(part.log_path.resolve()), self.cwd)
        return RayProcess(actor, self.timeout_s)

    def stop_all(self, parts: list[Part], timeout_s: float) -> None:
        stops = [part.proc.actor.stop.remote(timeout_s) for part in parts]
        for part, stop in zip(parts, stops):
            try:
                part.proc.returncode = ray.get(stop, timeout=timeout_s + 30)
            except ray.exceptions.RayError:
                pass
            ray.kill(part.proc.actor)

    def close(self) -> None:
        remove_placement_group(self.group)
        if self.owns_ray:
            ray.shutdown()
