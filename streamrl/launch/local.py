"""``streamrl up``: every part of a run, one process each, in dependency order.

    prepare (recipe) → Redis → router → servers → rollout workers → evaluator (eval at version 0)
    → learner (torchrun when learner.nproc > 1) → watch until the learner and evaluator finish

The parts run on this machine, or on a Ray cluster's nodes (``launcher: ray``, ``streamrl.launch.ray``);
while the run goes on, ``streamrl scale`` can ask it for more servers and workers.

Every part reads the same resolved config, written to ``RUN/config.yaml`` (with the embedded
Redis URL filled in). The embedded Redis is a part like the others: restarted on the same port
from its append-only file if it dies. Ctrl-C, completion or a fatal failure tears everything
down (Redis last, so the others can finish their writes).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from streamrl.buffer import BufferUnavailable, EmbeddedRedis, Namespace
from streamrl.buffer.redis_server import free_port
from streamrl.config import Config, ConfigError, load_config
from streamrl.envs.registry import load_plugin
from streamrl.launch import scale
from streamrl.launch.display import Dashboard
from streamrl.launch.gpus import gpu_plan, share_gpus, visible_gpus
from streamrl.launch.plots import plot_run
from streamrl.launch.priority import ServerPriority
from streamrl.launch.supervisor import Part, PartFailed, Supervisor
from streamrl.rollout.evaluate import read_records

if TYPE_CHECKING:
    from streamrl.launch.ray import RayActors


def prepare(cfg: Config, path: str | None, overrides: list[str]) -> Config:
    """Run the config's recipe (if any) and fold the overrides it returns into the config."""
    if not cfg.prepare.fn:
        return cfg
    try:
        fn = load_plugin(cfg.prepare.fn, "streamrl.recipes", "prepare.fn")  # module:function or file.py:function
    except ValueError as e:
        raise ConfigError(str(e)) from None
    made: dict[str, Any] = fn(cfg, **cfg.prepare.args)
    return load_config(path, [*overrides, *(f"{k}={v}" for k, v in made.items())])


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _has_eval(cfg: Config, step: int) -> bool:
    return any(r.get("step") == step for r in read_records(cfg.run.path / "metrics" / "eval.jsonl"))


def _threads(cfg: Config, learner: bool = False) -> dict[str, str]:
    """Torch threads per server and learner rank: the cores shared among the parts that compute.

    Sync mode too, though its generation and training take turns: on two cores, giving each phase both
    made the quickstart's sync run 1.3× slower (median of 4 side-by-side pairs, 1.07–1.52×; a small model's ops
    gain less from a second thread than they lose waiting on it beside the other processes).
    """
    n = cfg.supervise.threads or max(1, (os.cpu_count() or 1) // (cfg.server.count + cfg.learner.nproc))
    if learner and isinstance(cfg.supervise.learner_threads, int):  # auto: the share, widened by the learner
        n = cfg.supervise.learner_threads
    return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}


def _answers(part: Part, host: str | None, port: int) -> Callable[[], bool]:
    """Ready once the part answers /health where it runs: the configured host, else the node it landed on."""
    return lambda: part.host is not None and _healthy(f"http://{host or part.host}:{port}")


def server_part(cfg: Config, i: int, config_file: Path, gpus: dict[str, str] | None = None) -> Part:
    port = cfg.server.base_port + i
    part = Part(f"server-{i}", "server", [*_me(), "serve", str(config_file), "--port", str(port)],
                cfg.run.path / "logs" / f"server-{i}.log",
                env={**_threads(cfg), **({"CUDA_VISIBLE_DEVICES": gpus[f"server-{i}"]} if gpus and f"server-{i}" in gpus
                                         else {})})
    part.ready = _answers(part, cfg.server.host, port)
    return part


def rollout_part(cfg: Config, i: int, config_file: Path) -> Part:
    return Part(f"rollout-{i}", "rollout", [*_me(), "launch-rollout", str(config_file), "--name", f"worker-{i}"],
                cfg.run.path / "logs" / f"rollout-{i}.log", env={"OMP_NUM_THREADS": "1"})


def _me() -> list[str]:
    return [sys.executable, "-m", "streamrl"]


