"""Usage reports in SQL (SQLite and PostgreSQL): calendar buckets, groups, hit rate, TTFT
percentiles, the daily rollup kept in step with the raw rows, and query checks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tenants.records import UsageRecord
from tenants.usage_reports import UsageReportQuery, quantile, ttft_bin

T0 = datetime(2026, 11, 3, 10, 0, tzinfo=UTC)


def _rec(i: int, tenant: str, at: datetime, **kw) -> UsageRecord:
    base = {"request_id": f"r{i}", "tenant_id": tenant, "key_id": "k1", "model": "m",
            "endpoint": "chat.completions", "status": "ok", "prompt_tokens": 100,
            "cached_tokens": 0, "completion_tokens": 10, "ttft_s": 0.2, "latency_s": 1.0,
            "created_at": at}
    return UsageRecord(**{**base, **kw})


@pytest.fixture
def loaded(repo):
    a = repo.tenants.create("acme")
    b = repo.tenants.create("globex")
    recs = [
        # acme: day 1, two minutes of hour 10; one error, one hit, one other key, one end user
        _rec(1, a.id, T0, cached_tokens=64, tier_cached_tokens=48, cache_write_tokens=32,
             ttft_s=0.04),
        _rec(2, a.id, T0 + timedelta(seconds=30), status="error", ttft_s=None),
        _rec(3, a.id, T0 + timedelta(minutes=1), key_id="k2", end_user="alice", ttft_s=3.0),
        # acme: day 2
        _rec(4, a.id, T0 + timedelta(days=1), prompt_tokens=50, cached_tokens=50,
             tier_cached_tokens=16),
        # globex: day 1, hour 11
        _rec(5, b.id, T0 + timedelta(hours=1), key_id=None, ttft_s=0.6),
    ]
    repo.usage.record_usage_batch(recs[:3])
    for r in recs[3:]:
        repo.usage.record_usage(r)
    return repo, a, b


def _q(**kw) -> UsageReportQuery:
    return UsageReportQuery(**{"since": T0 - timedelta(days=1), "until": T0 + timedelta(days=3),
                               **kw})


def test_daily_report_per_tenant(loaded):
    repo, a, b = loaded
    rows = repo.usage.report(_q())
    got = [(r.bucket_start.day, r.tenant_name, r.requests, r.errors, r.prompt_tokens,
            r.cached_tokens, r.completion_tokens) for r in rows]
    assert got == [(3, "acme", 3, 1, 300, 64, 30), (3, "globex", 1, 0, 100, 0, 10),
                   (4, "acme", 1, 0, 50, 50, 10)]
    assert rows[0].hit_rate == pytest.approx(64 / 300)
    assert rows[2].hit_rate == 1.0
    assert rows[0].tenant_id == a.id and rows[1].tenant_id == b.id
    assert rows[0].ttft_bins[ttft_bin(0.04)] == 1 and sum(rows[0].ttft_bins) == 2
    # the tier split and cache writes, per day
    assert [(r.tier_cached_tokens, r.cache_write_tokens) for r in rows] == [
        (48, 32), (0, 0), (16, 0)]


def test_the_daily_rollup_agrees_with_the_raw_rows(loaded):
    """Hour buckets come from the raw rows, day buckets from usage_daily: same sums."""
    repo, a, _ = loaded
    hourly = repo.usage.report(_q(bucket="1h", tenant_id=a.id))
    daily = repo.usage.report(_q(bucket="1d", tenant_id=a.id))
    for field in ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens",
                  "tier_cached_tokens", "cache_write_tokens"):
        assert sum(getattr(r, field) for r in hourly) == sum(getattr(r, field) for r in daily)
    assert tuple(daily[0].ttft_bins) == tuple(
        sum(x) for x in zip(*[r.ttft_bins for r in hourly if r.bucket_start.day == 3]))


def test_minute_buckets_and_groups(loaded):
    repo, a, _ = loaded
    rows = repo.usage.report(_q(bucket="1m", group_by=("tenant", "key", "end_user"),
                                tenant_id=a.id, until=T0 + timedelta(hours=1)))
    assert [(r.bucket_start, r.key_id, r.end_user, r.requests) for r in rows] == [
        (T0, "k1", None, 2), (T0 + timedelta(minutes=1), "k2", "alice", 1)]
    by_model = repo.usage.report(_q(group_by=("model",)))
    assert {r.model for r in by_model} == {"m"} and by_model[0].tenant_id is None
    everyone = repo.usage.report(_q(group_by=()))
    assert sum(r.requests for r in everyone) == 5


def test_the_replayed_batch_is_not_counted_twice(loaded):
    repo, a, _ = loaded
    again = [_rec(1, a.id, T0, cached_tokens=64, ttft_s=0.04)]
    assert repo.usage.record_usage_batch(again) == 0
    assert repo.usage.report(_q(tenant_id=a.id))[0].requests == 3


def test_ttft_percentiles_interpolate_within_a_bin():
    bins = [0] * 11
    bins[ttft_bin(0.3)] = 10  # all in (0.25, 0.5]
    assert quantile(bins, 0.5) == pytest.approx(0.375)
    assert quantile(bins, 0.95) == pytest.approx(0.4875)
    assert quantile([0] * 11, 0.5) is None
    overflow = [0] * 10 + [3]
    assert quantile(overflow, 0.5) == 30.0


@pytest.mark.parametrize("kw, message", [
    ({"bucket": "2h"}, "bucket"), ({"group_by": ("colour",)}, "group_by"),
    ({"bucket": "1m", "until": T0 + timedelta(days=30)}, "buckets"),  # 44,640 minutes
    ({"until": T0 - timedelta(days=2)}, "after"),
    ({"since": datetime(2026, 11, 1)}, "timezone-aware")])
def test_bad_queries_are_refused(loaded, kw, message):
    repo, _, _ = loaded
    with pytest.raises(ValueError, match=message):
        repo.usage.report(_q(**kw))


def test_end_users_read_the_raw_rows_and_none_equals_empty(repo):
    a = repo.tenants.create("acme")
    recs = [_rec(i, a.id, T0 + timedelta(minutes=i), end_user=u)
            for i, u in enumerate(["alice", "alice", "", None, "bob"])]
    recs += [_rec(100 + i, a.id, T0, end_user=f"user-{i}") for i in range(50)]
    assert repo.usage.record_usage_batch(recs) == 55
    daily = repo.usage.report(_q(group_by=("end_user",)))
    counts = {r.end_user: r.requests for r in daily}
    assert counts["alice"] == 2 and counts["bob"] == 1 and counts[None] == 2
    assert len(daily) == 3 + 50  # '' and NULL are one group: "no end user"
    # The rollup is keyed by day, tenant, key and model only: 55 requests, one row.
    from sqlalchemy import func, select

    from tenants.models import UsageDailyRow

    with repo.usage._session_factory() as session:
        assert session.scalar(select(func.count()).select_from(UsageDailyRow)) == 1


def test_daily_reports_count_whole_utc_days(loaded):
    repo, a, _ = loaded
    q = UsageReportQuery(since=T0 + timedelta(minutes=10), until=T0 + timedelta(minutes=11),
                         bucket="1d", tenant_id=a.id)
    assert q.counted_range() == (T0.replace(hour=0), T0.replace(hour=0) + timedelta(days=1))
    assert [r.requests for r in repo.usage.report(q)] == [3]


@pytest.mark.parametrize("since, until", [
    (datetime(1, 1, 1, tzinfo=UTC), T0), (T0, datetime(9999, 12, 31, tzinfo=UTC))])
def test_extreme_times_are_refused(loaded, since, until):
    repo, _, _ = loaded
    with pytest.raises(ValueError, match="between 1971 and 9997"):
        repo.usage.report(UsageReportQuery(since=since, until=until))
