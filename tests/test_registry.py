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


def test_the_router_announces_its_address_which_expires_when_it_falls_silent(ns):
    from streamrl.buffer import RouterAddress

    address = RouterAddress(ns, ttl_s=0.3)
    assert address.get() is None
    address.announce("http://10.0.0.2:30000")
    address.withdraw("http://10.0.0.3:30000")  # another router's withdrawal leaves this one's announcement
    assert address.get() == "http://10.0.0.2:30000"
    address.withdraw("http://10.0.0.2:30000")
    assert address.get() is None
    address.announce("http://10.0.0.2:30000")
    time.sleep(0.45)
    assert address.get() is None


def test_workers_wait_for_the_router_and_follow_it_to_another_node(ns, tmp_path):
    import asyncio

    from streamrl.buffer import RouterAddress
    from streamrl.config import load_config
    from streamrl.rollout.client import GenerateClient, RouterLocator

    cfg = load_config(None, [f"run.name={ns.run}", f"run.dir={tmp_path}"])
    address = RouterAddress(ns)

    async def scenario() -> list[str]:
        locator = RouterLocator(cfg, ns)
        waiting = asyncio.create_task(locator.url(every_s=0.05))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # nothing announced yet: no address to guess
        address.announce("http://10.0.0.2:30000")
        seen = [await waiting]
        async with GenerateClient(seen[0]) as client:
            follower = asyncio.create_task(locator.follow(client, every_s=0.05))
            address.announce("http://10.0.0.3:30000")  # restarted on another node
            await asyncio.sleep(0.3)
            seen.append(client.base_url)
            follower.cancel()
        return seen

    assert asyncio.run(scenario()) == ["http://10.0.0.2:30000", "http://10.0.0.3:30000"]
    # a configured router wins over any announcement
    pinned = load_config(None, [f"run.name={ns.run}", "router.host=10.9.9.9", "router.port=1234"])
    assert asyncio.run(RouterLocator(pinned, ns).url()) == "http://10.9.9.9:1234"
