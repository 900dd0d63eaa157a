"""Per-tenant rate limits: requests per minute, tokens per minute, concurrent requests.

Limits come from the tenant record (``tenants.records.TenantQuota``: ``rpm_limit``,
``tpm_limit``, ``max_concurrent``; None = unlimited). ``RateLimiter.acquire`` admits a call or
raises ``RateLimitExceeded`` without changing any state, so a rejected call is neither queued nor
half-counted. An admitted call holds a ``Lease`` until ``Lease.release`` (idempotent), which frees
its concurrency slot and corrects its token reservation to what the call really used::

    admission: reserve prompt_tokens + n * max_tokens   (max_tokens None -> max_model_len - prompt)
    release:   reservation := prompt_tokens + completion_tokens   (never more than reserved)

Windows are sliding logs over the last ``window_s`` seconds (60 s: "per minute"), kept per
tenant in memory and pruned on every call. One process, one limiter: limits are not shared
between replicas.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tenants.records import TenantQuota

WINDOW_S = 60.0


class RateLimitExceeded(Exception):
    """A call over one of its tenant's limits; nothing was counted for it.

    Attributes:
        message: what was exceeded (no tenant data beyond the limit values).
        headers: ``x-ratelimit-*`` headers and ``Retry-After`` (seconds, integer).
    """

    def __init__(self, message: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.message, self.headers = message, headers


@dataclass(eq=False)
class _Entry:
    time: float
    tokens: int
    pruned: bool = False  # left the window (no longer in ``tokens_used``)


@dataclass
class _TenantWindow:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[_Entry] = field(default_factory=deque)
    tokens_used: int = 0  # sum of ``tokens`` entries
    in_flight: int = 0


def format_reset(seconds: float) -> str:
    """Formats a duration the way OpenAI's ``x-ratelimit-reset-*`` headers do: "20ms", "1.5s",
    "6m0s"."""
    seconds = max(0.0, seconds)
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60.0)
    rest_s = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_s}s" if minutes else f"{rest_s}s"


class Lease:
    """An admitted call's hold on its tenant's limits. ``release`` is idempotent."""

    def __init__(self, limiter: RateLimiter, tenant_id: str, entry: _Entry | None,
                 headers: dict[str, str]) -> None:
        self._limiter, self._tenant_id, self._entry = limiter, tenant_id, entry
        self.headers = headers  # x-ratelimit-* as of admission (empty when no limits are set)
        self.released = False
        self._request_time: float | None = None  # the call's entry in the rpm window

    def release(self, used_tokens: int | None = None) -> None:
        """Frees the concurrency slot and corrects the token reservation.

        Args:
            used_tokens: prompt + completion tokens the call really used; None keeps the whole
                reservation (e.g. the outcome is unknown). Never raises the reservation.
        """
        self._limiter._release(self, used_tokens)

    def reserve(self, limits: TenantQuota, tokens: int) -> None:
        """Adds ``tokens`` to the call's token reservation once they are known (after
        tokenisation), or raises without changing anything.

        Raises:
            RateLimitExceeded: over tpm.
        """
        self._limiter._reserve(self, limits, tokens)

    def cancel(self) -> None:
        """Undoes the admission as if it never happened (the engine refused the call before
        any work): frees the slot and removes the call from the rpm and tpm windows."""
        self._limiter._release(self, None, cancel=True)


class RateLimiter:
    """Thread-safe in-memory per-tenant limiter.

    Args:
        clock: monotonic time in seconds (injectable for tests).
        window_s: window length in seconds for the per-minute limits.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 window_s: float = WINDOW_S) -> None:
        self._clock, self._window_s = clock, window_s
        self._lock = threading.Lock()
        self._tenants: dict[str, _TenantWindow] = {}

    def acquire(self, tenant_id: str, limits: TenantQuota, tokens: int) -> Lease:
        """Admits one call reserving ``tokens``, or raises without counting anything.

        Returns:
            The call's lease; release it on every path.

        Raises:
            RateLimitExceeded: over max_concurrent, rpm or tpm (checked in that order).
        """
        with self._lock:
            now = self._clock()
            w = self._tenants.setdefault(tenant_id, _TenantWindow())
            self._prune(w, now)
            if limits.max_concurrent is not None and w.in_flight >= limits.max_concurrent:
                raise RateLimitExceeded(
                    f"too many concurrent requests: this tenant allows {limits.max_concurrent} "
                    "at a time", self._headers(w, limits, now, retry_after=1.0))
            if limits.rpm_limit is not None and len(w.requests) >= limits.rpm_limit:
                # The oldest request leaving the window frees a slot.
                wait = w.requests[0] + self._window_s - now
                raise RateLimitExceeded(
                    f"rate limit reached: {limits.rpm_limit} requests per minute",
                    self._headers(w, limits, now, retry_after=wait))
            need = max(tokens, 1)  # a call admitted before its size is known needs a free token
            if limits.tpm_limit is not None and w.tokens_used + need > limits.tpm_limit:
                raise self._tpm_exceeded(w, limits, now, tokens, need)
            w.requests.append(now)
            entry = _Entry(now, tokens)
            w.tokens.append(entry)
            w.tokens_used += tokens
            w.in_flight += 1
            lease = Lease(self, tenant_id, entry, self._headers(w, limits, now))
            lease._request_time = now
            return lease

    def _reserve(self, lease: Lease, limits: TenantQuota, tokens: int) -> None:
        with self._lock:
            entry = lease._entry
            if lease.released or entry is None or tokens <= 0:
                return
            now = self._clock()
            w = self._tenants[lease._tenant_id]
            self._prune(w, now)
            if limits.tpm_limit is None:
                self._renew(w, lease, tokens, now)
                return
            if w.tokens_used + tokens > limits.tpm_limit:
                raise self._tpm_exceeded(w, limits, now, entry.tokens + tokens, tokens)
            self._renew(w, lease, tokens, now)
            lease.headers = self._headers(w, limits, now)

    def _tpm_exceeded(self, w: _TenantWindow, limits: TenantQuota, now: float,
                      call_tokens: int, need: int) -> RateLimitExceeded:
        """The tpm refusal of a call that may use ``call_tokens`` in all and needs ``need`` more
        tokens of the window now (``acquire`` and ``Lease.reserve``)."""
        assert limits.tpm_limit is not None
        if call_tokens > limits.tpm_limit:
            message = (f"request too large: it may use up to {call_tokens} tokens (prompt + "
                       f"max_tokens) and this tenant allows {limits.tpm_limit} tokens per minute; "
                       "lower max_tokens")
            wait = self._window_s
        else:
            message = f"rate limit reached: {limits.tpm_limit} tokens per minute"
            wait = self._tokens_free_at(w, limits.tpm_limit - need, now) - now
        return RateLimitExceeded(message, self._headers(w, limits, now, retry_after=wait))

    @staticmethod
    def _renew(w: _TenantWindow, lease: Lease, tokens: int, now: float) -> None:
        """Re-dates the call's token entry to ``now`` with ``tokens`` more: tokens count from
        when they are reserved, even if the admission entry already left the window."""
        old = lease._entry
        assert old is not None
        if not old.pruned:
            w.tokens.remove(old)
            w.tokens_used -= old.tokens
        new = _Entry(now, old.tokens + tokens)
        w.tokens.append(new)
        w.tokens_used += new.tokens
        lease._entry = new

    def in_flight(self, tenant_id: str) -> int:
        """Calls of this tenant holding a lease now."""
        with self._lock:
            w = self._tenants.get(tenant_id)
            return 0 if w is None else w.in_flight

    def _release(self, lease: Lease, used_tokens: int | None, cancel: bool = False) -> None:
        with self._lock:
            if lease.released:
                return
            lease.released = True
            w = self._tenants[lease._tenant_id]
            w.in_flight -= 1
            assert w.in_flight >= 0, "rate limiter released more leases than it granted"
            entry = lease._entry
            if cancel and entry is not None:
                if lease._request_time in w.requests:  # equal timestamps are interchangeable
                    w.requests.remove(lease._request_time)
                if not entry.pruned:
                    w.tokens.remove(entry)
                    w.tokens_used -= entry.tokens
                return
            if entry is not None and used_tokens is not None and used_tokens < entry.tokens:
                used = max(0, used_tokens)
                if not entry.pruned:  # a pruned entry was already subtracted
                    w.tokens_used -= entry.tokens - used
                entry.tokens = used

    def _prune(self, w: _TenantWindow, now: float) -> None:
        horizon = now - self._window_s
        while w.requests and w.requests[0] <= horizon:
            w.requests.popleft()
        while w.tokens and w.tokens[0].time <= horizon:
            e = w.tokens.popleft()
            e.pruned = True
            w.tokens_used -= e.tokens

    def _tokens_free_at(self, w: _TenantWindow, max_used: int, now: float) -> float:
        """When the window's usage drops to ``max_used`` (>= 0) or below, if nothing new
        arrives."""
        used, free_at = w.tokens_used, now
        for e in w.tokens:
            if used <= max_used:
                break
            used -= e.tokens
            free_at = e.time + self._window_s
        return free_at

    def _headers(self, w: _TenantWindow, limits: TenantQuota, now: float,
                 retry_after: float | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if limits.rpm_limit is not None:
            # OpenAI: time until the limit is back to its initial state (window empty).
            reset = w.requests[-1] + self._window_s - now if w.requests else 0.0
            headers["x-ratelimit-limit-requests"] = str(limits.rpm_limit)
            headers["x-ratelimit-remaining-requests"] = str(
                max(0, limits.rpm_limit - len(w.requests)))
            headers["x-ratelimit-reset-requests"] = format_reset(reset)
        if limits.tpm_limit is not None:
            reset = w.tokens[-1].time + self._window_s - now if w.tokens else 0.0
            headers["x-ratelimit-limit-tokens"] = str(limits.tpm_limit)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tpm_limit - w.tokens_used))
            headers["x-ratelimit-reset-tokens"] = format_reset(reset)
        if retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
        return headers
