"""The cluster's shared state in Redis: the worker registry, KV-block leases and request records.

Every update that must not race is one Lua script, and every script takes its time from
Redis TIME, so all processes judge leases and expiries by one clock. Scripts name keys from
the prefix, so the store needs a single (non-cluster) Redis.

Keys, under the prefix (<role> = prefill | decode):
    workers:<role>          ZSET worker_id -> registration expiry (ms, Redis clock)
    worker:<role>:<id>      HASH of WorkerInfo fields, expiring with the registration
    leases:<id>             ZSET request_id -> lease expiry (ms); decode workers
    lease_blocks:<id>       HASH request_id -> "<num_blocks>:<worker epoch>"
    request:<id>            HASH state, history, t_<state>, counts, workers, router, error, trace_id (traced)
    prefixes:<role>:<id>    SET hex prefix hashes of the prompt chunks the worker's cache holds (expires
                            with the registration)
    routers                 ZSET router_id -> registration expiry (ms)
    router_requests:<id>    SET request ids the router has in flight (non-terminal records); expires with
                            its newest record's in-flight TTL
    drain:<id>              STRING the epoch an operator asked to drain (python -m router.status drain)
    drained:<role>:<id>     STRING the epoch that has drained (the worker's answer)
    reaped_at               STRING Redis time (ms) of the last reap_routers() by anyone

A worker's registry keys are under its role, so that Redis ACLs (common/redis_acl.py) can give each
role's user its own keys only: a worker registers only as its role, and a router not at all. The role
in a registration is the one its keys are under; reads never write (expired entries are dropped by the
workers' own heartbeats, expired leases by the router's reservations).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from enum import StrEnum

import redis


# Every router (and, without Redis ACLs, every worker) reaps dead routers with each heartbeat (0.5 s): a
# longer gap since anyone did means Redis was out of reach for everyone (or no router was running), and the
# routers' registrations do not run down for what of the gap is more than this (a router's registration
# TTL, 3 s, is longer than it).
REAP_MAX_GAP_S = 1.0


class StateUnavailable(RuntimeError):
    """Redis could not be asked: down, restarting, timed out, or it refused the command (out of
    memory, a read-only replica, an ACL without the permission). The message says which."""


class StatePermissionDenied(StateUnavailable):
    """Redis refused a command or key to this ACL user (NOPERM): not this role's to do."""


WORKER_ROLES = ("prefill", "decode")


class RequestState(StrEnum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATES = frozenset({RequestState.FINISHED, RequestState.FAILED, RequestState.CANCELLED})


@dataclass
class WorkerInfo:
    worker_id: str
    role: str  # "prefill" | "decode"
    address: str  # host:port of the worker's main gRPC service
    kv_address: str  # decode only: host:port of its KV-transfer service; "" for prefill
    epoch: str  # new at every process start
    model_id: str  # fingerprint of the loaded weights
    total_blocks: int
    free_blocks: int
    num_running: int
    num_waiting: int
    started_at: float  # unix seconds
    block_size: int = 16  # tokens per KV block: reservations are counted in these
    metrics_port: int = 0  # where its Prometheus /metrics answers (same host as address); 0 = none
    # How it names prompt prefixes (common/engine/prefix.py), so a router can find the worker that
    # holds a prompt's prefix: the hash seed (hex) and the prefill chunk size; "" / 0 = no prefix cache.
    prefix_seed: str = ""
    chunk_tokens: int = 0
    identity: str = ""  # the SPIFFE ID of its certificate (common/pki.py); "" with TLS off
    # Decode only, computed on read as total_blocks minus the live leases; never written.
    available_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"worker role must be 'prefill' or 'decode', got {self.role!r}")
        if not self.worker_id or not self.epoch:
            raise ValueError("worker_id and epoch must be non-empty")


_WORKER_FIELDS = [f.name for f in fields(WorkerInfo) if f.name != "available_blocks"]
_WORKER_INT_FIELDS = {"total_blocks", "free_blocks", "num_running", "num_waiting", "available_blocks",
                      "block_size", "metrics_port", "chunk_tokens"}


def _worker_from_flat(flat: list[str]) -> WorkerInfo:
    raw = dict(zip(flat[::2], flat[1::2]))
    values = {}
    for name in _WORKER_FIELDS + ["available_blocks"]:
        if name not in raw:
            continue
        value = raw[name]
        values[name] = int(value) if name in _WORKER_INT_FIELDS else float(value) if name == "started_at" else value
    return WorkerInfo(**values)


