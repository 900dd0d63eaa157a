"""Per-tenant rate limits shared by every replica, in Redis (``SALTSERVE_REDIS_URL``).

Same rules and interface as ``app.limits.RateLimiter`` (requests per minute, tokens per minute
with a reservation at admission corrected at release, concurrent requests; a refused call
changes nothing), with the state in Redis so that a tenant's limits hold across replicas. Each
operation is one Lua script (atomic; Redis's own clock, so replicas' clocks do not matter):

- ``{<ns>:rl:<tenant>}:req``   sorted set: one member per admitted request, scored by time
  (ms), kept only while the tenant has an rpm limit;
- ``{...}:tok`` / ``:tokn`` / ``:used``  token entries by time, their tokens, and their running
  total (so no script sums the window), kept only while the tenant has a tpm limit;
- ``{...}:run``   sorted set of running calls, scored by when their slot expires.

The braces are a Redis Cluster hash tag: one tenant's keys live on one shard. Every script
costs O(log n) plus the entries it prunes, so a tenant flooding cheap requests cannot slow
Redis down for the others.

A concurrency slot expires ``lease_ttl_s`` after admission even if never released, so the slots
of a replica killed mid-request come back. A release that fails (Redis unreachable) is kept and
retried with the next successful call, as is the undo of an admission whose reply was lost.
Keys expire when a tenant is idle.

Redis unreachable or slow: the limiter falls back to this replica's in-memory ``RateLimiter``
(each replica then enforces the limits on its own share of the traffic) and logs once per
``log_interval_s``; it never refuses a call because Redis is down. Calls are synchronous (the
limiter's interface), each bounded by a ``socket_timeout_s`` timeout; after a failure Redis is
left alone for ``retry_after_s`` (a circuit breaker), so a hung Redis costs this replica's event
loop one timeout per ``retry_after_s``, not one per request.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from typing import Any

from app.limits import WINDOW_S, RateLimiter, RateLimitExceeded, format_reset
from tenants.records import TenantQuota

logger = logging.getLogger(__name__)

# Shared prologue: now (ms, Redis clock), prune the windows, read what is left.
_PRUNE = """
local req, tok, tokn, used_key, run = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local window = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', req, '-inf', now - window)
local used = tonumber(redis.call('GET', used_key) or '0')
local old = redis.call('ZRANGEBYSCORE', tok, '-inf', now - window)
for _, id in ipairs(old) do
  used = used - tonumber(redis.call('HGET', tokn, id) or '0')
  redis.call('HDEL', tokn, id)
end
if #old > 0 then
  redis.call('ZREMRANGEBYSCORE', tok, '-inf', now - window)
  redis.call('SET', used_key, math.max(used, 0))
end
used = math.max(used, 0)
redis.call('ZREMRANGEBYSCORE', run, '-inf', now)
local function expire(ms)
  for _, k in ipairs({req, tok, tokn, used_key, run}) do redis.call('PEXPIRE', k, ms) end
