"""``/admin``: tenants, API keys, salt rotation, cache resets, audit log and usage (admin JWT only).

Every route depends on ``AdminPrincipal``; every mutation is audited with the JWT ``sub`` as the
actor. Responses never contain a salt (only its version) or a stored key hash; a new API key's
plaintext is in the create response only.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime
from functools import partial
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from app.auth import AdminPrincipal
from app.errors import APIError
from engine.protocol import EngineClient
from tenants.api_key_store import ApiKeyStore
from tenants.errors import TenantNotFound
from tenants.records import ApiKeyInfo, TenantInfo, UsageRecord
from tenants.salt_versions import SaltVersions
from tenants.tenant_store import MAX_LIMIT, MAX_TENANT_NAME_CHARS, TenantStore
from tenants.usage import AuditQuery, UsageStore
from tenants.usage_reports import csv_text

router = APIRouter(prefix="/admin", tags=["admin"])
schema_router = APIRouter(tags=["admin"])

# Fields where null means "no limit / no bound" (so "sent as null" differs from "not sent").
_NULLABLE_FIELDS = ("rpm_limit", "tpm_limit", "max_concurrent", "min_cache_blocks",
                    "max_cache_blocks")


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


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str | None = Field(None, max_length=255)
    # JSON has no datetime type: an ISO 8601 string (or unix seconds) is parsed.
    expires_at: datetime | None = Field(None, strict=False,
                                        description="timezone-aware ISO 8601, in the future")


def _tenants(request: Request) -> TenantStore:
    return request.app.state.repo.tenants


def _keys(request: Request) -> ApiKeyStore:
    return request.app.state.repo.keys


def _usage(request: Request) -> UsageStore:
    return request.app.state.repo.usage


async def _in_thread(fn: Any, *args: Any, _param: str | None = None, **kwargs: Any) -> Any:
    """Runs a blocking store call off the event loop; its ValueError is a 400 (``_param``
    names the field it is about)."""
    try:
        return await run_in_threadpool(partial(fn, *args, **kwargs))
    except ValueError as e:  # the repository's own validation messages are client-safe
        raise APIError(400, str(e), _param, "invalid_value") from None


def _tenant_out(t: TenantInfo) -> dict:
    return dataclasses.asdict(t)


def _key_out(k: ApiKeyInfo) -> dict:
    return dataclasses.asdict(k)


async def resolve_tenant(request: Request, name_or_id: str) -> TenantInfo:
    """The tenant a path or query names, by id or by name (ids first).

    Raises:
        TenantNotFound: neither exists (404, never an empty 200).
        APIError: 400 when the string is one tenant's id and another's name.
    """
    return await _in_thread(_tenants(request).resolve, name_or_id, _param="tenant")


async def _evict(request: Request, tenant_id: str | None, reason: str) -> int:
    engine: EngineClient = request.app.state.engine
    if tenant_id is None:
        return await engine.reset_prefix_cache()
    return await engine.evict_tenant_cache(tenant_id, reason)


# -- tenants --------------------------------------------------------------------------------------
@router.get("/tenants")
async def list_tenants(request: Request, _: AdminPrincipal) -> dict:
    tenants = await _in_thread(_tenants(request).list_all)
    return {"object": "list", "data": [_tenant_out(t) for t in tenants]}


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantCreate, request: Request, admin: AdminPrincipal) -> dict:
    """Creates a tenant (salt version 1). 409 when the name is taken."""
    t = await _in_thread(_tenants(request).create, body.name, _param="name",
                         enable_prefix_caching=body.enable_prefix_caching, actor=admin.subject)
    return _tenant_out(t)


@router.get("/tenants/{tenant}")
async def get_tenant(tenant: str, request: Request, _: AdminPrincipal) -> dict:
    """One tenant, by id or name."""
    return _tenant_out(await resolve_tenant(request, tenant))


@router.patch("/tenants/{tenant}")
async def update_tenant(tenant: str, body: TenantPatch, request: Request,
                        admin: AdminPrincipal) -> dict:
    """Changes flags and limits (tenant by id or name). Turning prefix caching off also drops
    the tenant's cached blocks (reason ``reset``), so nothing of theirs stays cached."""
    tenants = _tenants(request)
    limits = {k: getattr(body, k) for k in _NULLABLE_FIELDS if k in body.model_fields_set}
    before = await resolve_tenant(request, tenant)
    tenant_id = before.id
    t = await _in_thread(tenants.update, tenant_id, disabled=body.disabled,
                         enable_prefix_caching=body.enable_prefix_caching, weight=body.weight,
                         actor=admin.subject, **limits)
    if before.enable_prefix_caching and not t.enable_prefix_caching:
        dropped = await _evict(request, tenant_id, "reset")
        await _in_thread(_usage(request).audit, admin.subject, "cache.reset", tenant_id,
                         f"blocks={dropped} salt_version={t.current_salt_version} "
                         "cause=prefix_caching_off")
    return _tenant_out(t)


