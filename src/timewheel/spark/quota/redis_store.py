"""A job's quota kept in Redis, so several jobs or processes with one API key share it.

``RedisStore("redis://HOST:PORT/DB", "my-api-key-quota", quota)`` is a
:class:`~timewheel.spark.quota.spec.QuotaStore` whose every operation is one call of one Lua
script (:data:`SCRIPT`), which Redis runs atomically: the weighted take, the refund and
the settle, the pause, the expiry of dead holders and the budget are the same
accounting as :class:`~timewheel.spark.quota.bucket.Bucket`'s, step for step (the tests run
one scenario through both).

What is shared, and for how long. Every job naming the quota shares its *rates*,
*concurrency* and *pauses*: the buckets, the slots held and the pause live under
``{timewheel-quota:NAME}`` (with ``...:holders`` and ``...:expiry``), and expire once no
one has used them for ``ttl_s`` plus any pause or granted slot left plus a minute (by
then they are what a fresh quota would be: every holder gone, the timelines past).
Jobs on one name divide its rates by what each asks, on one timeline: a grant is a slot
of it, sized by the holders asking and the job's ``Quota.weight``. The *budget* and
the *request cap* are counted per **job**: what a job took and spent, the pauses it
took and the budget or cap it was refused at live under
``{timewheel-quota:NAME}:job:JOB``, which expires :data:`KEEP_JOB_S` (a day) after the
job last used it. ``job`` is this store's own random id unless given; ``dispatch``
gives one per :class:`~timewheel.spark.quota.spec.Quota` object in the driver (so a
``timewheel pipeline`` run, ``--resume`` included, counts its budget from zero, as the
driver's own service does), and processes that mean to share one budget give the same
``job``. A take reads the caller's own ``budget`` and ``max_requests`` first: a store
refused at a budget refuses again only callers whose budget is no larger (a caller
with a larger budget, or none, goes on from what was spent). All the keys sit in one
hash slot, so it works on a Redis Cluster too.

To forget a quota before its keys expire: :meth:`RedisStore.reset` (this job's count and
the shared state) or :func:`reset_quota` (everything kept under the name, every job's
count included), also ``timewheel quota reset NAME --store redis://...``.

Time is the Redis server's (``TIME``), the one clock every process sharing the quota
agrees on; a test may pass ``clock=`` to drive it. The quota's numbers travel with each
call: jobs sharing a ``name`` should give the same rates and concurrency.

A Redis that refuses the connection, times out (``timeout_s``) or dies raises
:class:`~timewheel.spark.quota.spec.QuotaStoreError`; a job's tasks draw on it through a
:class:`~timewheel.spark.quota.failover.Failover`, which says
so in one line and falls back to the share this process was granted while the store was
up. A URL's password is never shown (``repr`` and errors print the URL through
:func:`~timewheel.spark.secrets.redact_url`), and a store is
not pickled (it holds connections): an executor makes its own from the URL (without the
password) and the password given apart from the plan.
"""

from __future__ import annotations

import re
import secrets
import urllib.parse
from typing import Any, Callable

from ..secrets import hide_url, redact_url
from .spec import (
    BURST_S,
    HELD_FRESH_S,
    HORIZON_S,
    LEASE_S,
    LONG_PAUSE_S,
    MAX_ASKS_PER_S,
    PACE_CUT,
    PACE_CUT_EVERY_S,
    PACE_FLOOR,
    PACE_RECOVERY,
    PROBE_AGAIN_S,
    PROBE_WAIT_S,
    SPREAD,
    TERM_S,
    Ask,
    Grant,
    Quota,
    QuotaState,
    QuotaStoreError,
)

__all__ = ["KEEP_JOB_S", "SCRIPT", "RedisStore", "reset_quota"]

#: A job's count (taken, spent) expires this long after the job last used it.
KEEP_JOB_S = 86400.0
#: The connections one process keeps to Redis, shared by its tasks.
_CONNECTIONS = 8

