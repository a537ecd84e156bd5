"""Registry of rollout servers and the router: each announces itself and heartbeats; silence means gone.

One key per server (``srl:{run}:server:{url}``) with a TTL that every heartbeat
renews, so Redis itself expires a server that stopped beating. The router
launcher and the learner's weight push read the live set from here. The router
announces its own URL the same way (``srl:{run}:router``): under Ray it binds the
address of whichever node it landed on, which no config names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import msgpack

from streamrl.buffer.connection import Namespace


@dataclass(frozen=True)
class ServerInfo:
    url: str
    engine: str
    weight_version: int = 0
    started_at: float = 0.0


class ServerRegistry:
    def __init__(self, ns: Namespace, *, ttl_s: float = 10.0):
        if ttl_s <= 0:
            raise ValueError(f"registry ttl must be positive, got {ttl_s}")
        self.ns = ns
        self.ttl_ms = int(ttl_s * 1000)
        self.prefix = ns.key("server:")

    def heartbeat(self, info: ServerInfo) -> None:
        """Announce or refresh a server; call more often than the TTL."""
        payload = msgpack.packb(asdict(info))
        with self.ns.reachable(f"register server {info.url}"):
            self.ns.conn.set(self.prefix + info.url, payload, px=self.ttl_ms)

    def remove(self, url: str) -> None:
        with self.ns.reachable(f"deregister server {url}"):
            self.ns.conn.delete(self.prefix + url)

    def alive(self) -> list[ServerInfo]:
        """Servers whose last heartbeat is younger than the TTL, sorted by URL."""
        with self.ns.reachable("list rollout servers"):
            keys = sorted(self.ns.conn.scan_iter(match=self.prefix + "*", count=500))
            values = self.ns.conn.mget(keys) if keys else []
        servers = []
        for value in values:
            if value is None:  # expired between SCAN and MGET
                continue
            servers.append(ServerInfo(**msgpack.unpackb(value)))
        return servers


class RouterAddress:
    """The router's URL, as the router announced it; ``None`` until it does (or after it went silent)."""

    def __init__(self, ns: Namespace, *, ttl_s: float = 10.0):
        self.ns, self.ttl_ms, self.key = ns, int(ttl_s * 1000), ns.key("router")

    def announce(self, url: str) -> None:
        with self.ns.reachable("announce the router"):
            self.ns.conn.set(self.key, url, px=self.ttl_ms)

    def withdraw(self, url: str) -> None:
        """Forget ``url`` unless a newer router has announced itself since."""
        with self.ns.reachable("withdraw the router"):
            if self.ns.conn.get(self.key) == url.encode():
                self.ns.conn.delete(self.key)

    def get(self) -> str | None:
        with self.ns.reachable("look up the router"):
            url = self.ns.conn.get(self.key)
        return url.decode() if url is not None else None
