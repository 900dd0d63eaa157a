"""Usage reports over HTTP: ``GET /admin/usage/report`` (operators, any tenant) and
``GET /v1/usage`` (a tenant's own usage, with its own credentials). Both run
``tenants.usage_reports`` in SQL; see ``docs/admin.md``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from fastapi import APIRouter, Query, Response

from app.auth import AdminPrincipal, CurrentTenant
from app.deps import AdminServiceDep, CompletionsDep, RepoDep
from app.errors import APIError
from app.routes.admin import resolve_tenant
from app.services.admin import usage_report as run_usage_report
from tenants.usage import UsageStore
from tenants.usage_reports import (
    GROUP_BY,
    REPORT_COLUMNS,
    csv_text,
    report_dicts,
)

admin_router = APIRouter(prefix="/admin", tags=["admin"])
tenant_router = APIRouter(prefix="/v1", tags=["openai"])


def _group_by(text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in allowed]
    if bad:
        raise APIError(400, f"group_by takes a comma-separated list of {', '.join(allowed)}",
                       "group_by", "invalid_value")
    return parts


async def _report(usage: UsageStore, tenant_id: str | None, since: datetime | None,
                  until: datetime | None, bucket: str, group_by: tuple[str, ...],
                  fmt: str) -> dict | Response:
    """Answers JSON with the range the report counted (daily reports count whole UTC days), or
    CSV. Any refusal of the query is a 400 (``AdminService.usage_report``)."""
    rows, counted = await run_usage_report(usage, tenant_id, since, until, bucket, group_by)
    data = report_dicts(rows)
    if fmt == "csv":
        return Response(csv_text(data, REPORT_COLUMNS), media_type="text/csv")
    return {"object": "list", "bucket": bucket, "since": counted[0].isoformat(),
            "until": counted[1].isoformat(), "data": data}


@admin_router.get("/usage/report", response_model=None)
async def usage_report(_: AdminPrincipal, svc: AdminServiceDep, repo: RepoDep,
                       tenant: str | None = None,
                       since: datetime | None = None, until: datetime | None = None,
                       bucket: Literal["1m", "1h", "1d"] = "1d",
                       group_by: str = Query("tenant", max_length=64),
                       format: Literal["json", "csv"] = "json") -> dict | Response:
    """Usage per calendar bucket (UTC) and group: requests, errors, prompt / cached /
    completion tokens, hit rate, TTFT p50 / p95, tenant name beside the id. ``tenant`` by id
    or name (404 if unknown); ``group_by``: comma-separated ``tenant,key,model,end_user``;
    ``since`` / ``until`` timezone-aware (default: the last 3 hours, 2 days or 30 days; daily
    reports count whole UTC days, and the answer's ``since`` / ``until`` say which)."""
    tenant_id = None if tenant is None else (await resolve_tenant(svc, tenant)).id
    return await _report(repo.usage, tenant_id, since, until, bucket,
                         _group_by(group_by, GROUP_BY), format)


@tenant_router.get("/usage", response_model=None)
async def own_usage(auth: CurrentTenant, repo: RepoDep, completions: CompletionsDep,
                    since: datetime | None = None,
                    until: datetime | None = None, bucket: Literal["1m", "1h", "1d"] = "1d",
                    group_by: str = Query("", max_length=64),
                    format: Literal["json", "csv"] = "json") -> dict | Response:
    """The calling tenant's own usage (never another's), as ``/admin/usage/report``;
    ``group_by``: comma-separated ``key,model,end_user``. Counts against the tenant's
    requests-per-minute and concurrency limits (429 beyond them)."""
    groups = ("tenant", *_group_by(group_by, ("key", "model", "end_user")))
    lease = completions.admit(auth)
    try:
        return await _report(repo.usage, auth.tenant_id, since, until, bucket, groups, format)
    finally:
        if lease is not None:
            lease.release(0)