end
-- When the window's usage drops to max_used or below, if nothing new arrives (ms); looks at
-- the oldest 1,000 entries at most (a refusal's Retry-After, not worth more).
local function tokens_free_at(max_used)
  local u, at = used, now
  local entries = redis.call('ZRANGE', tok, 0, 999, 'WITHSCORES')
  for i = 1, #entries, 2 do
    if u <= max_used then break end
    u = u - tonumber(redis.call('HGET', tokn, entries[i]) or '0')
    at = tonumber(entries[i + 1]) + window
  end
  if u > max_used then at = now + window end
  return at
end
local function newest(key)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last == 0 then return -1 end
  return tonumber(last[2])
end
local function add_tokens(id, n)  -- n may be negative (a refund)
  local mine = tonumber(redis.call('HGET', tokn, id) or '0')
  redis.call('HSET', tokn, id, mine + n)
  redis.call('SET', used_key, math.max(used + n, 0))
  used = math.max(used + n, 0)
end
"""

# ARGV: window, rpm, tpm, max_concurrent (-1: none), tokens, call id, lease ttl (ms)
# Returns {0 admitted | 1 concurrency | 2 rpm | 3 tpm, now, requests, used, retry_ms,
#          newest request, newest token entry}
_ACQUIRE = _PRUNE + """
local rpm, tpm, maxc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens, id, ttl = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local nreq = redis.call('ZCARD', req)
local function refuse(code, retry)
  return {code, now, nreq, used, retry, newest(req), newest(tok)}
end
if maxc >= 0 and redis.call('ZCARD', run) >= maxc then return refuse(1, 1000) end
if rpm >= 0 and nreq >= rpm then
  local first = redis.call('ZRANGE', req, 0, 0, 'WITHSCORES')
  return refuse(2, tonumber(first[2]) + window - now)
end
local need = math.max(tokens, 1)
if tpm >= 0 and used + need > tpm then
  if tokens > tpm then return refuse(3, window) end
  return refuse(3, tokens_free_at(tpm - need) - now)
end
if rpm >= 0 then
  redis.call('ZADD', req, now, id)
  nreq = nreq + 1
end
if tpm >= 0 then
  redis.call('ZADD', tok, now, id)
  add_tokens(id, tokens)
end
if maxc >= 0 then redis.call('ZADD', run, now + ttl, id) end
expire(window + ttl)
return {0, now, nreq, used, 0, newest(req), newest(tok)}
"""

# ARGV: window, tpm (-1: none), tokens to add, call id, key ttl (ms)
# Returns {0 reserved | 3 tpm, now, requests, used, retry_ms, newest request, newest entry}
_RESERVE = _PRUNE + """
local tpm, tokens, id = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if tpm < 0 then return {0, now, redis.call('ZCARD', req), used, 0, newest(req), newest(tok)} end
if used + tokens > tpm then
  return {3, now, redis.call('ZCARD', req), used, tokens_free_at(tpm - tokens) - now,
          newest(req), newest(tok)}
end
-- Tokens count from when they are reserved: the entry is re-dated to now.
redis.call('ZADD', tok, now, id)
add_tokens(id, tokens)
expire(window + tonumber(ARGV[5]))
return {0, now, redis.call('ZCARD', req), used, 0, newest(req), now}
"""

# ARGV: window, used tokens (-1: keep the reservation), cancel (0/1), call id
_RELEASE = _PRUNE + """
local used_tokens, cancel, id = tonumber(ARGV[2]), ARGV[3] == '1', ARGV[4]
redis.call('ZREM', run, id)
local mine = redis.call('HGET', tokn, id)
if cancel then
  redis.call('ZREM', req, id)
  if mine then
    add_tokens(id, -tonumber(mine))
    redis.call('ZREM', tok, id)
    redis.call('HDEL', tokn, id)
  end
elseif used_tokens >= 0 and mine and used_tokens < tonumber(mine) then
  add_tokens(id, used_tokens - tonumber(mine))
end
return 0
"""


class RedisLease:
    """An admitted call's hold on its tenant's shared limits (``app.limits.Lease``'s
    interface). ``release`` is idempotent; a Redis error while releasing is logged (the slot
    then expires by itself)."""

    def __init__(self, limiter: RedisRateLimiter, tenant_id: str, call_id: str,
                 headers: dict[str, str]) -> None:
        self._limiter, self._tenant_id, self._call_id = limiter, tenant_id, call_id
        self.headers = headers
        self.released = False

    def reserve(self, limits: TenantQuota, tokens: int) -> None:
        """Adds ``tokens`` to the reservation, or raises RateLimitExceeded (over tpm) without
        changing anything."""
        if self.released or tokens <= 0:
            return
        reply = self._limiter._run("reserve", self._tenant_id, _or_none(limits.tpm_limit), tokens,
                                   self._call_id, self._limiter._ttl_ms)
        if reply is None:
            return
        if reply[0] != 0:
            raise self._limiter._refusal(reply, limits, tokens)
        self.headers = self._limiter._headers(reply, limits)

    def release(self, used_tokens: int | None = None) -> None:
        """Frees the concurrency slot; lowers the reservation to ``used_tokens`` (None keeps
        it)."""
        self._finish(-1 if used_tokens is None else max(0, used_tokens), cancel=False)

    def cancel(self) -> None:
        """Undoes the admission (the engine refused the call before any work)."""
        self._finish(-1, cancel=True)

    def _finish(self, used: int, cancel: bool) -> None:
        if self.released:
            return
        self.released = True
        self._limiter._release(self._tenant_id, used, cancel, self._call_id)


class RedisRateLimiter:
    """``app.limits.RateLimiter`` with its state in Redis, shared by every replica.

    Args:
        redis_url: ``redis://host:port/db``.
        namespace: prefix of the keys (``ClusterConfig.namespace``).
        window_s: window of the per-minute limits, seconds.
        lease_ttl_s: a concurrency slot never released (its replica died) expires after this.
        log_interval_s: at most one "Redis unavailable" line per this many seconds.
    """

    def __init__(self, redis_url: str, namespace: str = "saltserve",
                 window_s: float = WINDOW_S, lease_ttl_s: float = 600.0,
                 log_interval_s: float = 10.0, socket_timeout_s: float = 0.25,
                 retry_after_s: float = 5.0, max_pending: int = 10_000) -> None:
        import redis

        self._redis = redis.Redis.from_url(redis_url, socket_timeout=socket_timeout_s,
                                           socket_connect_timeout=socket_timeout_s)
        self._errors = redis.RedisError
        self._scripts = {name: self._redis.register_script(body) for name, body in
                         (("acquire", _ACQUIRE), ("reserve", _RESERVE), ("release", _RELEASE))}
        self._ns, self._window_ms = namespace, int(window_s * 1000)
        self._ttl_ms = int(lease_ttl_s * 1000)
        self._local = RateLimiter(window_s=window_s)  # while Redis is unreachable
        self._log_interval_s, self._last_log = log_interval_s, -float("inf")
        self._retry_after_s, self._down_until = retry_after_s, -float("inf")
        self._lock = threading.Lock()
        # Releases (tenant, used, cancel, call id) that failed: retried after the next
        # successful call; bounded (the oldest are dropped; their slots expire by TTL).
        self._pending: deque[tuple[str, int, bool, str]] = deque(maxlen=max_pending)

    def __repr__(self) -> str:
        return f"RedisRateLimiter(namespace={self._ns!r})"

    def _keys(self, tenant_id: str) -> list[str]:
        base = "{" + f"{self._ns}:rl:{tenant_id}" + "}"
        return [f"{base}:req", f"{base}:tok", f"{base}:tokn", f"{base}:used", f"{base}:run"]

    def _run(self, script: str, tenant_id: str, *args: Any) -> list[int] | None:
        """Runs a script; None (logged, rate-limited) when Redis is unreachable or the circuit
        breaker is open."""
        if time.monotonic() < self._down_until:
            return None
        try:
            reply = self._scripts[script](keys=self._keys(tenant_id),
                                          args=[self._window_ms, *args])
        except self._errors as e:
            now = time.monotonic()
            self._down_until = now + self._retry_after_s
            if now - self._last_log >= self._log_interval_s:
                self._last_log = now
                logger.error("rate limits: redis unavailable (%s); this replica enforces them "
                             "on its own traffic, retrying redis in %.0f s", type(e).__name__,
                             self._retry_after_s)
            return None
        if self._pending:
            self._retry_pending()
        return [int(x) for x in reply] if isinstance(reply, list) else [int(reply)]

    def _release(self, tenant_id: str, used: int, cancel: bool, call_id: str) -> None:
        """Releases a call's slot and corrects or cancels its reservation; kept for a retry
        when Redis does not answer."""
        if self._run("release", tenant_id, used, "1" if cancel else "0", call_id) is None:
            with self._lock:
                self._pending.append((tenant_id, used, cancel, call_id))

    def _retry_pending(self) -> None:
        with self._lock:
            batch, self._pending = list(self._pending), deque(maxlen=self._pending.maxlen)
        for tenant_id, used, cancel, call_id in batch:
            self._release(tenant_id, used, cancel, call_id)

    def acquire(self, tenant_id: str, limits: TenantQuota, tokens: int) -> Any:
        """Admits one call reserving ``tokens``, or raises RateLimitExceeded without counting
        anything (``app.limits.RateLimiter.acquire``)."""
        call_id = uuid.uuid4().hex
        reply = self._run("acquire", tenant_id, _or_none(limits.rpm_limit),
                          _or_none(limits.tpm_limit),
                          _or_none(limits.max_concurrent), tokens, call_id, self._ttl_ms)
        if reply is None:
            # The script may have run and only its reply been lost: undo it once Redis answers
            # (a no-op if it never ran), then count the call here.
            with self._lock:
                self._pending.append((tenant_id, -1, True, call_id))
            return self._local.acquire(tenant_id, limits, tokens)
        if reply[0] != 0:
            raise self._refusal(reply, limits, tokens)
        return RedisLease(self, tenant_id, call_id, self._headers(reply, limits))

    def in_flight(self, tenant_id: str) -> int:
        """Running calls of this tenant with a concurrency limit, on every replica (slots not
        yet expired)."""
        try:
            return int(self._redis.zcard(self._keys(tenant_id)[4]))
        except self._errors:
            return self._local.in_flight(tenant_id)

    def _refusal(self, reply: list[int], limits: TenantQuota,
                 tokens: int) -> RateLimitExceeded:
        code, retry_ms = reply[0], reply[4]
        if code == 1:
            message = (f"too many concurrent requests: this tenant allows "
                       f"{limits.max_concurrent} at a time")
        elif code == 2:
            message = f"rate limit reached: {limits.rpm_limit} requests per minute"
        elif limits.tpm_limit is not None and tokens > limits.tpm_limit:
            message = (f"request too large: it may use up to {tokens} tokens (prompt + "
                       f"max_tokens) and this tenant allows {limits.tpm_limit} tokens per minute; "
                       "lower max_tokens")
        else:
            message = f"rate limit reached: {limits.tpm_limit} tokens per minute"
        return RateLimitExceeded(message, self._headers(reply, limits, retry_ms / 1000))

    def _headers(self, reply: list[int], limits: TenantQuota,
                 retry_after: float | None = None) -> dict[str, str]:
        """``x-ratelimit-*`` as ``app.limits`` sends them, from a script's reply."""
        _, now, requests, used, _, newest_req, newest_tok = reply
        window = self._window_ms
        headers: dict[str, str] = {}
        if limits.rpm_limit is not None:
            reset = (newest_req + window - now) / 1000 if newest_req >= 0 else 0.0
            headers["x-ratelimit-limit-requests"] = str(limits.rpm_limit)
            headers["x-ratelimit-remaining-requests"] = str(max(0, limits.rpm_limit - requests))
            headers["x-ratelimit-reset-requests"] = format_reset(reset)
        if limits.tpm_limit is not None:
            reset = (newest_tok + window - now) / 1000 if newest_tok >= 0 else 0.0
            headers["x-ratelimit-limit-tokens"] = str(limits.tpm_limit)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tpm_limit - used))
            headers["x-ratelimit-reset-tokens"] = format_reset(reset)
        if retry_after is not None:
            headers["Retry-After"] = str(max(1, -(-int(retry_after * 1000) // 1000)))
        return headers


def _or_none(value: int | None) -> int:
    return -1 if value is None else value
