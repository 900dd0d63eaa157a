"""What the console's pages show, as plain data: chart specs (drawn by ``static/console.js``
with Chart.js) and the usage series, built from ``AdminService`` results. No I/O here.

A chart spec is ``{"id", "type": "bar" | "line", "title", "labels", "datasets": [{"label",
"data"}], "unit": "" | "%" | "ms", "stacked": bool}``; ``data`` holds numbers or None (a gap).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from engine.stats import EVICTION_REASONS
from tenants.usage_reports import BUCKETS, UsageReportRow

# Usage ranges the console offers, and the bucket each defaults to.
RANGES = {"1h": timedelta(hours=1), "6h": timedelta(hours=6), "24h": timedelta(days=1),
          "7d": timedelta(days=7), "30d": timedelta(days=30)}
DEFAULT_BUCKET = {"1h": "1m", "6h": "1m", "24h": "1h", "7d": "1h", "30d": "1d"}
_LABEL = {"1m": "%m-%d %H:%M", "1h": "%m-%d %H:00", "1d": "%Y-%m-%d"}


def tenant_label(tenant_id: str | None, name: str | None) -> str:
    """A tenant's name, else the start of its id (a removed tenant), else "(no tenant)"."""
    if name:
        return name
    return f"{tenant_id[:8]}…" if tenant_id else "(no tenant)"


def overview_charts(stats: dict) -> list[dict[str, Any]]:
    """Pool usage, then per tenant: resident blocks, hit rate and evictions by reason, from
    ``AdminService.cache_stats``."""
    tenants = stats["tenants"]
    labels = [tenant_label(t["tenant_id"], t["tenant_name"]) for t in tenants]
    seen = {r for t in tenants for r, n in t["evictions"].items() if n}
    reasons = [r for r in EVICTION_REASONS if r in seen or r != "fault"] + sorted(
        seen - set(EVICTION_REASONS))
    free, cached = stats["num_blocks_free"], stats["num_blocks_cached"]
    return [
        {"id": "chart-pool", "type": "bar", "title": "KV block pool (blocks)", "unit": "",
         "stacked": False, "labels": ["free", "in use", "cached"],
         "datasets": [{"label": "blocks", "data": [free, stats["num_blocks_used"], cached]}]},
        {"id": "chart-resident", "type": "bar", "title": "Resident cached blocks per tenant",
         "unit": "", "stacked": False, "labels": labels,
         "datasets": [{"label": "blocks", "data": [t["resident_blocks"] for t in tenants]}]},
        {"id": "chart-hit-rate", "type": "bar", "title": "Prefix-cache hit rate per tenant",
         "unit": "%", "stacked": False, "labels": labels,
         "datasets": [{"label": "hit rate", "data": [_percent(t["hit_rate"]) for t in tenants]}]},
        {"id": "chart-evictions", "type": "bar", "title": "Evicted blocks per tenant, by reason",
         "unit": "", "stacked": True, "labels": labels,
         "datasets": [{"label": r, "data": [t["evictions"].get(r, 0) for t in tenants]}
                      for r in reasons]},
    ]


def _percent(rate: float | None) -> float | None:
    return None if rate is None else round(100 * rate, 1)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def bucket_starts(bucket: str, since: datetime, until: datetime) -> list[datetime]:
    """Every calendar bucket (UTC) that overlaps [since, until), oldest first."""
    step = BUCKETS[bucket]
    start = since.astimezone(UTC).replace(second=0, microsecond=0)
    if bucket != "1m":
        start = start.replace(minute=0)
    if bucket == "1d":
        start = start.replace(hour=0)
    out = []
    while start < until:
        out.append(start)
        start += step
    return out


def usage_charts(rows: list[UsageReportRow], bucket: str, since: datetime,
                 until: datetime) -> list[dict[str, Any]]:
    """One chart per measure (requests, prompt / cached / completion tokens, hit rate, TTFT),
    one line per tenant over every bucket of the range (0 requests where a tenant had none;
    a gap for rates and times)."""
    starts = bucket_starts(bucket, since, until)
    index = {s: i for i, s in enumerate(starts)}
    names: dict[str | None, str] = {}
    series: dict[tuple[str | None, str], list[Any]] = {}
    measures = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                "hit_rate": None, "ttft_p50_s": None, "ttft_p95_s": None}
    for row in rows:
        names.setdefault(row.tenant_id, tenant_label(row.tenant_id, row.tenant_name))
        i = index.get(row.bucket_start.astimezone(UTC))
        if i is None:
            continue
        for measure, empty in measures.items():
            values = series.setdefault((row.tenant_id, measure), [empty] * len(starts))
            values[i] = getattr(row, measure)
    labels = [s.strftime(_LABEL[bucket]) for s in starts]
    tenants = sorted(names, key=lambda t: names[t])

    def chart(chart_id: str, title: str, unit: str, measure: str, convert=lambda v: v,
              suffix: str = "") -> dict[str, Any]:
        return {"id": chart_id, "type": "line", "title": title, "unit": unit, "stacked": False,
                "labels": labels,
                "datasets": [{"label": names[t] + suffix,
                              "data": [convert(v) for v in series[(t, measure)]]}
                             for t in tenants]}

    ttft = chart("chart-ttft", "Time to first token (ms)", "ms", "ttft_p50_s", _ms, " p50")
    ttft["datasets"] += chart("", "", "", "ttft_p95_s", _ms, " p95")["datasets"]
    return [chart("chart-requests", "Requests", "", "requests"),
            chart("chart-prompt", "Prompt tokens", "", "prompt_tokens"),
            chart("chart-cached", "Cached prompt tokens", "", "cached_tokens"),
            chart("chart-completion", "Completion tokens", "", "completion_tokens"),
            chart("chart-usage-hit-rate", "Hit rate (cached / prompt tokens)", "%", "hit_rate",
                  _percent),
            ttft]
