import time

import pytest

from streamrl.buffer import ServerInfo, ServerRegistry


def test_heartbeat_announces_and_updates_a_server(ns):
    registry = ServerRegistry(ns, ttl_s=5)
    registry.heartbeat(ServerInfo("http://127.0.0.1:31001", "hf", weight_version=0, started_at=1.5))
    registry.heartbeat(ServerInfo("http://127.0.0.1:31000", "vllm"))
    registry.heartbeat(ServerInfo("http://127.0.0.1:31001", "hf", weight_version=3, started_at=1.5))
    assert registry.alive() == [
        ServerInfo("http://127.0.0.1:31000", "vllm"),
        ServerInfo("http://127.0.0.1:31001", "hf", weight_version=3, started_at=1.5),
    ]


def test_a_silent_server_expires_and_a_removed_one_is_gone(ns):
    registry = ServerRegistry(ns, ttl_s=0.3)
    registry.heartbeat(ServerInfo("http://a:1", "hf"))
    registry.heartbeat(ServerInfo("http://b:2", "hf"))
    registry.remove("http://b:2")
    assert [s.url for s in registry.alive()] == ["http://a:1"]
    time.sleep(0.45)
    assert registry.alive() == []


def test_runs_do_not_see_each_others_servers(ns, redis_server):
    from streamrl.buffer import Namespace

    ServerRegistry(ns).heartbeat(ServerInfo("http://a:1", "hf"))
    assert ServerRegistry(Namespace.open(redis_server.url, ns.run + "-other")).alive() == []


def test_ttl_must_be_positive(ns):
    with pytest.raises(ValueError, match="ttl must be positive"):
        ServerRegistry(ns, ttl_s=0)
