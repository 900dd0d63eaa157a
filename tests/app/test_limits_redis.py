"""app/limits_redis.py: per-tenant limits shared by replicas through the machine's Redis. Two
limiters on one namespace stand for two replicas."""

from __future__ import annotations

import time
import uuid

import pytest

from app.limits import RateLimitExceeded
from app.limits_redis import RedisRateLimiter
from tenants.records import TenantQuota

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def pair() -> tuple[RedisRateLimiter, RedisRateLimiter]:
    namespace = f"test-{uuid.uuid4().hex}"
    a, b = RedisRateLimiter(REDIS_URL, namespace), RedisRateLimiter(REDIS_URL, namespace)
    a._redis.ping()  # Redis runs wherever this suite runs; fail loudly if not
    return a, b


def test_rpm_holds_across_replicas_and_a_refusal_counts_nothing(pair):
    a, b = pair
    limits = TenantQuota(rpm_limit=3)
    leases = [a.acquire("t", limits, 0), b.acquire("t", limits, 0), a.acquire("t", limits, 0)]
    for replica in (a, b):
        with pytest.raises(RateLimitExceeded) as e:
            replica.acquire("t", limits, 0)
        assert "3 requests per minute" in e.value.message
        assert e.value.headers["x-ratelimit-remaining-requests"] == "0"
        assert 55 <= int(e.value.headers["Retry-After"]) <= 60
    assert leases[2].headers["x-ratelimit-remaining-requests"] == "0"
    other = b.acquire("u", limits, 0)  # another tenant has its own window
    assert other.headers["x-ratelimit-remaining-requests"] == "2"
    # A cancelled call (refused by the engine before any work) gives its request back.
    leases[0].cancel()
    b.acquire("t", limits, 0)
    with pytest.raises(RateLimitExceeded):
        a.acquire("t", limits, 0)


def test_concurrency_slots_are_shared_released_once_and_expire(pair):
    a, b = pair
    limits = TenantQuota(max_concurrent=2)
    first, _second = a.acquire("t", limits, 0), b.acquire("t", limits, 0)
    assert a.in_flight("t") == 2 == b.in_flight("t")
    with pytest.raises(RateLimitExceeded, match="2 at a time"):
        b.acquire("t", limits, 0)
    first.release(0)
    first.release(0)  # idempotent: frees one slot, once
    b.acquire("t", limits, 0)
    with pytest.raises(RateLimitExceeded):
        a.acquire("t", limits, 0)
    # A replica killed mid-request never releases: its slots come back after the lease TTL.
    short = RedisRateLimiter(REDIS_URL, f"test-{uuid.uuid4().hex}", lease_ttl_s=0.3)
    short.acquire("t", TenantQuota(max_concurrent=1), 0)
    with pytest.raises(RateLimitExceeded):
        short.acquire("t", TenantQuota(max_concurrent=1), 0)
    time.sleep(0.4)
    short.acquire("t", TenantQuota(max_concurrent=1), 0)


def test_tpm_reservations_are_refunded_to_what_was_used(pair):
    a, b = pair
    limits = TenantQuota(tpm_limit=150)
    lease = a.acquire("t", limits, 0)
    lease.reserve(limits, 100)  # prompt + max_tokens, known after tokenisation
    assert lease.headers["x-ratelimit-remaining-tokens"] == "50"
    other = b.acquire("t", limits, 0)
    with pytest.raises(RateLimitExceeded, match="150 tokens per minute") as e:
        other.reserve(limits, 60)  # refused on the other replica; nothing counted
    assert int(e.value.headers["Retry-After"]) >= 55
    lease.release(20)  # it really used 20
    other.reserve(limits, 120)  # 20 + 120 <= 150
    assert other.headers["x-ratelimit-remaining-tokens"] == "10"
    with pytest.raises(RateLimitExceeded, match="request too large"):
        b.acquire("u", TenantQuota(tpm_limit=100), 500)
    lease.release(5)  # released already: changes nothing
    with pytest.raises(RateLimitExceeded):
        a.acquire("t", limits, 11)


