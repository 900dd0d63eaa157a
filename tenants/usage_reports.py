"""Usage reports: per calendar bucket (UTC minute, hour or day) and per tenant, key, model or end
user, aggregated in SQL.

Each report row has requests, errors, prompt / cached / completion tokens, the prefix-cache hit
rate (cached / prompt tokens), of the cached tokens those loaded from the offload tiers
(``tier_cached_tokens``; the rest hit the pool), the prompt tokens added to the cache
(``cache_write_tokens``), and TTFT p50 and p95. TTFT percentiles come from a fixed histogram
(``TTFT_BINS_S``) summed in SQL and interpolated within a bin, as Prometheus'
``histogram_quantile`` does: exact enough for a report, and the same on SQLite (which has no
percentile function) and PostgreSQL.

Daily reports read ``usage_daily`` (``UsageDailyRow``), which ``add_to_daily`` keeps up to date
in the transaction that stores the usage rows, so a month-long report reads one row per day,
tenant, key and model instead of every request's. Minute and hour reports, and reports by end
user (a tenant names end users freely), group the raw rows. Daily reports count whole UTC days:
the range is widened to day boundaries, and the report says which range it counted.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import String, case, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tenants.models import (
    TTFT_BIN_COLUMNS,
    TTFT_BINS_S,
    Tenant,
    UsageDailyRow,
    UsageRecordRow,
    require_aware,
)
from tenants.records import UsageRecord

BUCKETS = {"1m": timedelta(minutes=1), "1h": timedelta(hours=1), "1d": timedelta(days=1)}
GROUP_BY = ("tenant", "key", "model", "end_user")
MAX_BUCKETS = 10_000  # per report: a 30-day minute report (43,200 buckets) is refused
MAX_ROWS = 50_000  # per report: a larger one is refused (narrow the range or the grouping)
# Range reported when ``since`` is omitted: a useful window for each bucket size.
DEFAULT_RANGE = {"1m": timedelta(hours=3), "1h": timedelta(days=2), "1d": timedelta(days=30)}
_EARLIEST = datetime(1971, 1, 1, tzinfo=UTC)
_LATEST = datetime(9998, 1, 1, tzinfo=UTC)
# Bucket label formats: SQLite stores naive UTC as 'YYYY-MM-DD HH:MM:SS...' (a prefix is the
# bucket); PostgreSQL formats the UTC time the same way.
_PREFIX = {"1m": 16, "1h": 13, "1d": 10}
_PG_FORMAT = {"1m": "YYYY-MM-DD HH24:MI", "1h": "YYYY-MM-DD HH24", "1d": "YYYY-MM-DD"}
_PY_FORMAT = {"1m": "%Y-%m-%d %H:%M", "1h": "%Y-%m-%d %H", "1d": "%Y-%m-%d"}


@dataclass(frozen=True)
class UsageReportQuery:
    """What to report.

    Attributes:
        since, until: timezone-aware; rows with ``since <= created_at < until``. Daily reports
            count whole UTC days: every day that overlaps the range.
        bucket: ``1m``, ``1h`` or ``1d`` (calendar, UTC).
        group_by: any of ``GROUP_BY``; () sums all tenants.
        tenant_id: only this tenant's usage, or None for all.
    """

    since: datetime
    until: datetime
    bucket: str = "1d"
    group_by: tuple[str, ...] = ("tenant",)
    tenant_id: str | None = None

    def check(self) -> None:
        """Raises ValueError for a naive time, a time outside 1971..9997, an empty range, an
        unknown bucket or group, or more than ``MAX_BUCKETS`` buckets."""
        require_aware(self.since, "since")
        require_aware(self.until, "until")
        if not (_EARLIEST <= self.since <= _LATEST and _EARLIEST <= self.until <= _LATEST):
            raise ValueError("since and until must be between 1971 and 9997")
        if self.bucket not in BUCKETS:
            raise ValueError(f"bucket must be one of {', '.join(BUCKETS)}")
        unknown = set(self.group_by) - set(GROUP_BY)
        if unknown:
            raise ValueError(f"group_by takes {', '.join(GROUP_BY)}; got {sorted(unknown)}")
        if self.until <= self.since:
            raise ValueError("until must be after since")
        if (self.until - self.since) / BUCKETS[self.bucket] > MAX_BUCKETS:
            raise ValueError(f"more than {MAX_BUCKETS} {self.bucket} buckets; use a larger "
                             "bucket or a shorter range")

    def counted_range(self) -> tuple[datetime, datetime]:
        """The range the report counts: daily reports widen it to whole UTC days."""
        if self.bucket != "1d":
            return self.since, self.until
        day = timedelta(days=1)
        start = self.since.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        end = (self.until - timedelta(microseconds=1)).astimezone(UTC).replace(
            hour=0, minute=0, second=0, microsecond=0) + day
        return start, end


def default_query(bucket: str, since: datetime | None, until: datetime | None,
                  group_by: tuple[str, ...], tenant_id: str | None) -> UsageReportQuery:
    """A query with the default range filled in (``DEFAULT_RANGE`` before ``until``, which
    defaults to now). Raises ValueError for a range that cannot be computed."""
    try:
        end = until or datetime.now(UTC)
        start = since or end - DEFAULT_RANGE[bucket]
    except (OverflowError, KeyError):
        raise ValueError("since and until must be between 1971 and 9997, with a bucket of "
                         f"{', '.join(BUCKETS)}") from None
    return UsageReportQuery(since=start, until=end, bucket=bucket, group_by=group_by,
                            tenant_id=tenant_id)


@dataclass(frozen=True)
class UsageReportRow:
    """One bucket of one group. Group fields not grouped by are None."""

    bucket_start: datetime
    tenant_id: str | None
    tenant_name: str | None
    key_id: str | None
    model: str | None
    end_user: str | None
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    hit_rate: float | None  # cached / prompt tokens; None without prompt tokens
    tier_cached_tokens: int  # of the cached tokens, loaded from an offload tier
    cache_write_tokens: int  # prompt tokens added to the prefix cache
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_bins: tuple[int, ...] = field(default=(), repr=False, compare=False)


def ttft_bin(ttft_s: float) -> int:
    """The histogram bin of one TTFT: the first edge it does not exceed, or the last bin."""
    for i, edge in enumerate(TTFT_BINS_S):
        if ttft_s <= edge:
            return i
    return len(TTFT_BINS_S)


def quantile(bins: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a TTFT histogram, interpolated linearly within its bin
    (the first bin starts at 0; the overflow bin answers its lower edge). None when empty."""
    total = sum(bins)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(bins):
        if count and seen + count >= rank:
            if i == len(TTFT_BINS_S):
                return TTFT_BINS_S[-1]
            lower = 0.0 if i == 0 else TTFT_BINS_S[i - 1]
            return lower + (TTFT_BINS_S[i] - lower) * (rank - seen) / count
        seen += count
    return TTFT_BINS_S[-1]


