"""Operator actions, shared by the JSON admin API (``app.routes.admin``) and the console
(``app.routes.console``): one implementation of each action, so both audit and evict alike.

Every blocking store call runs off the event loop; a store's ``ValueError`` (its own,
client-safe validation message) becomes a 400 ``APIError``. Mutations are audited with the
caller's ``actor`` (the admin JWT ``sub``). Results never hold a salt or a key hash; a new key's
plaintext is returned by ``create_key`` only.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from datetime import datetime
from functools import partial
from typing import Any

from starlette.concurrency import run_in_threadpool

from app.errors import APIError
from app.services.cache_generations import CacheGenerationService
from engine.protocol import EngineClient
from tenants.errors import TenantNotFound
from tenants.records import ApiKeyInfo, AuditEntry, TenantInfo
from tenants.repository import TenantRepository
from tenants.usage import AuditQuery, UsageStore
from tenants.usage_reports import UsageReportRow, default_query

logger = logging.getLogger(__name__)

# TenantPatch fields where None means "no limit / no bound" (so "sent as None" differs from
# "not sent"): passed to the store only when present.
NULLABLE_LIMITS = ("rpm_limit", "tpm_limit", "max_concurrent", "min_cache_blocks",
                   "max_cache_blocks")
# TenantPatch fields of OpenAI's prompt_cache_retention ("in_memory" | "24h"; None: "24h").
RETENTION_SETTINGS = ("prompt_cache_retention", "max_prompt_cache_retention")


async def in_thread(fn: Any, *args: Any, _param: str | None = None, **kwargs: Any) -> Any:
    """Runs a blocking store call off the event loop; its ValueError is a 400 (``_param``
    names the field it is about)."""
    try:
        return await run_in_threadpool(partial(fn, *args, **kwargs))
    except ValueError as e:  # the stores' own validation messages are client-safe
        raise APIError(400, str(e), _param, "invalid_value") from None


@dataclasses.dataclass(frozen=True)
class AuditPage:
    """One page of the audit log, newest first; ``next_cursor`` is None on the last page."""

    rows: list[AuditEntry]
    next_cursor: str | None


class AdminService:
    """Tenants, keys, salts, caches and audit, for an admin ``actor``.

    Evictions (rotation, resets, caching off) go through ``generations``, which drops the same
    blocks on every replica.

    Args:
        repo: the tenant repository (stores for tenants, keys, usage and audit).
        engine: the engine client (cache statistics).
        generations: the cache-generation rule (``app.services.cache_generations``).
    """

    def __init__(self, repo: TenantRepository, engine: EngineClient,
                 generations: CacheGenerationService) -> None:
        self.repo, self.engine, self.generations = repo, engine, generations

    # -- tenants ----------------------------------------------------------------------------
    async def resolve_tenant(self, name_or_id: str) -> TenantInfo:
        """The tenant a path or query names, by id or by name (ids first).

        Raises:
            TenantNotFound: neither exists (404, never an empty 200).
            APIError: 400 when the string is one tenant's id and another's name.
        """
        return await in_thread(self.repo.tenants.resolve, name_or_id, _param="tenant")

    async def list_tenants(self) -> list[TenantInfo]:
        return await in_thread(self.repo.tenants.list_all)

    async def create_tenant(self, name: str, enable_prefix_caching: bool,
                            actor: str) -> TenantInfo:
        """Creates a tenant (salt version 1). Raises DuplicateTenant (409) for a taken name,
        APIError 400 for a bad one."""
        return await in_thread(self.repo.tenants.create, name, _param="name",
                               enable_prefix_caching=enable_prefix_caching, actor=actor)

    async def update_tenant(self, tenant: str, actor: str, **changes: Any) -> TenantInfo:
        """Changes flags, limits and share (``TenantStore.update`` keywords; limits in
        ``NULLABLE_LIMITS`` only when given). Disabling the tenant or turning its prefix caching
        off also drops its cached blocks, in the pool and the offload tiers (reason ``reset``,
        audited ``cache.reset`` with the tier bytes), so nothing of theirs stays cached."""
        before = await self.resolve_tenant(tenant)
        if drops_cache := (before.enable_prefix_caching and changes.get(
                "enable_prefix_caching") is False) or (not before.disabled and changes.get(
                "disabled") is True):
            tier = await self._tier_bytes(before.id)
        after = await in_thread(self.repo.tenants.update, before.id, actor=actor, **changes)
        if drops_cache and after.cache_epoch != before.cache_epoch:
            dropped = await self.generations.applied(after, "reset")  # the update bumped the epoch
            cause = "disabled" if after.disabled and not before.disabled else "prefix_caching_off"
            await in_thread(self.repo.usage.audit, actor, "cache.reset", before.id,
                            f"blocks={dropped} salt_version={after.current_salt_version} "
                            f"cause={cause}" + self._tier_detail(tier))
        return after

    async def rotate_salt(self, tenant: str, actor: str) -> dict:
        """New salt version, current at once; the tenant's cached blocks are dropped (reason
        ``salt_rotation``). Running requests finish unharmed. Returns ``tenant_id``,
        ``salt_version`` and ``blocks_dropped``, never the salt."""
        t = await self.resolve_tenant(tenant)
        tier = await self._tier_bytes(t.id)
        version = await in_thread(self.repo.tenants.rotate_salt, t.id, actor=actor)
        dropped = await self.generations.applied(
            dataclasses.replace(t, current_salt_version=version), "salt_rotation")
        return {"tenant_id": t.id, "salt_version": version, "blocks_dropped": dropped,
                "tier_bytes_dropped": tier}

    async def _tier_bytes(self, tenant_id: str | None) -> dict[str, int]:
        """``tier -> bytes`` the tenant (every tenant for None) has in the offload tiers now:
        what a reset or rotation about to run makes unreadable and deletes."""
        snap = await self.engine.stats()
        out: dict[str, int] = {}
        for t, st in snap.tenants.items():
            if tenant_id is None or t == tenant_id:
                for name, n in st.offload_bytes.items():
                    out[name] = out.get(name, 0) + n
        return out

    @staticmethod
    def _tier_detail(tier: dict[str, int]) -> str:
        return "".join(f" {name}_bytes={n}" for name, n in sorted(tier.items()))

    # -- caches -----------------------------------------------------------------------------
    async def reset_tenant_cache(self, tenant: str, actor: str) -> dict:
        """Drops every cached block of one tenant (reason ``reset``, audited); running requests
        unharmed. Returns ``tenant_id`` and ``blocks_dropped``."""
        tenant_id = (await self.resolve_tenant(tenant)).id
        tier = await self._tier_bytes(tenant_id)
        [t] = await in_thread(self.repo.tenants.bump_cache_epoch, tenant_id)
        dropped = await self.generations.applied(t, "reset")
        await in_thread(self.repo.usage.audit, actor, "cache.reset", t.id,
                        f"blocks={dropped} salt_version={t.current_salt_version}"
                        + self._tier_detail(tier))
        return {"tenant_id": t.id, "blocks_dropped": dropped, "tier_bytes_dropped": tier}

    async def reset_cache(self, actor: str) -> dict:
        """Drops every cached block of every tenant (audited); running requests unharmed."""
        tier = await self._tier_bytes(None)
        tenants = await in_thread(self.repo.tenants.bump_cache_epoch, None)
        dropped = await self.generations.applied_to_all(tenants)
        await in_thread(self.repo.usage.audit, actor, "cache.reset_all", None,
                        f"blocks={dropped}" + self._tier_detail(tier))
        return {"blocks_dropped": dropped, "tier_bytes_dropped": tier}

    async def cache_stats(self) -> dict:
        """The KV block pool and each tenant's prefix-cache accounting: blocks (total, free,
        used, cached), and per tenant resident blocks, queried and hit prompt tokens
        (cumulative since start), hit rate and evicted blocks by reason. Tenant names beside
        ids (None for a tenant deleted since, or tenantless requests). With offload tiers:
        ``tiers`` (each tier's budget, occupancy, traffic and blobs gone by reason),
        ``offload`` (loads), and per tenant its tier hits, and its bytes and fair-share bytes
        in each tier."""
        snap = await self.engine.stats()
        names = {t.id: t.name for t in await self.list_tenants()}
        tenants = []
        for tenant_id, st in sorted(snap.tenants.items(), key=lambda kv: str(kv[0])):
            q = st.prefix_cache_queries
            tenants.append({
                "tenant_id": tenant_id, "tenant_name": names.get(tenant_id or ""),
                "resident_blocks": st.resident_blocks,
                "cache_share_blocks": st.cache_share_blocks,
                "queried_tokens": q, "hit_tokens": st.prefix_cache_hits,
                "hit_rate": st.prefix_cache_hits / q if q else None,
                "tier_hit_tokens": st.prefix_cache_tier_hits,
                "tier_bytes": dict(st.offload_bytes),
                "tier_share_bytes": dict(st.offload_share_bytes),
                "evictions": dict(st.evictions)})
        o = snap.offload
        return {"num_blocks_total": snap.num_blocks_total,
                "num_blocks_free": snap.num_blocks_free,
                "num_blocks_used": snap.num_blocks_used,
                "num_blocks_cached": snap.num_blocks_cached,
                "kv_cache_usage": snap.kv_cache_usage, "hit_rate": snap.hit_rate,
                "evictions": dict(snap.evictions), "tenants": tenants,
                "tiers": [] if o is None else [dataclasses.asdict(t) for t in o.tiers],
                "offload": None if o is None else {
                    "loads": o.load_jobs, "loaded_blocks": o.loaded_blocks,
                    "load_seconds": o.load_seconds, "loads_in_flight": o.loads_in_flight,
                    "load_misses": o.load_missing, "write_dropped_blocks": o.write_dropped}}

    # -- API keys ---------------------------------------------------------------------------
    async def list_keys(self, tenant: str) -> list[ApiKeyInfo]:
        """The tenant's keys (no secrets), with ``last_used_at``."""
        tenant_id = (await self.resolve_tenant(tenant)).id
        return await in_thread(self.repo.keys.list_for_tenant, tenant_id)

    async def create_key(self, tenant: str, name: str | None, expires_at: datetime | None,
                         actor: str) -> tuple[str, ApiKeyInfo]:
        """Creates an API key: (plaintext, info). The plaintext is never available again."""
        tenant_id = (await self.resolve_tenant(tenant)).id
        return await in_thread(self.repo.keys.create, tenant_id, name, expires_at,
                               _param="expires_at", actor=actor)

    async def revoke_key(self, key_id: str, actor: str) -> ApiKeyInfo:
        """Revokes a key (idempotent); refused from its next request on. Raises
        ApiKeyNotFound (404)."""
        return await in_thread(self.repo.keys.revoke, key_id, actor=actor)

    # -- audit and usage --------------------------------------------------------------------
    async def audit_page(self, *, tenant: str | None = None, action: str | None = None,
                         actor: str | None = None, since: datetime | None = None,
                         until: datetime | None = None, cursor: str | None = None,
                         limit: int = 100) -> AuditPage:
        """Audit rows, newest first, filtered by tenant (id or name; a removed tenant's
        32-hex id still filters, since rows outlive tenants), action, actor and time (``since``
        inclusive, ``until`` exclusive). ``cursor``: a previous page's ``next_cursor``.

        Raises:
            APIError 400: a bad cursor or a naive time. TenantNotFound: an unknown name.
        """
        before_id = None
        if cursor is not None:
            if not re.fullmatch(r"[0-9]{1,18}", cursor):
                raise APIError(400, "cursor must be a next_cursor value from a previous page",
                               "cursor", "invalid_value")
            before_id = int(cursor)
        tenant_id = None
        if tenant is not None:
            try:
                tenant_id = (await self.resolve_tenant(tenant)).id
            except TenantNotFound:
                if not re.fullmatch(r"[0-9a-f]{32}", tenant):
                    raise
                tenant_id = tenant
        query = AuditQuery(tenant_id=tenant_id, action=action, actor=actor, since=since,
                           until=until, before_id=before_id)
        rows = await in_thread(self.repo.usage.list_audit, limit=limit + 1, query=query,
                               _param="since")
        more = len(rows) > limit
        rows = rows[:limit]
        return AuditPage(rows, str(rows[-1].id) if more else None)


async def usage_report(usage: UsageStore, tenant_id: str | None, since: datetime | None,
                       until: datetime | None, bucket: str, group_by: tuple[str, ...]
                       ) -> tuple[list[UsageReportRow], tuple[datetime, datetime]]:
    """Usage per calendar bucket (``tenants.usage_reports``), in SQL off the event loop:
    (rows, the range counted; daily reports count whole UTC days). Serves operators (any
    tenant) and tenants (``tenant_id`` their own).

    Raises:
        APIError 400: the query's own checks (range, bucket count, grouping).
    """
    try:
        query = default_query(bucket, since, until, group_by, tenant_id)
        rows = await run_in_threadpool(usage.report, query)
        return rows, query.counted_range()
    except ValueError as e:  # the query's own checks: client-safe messages
        raise APIError(400, str(e), None, "invalid_value") from None