#: The one script every operation runs. KEYS: the shared state, its holders, their
#: expiry, the job's count, the holders asking lately, the job's holders whose calls
#: hold budget. ARGV: op, now ("" = the server's
#: TIME), the quota (rate, cost_rate, concurrency, budget, max_requests: 0 = none; ttl_s;
#: the job's weight; the timelines' burst; a slot wait; KEEP_JOB_S), then the
#: operation's own arguments.
SCRIPT = r"""
local S, H, E, B, A, HL = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local op = ARGV[1]
local now = tonumber(ARGV[2])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local rate, crate, conc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local budget, cap, ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local weight, BURST = tonumber(ARGV[9]), tonumber(ARGV[10])
local LEASE, KEEP_JOB = tonumber(ARGV[11]), tonumber(ARGV[12])
local LEFT_SHARE, PROBE_WAIT, PROBE_AGAIN = 8, @PROBE_WAIT@, @PROBE_AGAIN@
local TERM, MAX_ASKS, HORIZON, LONG_PAUSE, SPREAD = @TERM@
local HELD_FRESH = @HELD_FRESH@
local PACE_CUT, PACE_CUT_EVERY, PACE_FLOOR, PACE_RECOVERY = @PACE@
local a = {}
for i = 13, #ARGV do a[i - 12] = ARGV[i] end

local function f(x) return string.format('%.17g', x) end
-- S: what jobs sharing the name share (the timelines, the pause, the slots); B: this
-- job's own count (taken, spent, pauses) and the budget and cap it was refused at.
local v = redis.call('HMGET', S, 'tr', 'tc', 'stamp', 'paused', 'slots', 'pace', 'paced', 'tail',
                    'turn')
local w = redis.call('HMGET', B, 'taken', 'spent', 'xb', 'xc', 'pauses', 'gen', 'bs', 'bt',
                    'ratio', 'ph', 'pu')
local st = {tr = tonumber(v[1]) or (now - BURST), tc = tonumber(v[2]) or (now - BURST),
            stamp = tonumber(v[3]) or now, paused = tonumber(v[4]) or 0,
            slots = tonumber(v[5]) or 0, pace = tonumber(v[6]) or 1,
            paced = tonumber(v[7]) or -math.huge, tail = v[8] or '',
            turn = tonumber(v[9]) or -math.huge,
            taken = tonumber(w[1]) or 0, spent = tonumber(w[2]) or 0,
            xb = tonumber(w[3]) or 0, xc = tonumber(w[4]) or 0, pauses = tonumber(w[5]) or 0,
            -- which count this is: a new one (a restart lost the last) gets a name of its own
            gen = w[6] or ('g' .. f(now)), bs = tonumber(w[7]) or 0, bt = tonumber(w[8]) or 0,
            -- the job's largest ratio of cost to estimate, its probe's holder and end (Bucket)
            ratio = tonumber(w[9]) or 0, ph = w[10] or '', pu = tonumber(w[11]) or -math.huge}
local function save()
  redis.call('HSET', S, 'tr', f(st.tr), 'tc', f(st.tc), 'stamp', f(st.stamp),
             'paused', f(st.paused), 'slots', f(st.slots), 'pace', f(st.pace),
             'paced', f(st.paced), 'tail', st.tail, 'turn', f(st.turn))
  redis.call('HSET', B, 'taken', f(st.taken), 'spent', f(st.spent), 'xb', f(st.xb),
             'xc', f(st.xc), 'pauses', st.pauses, 'gen', st.gen, 'bs', f(st.bs), 'bt', f(st.bt),
             'ratio', f(st.ratio), 'ph', st.ph, 'pu', f(st.pu))
  -- Idle this long, the shared state is what a fresh one would be (every holder gone,
  -- no pause, the timelines in the past): it expires. The job's count expires KEEP_JOB
  -- after its last use.
  local keep = math.ceil(ttl + math.max(0, st.paused - now, st.tr - now, st.tc - now)) + 60
  for _, k in ipairs({S, H, E, A, HL}) do redis.call('EXPIRE', k, keep) end
  redis.call('EXPIRE', B, math.ceil(KEEP_JOB))
end
-- Refused before at this budget or cap (or a larger one): this caller's own budget
-- and cap are read, so one that gives more (or none) is not refused by the mark.
local function refused_before()
  return (budget > 0 and st.xb > 0 and budget <= st.xb) or (cap > 0 and st.xc > 0 and cap <= st.xc)
end
local function held(h, k) return tonumber(redis.call('HGET', H, h .. '|' .. k)) or 0 end
local function forget(h)
  st.slots = st.slots - held(h, 's')
  redis.call('HDEL', H, h .. '|r', h .. '|c', h .. '|s')
  redis.call('ZREM', E, h)
  redis.call('ZREM', A, h)
  redis.call('ZREM', HL, h)
end
local function reap()
  for _, h in ipairs(redis.call('ZRANGEBYSCORE', E, '-inf', now)) do forget(h) end
end
local function recover()
  st.pace = math.min(1, st.pace + math.max(0, now - st.stamp) * PACE_RECOVERY)
  st.stamp = math.max(st.stamp, now)
end
-- The earliest a timeline may be pulled back to: now, or a pause's end (as Bucket._floor).
local function floor() return math.max(now, st.paused + BURST) end
local function settle(owed)
  if owed ~= 0 then
    st.spent = st.spent + owed
    if crate > 0 then
      st.tc = math.max(st.tc + owed / (crate * st.pace), math.min(st.tc, floor()))
    end
  end
end
local function begin(h, owed)
  reap(); recover(); settle(owed)
  redis.call('ZADD', E, now + ttl, h)
end
local function add(h, k, x) redis.call('HINCRBYFLOAT', H, h .. '|' .. k, f(x)) end
-- The term of some busy holders, and a grant: a term of a rate, or its share among them
-- while the timeline is booked ahead (as spec.term_of and spec.grant_size).
local function term(holders) return math.max(TERM, holders / MAX_ASKS) end
local function size(r, holders, booked)
  if booked then return r * term(holders) * weight / math.max(1, holders) end
  return r * TERM
end
-- The holders that asked within the last two terms, this one now among them.
local function active(h)
  local window = 2 * term(redis.call('ZCARD', A))
  redis.call('ZADD', A, now, h)
  redis.call('ZREMRANGEBYSCORE', A, '-inf', '(' .. f(now - window))
  return redis.call('ZCARD', A)
end

-- Return what holder h took and did not use, at most what it holds (as Bucket.give_back).
local function give_back(h, requests, cost, slots)
  requests = math.max(0, math.min(requests, held(h, 'r')))
  cost = math.max(0, math.min(cost, held(h, 'c')))
  slots = math.max(0, math.min(slots, held(h, 's')))
  if h == st.tail then
    local low = floor()
    if rate > 0 then
      st.tr = math.max(st.tr - requests / (rate * st.pace), math.min(st.tr, low))
    end
    if crate > 0 then
      st.tc = math.max(st.tc - cost / (crate * st.pace), math.min(st.tc, low))
    end
  end
  st.taken = st.taken - requests
  st.spent = st.spent - cost
  st.slots = st.slots - slots
  add(h, 'r', -requests); add(h, 'c', -cost); add(h, 's', -slots)
end

if op == 'take' then
  local h, requests, cost = a[1], tonumber(a[2]), tonumber(a[3])
  local need_cost, slots, need_slots = tonumber(a[4]), tonumber(a[5]), tonumber(a[6])
  begin(h, tonumber(a[7]))
  if a[11] ~= '' and a[11] ~= st.gen then  -- it saw a count lost since (Bucket._learn)
    local spent, taken = tonumber(a[9]), tonumber(a[10])
    if spent > st.bs then st.spent = st.spent + spent - st.bs; st.bs = spent end
    if taken > st.bt then st.taken = st.taken + taken - st.bt; st.bt = taken end
  end
  st.ratio = math.max(st.ratio, tonumber(a[12]) or 0)
  local unused = tonumber(a[8])
  if unused > 0 then
    local back = math.max(0, math.min(unused, held(h, 'r')))
    st.taken = st.taken - back
    add(h, 'r', -back)
  end
  cost = math.max(cost, need_cost)
  local budget_left, cap_left = math.huge, math.huge
  if budget > 0 then budget_left = budget - st.spent end
  if cap > 0 then cap_left = cap - st.taken end
  local function reply(kind, n, c, s, wait, start, span, width)
    save()
    return {kind, tostring(n), f(c), tostring(s), f(wait), f(budget_left), f(cap_left),
            f(start), f(span), st.gen, f(st.ratio), f(width or 0)}
  end
  -- The holders whose calls out hold some of the budget, when they said so (Bucket);
  -- a job with no budget keeps none (and no command for it on each take).
  if budget > 0 then
    if tonumber(a[14]) > 1e-9 then
      redis.call('ZADD', HL, now, h)
    else
      redis.call('ZREM', HL, h)
    end
  end
  if a[13] == '1' and st.ratio > 0 then  -- the job knows a ratio: hold it instead (Bucket)
    return reply('wait', 0, 0, 0, PROBE_AGAIN, 0, 0)
  end
  -- A need the budget left does not cover waits while others' calls hold budget (a
  -- call's hold is its worst case: some of it may come back), said within HELD_FRESH.
  if budget_left < need_cost and cap_left >= 1 and not refused_before() then
    redis.call('ZREMRANGEBYSCORE', HL, '-inf', '(' .. f(now - HELD_FRESH))
    local others = redis.call('ZCARD', HL)
    if redis.call('ZSCORE', HL, h) then others = others - 1 end
    if others > 0 then return reply('wait', 0, 0, 0, TERM, 0, 0) end
  end
  if (refused_before() and need_cost > 0) or cap_left < 1 or budget_left < need_cost then
    if cap_left < 1 then st.xc = math.max(st.xc, cap) end
    if budget_left < need_cost then st.xb = math.max(st.xb, budget) end
    return reply('spent', 0, 0, 0, 0, 0, 0)
  end
  local r, c = rate * st.pace, crate * st.pace
  if now < st.paused and r == 0 and c == 0 then
    return reply('pause', 0, 0, 0, st.paused - now, 0, 0)
  end
  if a[13] == '1' and st.ratio == 0 then  -- the job's probe: one holder's at a time (Bucket)
    if st.ph ~= '' and st.ph ~= h and now < st.pu then
      return reply('wait', 0, 0, 0, PROBE_WAIT, 0, 0)
    end
    st.ph = h; st.pu = now + ttl
  end
  local free = math.huge
  if conc > 0 then
    free = conc - st.slots
    if free < need_slots then return reply('wait', 0, 0, 0, LEASE, 0, 0) end
  end
  local holders = active(h)
  -- Near a cap or a budget, a grant is at most an eighth of what is left: what tasks
  -- hold unspent when it runs out is then a few calls, not a grant each.
  local got_r = requests
  if cap > 0 then got_r = math.min(got_r, math.max(1, math.ceil(cap_left / LEFT_SHARE))) end
  -- Shared among the holders asking while it is booked ahead (as Bucket.take).
  local booked = (r > 0 and st.tr > now) or (c > 0 and st.tc > now)
  if r > 0 then
    got_r = math.min(got_r, math.max(1, math.floor(size(r, holders, booked))))
  end
  local n = math.max(got_r, 1)
  local got_c = math.min(cost, math.max(need_cost, budget_left / LEFT_SHARE))
  if c > 0 then got_c = math.min(got_c, math.max(need_cost, size(c, holders, booked))) end
  -- Its place on the timelines at the whole rate; asked again a span on (Bucket.take).
  local start, width_r, width_c, span = now, 0, 0, 0
  if r > 0 then width_r = n / r; start = math.max(start, st.tr - BURST) end
  if c > 0 then width_c = got_c / c; start = math.max(start, st.tc - BURST) end
  if start - now > HORIZON then  -- too far ahead: a turn in the queue (Bucket.take)
    local turn = math.max(now, st.turn, start - HORIZON)
    st.turn = turn + math.max(width_r, width_c)
    return reply('wait', 0, 0, 0, turn - now, 0, 0)
  end
  if r > 0 then st.tr = math.max(st.tr, start) + width_r end
  if c > 0 then st.tc = math.max(st.tc, start) + width_c end
  if r > 0 or c > 0 then
    st.tail = h
    -- Its span: its width while free, its share when booked (as Bucket.take).
    local spread = 0
    if booked then
      spread = SPREAD * math.max(width_r, width_c) * math.max(1, holders) / weight
      spread = math.min(term(holders), spread)
    end
    span = math.max(width_r, width_c, spread)
  end
  local got_s = 0
  if conc > 0 then got_s = math.min(slots, free) end
  st.taken = st.taken + n
  st.spent = st.spent + got_c
  st.slots = st.slots + got_s
  add(h, 'r', n); add(h, 'c', got_c); add(h, 's', got_s)
  budget_left = budget_left - got_c
  cap_left = cap_left - n
  return reply('ok', n, got_c, got_s, 0, start - now, span, math.max(width_r, width_c))
elseif op == 'give_back' then
  local h = a[1]
  begin(h, tonumber(a[5]))
  give_back(h, tonumber(a[2]), tonumber(a[3]), tonumber(a[4]))
  save()
  return 'ok'
elseif op == 'leave' then  -- give back what it did not use (as give_back), then forget it
  local h = a[1]
  begin(h, tonumber(a[2]))
  give_back(h, tonumber(a[3]) or 0, tonumber(a[4]) or 0, 0)
  forget(h)
  save()
  return 'ok'
elseif op == 'settle' then
  begin(a[1], tonumber(a[2]))
  st.ratio = math.max(st.ratio, tonumber(a[3]) or 0)
  save()
  return 'ok'
elseif op == 'pause' then
  recover()  -- then the timelines past the pause, and the pace cut (as Bucket.pause)
  if now - st.paced >= PACE_CUT_EVERY then
    st.pace = math.max(PACE_FLOOR, st.pace * (1 - PACE_CUT))
    st.paced = now
  end
  -- The pause is a gap put in the timelines now (as Bucket.pause).
  local upto = math.max(st.paused, now + tonumber(a[1]))
  local gap = upto - math.max(st.paused, now)
  st.paused = upto
  if gap > 0 then
    st.tr = math.max(st.tr, now) + gap
    st.tc = math.max(st.tc, now) + gap
  end
  st.stamp = math.max(st.stamp, st.paused)
  st.pauses = st.pauses + 1
  if tonumber(a[1]) > LONG_PAUSE then  -- remembered with what was asked (Bucket.pause)
    redis.call('HSET', S, 'ask', f(math.max(tonumber(a[2]), tonumber(a[1]))), 'askh', a[3],
               'asku', f(now + tonumber(a[1])))
  end
  save()
  return 'ok'
elseif op == 'state' then
  reap()
  save()
  local refused = 0
  if refused_before() then refused = 1 end
  -- the long pause in effect, as asked (Bucket.state)
  local asked = redis.call('HMGET', S, 'ask', 'askh', 'asku')
  if (tonumber(asked[3]) or -math.huge) <= now then asked = {'0', ''} end
  return {tostring(st.taken), f(st.spent), tostring(st.slots), tostring(redis.call('ZCARD', E)),
          f(math.max(0, st.paused - now)), tostring(refused), tostring(st.pauses),
          asked[1] or '0', asked[2] or ''}
elseif op == 'reset' then
  redis.call('DEL', S, H, E, B, A)
  return 'ok'
end
return redis.error_reply('no such operation ' .. tostring(op))
"""
# The pace's constants, as Bucket has them (see spec.PACE_CUT).
SCRIPT = (
    SCRIPT.replace(
        "@PACE@", ", ".join(map(repr, (PACE_CUT, PACE_CUT_EVERY_S, PACE_FLOOR, PACE_RECOVERY)))
    )
    .replace(
        "@TERM@", ", ".join(map(repr, (TERM_S, MAX_ASKS_PER_S, HORIZON_S, LONG_PAUSE_S, SPREAD)))
    )
    .replace("@PROBE_WAIT@", repr(PROBE_WAIT_S))
    .replace("@HELD_FRESH@", repr(HELD_FRESH_S))
    .replace("@PROBE_AGAIN@", repr(PROBE_AGAIN_S))
)