class ReserveReason(StrEnum):
    OK = "ok"
    NO_CAPACITY = "no_capacity"
    WORKER_GONE = "worker_gone"  # not registered (never, expired, or deregistered)
    EPOCH_MISMATCH = "epoch_mismatch"  # the worker restarted since the caller looked
    NOT_DECODE = "not_decode"


@dataclass(frozen=True)
class ReserveResult:
    ok: bool
    reason: ReserveReason
    available_blocks: int  # left after this lease when ok, else what was free to take
    expires_at: float  # unix seconds by the Redis clock; 0.0 when not ok


# --- Lua -------------------------------------------------------------------------------------

_LUA_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Drops leases that expired or were made on an earlier epoch of the worker (whose KV pool
-- died with that process); returns the blocks the remaining leases hold.
local function held_blocks(leases, blocks, epoch, now)
  for _, rid in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now)) do
    redis.call('ZREM', leases, rid)
    redis.call('HDEL', blocks, rid)
  end
  local held = 0
  local all = redis.call('HGETALL', blocks)
  for i = 1, #all, 2 do
    local n, lease_epoch = string.match(all[i + 1], '^(%d+):(.*)$')
    if epoch and lease_epoch ~= epoch then
      redis.call('ZREM', leases, all[i])
      redis.call('HDEL', blocks, all[i])
    else
      held = held + tonumber(n)
    end
  end
  return held
end

