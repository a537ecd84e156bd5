import os

import pytest
import redis

from streamrl.buffer import EmbeddedRedis, Namespace, ReplayStream, StreamReader
from streamrl.testing import synthetic_group


def test_binds_loopback_and_keeps_data_across_a_crash(tmp_path):
    server = EmbeddedRedis(tmp_path, appendfsync="always")  # the config's default: no acknowledged write is lost
    server.start()
    try:
        assert server.url.startswith("redis://127.0.0.1:")
        port = server.port
        ns = Namespace.open(server.url, "durable")
        ids = [ReplayStream(ns).put(synthetic_group(2, 8, prompt_len=2)) for _ in range(5)]
        server.kill()
        server.start()
        assert server.port == port
        assert [e.id for e in StreamReader(ns).read(10)] == ids
        assert (tmp_path / "appendonly.aof").exists() or (tmp_path / "appendonlydir").exists()
    finally:
        server.stop()


def test_password_is_required_when_set(tmp_path):
    with EmbeddedRedis(tmp_path, password="s3cret/+") as server:
        assert redis.Redis.from_url(server.url).ping()
        anonymous = redis.Redis(host="127.0.0.1", port=server.port)
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("k", "v")


def test_stop_leaves_no_process(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        pid = server.proc.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_taken_fixed_port_is_reported(tmp_path):
    with EmbeddedRedis(tmp_path / "a") as first:
        with pytest.raises(RuntimeError, match=f"did not start on 127.0.0.1:{first.port}"):
            EmbeddedRedis(tmp_path / "b", port=first.port).start(timeout_s=3)
