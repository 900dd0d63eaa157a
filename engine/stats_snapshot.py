"""``take_snapshot``: the scheduler's and its block pool's accounting as one frozen
``EngineStatsSnapshot`` (``engine.stats``). Kept apart from ``engine.stats`` because it reads
the scheduler, which itself imports ``engine.stats``."""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from engine.stats import (
    EVICTION_REASONS,
    EngineStatsSnapshot,
    EvictionCount,
    OffloadSnapshot,
    TenantId,
    TenantStats,
    TierSnapshot,
)

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


def take_snapshot(scheduler: Scheduler) -> EngineStatsSnapshot:
    """Copies the scheduler's and its block pool's accounting into a frozen snapshot.

    Call on the thread that owns the scheduler (the engine thread); O(tenants^2 + reasons), never
    O(num_blocks). Never modifies any state.
    """
    pool = scheduler.kv.block_pool
    pstats, sstats = pool.stats, scheduler.stats
    ids: set[TenantId] = (set(sstats.per_tenant_queries) | set(sstats.per_tenant_recomputed_tokens)
                          | set(pstats.resident_blocks))
    evictions: dict[TenantId, dict[str, int]] = {}
    caused: dict[TenantId, dict[TenantId, int]] = {}
    rows = []
    for (owner, reason, by), n in sorted(pstats.evictions.items(), key=_row_key):
        rows.append(EvictionCount(owner, reason, by, n))
        _add(evictions.setdefault(owner, dict.fromkeys(EVICTION_REASONS, 0)), reason, n)
        ids.add(owner)
        if reason == "capacity":
            _add(caused.setdefault(by, {}), owner, n)
            ids.add(by)
    offload, offload_bytes, offload_share = _offload(scheduler.kv.offloader,
                                                     len(scheduler.loading))
    ids |= set(sstats.per_tenant_tier_hits) | set(offload_bytes)
    tenants = {
        t: TenantStats(
            prefix_cache_queries=sstats.per_tenant_queries.get(t, 0),
            prefix_cache_hits=sstats.per_tenant_hits.get(t, 0),
            prefix_cache_recomputed_tokens=sstats.per_tenant_recomputed_tokens.get(t, 0),
            resident_blocks=pstats.resident_blocks.get(t, 0),
            evictions=MappingProxyType(evictions.get(t, dict.fromkeys(EVICTION_REASONS, 0))),
            evictions_caused=MappingProxyType(caused.get(t, {})),
            cache_share_blocks=pool.cache_share(t),
            over_share_evictions=pstats.over_share_evictions.get(t, 0),
            prefix_cache_tier_hits=sstats.per_tenant_tier_hits.get(t, 0),
            offload_bytes=MappingProxyType(offload_bytes.get(t, {})),
            offload_share_bytes=MappingProxyType(offload_share.get(t, {})))
        for t in sorted(ids, key=lambda t: (t is not None, t or ""))}
    num_free = pool.get_num_free_blocks()
    return EngineStatsSnapshot(
        num_blocks_total=pool.num_blocks, num_blocks_free=num_free,
        num_blocks_used=pool.num_used_blocks, num_blocks_cached=pool.get_num_cached_blocks(),
        kv_cache_usage=pool.get_usage(),
        num_requests_running=len(scheduler.running),
        num_requests_waiting=len(scheduler.waiting) + len(scheduler.loading),
        num_preemptions=sstats.num_preemptions,
        num_share_preemptions=sstats.num_share_preemptions,
        prefix_cache_queries=sstats.prefix_cache_queries,
        prefix_cache_hits=sstats.prefix_cache_hits,
        prefix_cache_recomputed_tokens=sstats.num_recomputed_tokens,
        evictions=MappingProxyType(dict(pstats.num_evictions)),
        eviction_counts=tuple(rows),
        tenants=MappingProxyType(tenants),
        over_share_evictions=pstats.num_over_share_evictions, offload=offload)


def _offload(offloader, loads_in_flight: int) -> tuple[
        OffloadSnapshot | None, dict[TenantId, dict[str, int]], dict[TenantId, dict[str, int]]]:
    """The tiers' snapshot, and each tenant's bytes and fair-share bytes per tier (bytes of
    tenants this process has not served since start are the tier's ``unclaimed_bytes``)."""
    if offloader is None:
        return None, {}, {}
    held: dict[TenantId, dict[str, int]] = {}
    shares: dict[TenantId, dict[str, int]] = {}
    tiers = []
    for tier in offloader.tiers:
        u, s = tier.usage(), offloader.stats.tiers[tier.name]
        (owners, unclaimed), (owner_shares, _) = offloader.by_tenant(
            tier, u.owner_bytes, u.owner_share_bytes)
        for owner, n in owners.items():
            held.setdefault(owner or None, {})[tier.name] = n
        for owner, n in owner_shares.items():
            shares.setdefault(owner or None, {})[tier.name] = n
        tiers.append(TierSnapshot(
            name=tier.name, up=u.up, capacity_bytes=u.capacity_bytes, used_bytes=u.used_bytes,
            blobs=u.blobs, unclaimed_bytes=unclaimed, evicted_blobs=u.evicted,
            dropped_blobs=s.dropped + getattr(tier, "deferred_deleted", 0),
            written_blocks=s.written, written_bytes=s.written_bytes, write_failed=s.write_failed,
            loaded_blocks=s.loaded, loaded_bytes=s.loaded_bytes, load_failed=s.load_failed))
    s = offloader.stats
    return OffloadSnapshot(
        tiers=tuple(tiers), write_dropped=s.write_dropped, loaded_blocks=s.loaded,
        loaded_bytes=s.loaded_bytes, load_missing=s.load_missing, load_jobs=s.load_jobs,
        load_seconds=s.load_seconds, load_seconds_buckets=tuple(s.load_seconds_buckets),
        loads_in_flight=loads_in_flight), held, shares


def _add(d: dict, key: object, n: int) -> None:
    d[key] = d.get(key, 0) + n


def _row_key(item: tuple[tuple[TenantId, str, TenantId], int]) -> tuple:
    (owner, reason, by), _ = item
    return (owner or "", reason, by or "")
