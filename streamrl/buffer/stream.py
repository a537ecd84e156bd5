"""The replay stream: finished groups, in order, tagged with the policy versions that made them.

Writers (rollout workers) ``put`` groups; the learner reads them through a
``StreamReader`` whose cursor is saved in its checkpoint, so a restarted learner
continues exactly after the last entry it applied. The stream is trimmed only up
to a cursor that a checkpoint covers. Entries that fail to decode are copied to
the dead-letter stream with the reason, counted, and skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from streamrl.buffer.connection import Namespace
from streamrl.protocol import SCHEMA, Group, WireError, decode_group, encode_group

START = "0-0"

# Atomic put: remember the group id (so a retry after a lost reply is a no-op; the
# writer forgets it once the reply arrives, after which it never retries), append
# the entry, close the admission lease, finish the prompt's claim and count it —
# all or nothing. A put whose lease had already expired is counted as late, so the
# ledger does not count that group twice.
_PUT = """
local seen = redis.call('GET', KEYS[2])
if seen then return {seen, 0} end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 4))
redis.call('SET', KEYS[2], id, 'EX', ARGV[1])
if redis.call('ZREM', KEYS[3], ARGV[2]) == 0 then redis.call('HINCRBY', KEYS[4], 'late', 1) end
redis.call('HINCRBY', KEYS[4], 'accepted', 1)
if ARGV[3] ~= '' then
  redis.call('ZREM', KEYS[5], ARGV[3])
  redis.call('HDEL', KEYS[6], ARGV[3])
  redis.call('HDEL', KEYS[7], ARGV[3])
end
return {id, 1}
"""

# Idempotent dead-lettering: a reader replaying from an old cursor must not
# file the same bad entry twice.
_DEAD = """
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[1], '*', 'src', ARGV[1], 'reason', ARGV[2], 'd', ARGV[3])
redis.call('HINCRBY', KEYS[3], 'dead', 1)
return 1
"""


@dataclass(frozen=True)
class Entry:
    id: str
    group: Group


class ReplayStream:
    """Write side, plus the length/trim operations the learner needs."""

    def __init__(self, ns: Namespace, *, dedupe_ttl_s: int = 3600):
        self.ns = ns
        self.key = ns.key("groups")
        self.dedupe_ttl_s = dedupe_ttl_s
        self._put = ns.conn.register_script(_PUT)

    def put(self, group: Group, prompt_index: int | None = None) -> str:
        """Append a group; returns its entry id.

        A put retried after its reply was lost (by the client, or by a caller that got
        ``BufferUnavailable``) stores the group once: its id is remembered until the reply
        arrives, and for ``dedupe_ttl_s`` if it never does. Remembering every id for good
        would grow Redis by ~100 bytes a group for the life of the run.
        ``prompt_index``: the claimed prompt (``PromptClaims``) this group finishes.
        """
        payload = encode_group(group)
        v_min, v_max = group.version_range()
        fields = ["d", payload, "gid", group.group_id, "v_min", v_min, "v_max", v_max,
                  "ntok", group.num_tokens, "schema", SCHEMA]
        keys = [self.key, self.ns.key(f"gid:{group.group_id}"), self.ns.key("inflight"), self.ns.key("counters"),
                self.ns.key("prompts:leases"), self.ns.key("prompts:owner"), self.ns.key("prompts:life")]
        claim = "" if prompt_index is None else prompt_index
        with self.ns.reachable(f"put group {group.group_id}"):
            entry_id, _fresh = self._put(keys=keys, args=[self.dedupe_ttl_s, group.group_id, claim, *fields])
        try:  # acknowledged: no retry of this put can follow
            self.ns.conn.unlink(keys[1])
        except (redis.ConnectionError, redis.TimeoutError):
            pass  # the put stands; the id expires after dedupe_ttl_s
        return entry_id.decode()

    def __len__(self) -> int:
        with self.ns.reachable("measure the replay stream"):
            return self.ns.conn.xlen(self.key)

    def trim(self, covered_cursor: str) -> int:
        """Drop entries up to and including ``covered_cursor`` (one a checkpoint covers)."""
        ms, seq = (int(x) for x in covered_cursor.split("-"))
        with self.ns.reachable("trim the replay stream"):
            return self.ns.conn.xtrim(self.key, minid=f"{ms}-{seq + 1}", approximate=False)


class StreamReader:
    """Reads valid groups in order from a cursor that can be saved and restored."""

    def __init__(self, ns: Namespace, cursor: str = START):
        self.ns = ns
        self.key = ns.key("groups")
        self.cursor = _check_cursor(cursor)
        self._dead = ns.conn.register_script(_DEAD)

    def read(self, count: int, block_ms: int | None = None) -> list[Entry]:
        """Up to ``count`` entries after the cursor, waiting up to ``block_ms`` for the first.

        The cursor moves past every entry returned and every malformed entry skipped,
        so ``cursor`` is always the id of the last entry this reader has dealt with.
        """
        with self.ns.reachable("read the replay stream"):
            reply = self.ns.conn.xread({self.key: self.cursor}, count=count, block=block_ms)
        entries = []
        for raw_id, fields in reply[0][1] if reply else []:
            entry_id = raw_id.decode()
            try:
                entries.append(Entry(entry_id, _decode_entry(fields)))
            except WireError as e:
                self.dead_letter(entry_id, str(e), fields.get(b"d", b""))
            self.cursor = entry_id
        return entries

    def dead_letter(self, entry_id: str, reason: str, payload: bytes = b"") -> None:
        """File an entry that cannot be used (idempotent: replaying it files it once)."""
        keys = [self.ns.key("dead"), self.ns.key("dead_ids"), self.ns.key("counters")]
        with self.ns.reachable(f"dead-letter entry {entry_id}"):
            self._dead(keys=keys, args=[entry_id, reason, payload])


def _decode_entry(fields: dict[bytes, bytes]) -> Group:
    """Decode and cross-check the entry's header fields against its payload."""
    if b"d" not in fields:
        raise WireError("entry has no payload field 'd'")
    try:
        schema = int(fields.get(b"schema", b"-1"))
        header = tuple(int(fields[k]) for k in (b"v_min", b"v_max", b"ntok"))
        gid = fields[b"gid"].decode()
    except (KeyError, ValueError, UnicodeDecodeError) as e:
        raise WireError(f"entry header is malformed: {e!r}") from None
    if schema != SCHEMA:
        raise WireError(f"entry schema {schema} is not {SCHEMA}")
    group = decode_group(fields[b"d"])
    if (*group.version_range(), group.num_tokens) != header or gid != group.group_id:
        raise WireError("entry header (gid, v_min, v_max, ntok) disagrees with its payload")
    return group


def _check_cursor(cursor: str) -> str:
    ms, sep, seq = cursor.partition("-")
    if not (sep and ms.isdigit() and seq.isdigit()):
        raise ValueError(f"stream cursor must look like '<ms>-<seq>', got {cursor!r}")
    return cursor