_NAME = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,200}$")


def _base(name: str) -> str:
    """The key every key of the quota ``name`` starts with (its hash tag: one slot)."""
    return "{timewheel-quota:" + name + "}"


def _check_url(url: Any) -> None:
    if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in (
        "redis",
        "rediss",
        "unix",
    ):
        shown = redact_url(url) if isinstance(url, str) else url
        raise ValueError(f"store must be a redis://HOST:PORT/DB URL, got {shown!r}")


def _client(url: str, timeout_s: float, password: str | None) -> Any:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    hide_url(url)  # a password in its query (redis-py reads one there): never written
    extra: dict[str, Any] = {} if password is None else {"password": password}
    # No retry inside the client: a script sent twice could return tokens twice. A few
    # connections, reused, for however many tasks a process runs: a task waits for one
    # (as long as for an answer) rather than failing, or opening one of its own.
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=_CONNECTIONS,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        **extra,
    )
    return redis.Redis(connection_pool=pool)


def _close(client: Any) -> None:
    """Close ``client`` and its pool's connections (a client made on a pool of its own
    leaves the pool open when closed: its sockets would wait for the collector)."""
    client.close()
    client.connection_pool.disconnect()


def check_reachable(url: str, *, password: str | None = None, timeout_s: float = 5.0) -> None:
    """QuotaStoreError unless the Redis at ``url`` answers a PING within ``timeout_s``:
    the driver asks before a job starts, so a store that is mistyped or down stops the
    job with that reason instead of leaving its tasks waiting for it."""
    import redis

    _check_url(url)
    client = _client(url, timeout_s, password)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise QuotaStoreError(
            f"the quota store {redact_url(url)} cannot be reached: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        _close(client)


def reset_quota(url: str, name: str, *, password: str | None = None, timeout_s: float = 5.0) -> int:
    """Forget everything the Redis at ``url`` keeps for the quota ``name``: the state
    the jobs share and every job's count (so a budget refused is gone too). Returns
    the number of keys deleted. Jobs drawing on the quota meanwhile start it afresh."""
    import redis

    _check_url(url)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"name must be 1 to 200 letters, digits or _.:@/+-, got {name!r}")
    client = _client(url, timeout_s, password)
    try:
        keys = list(client.scan_iter(match=_base(name) + "*", count=1000))
        return int(client.delete(*keys)) if keys else 0
    except redis.RedisError as exc:
        raise QuotaStoreError(f"Redis at {redact_url(url)}: {type(exc).__name__}: {exc}") from None
    finally:
        _close(client)


