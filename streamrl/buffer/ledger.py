"""The ledger: what became of every group, so a run can show it lost nothing and trained nothing twice.

Rollout side, counters kept by admission and the atomic put (``counters``)::

    admitted = accepted + abandoned (by reason) + expired + running - late

(``late``: a group put after its lease expired, so counted both as expired and accepted.)
Learner side, one outcome per group id (``ledger:outcome``)::

    accepted = trained + dropped (stale | dead | skipped | no_signal) + pending in the stream after the cursor

Outcomes are recorded step by step (``ledger:step:<version>``). A learner that resumes from an
older checkpoint no longer holds what it trained after it, so it rolls those steps' outcomes back
and records them again as it replays the stream from the checkpoint's cursor. An outcome recorded
twice without a rollback between is counted in ``twice``: that is the defect the ledger exists to
catch. A checkpoint settles the steps it covers: their ids are dropped and only their counts kept
(``settled``), so the ledger's size follows the steps since the last checkpoint, not the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrl.buffer.connection import Namespace

# KEYS: outcome hash, steps zset, counts hash, cursor, step list; ARGV: version, cursor, gid, outcome, ...
_RECORD = """
local twice = 0
for i = 3, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('RPUSH', KEYS[5], ARGV[i])
    redis.call('HINCRBY', KEYS[3], ARGV[i + 1], 1)
  else
    redis.call('HINCRBY', KEYS[3], 'twice', 1)
    redis.call('RPUSH', KEYS[1] .. ':twice', ARGV[i])
    twice = twice + 1
  end
end
redis.call('ZADD', KEYS[2], ARGV[1], KEYS[5])
redis.call('SET', KEYS[4], ARGV[2])
return twice
"""

# KEYS: outcome hash, steps zset, counts hash, admission's counters; ARGV: first version to forget
_ROLLBACK = """
local forgotten = 0
for _, step in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], ARGV[1], '+inf')) do
  for _, gid in ipairs(redis.call('LRANGE', step, 0, -1)) do
    local outcome = redis.call('HGET', KEYS[1], gid)
    if outcome then
      redis.call('HINCRBY', KEYS[3], outcome, -1)
      redis.call('HDEL', KEYS[1], gid)
      forgotten = forgotten + 1
    end
  end
  redis.call('DEL', step)
  redis.call('ZREM', KEYS[2], step)
end
-- admission counts a drop as the learner reads it, and every group after the cursor is read and judged again:
-- what the checkpoint's steps dropped is what holds no slot now (else a drop counted twice frees a slot twice)
for _, kind in ipairs({'stale', 'no_signal'}) do
  redis.call('HSET', KEYS[4], 'dropped_' .. kind, redis.call('HGET', KEYS[3], 'dropped:' .. kind) or '0')
end
return forgotten
"""

# KEYS: outcome hash, steps zset, counts hash; ARGV: last version to settle
_SETTLE = """
local settled = 0
for _, step in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])) do
  for _, gid in ipairs(redis.call('LRANGE', step, 0, -1)) do
    settled = settled + redis.call('HDEL', KEYS[1], gid)
  end
  redis.call('DEL', step)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