def parts(cfg: Config, config_file: Path, redis: EmbeddedRedis | None = None,
          gpus: dict[str, str] | None = None) -> list[Part]:
    """What to start, in order, for this config; ``gpus``: ``CUDA_VISIBLE_DEVICES`` by part (``gpu_plan``)."""
    logs, cfg_arg = cfg.run.path / "logs", str(config_file)
    out = [Part("redis", "redis", redis.argv(), redis.log_path, ready=redis.ping)] if redis else []
    # The learner starts first: its start-up (imports, DeepSpeed, ~10 s) overlaps the others'. It cannot
    # step before there is data, and the workers start only after the evaluator's baseline (version 0).
    # Several ranks run under torchrun here; Ray starts an actor per rank itself, each with torchrun's variables.
    if cfg.learner.nproc == 1 or cfg.launcher == "ray":
        learner = [*_me(), "launch-learner", cfg_arg]
    else:
        learner = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cfg.learner.nproc),
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "streamrl",
                   "launch-learner", cfg_arg]
    out.append(Part("learner", "learner", learner, logs / "learner.log",
                    env={**_threads(cfg, learner=True),
                         **({"CUDA_VISIBLE_DEVICES": gpus["learner"]} if gpus and "learner" in gpus else {})}))
    router = Part("router", "router", [*_me(), "launch-router", cfg_arg], logs / "router.log")
    router.ready = _answers(router, cfg.router.host, cfg.router.port)
    out.append(router)
    out.extend(server_part(cfg, i, config_file, gpus) for i in range(cfg.server.count))
    if cfg.eval.dataset:
        out.append(Part("evaluator", "evaluator", [*_me(), "evaluate", cfg_arg], logs / "evaluator.log",
                        env={"OMP_NUM_THREADS": "1"}, ready=lambda: _has_eval(cfg, 0)))
    out.extend(rollout_part(cfg, i, config_file) for i in range(cfg.rollout.workers))
    return out


def up(path: str | None, overrides: list[str], *, fresh: bool = False) -> int:
    """Run everything; return the exit status (0: the learner reached max_steps)."""
    cfg = load_config(path, overrides)
    if fresh and cfg.run.path.exists():
        shutil.rmtree(cfg.run.path)
    cfg.run.path.mkdir(parents=True, exist_ok=True)
    dashboard = Dashboard(cfg)
    say = dashboard.say
    t0 = time.time()
    say(f"run {cfg.run.name} in {cfg.run.path} (logs in {cfg.run.path / 'logs'})")
    gpus = visible_gpus()
    plan = gpu_plan(cfg, gpus)  # before the recipe runs: too many learner ranks are refused here
    if cfg.prepare.fn:
        say(f"preparing: {cfg.prepare.fn}")
    try:
        cfg = prepare(cfg, path, overrides)
    except KeyboardInterrupt:
        say("interrupted while preparing; nothing was started")
        return 130
    if not cfg.model.path:
        raise ConfigError("model.path is not set (and no prepare.fn sets it)")
    _lock_down(cfg)
    if plan:
        say("GPUs: " + ", ".join(f"{name} {ids}" for name, ids in plan.items()))
    if line := share_gpus(cfg, gpus, plan):
        say(line)
    launcher = supervisor = redis = None
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the run like Ctrl-C, even while parts start
    try:
        if cfg.launcher == "ray":  # first: the cluster must be able to hold the run before anything starts
            from streamrl.launch.ray import RayActors

            say(f"joining Ray ({cfg.ray.address or 'a local cluster'})")
            launcher = RayActors(cfg)
        if not cfg.redis.url:
            redis = _embedded_redis(cfg, launcher)
            cfg.redis.url = redis.url
        config_file = _write_config(cfg)
        todo = parts(cfg, config_file, redis, plan)
        if launcher:
            say(f"placing {len(todo)} parts on Ray")
            launcher.place(todo)
        priority = _server_priority(cfg, launcher, gpus, say)
        supervisor = Supervisor(cfg.supervise.restart, cfg.supervise.max_restarts, cfg.supervise.ready_timeout_s,
                                say, state_path=cfg.run.path / "parts.json", launcher=launcher)
        dashboard.connect(cfg.redis.url, supervisor)
        # each round reads through the dashboard's client, without retries: a Redis that is down must not hold up
        # its own restart
        requests, told = dashboard.ns, set()
        for part in todo:
            say(f"starting {part.name}")
            supervisor.start(part)
        say("all parts ready")
        while not all(p.finished for p in supervisor.parts if p.kind in ("learner", "evaluator")):
            supervisor.check()
            if priority:
                priority.watch(supervisor.parts)
            _scale(cfg, requests, supervisor, launcher, config_file, plan, told)
            dashboard.refresh()
            time.sleep(cfg.supervise.refresh_s)
        code = 0
    except KeyboardInterrupt:
        say("interrupted: stopping every part")
        code = 130
    except (PartFailed, RuntimeError) as e:  # RuntimeError: e.g. the Ray cluster cannot hold the run
        say(f"stopping the run: {e}")
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the teardown short
            signal.signal(sig, signal.SIG_IGN)
        _teardown(say, dashboard.close, supervisor and supervisor.stop, launcher and launcher.close)
    dashboard.summary(time.time() - t0, code)
    try:
        say(f"curves: {plot_run(cfg.run.path, cfg.staleness_bound)}")
    except FileNotFoundError:
        pass  # stopped before any step or evaluation: nothing to draw
    return code


