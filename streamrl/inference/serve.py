"""The ``streamrl serve`` process: an engine, its HTTP server, and its heartbeat in the registry."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from streamrl.adapters import LoraServing
from streamrl.buffer import Namespace, ServerInfo, ServerRegistry
from streamrl.config import Config
from streamrl.inference.engines import load_engine
from streamrl.inference.server import create_app
from streamrl.models import load_tokenizer
from streamrl.node import node_address
from streamrl.weightsync import Probe, ProbeMismatch

log = logging.getLogger("streamrl.serve")


def serve(cfg: Config, *, host: str | None = None, port: int | None = None) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a server's log is for requests, not loading bars
    if not cfg.model.path:
        raise ValueError("model.path is not set: give a local Hugging Face model directory")
    host, port = host or node_address(cfg.server.host), port or cfg.server.base_port
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    model_path, version = newest_weights(cfg)
    lora = LoraServing.of(cfg)
    served = cfg.model.path if lora else model_path  # a LoRA server's base is the model; the adapter comes after
    engine = load_engine(cfg.server.engine, served, dtype=cfg.model.dtype,
                         max_batch_size=cfg.server.max_batch_size, tokenizer=tokenizer,
                         kv_cache_gb=cfg.server.kv_cache_gb, gpu_memory_utilization=cfg.server.gpu_memory_utilization,
                         lora=lora)
    if lora and version:
        asyncio.run(engine.weight_receiver().load_from_disk(str(Path(model_path) / "adapter"), version))
    else:
        engine.version = version
    withdrawn = None
    if version:
        log.info("late joiner: serving the learner's export %s (weight version %d)", model_path, version)
        withdrawn = asyncio.run(_unverified(engine, Path(model_path), version))
    model_path = served
    app = create_app(engine, model_path=model_path, tokenizer=tokenizer, token=cfg.server.token,
                     engine_name=cfg.server.engine, withdrawn=withdrawn)
    url = f"http://{host}:{port}"
    stop = threading.Event()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5))
    threading.Thread(target=_watch, args=(engine, server, stop), daemon=True).start()
    if cfg.redis.url:
        ns = Namespace.open(cfg.redis.url, cfg.run.name, **cfg.redis.retry())
        registry = ServerRegistry(ns, ttl_s=cfg.server.registry_ttl_s)
        beat = threading.Thread(target=_heartbeat, args=(registry, url, engine, app.state.standing, cfg, stop),
                                daemon=True)
        beat.start()
    else:
        log.warning("redis.url is not set: %s will not announce itself in a registry", url)
    try:
        server.run()
    finally:
        stop.set()
        if cfg.redis.url:
            registry.remove(url)
        died = not engine.healthy()
        engine.shutdown()
    if died:  # a non-zero exit: the supervisor restarts this server
        raise RuntimeError(f"the {cfg.server.engine} engine behind {url} stopped serving (its error is above)")


def _watch(engine, server: uvicorn.Server, stop: threading.Event, every_s: float = 1.0,
           grace_s: float = 10.0) -> None:
    """Stop the HTTP server once the engine dies: a live front end over a dead engine would stay
    registered and be routed to (the router only marks it unhealthy) instead of being restarted."""
    while not stop.wait(every_s):
        if not engine.healthy():
            log.error("the engine died: shutting the server down")
            server.should_exit = True
            if not stop.wait(grace_s):  # requests stuck on the dead engine keep uvicorn from stopping
                log.error("the server did not stop within %.0f s: exiting now", grace_s)
                os._exit(1)
            return


def newest_weights(cfg: Config) -> tuple[str, int]:
    """The weights a server should start from: the learner's newest export if training has begun.

    A server that joins a running job must not serve the initial weights as if they were current;
    it starts from ``RUN/export/latest`` (and its version), then follows the pushes.
    """
    pointer = cfg.run.path / "export" / "latest"
    if not pointer.is_file():
        return cfg.model.path, 0
    name = pointer.read_text().strip()
    return str(pointer.parent / name), int(name.removeprefix("version-"))


async def _unverified(engine, export: Path, version: int) -> str | None:
    """Why the export's weights, as loaded, fail the probe the learner wrote beside them (None: they pass, or the
    export has no probe). Scored like a prompt: the server takes no request before this returns."""
    path = export / "probe.json"
    if not path.is_file():
        return None
    check = Probe(**json.loads(path.read_text()))
    scores = await engine.score_prompt("export-probe", check.input_ids)
    try:
        gap = check.check(scores.logprobs, version)
    except ProbeMismatch as e:
        log.error("%s: the export at %s did not load as the learner wrote it; this server takes no generation "
                  "until the learner pushes a version that passes", e, export)
        return str(e)
    log.info("the export's weights pass their probe (gap %.1e)", gap)
    return None


def _heartbeat(registry: ServerRegistry, url: str, engine, standing, cfg: Config, stop: threading.Event) -> None:
    """Announce the server once it answers /health, then keep the registry entry alive. A withdrawn server (its
    weights failed a probe) announces version -1: the learner catches it up."""
    started = time.time()
    while not stop.is_set():
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        stop.wait(0.2)
    while not stop.is_set():
        try:
            version = -1 if standing.withdrawn else engine.version
            registry.heartbeat(ServerInfo(url, cfg.server.engine, version, started))
        except Exception as e:  # keep serving; the registry entry expires and the router drops us
            log.warning("heartbeat to the registry failed: %s", e)
        stop.wait(cfg.server.heartbeat_s)
