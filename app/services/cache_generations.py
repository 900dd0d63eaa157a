"""The cache-generation rule, in one place.

A tenant's cached blocks belong to a generation: its salt version (bumped by a rotation) and its
cache epoch (bumped by a reset or by turning its caching off; ``TenantStore.bump_cache_epoch``).
When the generation moves on, the blocks of the older one are dropped **once, on every replica**:

======================================  =================================================
who notices                             what it calls
======================================  =================================================
this process changed it (admin API,     ``applied(tenant, reason)`` / ``applied_to_all``:
console)                                note it, evict here, broadcast to the others
another replica's broadcast             ``on_broadcast(tenant_id)``: re-read from the
(``app.cluster.ClusterListener``)       database, evict if newer than last seen
a request meets a newer generation      ``on_request(ctx)``: evict if newer (the fallback
(CLI rotation, a missed broadcast)      for a lost message; ``app.auth``)
======================================  =================================================

Blocks of an older salt can never be hit again whatever happens here (the salt is in their
hash): a late eviction costs memory until the tenant's next request, never isolation. Holds
tenant ids and integers only, never salts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal, Protocol

from starlette.concurrency import run_in_threadpool

from engine.protocol import EngineClient
from tenants.errors import TenantNotFound
from tenants.records import AuthContext, TenantInfo

__all__ = ["CacheEventBroadcast", "CacheGenerationService", "CacheGenerations", "EvictReason"]

logger = logging.getLogger(__name__)

EvictReason = Literal["salt_rotation", "reset"]


class CacheGenerations:
    """The last (salt version, cache epoch) seen per tenant in this process (starts empty).

    Thread-safe: one lock guards the map and every method is one short critical section.
    Memory: one entry per tenant seen since the process started.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, int]] = {}  # tenant id -> (salt version, cache epoch)

    def __repr__(self) -> str:
        with self._lock:
            return f"CacheGenerations(tenants={len(self._seen)})"

    def note_seen(self, tenant_id: str, salt_version: int,
                  cache_epoch: int = 0) -> EvictReason | None:
        """Records that a request (or a broadcast) carries this generation.

        Returns:
            Why the tenant's cached blocks must go when the generation is newer than the one
            last seen (``salt_rotation`` when the salt moved on, else ``reset``): exactly one
            caller per change gets it. None on the first sighting since start (nothing of this
            tenant can be cached yet) and when nothing is newer (a request that read the tenant
            before a change never moves the record back).
        """
        with self._lock:
            last = self._seen.get(tenant_id)
            if last is None:
                self._seen[tenant_id] = (salt_version, cache_epoch)
                return None
            newer_salt, newer_epoch = salt_version > last[0], cache_epoch > last[1]
            if not (newer_salt or newer_epoch):
                return None
            self._seen[tenant_id] = (max(salt_version, last[0]), max(cache_epoch, last[1]))
            return "salt_rotation" if newer_salt else "reset"

    def note_applied(self, tenant_id: str, salt_version: int, cache_epoch: int = 0) -> None:
        """Records a change to this generation that this process evicted for itself, so the
        next ``note_seen`` at it reports nothing. Never moves the record back."""
        with self._lock:
            last = self._seen.get(tenant_id, (0, 0))
            self._seen[tenant_id] = (max(salt_version, last[0]), max(cache_epoch, last[1]))

    def last_seen(self, tenant_id: str) -> tuple[int, int] | None:
        """The last (salt version, cache epoch) seen or applied for ``tenant_id``, or None."""
        with self._lock:
            return self._seen.get(tenant_id)


class CacheEventBroadcast(Protocol):
    """What the service needs of the replicas' broadcast (``app.cluster.ClusterBroadcast``)."""

    def announce(self, tenant_id: str | None, reason: str) -> None:
        """Tells the other replicas, in the background, never raising or waiting."""


class CacheGenerationService:
    """Drops a tenant's cached blocks once per generation change, on every replica.

    Args:
        engine: whose prefix cache the blocks are dropped from.
        get_tenant: the tenant by id from the database (``TenantStore.get``, blocking: run off
            the event loop); raises ``TenantNotFound``.
        list_tenants: every tenant from the database (``TenantStore.list_all``, blocking).
        broadcast: tells the other replicas; None for a single replica.
    """

    def __init__(self, engine: EngineClient, get_tenant: Callable[[str], TenantInfo],
                 list_tenants: Callable[[], list[TenantInfo]],
                 broadcast: CacheEventBroadcast | None = None) -> None:
        self._engine, self._broadcast = engine, broadcast
        self._get_tenant, self._list_tenants = get_tenant, list_tenants
        self.seen = CacheGenerations()

    def __repr__(self) -> str:
        return f"CacheGenerationService({self.seen!r}, broadcast={self._broadcast is not None})"

    async def on_request(self, ctx: AuthContext) -> int:
        """A request authenticated at ``ctx``'s generation: when it is newer than the one this
        process last saw (rotated by the CLI, or a broadcast that never arrived), the tenant's
        older blocks are dropped before the request goes on. Exactly one request per change
        evicts. Returns the blocks dropped (0 almost always)."""
        reason = self.seen.note_seen(ctx.tenant_id, ctx.salt_version, ctx.cache_epoch)
        if reason is None:
            return 0  # first sight since start, or nothing newer
        dropped = await self._engine.evict_tenant_cache(ctx.tenant_id, reason)
        logger.info("tenant %s moved to salt version %d, cache epoch %d (%s): dropped %d cached "
                    "blocks", ctx.tenant_id, ctx.salt_version, ctx.cache_epoch, reason, dropped)
        return dropped

    async def applied(self, tenant: TenantInfo, reason: EvictReason) -> int:
        """This process moved ``tenant`` to its (already committed) generation: notes it (so the
        tenant's next request does not evict again), drops its blocks here and tells the other
        replicas. Returns the blocks dropped here."""
        self.seen.note_applied(tenant.id, tenant.current_salt_version, tenant.cache_epoch)
        dropped = await self._engine.evict_tenant_cache(tenant.id, reason)
        if self._broadcast is not None:
            self._broadcast.announce(tenant.id, reason)
        return dropped

    async def applied_to_all(self, tenants: list[TenantInfo]) -> int:
        """This process reset every tenant's cache (each already at its new committed epoch):
        notes them all, drops every cached block here and tells the other replicas. Returns the
        blocks dropped here."""
        for t in tenants:
            self.seen.note_applied(t.id, t.current_salt_version, t.cache_epoch)
        dropped = await self._engine.reset_prefix_cache()
        if self._broadcast is not None:
            self._broadcast.announce(None, "reset")
        return dropped

    async def on_broadcast(self, tenant_id: str | None) -> int:
        """Another replica moved ``tenant_id`` (every tenant for None) on. The event is only a
        hint: generations are re-read from the database, and only a tenant whose generation is
        newer than this process last saw is evicted, so a forged or replayed event changes
        nothing. Returns the blocks dropped."""
        if tenant_id is None:
            tenants = await run_in_threadpool(self._list_tenants)
        else:
            try:
                tenants = [await run_in_threadpool(self._get_tenant, tenant_id)]
            except TenantNotFound:
                return 0
        dropped = 0
        for t in tenants:
            reason = self.seen.note_seen(t.id, t.current_salt_version, t.cache_epoch)
            if reason is not None:
                dropped += await self._engine.evict_tenant_cache(t.id, reason)
        logger.info("applied a cache event: %s, %d blocks dropped",
                    "every tenant" if tenant_id is None else f"tenant {tenant_id}", dropped)
        return dropped
