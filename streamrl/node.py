"""The address of the node this process runs on, as other nodes reach it.

A part that Ray placed is told its node's address by the actor that started it (Ray knows it:
``ray.util.get_node_ip_address()``); a part started by hand is on loopback unless its config names
an address. Every address a part binds or announces and that the config leaves empty comes from here.
"""

from __future__ import annotations

import os

NODE_IP_ENV = "STREAMRL_NODE_IP"


def node_address(configured: str | None = None) -> str:
    """``configured`` if the config names one, else this node's address under Ray, else 127.0.0.1."""
    return configured or os.environ.get(NODE_IP_ENV) or "127.0.0.1"