def test_redis_down_falls_back_to_this_replicas_own_limits(caplog):
    down = RedisRateLimiter("redis://127.0.0.1:9/0", "test-down")  # nothing listens on 9
    limits = TenantQuota(rpm_limit=2)
    down.acquire("t", limits, 0)
    down.acquire("t", limits, 0)
    with pytest.raises(RateLimitExceeded):  # still limited, by this replica alone
        down.acquire("t", limits, 0)
    lines = [r for r in caplog.records if "redis unavailable" in r.getMessage()]
    assert len(lines) == 1  # logged once per interval, not per call


def test_a_flooding_tenant_does_not_touch_anothers_window(pair):
    a, b = pair
    flood = TenantQuota(rpm_limit=5)
    for _ in range(5):
        a.acquire("noisy", flood, 0)
    for _ in range(20):
        with pytest.raises(RateLimitExceeded):
            b.acquire("noisy", flood, 0)
    quiet = a.acquire("quiet", TenantQuota(rpm_limit=5, tpm_limit=1000), 0)
    assert quiet.headers["x-ratelimit-remaining-requests"] == "4"
    assert quiet.headers["x-ratelimit-remaining-tokens"] == "1000"


def test_a_hung_redis_costs_one_timeout_per_breaker_interval_not_one_per_call():
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # accepts connections, never answers: a paused or partitioned Redis
    held: list[socket.socket] = []

    def hold() -> None:  # ends when the test closes the listening socket
        try:
            for _ in range(16):
                held.append(server.accept()[0])
        except OSError:
            pass

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    port = server.getsockname()[1]
    hung = RedisRateLimiter(f"redis://127.0.0.1:{port}/0", "test-hung",
                            socket_timeout_s=0.2, retry_after_s=30)
    limits = TenantQuota(rpm_limit=100)
    start = time.perf_counter()
    hung.acquire("t", limits, 0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(50):
        hung.acquire("t", limits, 0).release(0)
    rest = time.perf_counter() - start
    assert 0.15 <= first < 1.0 and rest < 0.2, (first, rest)
    server.shutdown(socket.SHUT_RDWR)  # wakes the holder's accept (close alone does not)
    server.close()
    holder.join(timeout=5)
    assert not holder.is_alive()
    for conn in held:
        conn.close()


def test_releases_lost_while_redis_was_away_are_retried(pair):
    a, _ = pair
    limits = TenantQuota(max_concurrent=1)
    lease = a.acquire("t", limits, 0)
    a._down_until = time.monotonic() + 60  # Redis goes away (the breaker is open)
    lease.release(0)  # cannot reach Redis: kept for later
    local = a.acquire("t", limits, 0)  # meanwhile this replica limits on its own
    assert a._redis.zcard(a._keys("t")[4]) == 1  # the slot is still taken in Redis
    local.release(0)
    a._down_until = -float("inf")  # Redis is back
    a.acquire("u", limits, 0)  # the next successful call retries the kept release ...
    assert a._redis.zcard(a._keys("t")[4]) == 0  # ... and the slot is free again
    a.acquire("t", limits, 0)


def test_only_the_limits_a_tenant_has_keep_state(pair):
    """A flood of cheap requests from a tenant with a concurrency limit only leaves no
    per-request entries behind (every script stays cheap for everyone else)."""
    a, _ = pair
    for _ in range(200):
        a.acquire("flood", TenantQuota(max_concurrent=5), 0).release(0)
    req, tok, tokn, used, run = a._keys("flood")
    assert a._redis.exists(req, tok, tokn) == 0 and a._redis.zcard(run) == 0
    lease = a.acquire("flood", TenantQuota(tpm_limit=100), 30)
    lease.release(10)
    assert int(a._redis.get(used)) == 10  # the running total follows refunds
    lease2 = a.acquire("flood", TenantQuota(tpm_limit=100), 50)
    lease2.cancel()
    assert int(a._redis.get(used)) == 10