@router.post("/tenants/{tenant}/rotate-salt")
async def rotate_salt(tenant: str, request: Request, admin: AdminPrincipal) -> dict:
    """New salt version, current at once; the tenant's cached blocks are dropped (reason
    ``salt_rotation``). Running requests finish unharmed. Returns the version, never the salt."""
    tenant_id = (await resolve_tenant(request, tenant)).id
    version = await _in_thread(_tenants(request).rotate_salt, tenant_id, actor=admin.subject)
    versions: SaltVersions = request.app.state.salt_versions
    versions.note_rotated(tenant_id, version)  # evicted here: no second eviction on next auth
    dropped = await _evict(request, tenant_id, "salt_rotation")
    return {"tenant_id": tenant_id, "salt_version": version, "blocks_dropped": dropped}


@router.post("/tenants/{tenant}/cache/reset")
async def reset_tenant_cache(tenant: str, request: Request, admin: AdminPrincipal) -> dict:
    """Drops every cached block of one tenant (reason ``reset``); running requests unharmed."""
    t = await resolve_tenant(request, tenant)
    dropped = await _evict(request, t.id, "reset")
    await _in_thread(_usage(request).audit, admin.subject, "cache.reset", t.id,
                     f"blocks={dropped} salt_version={t.current_salt_version}")
    return {"tenant_id": t.id, "blocks_dropped": dropped}


@router.get("/cache")
async def cache_stats(request: Request, _: AdminPrincipal) -> dict:
    """The KV block pool and each tenant's prefix-cache accounting, without Prometheus:
    blocks (total, free, used, cached), and per tenant resident blocks, queried and hit
    prompt tokens (cumulative since start), hit rate and evicted blocks by reason. Tenant
    names beside ids (``null`` for a tenant deleted since, or tenantless requests)."""
    engine: EngineClient = request.app.state.engine
    snap = await engine.stats()
    names = {t.id: t.name for t in await _in_thread(_tenants(request).list_all)}
    tenants = []
    for tenant_id, st in sorted(snap.tenants.items(), key=lambda kv: str(kv[0])):
        q = st.prefix_cache_queries
        tenants.append({
            "tenant_id": tenant_id, "tenant_name": names.get(tenant_id or ""),
            "resident_blocks": st.resident_blocks, "cache_share_blocks": st.cache_share_blocks,
            "queried_tokens": q, "hit_tokens": st.prefix_cache_hits,
            "hit_rate": st.prefix_cache_hits / q if q else None,
            "evictions": dict(st.evictions)})
    return {"num_blocks_total": snap.num_blocks_total, "num_blocks_free": snap.num_blocks_free,
            "num_blocks_used": snap.num_blocks_used, "num_blocks_cached": snap.num_blocks_cached,
            "kv_cache_usage": snap.kv_cache_usage, "hit_rate": snap.hit_rate,
            "evictions": dict(snap.evictions), "tenants": tenants}


@router.post("/cache/reset")
async def reset_cache(request: Request, admin: AdminPrincipal) -> dict:
    """Drops every cached block of every tenant; running requests unharmed."""
    dropped = await _evict(request, None, "reset")
    await _in_thread(_usage(request).audit, admin.subject, "cache.reset_all", None,
                     f"blocks={dropped}")
    return {"blocks_dropped": dropped}


# -- API keys -------------------------------------------------------------------------------------
@router.get("/tenants/{tenant}/keys")
async def list_keys(tenant: str, request: Request, _: AdminPrincipal) -> dict:
    """The tenant's keys (no secrets), with ``last_used_at``."""
    keys = await _in_thread(_keys(request).list_for_tenant, (await resolve_tenant(request, tenant)).id)
    return {"object": "list", "data": [_key_out(k) for k in keys]}


@router.post("/tenants/{tenant}/keys", status_code=201)
async def create_key(tenant: str, body: KeyCreate, request: Request,
                     admin: AdminPrincipal) -> dict:
    """Creates an API key. ``key`` (the plaintext) is in this response only, never again."""
    tenant_id = (await resolve_tenant(request, tenant)).id
    token, info = await _in_thread(_keys(request).create, tenant_id, body.name,
                                   body.expires_at, _param="expires_at", actor=admin.subject)
    return {**_key_out(info), "key": token}