class RedisStore:
    """A quota named ``name`` in the Redis at ``url`` (``redis://``, ``rediss://``,
    ``unix://``); the ``redis`` client is needed (the ``quota`` extra)."""

    def __init__(
        self,
        url: str,
        name: str,
        quota: Quota,
        *,
        clock: Callable[[], float] | None = None,
        timeout_s: float = 5.0,
        password: str | None = None,
        job: str | None = None,
    ) -> None:
        _check_url(url)
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"name must be 1 to 200 letters, digits or _.:@/+-, got {name!r}")
        if not isinstance(quota, Quota):
            raise TypeError(f"quota must be a Quota, got {quota!r}")
        if job is None:
            job = secrets.token_hex(8)
        elif not isinstance(job, str) or not _NAME.match(job):
            raise ValueError(f"job must be 1 to 200 letters, digits or _.:@/+-, got {job!r}")
        self.url = url
        self.name = name
        self.quota = quota
        self.job = job
        self.clock = clock
        self._redis = _client(url, timeout_s, password)
        self._script = self._redis.register_script(SCRIPT)
        base = _base(name)
        self._keys = [
            base,
            base + ":holders",
            base + ":expiry",
            base + ":job:" + job,
            base + ":active",
            base + ":job:" + job + ":held",
        ]
        q = quota
        self._quota_args = [
            repr(float(q.rate or 0)),
            repr(float(q.cost_rate or 0)),
            str(q.concurrency or 0),
            repr(float(q.budget or 0)),
            str(q.max_requests or 0),
            repr(float(q.ttl_s)),
            repr(float(q.weight)),
            repr(BURST_S),
            repr(LEASE_S),
            repr(KEEP_JOB_S),
        ]

    def __repr__(self) -> str:
        return f"RedisStore({redact_url(self.url)!r}, {self.name!r}, job={self.job!r})"

    def __reduce__(self) -> Any:
        raise TypeError(
            "a RedisStore holds connections and is not pickled: give the executors its URL "
            "(without a password) and name"
        )

    def _run(self, op: str, *args: Any) -> Any:
        import redis

        now = "" if self.clock is None else repr(float(self.clock()))
        argv = [op, now, *self._quota_args, *args]
        try:
            return self._script(keys=self._keys, args=argv)
        except redis.RedisError as exc:
            raise QuotaStoreError(
                f"Redis at {redact_url(self.url)}: {type(exc).__name__}: {exc}"
            ) from None

    @staticmethod
    def _f(x: Any) -> float:
        return float(x.decode() if isinstance(x, bytes) else x)

    def take(self, holder: str, ask: Ask) -> Grant:
        requests, cost, need_cost, slots, need_slots, owed, unused = ask[:7]
        got = self._run(
            "take",
            holder,
            int(requests),
            repr(float(cost)),
            repr(float(need_cost)),
            int(slots),
            int(need_slots),
            repr(float(owed)),
            int(unused),
            repr(float(ask.seen_spent)),
            int(ask.seen_taken),
            ask.gen,
            repr(float(ask.ratio)),
            "1" if ask.probe else "0",
            repr(float(ask.held)),
        )
        kind = got[0].decode()
        n, c, s, wait, budget_left, cap_left, start, span = (self._f(x) for x in got[1:9])
        count = got[9].decode()
        ratio, width = self._f(got[10]), self._f(got[11])
        if kind == "spent":
            return Grant(spent=True, budget_left=budget_left, requests_left=cap_left, gen=count)
        if kind in ("wait", "pause"):
            return Grant(
                wait_s=wait,
                paused=kind == "pause",
                budget_left=budget_left,
                requests_left=cap_left,
                ratio=ratio,
            )
        return Grant(
            requests=int(n),
            cost=c,
            slots=int(s),
            budget_left=budget_left,
            requests_left=cap_left,
            start_s=start,
            span_s=span,
            width_s=width,
            gen=count,
            ratio=ratio,
        )

    def give_back(
        self, holder: str, requests: int = 0, cost: float = 0.0, slots: int = 0, owed: float = 0.0
    ) -> None:
        self._run(
            "give_back", holder, int(requests), repr(float(cost)), int(slots), repr(float(owed))
        )

    def leave(self, holder: str, owed: float = 0.0, requests: int = 0, cost: float = 0.0) -> None:
        self._run("leave", holder, repr(float(owed)), int(requests), repr(float(cost)))

    def settle(self, holder: str, owed: float, ratio: float = 0.0) -> None:
        self._run("settle", holder, repr(float(owed)), repr(float(ratio)))

    def pause(self, seconds: float, asked: float = 0.0, header: str = "") -> None:
        self._run("pause", repr(float(seconds)), repr(float(asked)), header)

    def state(self) -> QuotaState:
        got = self._run("state")
        taken, spent, slots, holders, paused, exhausted, pauses, asked = (
            self._f(x) for x in got[:8]
        )
        asked_by = got[8].decode() if isinstance(got[8], bytes) else str(got[8])
        return QuotaState(
            requests_taken=int(taken),
            cost_spent=spent,
            slots_used=int(slots),
            holders=int(holders),
            paused_for_s=paused,
            exhausted=bool(exhausted),
            pauses=int(pauses),
            asked_pause_s=asked,
            asked_by=asked_by,
        )

    def reset(self) -> None:
        """Forget this job's count (what it took and spent) and the state the jobs
        naming the quota share (what is held and paused); other jobs' counts stay
        (:func:`reset_quota` forgets them too)."""
        self._run("reset")

    def close(self) -> None:
        """Close the connections (redis-py makes new ones in a forked child by itself)."""
        _close(self._redis)
