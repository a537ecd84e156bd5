"""Sharding prompts among rollout workers: each dataset index is claimed once, and finished once.

Workers take global indices from one counter (index ``i`` is dataset row ``i mod N``
of epoch ``i // N``). A claim holds a lease, renewed while its prompt runs; putting
the prompt's group into the replay stream releases it in the same atomic step (see
``ReplayStream.put``), so a worker that dies mid-prompt leaves an expired claim that
the next worker takes over — nothing lost, nothing done twice. A restarted worker takes back its own
claims at once, without waiting for the lease.
"""

from __future__ import annotations

from streamrl.buffer.connection import LUA_NOW, Namespace

# Take a released or expired claim first (oldest first), else a fresh index.
_CLAIM = LUA_NOW + """
local index
local mine = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '+inf')
for _, i in ipairs(mine) do
  if redis.call('HGET', KEYS[2], i) == ARGV[1] and redis.call('HGET', KEYS[4], i) ~= ARGV[3] then
    index = i
    break
  end
end
if not index then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1)
  if #expired > 0 then index = expired[1] end
end
if not index then index = tostring(redis.call('INCR', KEYS[3]) - 1) end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), index)
redis.call('HSET', KEYS[2], index, ARGV[1])
redis.call('HSET', KEYS[4], index, ARGV[3])
return index
"""

# Extend this life's claims still held (an expired one may already be another worker's).
_RENEW = LUA_NOW + """
local renewed = 0
for i = 4, #ARGV do
  local deadline = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if deadline and tonumber(deadline) > now and redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[1]
      and redis.call('HGET', KEYS[3], ARGV[i]) == ARGV[2] then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[i])
    renewed = renewed + 1
  end
end
return renewed
"""


class PromptClaims:
    def __init__(self, ns: Namespace, worker: str, *, lease_s: float = 600.0, life: str = ""):
        """``worker`` names the worker across restarts; ``life`` tells this run of it from earlier ones."""
        self.ns, self.worker, self.life = ns, worker, life
        self.lease_ms = int(lease_s * 1000)
        self.keys = [ns.key("prompts:leases"), ns.key("prompts:owner"), ns.key("prompts:next"),
                     ns.key("prompts:life")]
        self._claim = ns.conn.register_script(_CLAIM)
        self._renew = ns.conn.register_script(_RENEW)

    def claim(self) -> int:
        """The next prompt index this worker should run."""
        with self.ns.reachable("claim a prompt"):
            return int(self._claim(keys=self.keys, args=[self.worker, self.lease_ms, self.life]))

    def renew(self, indices: list[int]) -> int:
        """Extend the leases of prompts this life still runs; returns how many were still held."""
        if not indices:
            return 0
        with self.ns.reachable(f"renew {len(indices)} prompt claims"):
            return int(self._renew(keys=[self.keys[0], self.keys[1], self.keys[3]],
                                   args=[self.worker, self.life, self.lease_ms, *indices]))

    def release(self, index: int) -> None:
        """Finish a prompt that produced no group (so it is not retried)."""
        with self.ns.reachable("release a prompt"):
            pipe = self.ns.conn.pipeline()
            pipe.zrem(self.keys[0], index)
            pipe.hdel(self.keys[1], index)
            pipe.hdel(self.keys[3], index)
            pipe.execute()

    def outstanding(self) -> int:
        with self.ns.reachable("count claimed prompts"):
            return self.ns.conn.zcard(self.keys[0])
