"""The Redis side of streamrl: replay stream, admission control, server registry.

Knows nothing of models or torch; speaks only the wire types of ``streamrl.protocol``.
"""

from streamrl.buffer.admission import Admission
from streamrl.buffer.connection import BufferUnavailable, Namespace, connect
from streamrl.buffer.ledger import Ledger, LedgerReport
from streamrl.buffer.prompts import PromptClaims
from streamrl.buffer.redis_server import EmbeddedRedis
from streamrl.buffer.registry import RouterAddress, ServerInfo, ServerRegistry
from streamrl.buffer.stream import Entry, ReplayStream, StreamReader
from streamrl.buffer.version import PolicyVersion

__all__ = [
    "Admission",
    "BufferUnavailable",
    "EmbeddedRedis",
    "Entry",
    "Ledger",
    "LedgerReport",
    "Namespace",
    "PolicyVersion",
    "PromptClaims",
    "ReplayStream",
    "RouterAddress",
    "ServerInfo",
    "ServerRegistry",
    "StreamReader",
    "connect",
]