def _server_priority(cfg: Config, launcher: RayActors | None, gpus: list[str],
                     say: Callable[[str], None]) -> ServerPriority | None:
    """Who goes first on the cores, where servers on the CPU share them with a learner on the CPU (Ray reserves
    each part's CPUs itself). A learner whose threads take every core needs no priority from ``auto``: under
    one it would run alone whenever it had data, starving the generation it waits on next."""
    setting = cfg.supervise.server_nice
    if setting == 0 or launcher:  # Ray: refused by the config
        return None
    if gpus:
        say(f"supervise.server_nice {setting}: this machine has GPUs, and the servers' compute is theirs; left as is")
        return None
    learner_cores = cfg.learner.nproc * int(_threads(cfg, learner=True)["OMP_NUM_THREADS"])
    if setting == "auto" and learner_cores >= (os.cpu_count() or 1):
        say(f"supervise.server_nice auto: the learner's threads take all {learner_cores} cores, and first on every "
            "core it would starve the generation it waits on next; the servers keep niceness 0")
        return None
    return ServerPriority(cfg.supervise.server_nice, cfg.run.path / "metrics" / "learner.jsonl", say)


def _embedded_redis(cfg: Config, launcher: RayActors | None) -> EmbeddedRedis:
    """The run's own Redis, on a fixed port, so that a restarted Redis is where everyone looks."""
    host = cfg.redis.host or (launcher.node_ip if launcher else "127.0.0.1")
    return EmbeddedRedis(cfg.run.path / "redis", host=host, port=cfg.redis.port or free_port(host),
                         password=cfg.redis.password, appendfsync=cfg.redis.appendfsync)


def _write_config(cfg: Config) -> Path:
    """The resolved config every part reads, readable by the user alone: it holds the Redis password."""
    config_file = cfg.run.path / "config.yaml"
    config_file.unlink(missing_ok=True)
    with os.fdopen(os.open(config_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        yaml.safe_dump(cfg.model_dump(mode="json"), f, sort_keys=False)
    return config_file


def _teardown(say: Callable[[str], None], *steps: Callable[[], Any] | None) -> None:
    for step in steps:
        try:
            if step:
                step()
        except Exception as e:  # one failed step must not leave the others undone
            say(f"teardown: {e}")


def _scale(cfg: Config, ns: Namespace, supervisor: Supervisor, launcher: RayActors | None, config_file: Path,
           plan: dict[str, str], told: set[str]) -> None:
    """Start the servers and workers that `streamrl scale` asked for and the run does not have yet."""
    try:
        wanted = scale.wanted(ns)
    except BufferUnavailable:  # Redis is a part too, and may be restarting: ask again next round
        return
    have = {kind: sum(1 for p in supervisor.parts if p.kind == kind) for kind in ("server", "rollout")}
    if wanted.get("server", 0) > have["server"] and any(name.startswith("server-") for name in plan):
        if "gpus" not in told:
            supervisor.say("streamrl scale: servers added to a run whose servers have GPUs of their own need "
                           "launcher=ray (Ray gives each its own); adding no server")
            told.add("gpus")
        wanted["server"] = have["server"]
    new = [*(server_part(cfg, i, config_file) for i in range(have["server"], wanted.get("server", 0))),
           *(rollout_part(cfg, i, config_file) for i in range(have["rollout"], wanted.get("rollout", 0)))]
    if not new:
        return
    if launcher:
        launcher.place(new, settle_s=0)  # the watch goes on; a part with no room waits, and says so
    for part in new:
        supervisor.say(f"scaling up: starting {part.name}")
        supervisor.start(part, wait=False)


def _lock_down(cfg: Config) -> None:
    """Secrets for a run that did not configure its own: a password for the embedded Redis and a token for
    the servers' control endpoints. They live only in RUN/config.yaml (mode 0600), which every part reads."""
    if not cfg.redis.url and cfg.redis.password is None:
        cfg.redis.password = secrets.token_urlsafe(24)
    if cfg.server.token is None:
        cfg.server.token = secrets.token_urlsafe(24)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt
