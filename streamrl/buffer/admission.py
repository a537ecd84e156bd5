"""Admission control: a rollout worker starts a group only while its data cannot go stale.

AReaL's rule (ARCHITECTURE §3): start a new group only while

    accepted + running < (max_staleness + V + 1) * groups_per_step

where ``V`` is the learner's policy version (``max_staleness`` is the bound given, or the one the learner
publishes with ``max_staleness: auto``), ``accepted`` counts groups ever put
into the replay stream (less those the learner dropped as stale, dead-lettered (``dead``: counted once
per entry, whoever reads it again) or, with dynamic sampling, as carrying no signal: they will never be
trained, so they must not hold slots, or a burst of such data would stall the run)
and ``running`` counts groups admitted but not yet put.
Running groups hold a lease that their worker renews while it runs them, so a
group slower than the lease keeps its slot, and a worker that dies mid-group does
not hold its slot forever. A worker restarted under its name gives back at once the
slots of its earlier life, whose groups will never be put (``reclaim``): group ids
begin with ``NAME/LIFE/`` (``group_id``). Check-and-admit is one Lua script: no two
workers can take the last slot.
"""

from __future__ import annotations

import uuid

from streamrl.buffer.connection import LUA_NOW, Namespace


def _full(staleness_arg: int, per_step_arg: int) -> str:
    """Lua that sets ``running`` (groups admitted, not yet put) and ``full`` (no slot free under the bound in force,
    the one the learner publishes or else ``ARGV[staleness_arg]``; ``ARGV[per_step_arg]``: groups per step)."""
    return f"""
local running = redis.call('ZCARD', KEYS[1])
local accepted = tonumber(redis.call('HGET', KEYS[2], 'accepted') or '0')
  - tonumber(redis.call('HGET', KEYS[2], 'dropped_stale') or '0')
  - tonumber(redis.call('HGET', KEYS[2], 'dropped_no_signal') or '0')
  - tonumber(redis.call('HGET', KEYS[2], 'dead') or '0')
local version = tonumber(redis.call('GET', KEYS[3]) or '0')
local bound = tonumber(redis.call('GET', KEYS[4]) or ARGV[{staleness_arg}])
local full = accepted + running >= (bound + version + 1) * tonumber(ARGV[{per_step_arg}])
"""


_ADMIT = LUA_NOW + """
local expired = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if expired > 0 then redis.call('HINCRBY', KEYS[2], 'expired', expired) end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  return 1
end""" + _full(3, 4) + """if full then
  redis.call('HINCRBY', KEYS[2], 'refused', 1)
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HINCRBY', KEYS[2], 'admitted', 1)
return 1
"""

# Read-only: whether no group runs and none may start before the version moves (a lease past its deadline still
# counts as running here, until a worker's next admit expires it).
_HELD = _full(1, 2) + """if full and running == 0 then return 1 end
return 0
"""

_RELEASE = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'abandoned', 1)
  redis.call('HINCRBY', KEYS[2], 'abandoned:' .. ARGV[2], 1)
  return 1