def day_of(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d")


def add_to_daily(session: Session, records: Iterable[tuple[UsageRecord, datetime]]) -> None:
    """Adds stored usage rows (each with the time it was stored under) to ``usage_daily``: one
    multi-row upsert per call, keys in a fixed order (concurrent writers on PostgreSQL lock
    them in the same order, so they cannot deadlock); call in the transaction that adds them."""
    sums: dict[tuple[str, str, str, str], list[int]] = defaultdict(
        lambda: [0] * (7 + len(TTFT_BIN_COLUMNS)))
    for r, created_at in records:
        acc = sums[(day_of(created_at), r.tenant_id, r.key_id or "", r.model)]
        acc[0] += 1
        acc[1] += r.status != "ok"
        acc[2] += r.prompt_tokens
        acc[3] += r.cached_tokens
        acc[4] += r.completion_tokens
        acc[5] += r.tier_cached_tokens
        acc[6] += r.cache_write_tokens
        if r.ttft_s is not None:
            acc[7 + ttft_bin(r.ttft_s)] += 1
    if not sums:
        return
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    table = UsageDailyRow.__table__
    counters = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens",
                "tier_cached_tokens", "cache_write_tokens", *TTFT_BIN_COLUMNS)
    keys = ("day", "tenant_id", "key_id", "model")
    stmt = insert(table).values([{**dict(zip(keys, key)), **dict(zip(counters, sums[key]))}
                                 for key in sorted(sums)])
    session.execute(stmt.on_conflict_do_update(
        index_elements=list(keys), set_={c: table.c[c] + stmt.excluded[c] for c in counters}))


def _bucket_label(session: Session, column: Any, bucket: str) -> Any:
    if session.get_bind().dialect.name == "postgresql":
        return func.to_char(func.timezone("UTC", column), _PG_FORMAT[bucket], type_=String)
    return func.substr(column, 1, _PREFIX[bucket], type_=String)