redis.call('HINCRBY', KEYS[3], 'settled', settled)
return settled
"""

OUTCOMES = ("trained", "dropped:stale", "dropped:dead", "dropped:skipped", "dropped:no_signal")


@dataclass
class LedgerReport:
    rollout: dict[str, int]
    learner: dict[str, int]
    running: int
    pending: int
    cursor: str
    problems: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # "VERSION@SERVER": why a server refused that push

    @property
    def balanced(self) -> bool:
        return not self.problems


class Ledger:
    def __init__(self, ns: Namespace):
        self.ns = ns
        self._outcome, self._steps, self._counts = ns.key("ledger:outcome"), ns.key("ledger:steps"), ns.key("ledger:counts")
        self._cursor = ns.key("ledger:cursor")
        self._record = ns.conn.register_script(_RECORD)
        self._rollback = ns.conn.register_script(_ROLLBACK)
        self._settle = ns.conn.register_script(_SETTLE)

    def record(self, version: int, cursor: str, outcomes: dict[str, str]) -> int:
        """Record what step ``version`` did with each group id read up to ``cursor``; returns repeats."""
        for outcome in outcomes.values():
            if outcome not in OUTCOMES:
                raise ValueError(f"unknown ledger outcome {outcome!r}; one of {OUTCOMES}")
        keys = [self._outcome, self._steps, self._counts, self._cursor, self.ns.key(f"ledger:step:{version}")]
        args = [version, cursor, *(x for pair in outcomes.items() for x in pair)]
        with self.ns.reachable(f"record step {version} in the ledger"):
            return int(self._record(keys=keys, args=args))

    def rollback(self, after_version: int, cursor: str) -> int:
        """Forget the outcomes of steps after ``after_version``, whose checkpoint resumes reading at ``cursor``, and
        set admission's drop counters to what the steps up to it dropped: the rest are read and judged again."""
        with self.ns.reachable("roll the ledger back"):
            keys = [self._outcome, self._steps, self._counts, self.ns.key("counters")]
            forgotten = int(self._rollback(keys=keys, args=[after_version + 1]))
            self.ns.conn.set(self._cursor, cursor)
            return forgotten

    def settle(self, through_version: int) -> int:
        """Steps a checkpoint covers can never be rolled back: keep only their counts.

        Their groups are trimmed from the stream and behind every cursor a learner can resume
        from, so no replay can bring them back; keeping each id would grow Redis with the run.
        Returns how many outcomes were folded into the counts.
        """
        with self.ns.reachable("settle the ledger"):
            return int(self._settle(keys=[self._outcome, self._steps, self._counts], args=[through_version]))

    def refuse(self, version: int, server: str, reason: str) -> None:
        """Record that ``server`` refused the push of ``version`` (its probe failed; it kept its weights)."""
        with self.ns.reachable("record a refused push"):
            self.ns.conn.hset(self.ns.key("ledger:refused"), f"{version}@{server}", reason)

    def report(self) -> LedgerReport:
        from streamrl.buffer.admission import COUNTERS

        conn = self.ns.conn
        with self.ns.reachable("read the ledger"):
            raw = {k.decode(): int(v) for k, v in conn.hgetall(self.ns.key("counters")).items()}
            counts = {k.decode(): int(v) for k, v in conn.hgetall(self._counts).items()}
            running = conn.zcard(self.ns.key("inflight"))
            cursor = (conn.get(self._cursor) or b"0-0").decode()
            outcomes = conn.hlen(self._outcome)
            twice_ids = [g.decode() for g in conn.lrange(self._outcome + ":twice", 0, 9)]
            pending = _count_after(conn, self.ns.key("groups"), cursor)
            refused = {k.decode(): v.decode() for k, v in conn.hgetall(self.ns.key("ledger:refused")).items()}
        rollout = {name: raw.pop(name, 0) for name in COUNTERS} | raw
        learner = {name: counts.get(name, 0) for name in (*OUTCOMES, "twice", "settled")}
        report = LedgerReport(rollout, learner, running, pending, cursor, refused=refused)
        started_gap = rollout["admitted"] - (rollout["accepted"] + rollout["abandoned"] + rollout["expired"] + running
                                             - rollout.get("late", 0))
        if started_gap:
            report.problems.append(f"{started_gap:+d} admitted groups are neither put, abandoned, expired nor running")
        settled = sum(learner[o] for o in OUTCOMES)
        gap = rollout["accepted"] - settled - pending
        if gap:
            report.problems.append(f"{gap:+d} pushed groups are neither trained, dropped nor pending (lost)"
                                   if gap > 0 else f"{-gap} more outcomes than pushed groups")
        if learner["twice"]:
            report.problems.append(f"{learner['twice']} groups were recorded twice (e.g. {', '.join(twice_ids)})")
        if outcomes + learner["settled"] != settled:
            report.problems.append(f"{outcomes} group outcomes and {learner['settled']} settled, "
                                   f"but counts sum to {settled}")
        return report


def _count_after(conn, key: str, cursor: str, chunk: int = 1000) -> int:
    """Entries in the stream after ``cursor``."""
    count, start = 0, f"({cursor}"
    while batch := conn.xrange(key, min=start, count=chunk):
        count += len(batch)
        start = f"({batch[-1][0].decode()}"
    return count