@router.post("/keys/{key_id}/revoke")
async def revoke_key(key_id: str, request: Request, admin: AdminPrincipal) -> dict:
    """Revokes a key (idempotent); refused from the next request on."""
    return _key_out(await _in_thread(_keys(request).revoke, key_id, actor=admin.subject))


# -- platform tokens ------------------------------------------------------------------------------
class TokenRevoke(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    jti: str = Field(min_length=1, max_length=64,
                     description="the token's jti (printed by `saltserve token issue`)")


@router.post("/tokens/revoke")
async def revoke_token(body: TokenRevoke, request: Request, admin: AdminPrincipal) -> dict:
    """Revokes a platform JWT by its ``jti`` (idempotent): refused from its next request on."""
    revoked_at = await _in_thread(request.app.state.repo.revocations.revoke, body.jti,
                                  _param="jti", actor=admin.subject)
    return {"jti": body.jti, "revoked_at": revoked_at}


# -- audit and usage ------------------------------------------------------------------------------
@router.get("/audit")
async def audit_log(request: Request, _: AdminPrincipal, tenant: str | None = None,
                    action: str | None = Query(None, max_length=64),
                    actor: str | None = Query(None, max_length=255),
                    since: datetime | None = None, until: datetime | None = None,
                    cursor: str | None = Query(None, max_length=32),
                    limit: int = Query(100, ge=1, le=1000)) -> dict:
    """Audit rows, newest first, filtered by ``tenant``, ``action``, ``actor`` and time
    (``since`` inclusive, ``until`` exclusive; timezone-aware ISO 8601). Pages: pass the
    previous page's ``next_cursor`` as ``cursor`` (None on the last page). Rows hold salt
    versions and key ids, never salts or secrets."""
    before_id = None
    if cursor is not None:
        if not re.fullmatch(r"[0-9]{1,18}", cursor):
            raise APIError(400, "cursor must be a next_cursor value from a previous page",
                           "cursor", "invalid_value")
        before_id = int(cursor)
    tenant_id = None
    if tenant is not None:  # audit rows outlive tenants: a removed tenant's id still filters
        try:
            tenant_id = (await resolve_tenant(request, tenant)).id
        except TenantNotFound:
            if not re.fullmatch(r"[0-9a-f]{32}", tenant):
                raise
            tenant_id = tenant
    query = AuditQuery(tenant_id=tenant_id, action=action, actor=actor, since=since, until=until,
                       before_id=before_id)
    rows = await _in_thread(_usage(request).list_audit, limit=limit + 1, query=query,
                            _param="since")
    more = len(rows) > limit
    rows = rows[:limit]
    return {"object": "list", "data": [dataclasses.asdict(r) for r in rows], "has_more": more,
            "next_cursor": str(rows[-1].id) if more else None}


_USAGE_COLUMNS = [f.name for f in dataclasses.fields(UsageRecord)]
@router.get("/usage", response_model=None)
async def usage(request: Request, _: AdminPrincipal, tenant: str | None = None,
                since: datetime | None = None, until: datetime | None = None,
                limit: int | None = Query(None, ge=1, le=100_000),
                end_user: str | None = Query(None, max_length=256),
                bucket_s: int | None = Query(None, include_in_schema=False),
                format: Literal["json", "csv"] = "json") -> dict | Response:
    """Usage records, one per call, oldest first (sums per bucket: ``/admin/usage/report``).
    ``since``/``until`` must carry a timezone; ``end_user``: only calls a tenant made for this
    end user (OpenAI ``user``)."""
    if bucket_s is not None:  # removed: sums per bucket come from SQL now
        raise APIError(400, "bucket_s is gone: use GET /admin/usage/report?bucket=1m|1h|1d",
                       "bucket_s", "unsupported_parameter")
    tenant_id = None if tenant is None else (await resolve_tenant(request, tenant)).id
    records = await _in_thread(_usage(request).list_usage, tenant_id, since, until, limit,
                               end_user)
    rows, columns = [dataclasses.asdict(r) for r in records], _USAGE_COLUMNS
    if format == "json":
        return {"object": "list", "data": rows}
    return Response(csv_text(rows, columns), media_type="text/csv")


@schema_router.get("/openapi.json", include_in_schema=False)
async def openapi_schema(request: Request, _: AdminPrincipal) -> dict:
    """The OpenAPI schema, for admins only (FastAPI's public /openapi.json, /docs and /redoc are
    turned off)."""
    return request.app.openapi()