def usage_report(session: Session, q: UsageReportQuery) -> list[UsageReportRow]:
    """The report's rows, oldest bucket first, then by group.

    Raises:
        ValueError: from ``UsageReportQuery.check``.
    """
    q.check()
    since, until = q.counted_range()
    daily = q.bucket == "1d" and "end_user" not in q.group_by
    src: Any = UsageDailyRow if daily else UsageRecordRow
    # NULL and '' are both "none" (the rollup stores ''): grouped and ordered as ''.
    group_cols = {"tenant": src.tenant_id, "key": func.coalesce(src.key_id, ""),
                  "model": src.model}
    if not daily:
        group_cols["end_user"] = func.coalesce(src.end_user, "")
    label = src.day if daily else _bucket_label(session, src.created_at, q.bucket)
    chosen = [g for g in GROUP_BY if g in q.group_by]
    cols: list[Any] = [label.label("bucket"), *[group_cols[g].label(g) for g in chosen]]
    if "tenant" in chosen:
        cols.append(func.max(Tenant.name).label("tenant_name"))
    if daily:
        measures = [func.sum(src.requests), func.sum(src.errors), func.sum(src.prompt_tokens),
                    func.sum(src.cached_tokens), func.sum(src.completion_tokens),
                    func.sum(src.tier_cached_tokens), func.sum(src.cache_write_tokens),
                    *[func.sum(getattr(src, c)) for c in TTFT_BIN_COLUMNS]]
    else:
        bin_index = case(*[(src.ttft_s <= edge, i) for i, edge in enumerate(TTFT_BINS_S)],
                         else_=len(TTFT_BINS_S))
        measures = [func.count(), func.sum(case((src.status != "ok", 1), else_=0)),
                    func.sum(src.prompt_tokens), func.sum(src.cached_tokens),
                    func.sum(src.completion_tokens), func.sum(src.tier_cached_tokens),
                    func.sum(src.cache_write_tokens),
                    *[func.sum(case((src.ttft_s.is_(None), 0), (bin_index == i, 1), else_=0))
                      for i in range(len(TTFT_BIN_COLUMNS))]]
    stmt = select(*cols, *measures)
    if "tenant" in chosen:
        stmt = stmt.join(Tenant, Tenant.id == src.tenant_id)
    if daily:
        stmt = stmt.where(src.day >= day_of(since), src.day < day_of(until))
    else:
        stmt = stmt.where(src.created_at >= since, src.created_at < until)
    if q.tenant_id is not None:
        stmt = stmt.where(src.tenant_id == q.tenant_id)
    groups = [label, *[group_cols[g] for g in chosen]]
    order = [label, *([func.max(Tenant.name)] if "tenant" in chosen else []), *groups[1:]]
    stmt = stmt.group_by(*groups).order_by(*order).limit(MAX_ROWS + 1)
    result = session.execute(stmt).all()
    if len(result) > MAX_ROWS:
        raise ValueError(f"the report has more than {MAX_ROWS} rows; use a larger bucket, a "
                         "shorter range or fewer groups")
    out = []
    for row in result:
        values = row._mapping
        n = 1 + len(chosen) + ("tenant" in chosen)
        requests, errors, prompt, cached, completion, tier, writes, *bins = (
            int(v or 0) for v in row[n:])
        named = {g: values[g] for g in chosen}
        out.append(UsageReportRow(
            bucket_start=datetime.strptime(values["bucket"], _PY_FORMAT[q.bucket]).replace(
                tzinfo=UTC),
            tenant_id=named.get("tenant"),
            tenant_name=values["tenant_name"] if "tenant" in chosen else None,
            key_id=named.get("key") or None, model=named.get("model"),
            end_user=named.get("end_user") or None,
            requests=requests, errors=errors, prompt_tokens=prompt, cached_tokens=cached,
            completion_tokens=completion, hit_rate=cached / prompt if prompt else None,
            tier_cached_tokens=tier, cache_write_tokens=writes, ttft_p50_s=quantile(bins, 0.5), ttft_p95_s=quantile(bins, 0.95),
            ttft_bins=tuple(bins)))
    return out


REPORT_COLUMNS = [f.name for f in fields(UsageReportRow) if f.name != "ttft_bins"]


def report_dicts(rows: Iterable[UsageReportRow]) -> list[dict[str, Any]]:
    """The rows as plain dicts of ``REPORT_COLUMNS`` (JSON, CSV, tables)."""
    return [{c: getattr(r, c) for c in REPORT_COLUMNS} for r in rows]


def csv_text(rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> str:
    """CSV with a header line; datetimes in ISO 8601."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (v.isoformat() if isinstance(v, datetime) else v)
                         for k, v in row.items()})
    return buf.getvalue()
