"""Usage reports over HTTP: ``GET /admin/usage/report`` (operators, any tenant) and
``GET /v1/usage`` (a tenant's own usage, with its own credentials). Both run
``tenants.usage_reports`` in SQL; see ``docs/admin.md``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from datetime import UTC, datetime, timedelta
from typing import Literal

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from app.auth import AdminPrincipal, CurrentTenant
from app.errors import APIError
from tenants.usage_reports import GROUP_BY, UsageReportQuery, UsageReportRow

admin_router = APIRouter(prefix="/admin", tags=["admin"])
tenant_router = APIRouter(prefix="/v1", tags=["openai"])

# Range reported when ``since`` is omitted: a useful window for each bucket size.
DEFAULT_RANGE = {"1m": timedelta(hours=3), "1h": timedelta(days=2), "1d": timedelta(days=30)}
COLUMNS = [f.name for f in dataclasses.fields(UsageReportRow) if f.name != "ttft_bins"]


def _group_by(text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in allowed]
    if bad:
        raise APIError(400, f"group_by takes a comma-separated list of {', '.join(allowed)}",
                       "group_by", "invalid_value")
    return parts


async def _report(request: Request, tenant_id: str | None, since: datetime | None,
                  until: datetime | None, bucket: str, group_by: tuple[str, ...],
                  fmt: str) -> dict | Response:
    until = until or datetime.now(UTC)
    since = since or until - DEFAULT_RANGE[bucket]
    query = UsageReportQuery(since=since, until=until, bucket=bucket, group_by=group_by,
                             tenant_id=tenant_id)
    try:
        rows = await run_in_threadpool(request.app.state.repo.usage.report, query)
    except ValueError as e:  # the query's own checks: client-safe messages
        raise APIError(400, str(e), None, "invalid_value") from None
    data = [{k: v for k, v in dataclasses.asdict(r).items() if k != "ttft_bins"} for r in rows]
    if fmt == "json":
        return {"object": "list", "bucket": bucket, "since": since.isoformat(),
                "until": until.isoformat(), "data": data}
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in data:
        writer.writerow({k: (v.isoformat() if isinstance(v, datetime) else v)
                         for k, v in row.items()})
    return Response(buf.getvalue(), media_type="text/csv")


@admin_router.get("/usage/report", response_model=None)
async def usage_report(request: Request, _: AdminPrincipal, tenant: str | None = None,
                       since: datetime | None = None, until: datetime | None = None,
                       bucket: Literal["1m", "1h", "1d"] = "1d",
                       group_by: str = Query("tenant", max_length=64),
                       format: Literal["json", "csv"] = "json") -> dict | Response:
    """Usage per calendar bucket (UTC) and group: requests, errors, prompt / cached /
    completion tokens, hit rate, TTFT p50 / p95, tenant name beside the id. ``tenant`` by id
    or name (404 if unknown); ``group_by``: comma-separated ``tenant,key,model,end_user``;
    ``since`` / ``until`` timezone-aware (default: the last 3 hours, 2 days or 30 days)."""
    tenant_id = None
    if tenant is not None:
        tenant_id = (await run_in_threadpool(request.app.state.repo.tenants.resolve, tenant)).id
    return await _report(request, tenant_id, since, until, bucket,
                         _group_by(group_by, GROUP_BY), format)


@tenant_router.get("/usage", response_model=None)
async def own_usage(request: Request, auth: CurrentTenant, since: datetime | None = None,
                    until: datetime | None = None, bucket: Literal["1m", "1h", "1d"] = "1d",
                    group_by: str = Query("", max_length=64),
                    format: Literal["json", "csv"] = "json") -> dict | Response:
    """The calling tenant's own usage (never another's), as ``/admin/usage/report``;
    ``group_by``: comma-separated ``key,model,end_user``. Counts against the tenant's
    requests-per-minute and concurrency limits (429 beyond them)."""
    groups = ("tenant", *_group_by(group_by, ("key", "model", "end_user")))
    lease = request.app.state.completions.admit(auth)
    try:
        return await _report(request, auth.tenant_id, since, until, bucket, groups, format)
    finally:
        if lease is not None:
            lease.release(0)
