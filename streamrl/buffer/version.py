"""The learner's policy version: the number of optimizer updates in its weights.

Every new version is also published on a channel, so a rollout worker waiting for admission wakes
the moment the learner's step frees slots instead of polling for it.
"""

from __future__ import annotations

import time

import redis

from streamrl.buffer.connection import Namespace


class PolicyVersion:
    def __init__(self, ns: Namespace):
        self.ns = ns
        self.key = ns.key("version")
        self.channel = ns.key("version:changed")

    def get(self) -> int:
        with self.ns.reachable("read the policy version"):
            value = self.ns.conn.get(self.key)
        return int(value) if value is not None else 0

    def set(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        with self.ns.reachable("set the policy version"):
            self.ns.conn.pipeline().set(self.key, version).publish(self.channel, version).execute()

    def watch(self) -> VersionWatch:
        return VersionWatch(self)


class VersionWatch:
    """Waits for the next published version. One waiter at a time (a pub/sub connection is not shared)."""

    def __init__(self, version: PolicyVersion):
        self.pubsub = version.ns.conn.pubsub(ignore_subscribe_messages=True)
        self.channel = version.channel
        self.pubsub.subscribe(self.channel)

    def wait(self, timeout_s: float) -> bool:
        """True when a new version was published within ``timeout_s``. Redis unreachable: sleeps, False."""
        deadline = time.monotonic() + timeout_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                if self.pubsub.get_message(timeout=left) is not None:  # None: nothing, or a (re)subscribe reply
                    return True
        except redis.RedisError:
            time.sleep(max(deadline - time.monotonic(), 0.0))  # the caller's next Redis call reports the outage
        return False

    def close(self) -> None:
        self.pubsub.close()