-- The live leases (unexpired, made on `epoch`) as {request_id, blocks, ...}, changing nothing: for readers.
local function live_leases(leases, blocks, epoch, now)
  local out = {}
  local all = redis.call('HGETALL', blocks)
  for i = 1, #all, 2 do
    local n, lease_epoch = string.match(all[i + 1], '^(%d+):(.*)$')
    local expiry = redis.call('ZSCORE', leases, all[i])
    if expiry and tonumber(expiry) > now and (not epoch or lease_epoch == epoch) then
      out[#out + 1] = all[i]
      out[#out + 1] = tonumber(n)
    end
  end
  return out
end

-- Lease keys live as long as their last lease, so a vanished worker leaves nothing behind.
local function expire_with_last_lease(leases, blocks)
  local last = redis.call('ZRANGE', leases, -1, -1, 'WITHSCORES')
  if last[2] then
    local at = string.format('%d', tonumber(last[2]))
    redis.call('PEXPIREAT', leases, at)
    redis.call('PEXPIREAT', blocks, at)
  end
end
"""

# KEYS: workers index of the role, worker hash. ARGV: worker_id, ttl_ms, field/value pairs. Each beat
# also drops the index's expired entries (a reader never writes).
_HEARTBEAT = _LUA_PRELUDE + """
local ttl_ms = tonumber(ARGV[2])
local now = now_ms()
redis.call('HSET', KEYS[2], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[2], ttl_ms)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + ttl_ms, ARGV[1])
return 1
"""

# KEYS: workers index, worker hash, then the worker's other keys to delete (none: a draining worker keeps
# its leases). ARGV: worker_id, epoch.
_DEREGISTER = """
if redis.call('HGET', KEYS[2], 'epoch') ~= ARGV[2] then return 0 end
redis.call('DEL', unpack(KEYS, 2))
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""

# KEYS: leases, lease_blocks. ARGV: epoch. Drops the leases made against `epoch`; returns how many.
_DROP_LEASES = """
local dropped = 0
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  if string.match(all[i + 1], '^%d+:(.*)$') == ARGV[1] then
    redis.call('ZREM', KEYS[1], all[i])
    redis.call('HDEL', KEYS[2], all[i])
    dropped = dropped + 1
  end
end
return dropped
"""

# ARGV: prefix, role ('' = both), then worker ids (none = every registered worker). Returns one flat
# field/value list per live worker, decode workers with available_blocks; writes nothing. An entry whose
# role field is not the role its keys are under is no registration (its keys' ACL is that role's).
_LIST_WORKERS = _LUA_PRELUDE + """
local prefix, role = ARGV[1], ARGV[2]
local now = now_ms()
local given = {unpack(ARGV, 3)}
local roles = {role}
if role == '' then roles = {'prefill', 'decode'} end
local out = {}
for _, r in ipairs(roles) do
  local ids = given
  if #ids == 0 then ids = redis.call('ZRANGEBYSCORE', prefix .. 'workers:' .. r, '(' .. now, '+inf') end
  for _, id in ipairs(ids) do
    local info = redis.call('HGETALL', prefix .. 'worker:' .. r .. ':' .. id)
    local w = {}
    for i = 1, #info, 2 do w[info[i]] = info[i + 1] end
    if #info > 0 and w.role == r then
      if r == 'decode' then
        local held = 0
        local live = live_leases(prefix .. 'leases:' .. id, prefix .. 'lease_blocks:' .. id, w.epoch, now)
        for i = 2, #live, 2 do held = held + live[i] end
        info[#info + 1] = 'available_blocks'
        info[#info + 1] = tonumber(w.total_blocks) - held
      end
      out[#out + 1] = info
    end
  end
end
return out
"""

# A worker's registration is passed in ARGV, not KEYS: a key EVAL declares needs read and write access,
# and a router or operator may only read registrations (common/redis_acl.py).

# KEYS: leases, lease_blocks. ARGV: worker hash, epoch, request_id, num_blocks, ttl_ms.
# Returns {ok, reason, available_blocks, expires_at_ms}. Re-reserving the same request
# replaces its lease (only if the new one fits), so a retried call cannot hold blocks twice.
_RESERVE = _LUA_PRELUDE + """
local epoch, rid, num_blocks = ARGV[2], ARGV[3], tonumber(ARGV[4])
local now = now_ms()
local w = redis.call('HMGET', ARGV[1], 'epoch', 'role', 'total_blocks')
if not w[1] then return {0, 'worker_gone', 0, 0} end
if w[1] ~= epoch then return {0, 'epoch_mismatch', 0, 0} end
if w[2] ~= 'decode' then return {0, 'not_decode', 0, 0} end
local held = held_blocks(KEYS[1], KEYS[2], epoch, now)
local mine = redis.call('HGET', KEYS[2], rid)
if mine then held = held - tonumber(string.match(mine, '^(%d+):')) end
local available = tonumber(w[3]) - held
if available < num_blocks then return {0, 'no_capacity', available, 0} end
local expires_at = now + tonumber(ARGV[5])
redis.call('ZADD', KEYS[1], expires_at, rid)
redis.call('HSET', KEYS[2], rid, num_blocks .. ':' .. epoch)
expire_with_last_lease(KEYS[1], KEYS[2])
return {1, 'ok', available - num_blocks, expires_at}
"""

# KEYS: leases, lease_blocks. ARGV: worker hash, request_id, ttl_ms. An expired lease
# is not revived: its blocks may already be promised to someone else.
_RENEW = _LUA_PRELUDE + """
local now = now_ms()
held_blocks(KEYS[1], KEYS[2], redis.call('HGET', ARGV[1], 'epoch'), now)
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[3]), ARGV[2])
expire_with_last_lease(KEYS[1], KEYS[2])
return 1
"""

# ARGV: worker hash, leases, lease_blocks. Returns {total_blocks or -1, request/blocks pairs...}; writes nothing.
_LIVE_LEASES = _LUA_PRELUDE + """
local w = redis.call('HMGET', ARGV[1], 'epoch', 'total_blocks')
local out = {tonumber(w[2] or -1)}
for _, v in ipairs(live_leases(ARGV[2], ARGV[3], w[1], now_ms())) do out[#out + 1] = v end
return out
"""

# KEYS: leases, lease_blocks. ARGV: request_id, epoch. Returns the blocks of the request's live
# lease made against `epoch`, or 0.
_LEASE_BLOCKS = _LUA_PRELUDE + """
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= now_ms() then return 0 end
local value = redis.call('HGET', KEYS[2], ARGV[1])
if not value then return 0 end
local n, epoch = string.match(value, '^(%d+):(.*)$')
if epoch ~= ARGV[2] then return 0 end
return tonumber(n)
"""

# KEYS: routers index. ARGV: router_id, ttl_ms.
_ROUTER_HEARTBEAT = _LUA_PRELUDE + """
redis.call('ZADD', KEYS[1], now_ms() + tonumber(ARGV[2]), ARGV[1])
return 1
"""

_LUA_NOW_STR = """
local function now_str()
  local t = redis.call('TIME')
  return t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
end
"""

# KEYS: request hash. ARGV: ttl_ms, prefix, router_id ('' = none), request_id, field/value pairs.
# A request with a router joins router_requests:<router> until its terminal state, so that the
# record is ended by whoever reaps that router if it dies. History is kept as a JSON string built
# here, because cjson would round timestamps to 14 significant digits.
_CREATE_REQUEST = _LUA_NOW_STR + f"""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local ts = now_str()
redis.call('HSET', KEYS[1], 'state', '{RequestState.QUEUED}', 'history', '[["{RequestState.QUEUED}",' .. ts .. ']]',
           't_{RequestState.QUEUED}', ts, unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if ARGV[3] ~= '' then
  local set = ARGV[2] .. 'router_requests:' .. ARGV[3]
  redis.call('HSET', KEYS[1], 'router', ARGV[3])
  redis.call('SADD', set, ARGV[4])
  redis.call('PEXPIRE', set, ARGV[1])  -- a member whose end was never recorded leaks nothing for good
end
return 1
"""

_TERMINAL_TABLE = "local TERMINAL = {%s}\n" % ", ".join(f"{s}=true" for s in sorted(TERMINAL_STATES))

# Moves one record to `state` (unless it is already terminal), with fields; on a terminal state it
# leaves its router's in-flight set. Shared by _TRANSITION and _REAP_ROUTERS.
_LUA_TRANSITION_FN = _LUA_NOW_STR + _TERMINAL_TABLE + """
local function transition(key, prefix, request_id, state, ttl_ms, pairs)
  local current = redis.call('HGET', key, 'state')
  if not current or TERMINAL[current] then return 0 end
  local ts = now_str()
  local history = redis.call('HGET', key, 'history')
  history = string.sub(history, 1, -2) .. ',["' .. state .. '",' .. ts .. ']]'
  redis.call('HSET', key, 'state', state, 'history', history, 't_' .. state, ts)
  if #pairs > 0 then redis.call('HSET', key, unpack(pairs)) end
  redis.call('PEXPIRE', key, ttl_ms)
  if TERMINAL[state] then
    local router = redis.call('HGET', key, 'router')
    if router then redis.call('SREM', prefix .. 'router_requests:' .. router, request_id) end
  end
  return 1
end
"""

# KEYS: request hash. ARGV: state, ttl_ms, prefix, request_id, field/value pairs.
_TRANSITION = _LUA_TRANSITION_FN + """
return transition(KEYS[1], ARGV[3], ARGV[4], ARGV[1], ARGV[2], {unpack(ARGV, 5)})
"""

# A router's requests still in flight become `failed` with `why` (their leases are released at once,
# not left to expire), and the router leaves the index. Returns the number of requests ended.
_LUA_END_ROUTER_FN = _LUA_TRANSITION_FN + """
local function end_router(prefix, router, failed, ttl_ms, why)
  local set = prefix .. 'router_requests:' .. router
  local ended = 0
  for _, rid in ipairs(redis.call('SMEMBERS', set)) do
    local key = prefix .. 'request:' .. rid
    local decode = redis.call('HGET', key, 'decode_worker')
    if transition(key, prefix, rid, failed, ttl_ms, {'error', 'router ' .. router .. ' ' .. why,
                                                     'finish_reason', 'error'}) == 1 then
      ended = ended + 1
    end
    if decode then
      redis.call('ZREM', prefix .. 'leases:' .. decode, rid)
      redis.call('HDEL', prefix .. 'lease_blocks:' .. decode, rid)
    end
  end
  redis.call('DEL', set)
  redis.call('ZREM', prefix .. 'routers', router)
  return ended
end
"""

# ARGV: prefix, failed state, record ttl_ms, max_gap_ms. Every router whose registration expired is ended.
# Every live router (and worker, without ACLs) reaps with each heartbeat, so a longer gap than max_gap_ms
# since the last reap means no router reached Redis meanwhile (it was down, or unreachable), so none could
# heartbeat either:
# that time is not counted against their registrations, which are pushed back by it. Without this the
# first process back after an outage longer than a router's TTL reaped every live router.
# Returns {router_id, number of requests ended, ...}.
_REAP_ROUTERS = _LUA_PRELUDE + _LUA_END_ROUTER_FN + """
local prefix, failed, ttl_ms, max_gap = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local index = prefix .. 'routers'
local now = now_ms()
local last = redis.call('GET', prefix .. 'reaped_at')
redis.call('SET', prefix .. 'reaped_at', now, 'PX', 86400000)
if last and now - tonumber(last) > max_gap then
  local shift = now - tonumber(last) - max_gap
  local all = redis.call('ZRANGE', index, 0, -1, 'WITHSCORES')
  for i = 1, #all, 2 do
    redis.call('ZADD', index, string.format('%d', tonumber(all[i + 1]) + shift), all[i])
  end
end
local out = {}
for _, router in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now)) do
  out[#out + 1] = router
  out[#out + 1] = end_router(prefix, router, failed, ttl_ms,
                             'stopped (its registration expired) before the request ended')
end
return out
"""

# ARGV: prefix, router_id, failed state, record ttl_ms. A router that stops cleanly: what it still has in
# flight is a request whose end it could not record (Redis refused it); it is ended as the reaper would.
_DEREGISTER_ROUTER = _LUA_END_ROUTER_FN + """
return end_router(ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'stopped without recording the end of the request')
"""


# --- the store ---------------------------------------------------------------------------------

def _ms(seconds: float) -> int:
    if seconds <= 0:
        raise ValueError(f"ttl must be positive, got {seconds} s")
    return max(1, int(seconds * 1000))


def _pairs(values: dict[str, object]) -> list[str]:
    flat = []
    for name, value in values.items():
        if not isinstance(value, (str, int, float)):
            raise TypeError(f"request field {name} must be str, int or float, got {type(value).__name__}")
        flat += [name, str(value)]
    return flat


def _unavailable_as_state_error(method):
    """Turns every way of not reaching Redis into one StateUnavailable, without the password."""
    @functools.wraps(method)
    def wrapper(self: StateStore, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except redis.RedisError as exc:
            detail = str(exc)
            if self._password:
                detail = detail.replace(self._password, "***")
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                what = "is unreachable"
            elif isinstance(exc, redis.exceptions.NoPermissionError) or "ACL failure in script" in detail:
                raise StatePermissionDenied(
                    f"Redis at {self.url} refused {method.__name__} to ACL user {self.username or 'default'}: "
                    f"not this role's to do (common/redis_acl.py): {detail}") from exc
            else:  # OOM, READONLY, ...: Redis answered, but refused
                what = ("refused a command (check its memory limit, that it is a primary, and the ACL "
                        "user's permissions)")
            raise StateUnavailable(f"Redis at {self.url} {what}: {type(exc).__name__}: {detail}") from exc
    return wrapper


class StateStore:
    """Worker registry, KV leases and request records in one Redis; safe to share across threads.

    Use a client from common.redis_server.connect(): it decodes responses, times out after
    2 s and reconnects after a Redis restart. Every method raises StateUnavailable when
    Redis cannot be reached.
    """

    _INT_REQUEST_FIELDS = {"prompt_tokens", "max_tokens", "completion_tokens"}
    _RESERVED_REQUEST_FIELDS = {"state", "history"}

    def __init__(self, client: redis.Redis, *, prefix: str = "handoff:",
                 record_ttl_s: float = 3600.0, active_record_ttl_s: float = 86400.0) -> None:
        if not client.get_encoder().decode_responses:
            raise ValueError("StateStore needs a client with decode_responses=True (use redis_server.connect)")
        self.client = client
        self.prefix = prefix
        self.record_ttl_s = record_ttl_s  # how long a finished/failed/cancelled record is kept
        # An unfinished record still expires, so a router that died mid-request leaks nothing.
        self.active_record_ttl_s = active_record_ttl_s
        kwargs = client.connection_pool.connection_kwargs
        self._password = kwargs.get("password")
        self.username = kwargs.get("username")
        where = kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
        scheme = "rediss" if issubclass(client.connection_pool.connection_class, redis.SSLConnection) else "redis"
        self.url = f"{scheme}://{where}/{kwargs.get('db', 0)}"  # never holds the password; rediss = TLS
        # redis-py runs these by EVALSHA and re-loads them on NOSCRIPT, e.g. after a Redis restart.
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._deregister = client.register_script(_DEREGISTER)
        self._drop_leases = client.register_script(_DROP_LEASES)
        self._list_workers = client.register_script(_LIST_WORKERS)
        self._reserve = client.register_script(_RESERVE)
        self._renew = client.register_script(_RENEW)
        self._live_leases = client.register_script(_LIVE_LEASES)
        self._create_request = client.register_script(_CREATE_REQUEST)
        self._transition = client.register_script(_TRANSITION)
        self._lease_blocks = client.register_script(_LEASE_BLOCKS)
        self._router_heartbeat = client.register_script(_ROUTER_HEARTBEAT)
        self._reap_routers = client.register_script(_REAP_ROUTERS)
        self._deregister_router = client.register_script(_DEREGISTER_ROUTER)

    def __repr__(self) -> str:
        return f"StateStore({self.url}, prefix={self.prefix!r})"

    def _worker_key(self, role: str, worker_id: str) -> str:
        if role not in WORKER_ROLES:
            raise ValueError(f"worker role must be 'prefill' or 'decode', got {role!r}")
        return f"{self.prefix}worker:{role}:{worker_id}"

    def _worker_keys(self, worker_id: str) -> list[str]:
        """A decode worker's registration, leases and lease blocks."""
        p = self.prefix
        return [self._worker_key("decode", worker_id), f"{p}leases:{worker_id}", f"{p}lease_blocks:{worker_id}"]

    @_unavailable_as_state_error
    def ping(self) -> bool:
        return bool(self.client.ping())

    # --- worker registry ---

    @_unavailable_as_state_error
    def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        """Writes the whole entry and its expiry, so it also re-creates one a Redis restart lost."""
        pairs = [x for name in _WORKER_FIELDS for x in (name, str(getattr(info, name)))]
        self._heartbeat(keys=[f"{self.prefix}workers:{info.role}", self._worker_key(info.role, info.worker_id)],
                        args=[info.worker_id, _ms(ttl_s), *pairs])

    register = heartbeat  # registering is the first heartbeat

    @_unavailable_as_state_error
    def deregister(self, worker_id: str, epoch: str, role: str = "decode", keep_leases: bool = False) -> bool:
        """Removes the worker (and a decode worker's leases), only if it still runs `epoch` (a restarted
        worker's old process must not remove the new one). keep_leases: a draining worker leaves the
        registry (nobody reserves on it any more) but its requests keep their leases, which their
        routers go on renewing until they end (drop_leases() once it has drained)."""
        keys = self._worker_keys(worker_id) if role == "decode" else [self._worker_key(role, worker_id)]
        if keep_leases:
            keys = keys[:1]
        return bool(self._deregister(keys=[f"{self.prefix}workers:{role}", *keys], args=[worker_id, epoch]))

    @_unavailable_as_state_error
    def drop_leases(self, worker_id: str, epoch: str) -> int:
        """Removes the leases made on the decode worker at `epoch` (it has drained): how many were left."""
        _, leases, blocks = self._worker_keys(worker_id)
        return int(self._drop_leases(keys=[leases, blocks], args=[epoch]))

    @_unavailable_as_state_error
    def list_workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Live workers, decode ones with available_blocks, in one round trip."""
        return [_worker_from_flat(flat) for flat in self._list_workers(args=[self.prefix, role or ""])]

    @_unavailable_as_state_error
    def get_worker(self, worker_id: str) -> WorkerInfo | None:
        found = self._list_workers(args=[self.prefix, "", worker_id])
        return _worker_from_flat(found[0]) if found else None

    # --- KV leases on decode workers ---

    @_unavailable_as_state_error
    def reserve(self, worker_id: str, epoch: str, request_id: str, num_blocks: int, ttl_s: float) -> ReserveResult:
        """Leases num_blocks of the worker's KV pool to the request if it runs `epoch` and has room."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        ok, reason, available, expires_at_ms = self._reserve(
            keys=self._worker_keys(worker_id)[1:], args=[self._worker_key("decode", worker_id), epoch, request_id,
                                                         num_blocks, _ms(ttl_s)])
        return ReserveResult(bool(ok), ReserveReason(reason), int(available), int(expires_at_ms) / 1000)

    @_unavailable_as_state_error
    def renew(self, worker_id: str, request_id: str, ttl_s: float) -> bool:
        """Extends a live lease to now + ttl_s; False if it expired, was released or the worker restarted."""
        worker, leases, blocks = self._worker_keys(worker_id)
        return bool(self._renew(keys=[leases, blocks], args=[worker, request_id, _ms(ttl_s)]))

    @_unavailable_as_state_error
    def lease_blocks(self, worker_id: str, epoch: str, request_id: str) -> int:
        """Blocks of the request's live lease on the worker made against `epoch`; 0 if there is none
        (never made, released, expired, or made against another epoch). Decode workers ask this
        before accepting a push or a Decode call."""
        _, leases, blocks = self._worker_keys(worker_id)
        return int(self._lease_blocks(keys=[leases, blocks], args=[request_id, epoch]))

    @_unavailable_as_state_error
    def release(self, worker_id: str, request_id: str) -> bool:
        """Frees the request's lease; True if there was one. Safe to call any number of times."""
        _, leases, blocks = self._worker_keys(worker_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.zrem(leases, request_id)
        pipe.hdel(blocks, request_id)
        num_removed, _ = pipe.execute()
        return num_removed > 0

    @_unavailable_as_state_error
    def reservations(self, worker_id: str) -> dict[str, int]:
        """Live leases on the worker: request_id -> num_blocks."""
        _, *flat = self._live_leases(args=self._worker_keys(worker_id))
        return {rid: int(n) for rid, n in zip(flat[::2], flat[1::2])}

    @_unavailable_as_state_error
    def available_blocks(self, worker_id: str) -> int:
        """total_blocks minus the live leases; 0 for a worker that is not registered."""
        total_blocks, *flat = self._live_leases(args=self._worker_keys(worker_id))
        if total_blocks < 0:
            return 0
        return total_blocks - sum(int(n) for n in flat[1::2])

    # --- request records ---

    def _request_key(self, request_id: str) -> str:
        return f"{self.prefix}request:{request_id}"

    def _check_fields(self, extra: dict[str, object]) -> None:
        for name in extra:
            if name in self._RESERVED_REQUEST_FIELDS or name.startswith("t_"):
                raise ValueError(f"request field {name!r} is managed by the store")

    @_unavailable_as_state_error
    def create_request(self, request_id: str, *, prompt_tokens: int, max_tokens: int, router_id: str = "",
                       **extra: object) -> bool:
        """Records a new request as queued; False if the id is already taken. With router_id the
        request is in that router's care: should the router's registration expire, reap_routers()
        ends the record."""
        self._check_fields(extra)
        pairs = _pairs({"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, **extra})
        return bool(self._create_request(keys=[self._request_key(request_id)],
                                         args=[_ms(self.active_record_ttl_s), self.prefix, router_id,
                                               request_id, *pairs]))

    @_unavailable_as_state_error
    def transition(self, request_id: str, state: RequestState | str, **fields: object) -> bool:
        """Moves the request to `state`, stamped with Redis time, and writes `fields`.

        False if the request is unknown or already terminal: each request gets exactly one
        terminal state. A terminal record expires after record_ttl_s.
        """
        state = RequestState(state)
        self._check_fields(fields)
        ttl_s = self.record_ttl_s if state in TERMINAL_STATES else self.active_record_ttl_s
        return bool(self._transition(keys=[self._request_key(request_id)],
                                     args=[state.value, _ms(ttl_s), self.prefix, request_id, *_pairs(fields)]))

    # --- prefix caches: which worker holds which prompt prefixes ---

    @_unavailable_as_state_error
    def publish_prefixes(self, worker_id: str, hashes: list[bytes], ttl_s: float, role: str = "prefill") -> None:
        """Replace the worker's published set of cached prefix hashes (at most a few thousand)."""
        key = self._prefixes_key(role, worker_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(key)
        if hashes:
            pipe.sadd(key, *(h.hex() for h in hashes))
            pipe.pexpire(key, _ms(ttl_s))
        pipe.execute()

    @_unavailable_as_state_error
    def cached_prefix_chunks(self, worker_ids: list[str], chunk_hashes: list[bytes],
                             role: str = "prefill") -> dict[str, int]:
        """For each worker of `role`: how many leading chunk hashes of a prompt its published set holds."""
        pipe = self.client.pipeline(transaction=False)
        for wid in worker_ids:
            pipe.smismember(self._prefixes_key(role, wid), [h.hex() for h in chunk_hashes])
        out = {}
        for wid, held in zip(worker_ids, pipe.execute()):
            out[wid] = next((i for i, h in enumerate(held) if not h), len(held))
        return out

    def _prefixes_key(self, role: str, worker_id: str) -> str:
        if role not in WORKER_ROLES:
            raise ValueError(f"worker role must be 'prefill' or 'decode', got {role!r}")
        return f"{self.prefix}prefixes:{role}:{worker_id}"

    # --- routers: who looks after which request ---

    @_unavailable_as_state_error
    def router_heartbeat(self, router_id: str, ttl_s: float) -> None:
        """Keeps the router registered for ttl_s more; once it lapses, its requests are reaped."""
        self._router_heartbeat(keys=[f"{self.prefix}routers"], args=[router_id, _ms(ttl_s)])

    @_unavailable_as_state_error
    def deregister_router(self, router_id: str) -> int:
        """A router that stops cleanly leaves the index with its in-flight set. Its requests are all over; a
        record still in flight is one whose end it could not record: it is ended (failed) as the reaper
        would, its lease released. Returns how many."""
        return int(self._deregister_router(args=[self.prefix, router_id, RequestState.FAILED.value,
                                                 _ms(self.record_ttl_s)]))

    @_unavailable_as_state_error
    def reap_routers(self) -> dict[str, int]:
        """Ends the in-flight records of every router whose registration expired (state failed,
        leases released): router_id -> requests ended. Cheap when none died; every worker and
        router runs it with its heartbeat, so one survivor suffices."""
        flat = self._reap_routers(args=[self.prefix, RequestState.FAILED.value, _ms(self.record_ttl_s),
                                        _ms(REAP_MAX_GAP_S)])
        return {router: int(n) for router, n in zip(flat[::2], flat[1::2])}

    @_unavailable_as_state_error
    def get_request(self, request_id: str) -> dict | None:
        """The record with state as RequestState, history as [(state, ts)], t_* and counts as numbers."""
        record = self.client.hgetall(self._request_key(request_id))
        if not record:
            return None
        record["state"] = RequestState(record["state"])
        record["history"] = [(RequestState(s), ts) for s, ts in json.loads(record["history"])]
        for name, value in record.items():
            if name.startswith("t_"):
                record[name] = float(value)
            elif name in self._INT_REQUEST_FIELDS:
                record[name] = int(value)
        return record

    # --- operator tools (router/status.py): drain requests, recent records --------------------
    # Nothing here is on a request's path. A drain request is one key, drain:<worker_id>, holding
    # the epoch it is meant for, so a worker restarted under the same id does not drain again.

    def _drain_key(self, worker_id: str) -> str:
        return f"{self.prefix}drain:{worker_id}"

    @_unavailable_as_state_error
    def request_drain(self, worker_id: str, epoch: str, ttl_s: float) -> None:
        """Asks the worker running `epoch` to drain; its heartbeat sees it. Expires after ttl_s."""
        self.client.set(self._drain_key(worker_id), epoch, px=_ms(ttl_s))

    @_unavailable_as_state_error
    def drain_requested(self, worker_id: str, epoch: str) -> bool:
        return self.client.get(self._drain_key(worker_id)) == epoch

    @_unavailable_as_state_error
    def end_drain(self, worker_id: str, epoch: str, role: str | None = None) -> bool:
        """Removes the drain request for `epoch` (the worker has drained, or the operator gave up), and with
        `role` the worker's answer (mark_drained)."""
        keys = [self._drain_key(worker_id)] + ([self._drained_key(role, worker_id)] if role else [])
        return bool(self.client.eval("if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end "
                                     "redis.call('DEL', unpack(KEYS)) return 1", len(keys), *keys, epoch))

    def _drained_key(self, role: str, worker_id: str) -> str:
        if role not in WORKER_ROLES:
            raise ValueError(f"worker role must be 'prefill' or 'decode', got {role!r}")
        return f"{self.prefix}drained:{role}:{worker_id}"

    @_unavailable_as_state_error
    def mark_drained(self, role: str, worker_id: str, epoch: str, ttl_s: float) -> None:
        """The worker's answer to a drain request: it has finished its work at `epoch` (the request itself is
        the operator's to remove: a worker may read drain requests, never write them)."""
        self.client.set(self._drained_key(role, worker_id), epoch, px=_ms(ttl_s))

    @_unavailable_as_state_error
    def drained(self, role: str, worker_id: str, epoch: str) -> bool:
        return self.client.get(self._drained_key(role, worker_id)) == epoch

    @_unavailable_as_state_error
    def drain_requests(self) -> dict[str, tuple[str, float]]:
        """Pending drain requests: worker_id -> (epoch, seconds until the request expires)."""
        start = len(self._drain_key(""))
        keys = self._scan(self._drain_key("*"), max_keys=10_000)
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
            pipe.pttl(key)
        values = pipe.execute()
        return {key[start:]: (epoch, ttl_ms / 1000)
                for key, epoch, ttl_ms in zip(keys, values[::2], values[1::2]) if epoch is not None}

    @_unavailable_as_state_error
    def recent_request_ids(self, limit: int, max_scanned: int = 20_000) -> tuple[list[str], int]:
        """Up to `limit` request ids, newest t_queued first, from a SCAN of at most max_scanned
        records (they expire, so the keyspace stays bounded); also how many records were seen."""
        start = len(self._request_key(""))
        keys = self._scan(self._request_key("*"), max_keys=max_scanned)
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, f"t_{RequestState.QUEUED}")
        stamped = sorted(((float(t), key) for key, t in zip(keys, pipe.execute()) if t is not None), reverse=True)
        return [key[start:] for _, key in stamped[:limit]], len(keys)

    @_unavailable_as_state_error
    def redis_time(self) -> float:
        """Now by the Redis clock, the one every t_* stamp and lease uses (unix seconds)."""
        seconds, micros = self.client.time()
        return seconds + micros / 1e6

    def _scan(self, pattern: str, max_keys: int) -> list[str]:
        # The prefix is literal: escape the glob characters SCAN's MATCH would read in it.
        literal, star = pattern[:-1], pattern[-1]
        match = "".join("\\" + c if c in "*?[]\\" else c for c in literal) + star
        keys = []
        for key in self.client.scan_iter(match=match, count=1000):
            keys.append(key)
            if len(keys) >= max_keys:
                break
        return keys
