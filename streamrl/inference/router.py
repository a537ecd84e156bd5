"""sglang-router: started, kept in step with the registry of rollout servers, and found by its clients.

The router is the real Rust ``sglang-router`` (PyPI). We start it with an explicit bind (its
defaults listen on all interfaces): loopback, the node's address under Ray, or the configured
one. We wait for it and manage its worker set through its HTTP API: ``POST /workers``,
``GET /workers``, ``DELETE /workers/{id}``. It announces its URL in Redis, where rollout workers
and the evaluator look it up (``RouterLocator``) and follow it if it moves to another node.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import httpx

from streamrl.buffer import Namespace, RouterAddress, ServerRegistry
from streamrl.buffer.redis_server import die_with_parent
from streamrl.config import Config
from streamrl.node import node_address

log = logging.getLogger("streamrl.router")


class Router:
    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 30000,
        policy: str = "cache_aware",
        prometheus_port: int | None = None,
        request_timeout_s: float = 600.0,
        health_check_interval_s: float = 2.0,
        health_failure_threshold: int = 2,
        log_path: Path | None = None,
    ):
        self.host, self.port, self.policy = host, port, policy
        self.prometheus_port = prometheus_port or port + 1
        self.request_timeout_s = request_timeout_s
        self.health_check_interval_s = health_check_interval_s
        self.health_failure_threshold = health_failure_threshold
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._http = httpx.Client(base_url=self.url, timeout=10)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", self.host, "--port", str(self.port),
            "--policy", self.policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
            "--request-timeout-secs", str(int(self.request_timeout_s)),
            "--health-check-interval-secs", str(max(1, int(self.health_check_interval_s))),
            "--health-failure-threshold", str(self.health_failure_threshold),
            "--health-success-threshold", "1",
            "--log-level", "warn",
        ]

    def start(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self._answers():  # e.g. the router of a killed predecessor, still on its way out
            if time.monotonic() > deadline:
                raise RuntimeError(f"another process already serves {self.url}: choose another router.port")
            time.sleep(0.2)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        # the Rust router dies with this process: an orphan would keep the port and a stale worker set
        self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode} on startup"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            if self._answers():
                return
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"sglang-router did not answer on {self.url} within {timeout_s:.0f}s")

    def _answers(self) -> bool:
        try:
            return self._http.get("/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._http.close()

    # ---------------------------------------------------------------- worker set

    def workers(self) -> dict[str, str]:
        """url -> worker id, as the router knows them."""
        reply = self._http.get("/workers")
        reply.raise_for_status()
        return {w["url"]: w["id"] for w in reply.json()["workers"]}

    def add(self, url: str) -> None:
        reply = self._http.post("/workers", json={"url": url})
        if reply.status_code not in (200, 202):
            raise RuntimeError(f"router refused worker {url}: {reply.status_code} {reply.text}")

    def remove(self, url: str) -> None:
        worker_id = self.workers().get(url)
        if worker_id is not None:
            self._http.delete(f"/workers/{worker_id}")

    def sync(self, urls: set[str]) -> tuple[set[str], set[str]]:
        """Make the router's worker set equal ``urls``; returns (added, removed)."""
        known = self.workers()
        added, removed = urls - set(known), set(known) - urls
        for url in sorted(added):
            self.add(url)
        for url in sorted(removed):
            self._http.delete(f"/workers/{known[url]}")
        return added, removed


def follow_registry(router: Router, registry: ServerRegistry, *, every_s: float, stop: threading.Event,
                    static: frozenset[str] = frozenset(), address: RouterAddress | None = None) -> None:
    """Keep the router's workers equal to the live servers in the registry (plus ``static`` ones), and its
    announcement in ``address`` alive. A server withdrawn from generation (its weights failed their probe: it
    announces version -1) is left out until a version passes.

    Returns when ``stop`` is set; raises if the router process dies (its supervisor restarts us).
    """
    while not stop.is_set():
        if not router.alive():
            raise RuntimeError(f"sglang-router exited with {router.proc.returncode}; see {router.log_path}")
        try:
            if address is not None:
                address.announce(router.url)
            added, removed = router.sync({s.url for s in registry.alive() if s.weight_version >= 0} | static)
            for url in added:
                log.info("router: added %s", url)
            for url in removed:
                log.info("router: removed %s", url)
        except Exception as e:  # Redis or router hiccup: try again next round
            log.warning("router sync failed: %s", e)
        stop.wait(every_s)


def launch(cfg: Config, workers: Iterable[str] = ()) -> None:
    """Process entry of ``streamrl launch-router``: start sglang-router and keep its worker set equal to the
    registry's live servers (and ``workers``) until SIGTERM or Ctrl-C; raises if the router fails or dies."""
    cfg.run.path.mkdir(parents=True, exist_ok=True)
    router = Router(host=node_address(cfg.router.host), port=cfg.router.port, policy=cfg.router.policy,
                    prometheus_port=cfg.router.prometheus_port, request_timeout_s=cfg.router.request_timeout_s,
                    health_check_interval_s=cfg.router.health_check_interval_s,
                    log_path=cfg.run.path / "router.log")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    address = None
    try:
        router.start()
        _say(f"sglang-router ready on {router.url} (log: {router.log_path})")
        static = frozenset(workers)
        if cfg.redis.url:
            ns = Namespace.open(cfg.redis.url, cfg.run.name, **cfg.redis.retry())
            registry = ServerRegistry(ns, ttl_s=cfg.server.registry_ttl_s)
            address = RouterAddress(ns, ttl_s=cfg.server.registry_ttl_s)
            follow_registry(router, registry, every_s=cfg.router.sync_every_s, stop=stop, static=static,
                            address=address)
        else:
            _say("redis.url is not set: routing only to --worker URLs")
            router.sync(set(static))
            while not stop.wait(1) and router.alive():
                pass
    except KeyboardInterrupt:
        pass
    finally:
        router.stop()
        if address is not None:
            try:
                address.withdraw(router.url)
            except Exception as e:  # Redis away: the announcement expires on its own
                _say(f"could not withdraw the router's announcement: {e}")


def _say(line: str) -> None:
    """A line for whoever watches the process (its supervisor keeps stderr in the part's log)."""
    print(line, file=sys.stderr, flush=True)
