"""Connecting to Redis, and the key layout of one run (``srl:{run}:...``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry


class BufferUnavailable(ConnectionError):
    """Redis could not be reached even after retrying with backoff."""


def connect(url: str, *, retries: int = 8, retry_cap_s: float = 2.0) -> redis.Redis:
    """A client that retries lost connections with exponential backoff.

    Every write streamrl makes is idempotent (see ``ReplayStream.put``), so
    re-sending a command whose reply was lost never duplicates data.
    """
    return redis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=retry_cap_s, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        socket_connect_timeout=5,
        socket_keepalive=True,
        health_check_interval=30,
    )


def redacted(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:" if parts.username else ":"
    return urlunsplit(parts._replace(netloc=f"{user}***@{netloc}"))


@dataclass(frozen=True)
class Namespace:
    """One run's keys on one Redis connection."""

    conn: redis.Redis
    run: str
    url: str  # for messages; password redacted

    @classmethod
    def open(cls, url: str, run: str, *, retries: int = 8, retry_cap_s: float = 2.0) -> Namespace:
        return cls(connect(url, retries=retries, retry_cap_s=retry_cap_s), run, redacted(url))

    def key(self, name: str) -> str:
        return f"srl:{self.run}:{name}"

    @contextlib.contextmanager
    def reachable(self, action: str) -> Iterator[None]:
        """Turn a give-up after retries into one clear error naming the server and the action."""
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise BufferUnavailable(f"Redis at {self.url} unreachable while trying to {action}: {e}") from e


# The opening of a Lua script that needs the time: ``now``, Redis's clock in ms (one clock for every worker).
LUA_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