end
return 0
"""

# Give back the slots of groups whose id begins with this worker's name but not its life.
_RECLAIM = """
local taken = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if string.sub(id, 1, #ARGV[1]) == ARGV[1] and string.sub(id, 1, #ARGV[2]) ~= ARGV[2] then
    redis.call('ZREM', KEYS[1], id)
    taken = taken + 1
  end
end
if taken > 0 then
  redis.call('HINCRBY', KEYS[2], 'abandoned', taken)
  redis.call('HINCRBY', KEYS[2], 'abandoned:worker_restarted', taken)
end
return taken
"""

# Extend the leases still held; one already past its deadline is left to expire.
_RENEW = LUA_NOW + """
local renewed = 0
for i = 2, #ARGV do
  local deadline = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if deadline and tonumber(deadline) > now then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
    renewed = renewed + 1
  end
end
return renewed
"""

RETRY_S = 0.5  # a refused worker tries again after this long, or as soon as the learner publishes a version

COUNTERS = ("admitted", "accepted", "abandoned", "expired", "dropped_stale", "dropped_no_signal", "dead")


class Admission:
    def __init__(self, ns: Namespace, *, max_staleness: int, groups_per_step: int, lease_s: float = 600.0):
        if max_staleness < 0 or groups_per_step < 1:
            raise ValueError("admission needs max_staleness >= 0 and groups_per_step >= 1")
        self.ns = ns
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.lease_ms = int(lease_s * 1000)
        self._keys = [ns.key("inflight"), ns.key("counters"), ns.key("version"), ns.key("staleness_bound")]
        self._kept_key = ns.key("staleness_kept")
        self._trust_key = ns.key("staleness_late_trusted_from")
        self._admit = ns.conn.register_script(_ADMIT)
        self._release = ns.conn.register_script(_RELEASE)
        self._renew = ns.conn.register_script(_RENEW)
        self._reclaim = ns.conn.register_script(_RECLAIM)
        self._held = ns.conn.register_script(_HELD)

    def published(self) -> int | None:
        """The bound the learner published (``max_staleness: auto``), if it did."""
        with self.ns.reachable("read the staleness bound"):
            live = self.ns.conn.get(self._keys[3])
        return None if live is None else int(live)

    def bound(self) -> int:
        """The staleness bound in force: the learner's (``max_staleness: auto``), else the one given."""
        published = self.published()
        return self.max_staleness if published is None else published

    def set_bound(self, bound: int) -> None:
        """The learner moves the bound (``max_staleness: auto``); every admission from now on reads it."""
        if bound < 0:
            raise ValueError(f"a staleness bound is >= 0, got {bound}")
        with self.ns.reachable("set the staleness bound"):
            self.ns.conn.set(self._keys[3], bound)

    def kept_bounds(self) -> dict[int, int]:
        """The bounds the learner keeps for groups admitted before an easing or a revert: the version of the move
        -> the bound it left (``max_staleness: auto``), kept here so that a resumed learner keeps them too."""
        with self.ns.reachable("read the kept staleness bounds"):
            kept = self.ns.conn.hgetall(self._kept_key)
        return {int(at): int(old) for at, old in kept.items()}

    def set_kept_bounds(self, kept: dict[int, int]) -> None:
        with self.ns.reachable("record the kept staleness bounds"):
            pipe = self.ns.conn.pipeline()
            pipe.delete(self._kept_key)
            if kept:
                pipe.hset(self._kept_key, mapping=kept)
            pipe.execute()

    def late_trusted_from(self) -> int | None:
        """The version from which the learner trains groups past the bound (``off_policy.auto.late: keep``), None
        while it trains none: kept here so that a resumed learner trusts what the one before it did, and no more."""
        with self.ns.reachable("read when late groups are trusted"):
            at = self.ns.conn.get(self._trust_key)
        return None if at is None else int(at)

    def set_late_trusted_from(self, at: int | None) -> None:
        with self.ns.reachable("record when late groups are trusted"):
            if at is None:
                self.ns.conn.delete(self._trust_key)
            else:
                self.ns.conn.set(self._trust_key, at)

    def try_admit(self, group_id: str) -> bool:
        """Take a slot for ``group_id`` (or renew its lease). False when the bound in force is reached."""
        args = [group_id, self.lease_ms, self.max_staleness, self.groups_per_step]
        with self.ns.reachable(f"admit group {group_id}"):
            return bool(self._admit(keys=self._keys, args=args))

    def renew(self, group_ids: list[str]) -> int:
        """Extend the leases of groups still running; returns how many were still held."""
        if not group_ids:
            return 0
        with self.ns.reachable(f"renew {len(group_ids)} group leases"):
            return int(self._renew(keys=self._keys[:1], args=[self.lease_ms, *group_ids]))

    def abandon(self, group_id: str, reason: str = "failed") -> bool:
        """Give back the slot of a group that will never be put, counted under ``abandoned:<reason>``."""
        with self.ns.reachable(f"abandon group {group_id}"):
            return bool(self._release(keys=self._keys[:2], args=[group_id, reason]))

    def reclaim(self, worker: str, life: str) -> int:
        """Give back the slots of groups ``worker`` admitted in an earlier life (it died mid-group and was
        restarted: they will never be put); returns how many. A group put late still counts as ``late``."""
        with self.ns.reachable(f"reclaim the slots of {worker}'s earlier life"):
            return int(self._reclaim(keys=self._keys[:2], args=[f"{worker}/", f"{worker}/{life}/"]))

    def refusals(self) -> int:
        """How many times the bound has turned a worker away (``try_admit`` refused; a held worker retries every
        ``RETRY_S``): while it does, the bound, not generation, limits the groups in flight."""
        with self.ns.reachable("read the admission refusals"):
            return int(self.ns.conn.hget(self._keys[1], "refused") or 0)

    def held(self) -> bool:
        """Whether generation is held: every slot is taken and no group runs, so no worker starts one (nor any
        server computes for one) until the learner publishes a version."""
        with self.ns.reachable("read whether admission holds generation"):
            return bool(self._held(keys=self._keys, args=[self.max_staleness, self.groups_per_step]))

    def running(self) -> int:
        with self.ns.reachable("count running groups"):
            return self.ns.conn.zcard(self._keys[0])

    def counters(self) -> dict[str, int]:
        """Every ledger counter of the run, zero when never touched."""
        with self.ns.reachable("read the admission counters"):
            raw = self.ns.conn.hgetall(self._keys[1])
        counts = {k.decode(): int(v) for k, v in raw.items()}
        return {name: counts.pop(name, 0) for name in COUNTERS} | counts

    def count_dropped_stale(self, n: int = 1) -> None:
        """The learner's guard dropped ``n`` groups past the staleness bound."""
        with self.ns.reachable("count dropped groups"):
            self.ns.conn.hincrby(self._keys[1], "dropped_stale", n)

    def count_dropped_no_signal(self, n: int = 1) -> None:
        """The learner left out ``n`` groups whose rewards were all equal (dynamic sampling)."""
        with self.ns.reachable("count dropped groups"):
            self.ns.conn.hincrby(self._keys[1], "dropped_no_signal", n)


def group_id(worker: str, life: str) -> str:
    """A new group's id, naming the worker and the life of it that admits the group (see ``reclaim``)."""
    return f"{worker}/{life}/{uuid.uuid4().hex}"
