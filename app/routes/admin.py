"""``/admin``: tenants, API keys, salt rotation, cache resets, audit log and usage (admin JWT only).

Every route depends on ``AdminPrincipal``; every mutation is audited with the JWT ``sub`` as the
actor. Responses never contain a salt (only its version) or a stored key hash; a new API key's
plaintext is in the create response only.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from app.auth import AdminPrincipal
from app.deps import AdminServiceDep, RepoDep
from app.errors import APIError
from app.services.admin import NULLABLE_LIMITS, RETENTION_SETTINGS, AdminService, in_thread
from tenants.api_key_store import MAX_KEY_NAME_CHARS
from tenants.records import ApiKeyInfo, TenantInfo, UsageRecord
from tenants.tenant_store import MAX_LIMIT, MAX_TENANT_NAME_CHARS
from tenants.usage_reports import csv_text

router = APIRouter(prefix="/admin", tags=["admin"])
schema_router = APIRouter(tags=["admin"])


# Admin bodies are strict (no coercion): ``"yes"`` is not a bool, ``true`` and ``"5"`` are not
# numbers; every number has bounds its column can hold. A bad field is a 400 naming it.
class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=MAX_TENANT_NAME_CHARS,
                      description="printable, not 32 hex characters, unique ignoring case")
    enable_prefix_caching: bool = True


class TenantPatch(BaseModel):
    """Only the fields sent are changed. Limits: an int >= 1, or null for unlimited.

    Capacity share (applies from the tenant's next request): ``weight`` (int in [1, 1000]) is
    the tenant's share of each engine step's token budget and of the cached KV blocks relative
    to the other tenants; ``min_cache_blocks`` / ``max_cache_blocks`` (int >= 0, or null for
    no bound) clamp its cache share."""

    model_config = ConfigDict(extra="forbid", strict=True)
    disabled: bool | None = None
    enable_prefix_caching: bool | None = None
    rpm_limit: int | None = Field(None, ge=1, le=MAX_LIMIT)
    tpm_limit: int | None = Field(None, ge=1, le=MAX_LIMIT)
    max_concurrent: int | None = Field(None, ge=1, le=MAX_LIMIT)
    weight: int | None = Field(None, ge=1, le=1000)
    min_cache_blocks: int | None = Field(None, ge=0, le=MAX_LIMIT)
    max_cache_blocks: int | None = Field(None, ge=0, le=MAX_LIMIT)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="retention of calls that ask none (OpenAI prompt_cache_retention); "
                          "null: 24h")
    max_prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="the longest a call may ask; in_memory: nothing of the tenant's is "
                          "written to an offload tier; null: 24h")


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str | None = Field(None, max_length=MAX_KEY_NAME_CHARS)
    # JSON has no datetime type: an ISO 8601 string (or unix seconds) is parsed.
    expires_at: datetime | None = Field(None, strict=False,
                                        description="timezone-aware ISO 8601, in the future")


def _tenant_out(t: TenantInfo) -> dict:
    return dataclasses.asdict(t)


def _key_out(k: ApiKeyInfo) -> dict:
    return dataclasses.asdict(k)


async def resolve_tenant(svc: AdminService, name_or_id: str) -> TenantInfo:
    """The tenant a path or query names, by id or by name (``AdminService.resolve_tenant``)."""
    return await svc.resolve_tenant(name_or_id)


# -- tenants --------------------------------------------------------------------------------------
@router.get("/tenants")
async def list_tenants(_: AdminPrincipal, svc: AdminServiceDep) -> dict:
    tenants = await svc.list_tenants()
    return {"object": "list", "data": [_tenant_out(t) for t in tenants]}


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantCreate, admin: AdminPrincipal,
                        svc: AdminServiceDep) -> dict:
    """Creates a tenant (salt version 1). 409 when the name is taken."""
    return _tenant_out(await svc.create_tenant(
        body.name, body.enable_prefix_caching, admin.subject))


@router.get("/tenants/{tenant}")
async def get_tenant(tenant: str, _: AdminPrincipal, svc: AdminServiceDep) -> dict:
    """One tenant, by id or name."""
    return _tenant_out(await resolve_tenant(svc, tenant))


@router.patch("/tenants/{tenant}")
async def update_tenant(tenant: str, body: TenantPatch, admin: AdminPrincipal,
                        svc: AdminServiceDep) -> dict:
    """Changes flags and limits (tenant by id or name). Turning prefix caching off also drops
    the tenant's cached blocks (reason ``reset``), so nothing of theirs stays cached."""
    limits = {k: getattr(body, k) for k in (*NULLABLE_LIMITS, *RETENTION_SETTINGS)
              if k in body.model_fields_set}
    return _tenant_out(await svc.update_tenant(
        tenant, admin.subject, disabled=body.disabled,
        enable_prefix_caching=body.enable_prefix_caching, weight=body.weight, **limits))


@router.post("/tenants/{tenant}/rotate-salt")
async def rotate_salt(tenant: str, admin: AdminPrincipal, svc: AdminServiceDep) -> dict:
    """New salt version, current at once; the tenant's cached blocks are dropped (reason
    ``salt_rotation``). Running requests finish unharmed. Returns the version, never the salt."""
    return await svc.rotate_salt(tenant, admin.subject)


@router.post("/tenants/{tenant}/cache/reset")
async def reset_tenant_cache(tenant: str, admin: AdminPrincipal,
                             svc: AdminServiceDep) -> dict:
    """Drops every cached block of one tenant (reason ``reset``); running requests unharmed."""
    return await svc.reset_tenant_cache(tenant, admin.subject)


@router.get("/cache")
async def cache_stats(_: AdminPrincipal, svc: AdminServiceDep) -> dict:
    """The KV block pool and each tenant's prefix-cache accounting, without Prometheus:
    blocks (total, free, used, cached), and per tenant resident blocks, queried and hit
    prompt tokens (cumulative since start), hit rate and evicted blocks by reason. Tenant
    names beside ids (``null`` for a tenant deleted since, or tenantless requests)."""
    return await svc.cache_stats()


@router.post("/cache/reset")
async def reset_cache(admin: AdminPrincipal, svc: AdminServiceDep) -> dict:
    """Drops every cached block of every tenant; running requests unharmed."""
    return await svc.reset_cache(admin.subject)


# -- API keys -------------------------------------------------------------------------------------
@router.get("/tenants/{tenant}/keys")
async def list_keys(tenant: str, _: AdminPrincipal, svc: AdminServiceDep) -> dict:
    """The tenant's keys (no secrets), with ``last_used_at``."""
    keys = await svc.list_keys(tenant)
    return {"object": "list", "data": [_key_out(k) for k in keys]}


@router.post("/tenants/{tenant}/keys", status_code=201)
async def create_key(tenant: str, body: KeyCreate, admin: AdminPrincipal,
                     svc: AdminServiceDep) -> dict:
    """Creates an API key. ``key`` (the plaintext) is in this response only, never again."""
    token, info = await svc.create_key(tenant, body.name, body.expires_at,
                                                   admin.subject)
    return {**_key_out(info), "key": token}


@router.post("/keys/{key_id}/revoke")
async def revoke_key(key_id: str, admin: AdminPrincipal, svc: AdminServiceDep) -> dict:
    """Revokes a key (idempotent); refused from the next request on."""
    return _key_out(await svc.revoke_key(key_id, admin.subject))


# -- platform tokens ------------------------------------------------------------------------------
class TokenRevoke(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    jti: str = Field(min_length=1, max_length=64,
                     description="the token's jti (printed by `saltserve token issue`)")


@router.post("/tokens/revoke")
async def revoke_token(body: TokenRevoke, admin: AdminPrincipal, repo: RepoDep) -> dict:
    """Revokes a platform JWT by its ``jti`` (idempotent): refused from its next request on."""
    revoked_at = await in_thread(repo.revocations.revoke, body.jti,
                                  _param="jti", actor=admin.subject)
    return {"jti": body.jti, "revoked_at": revoked_at}


# -- audit and usage ------------------------------------------------------------------------------
@router.get("/audit")
async def audit_log(_: AdminPrincipal, svc: AdminServiceDep, tenant: str | None = None,
                    action: str | None = Query(None, max_length=64),
                    actor: str | None = Query(None, max_length=255),
                    since: datetime | None = None, until: datetime | None = None,
                    cursor: str | None = Query(None, max_length=32),
                    limit: int = Query(100, ge=1, le=1000)) -> dict:
    """Audit rows, newest first, filtered by ``tenant``, ``action``, ``actor`` and time
    (``since`` inclusive, ``until`` exclusive; timezone-aware ISO 8601). Pages: pass the
    previous page's ``next_cursor`` as ``cursor`` (None on the last page). Rows hold salt
    versions and key ids, never salts or secrets."""
    page = await svc.audit_page(tenant=tenant, action=action, actor=actor,
                                            since=since, until=until, cursor=cursor,
                                            limit=limit)
    return {"object": "list", "data": [dataclasses.asdict(r) for r in page.rows],
            "has_more": page.next_cursor is not None, "next_cursor": page.next_cursor}


_USAGE_COLUMNS = [f.name for f in dataclasses.fields(UsageRecord)]
@router.get("/usage", response_model=None)
async def usage(_: AdminPrincipal, svc: AdminServiceDep, repo: RepoDep,
                tenant: str | None = None,
                since: datetime | None = None, until: datetime | None = None,
                limit: int | None = Query(None, ge=1, le=100_000),
                end_user: str | None = Query(None, max_length=256),
                bucket_s: int | None = Query(None, include_in_schema=False),
                format: Literal["json", "csv"] = "json") -> dict | Response:
    """Usage records, one per call, oldest first (sums per bucket: ``/admin/usage/report``).
    ``since``/``until`` must carry a timezone; ``end_user``: only calls a tenant made for this
    end user (OpenAI ``user``)."""
    if bucket_s is not None:  # sums per bucket: GET /admin/usage/report
        raise APIError(400, "bucket_s is gone: use GET /admin/usage/report?bucket=1m|1h|1d",
                       "bucket_s", "unsupported_parameter")
    tenant_id = None if tenant is None else (await resolve_tenant(svc, tenant)).id
    records = await in_thread(repo.usage.list_usage, tenant_id, since, until,
                              limit, end_user)
    rows, columns = [dataclasses.asdict(r) for r in records], _USAGE_COLUMNS
    if format == "json":
        return {"object": "list", "data": rows}
    return Response(csv_text(rows, columns), media_type="text/csv")


@schema_router.get("/openapi.json", include_in_schema=False)
async def openapi_schema(request: Request, _: AdminPrincipal) -> dict:
    """The OpenAPI schema, for admins only (FastAPI's public /openapi.json, /docs and /redoc are
    turned off)."""
    return request.app.openapi()
