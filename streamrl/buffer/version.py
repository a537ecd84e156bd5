"""The learner's policy version: the number of optimizer updates in its weights."""

from __future__ import annotations

from streamrl.buffer.connection import Namespace


class PolicyVersion:
    def __init__(self, ns: Namespace):
        self.ns = ns
        self.key = ns.key("version")

    def get(self) -> int:
        with self.ns.reachable("read the policy version"):
            value = self.ns.conn.get(self.key)
        return int(value) if value is not None else 0

    def set(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        with self.ns.reachable("set the policy version"):
            self.ns.conn.set(self.key, version)
