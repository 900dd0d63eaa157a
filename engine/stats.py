"""Per-tenant prefix-cache accounting and the frozen engine stats snapshot (pure Python, stdlib).

Two mutable accumulators live on the engine thread:

- ``BlockPoolStats`` (owned by ``BlockPool``): evictions of cached blocks by owner, reason and
  evicting tenant, and the resident cached blocks of each owner (gauge).
- ``SchedulerStats`` (owned by ``Scheduler``): prefix-cache queries and hits (tokens, counted once
  per request at its first admission), recomputed tokens after preemption, preemptions.

``engine.stats_snapshot.take_snapshot`` copies both, plus the pool and queue gauges, into an
``EngineStatsSnapshot``:
plain frozen data that can cross threads (``AsyncLLM.call``) and be exported by the app
(``app/metrics.py``). Every global counter is kept independently of the per-tenant ones, so
``EngineStatsSnapshot.check_integrity`` (per-tenant sums equal the globals) is a real check.

Tenant ids are opaque; ``None`` is the tenant of requests submitted without one (offline use).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

TenantId = str | None

# Why a cached block lost its hash:
#   capacity       popped from the free queue for reuse by an allocation (lazy LRU eviction)
#   salt_rotation  the owner's salt was rotated: its old blocks became unreachable
#   reset          a global or per-tenant prefix-cache reset
#   fault          a failed engine step was writing the block's KV (engine.llm_engine.step)
EVICTION_REASONS: tuple[str, ...] = ("capacity", "salt_rotation", "reset", "fault")
# Reasons ``BlockPool.evict_cached_blocks`` takes (capacity is never explicit).
EXPLICIT_EVICTION_REASONS: tuple[str, ...] = ("salt_rotation", "reset", "fault")
# Reasons an operator may ask for (admin API, ``LLMEngine.evict_tenant_cache``).
OPERATOR_EVICTION_REASONS: tuple[str, ...] = ("salt_rotation", "reset")


def _add(d: dict, key: object, n: int) -> None:
    d[key] = d.get(key, 0) + n


@dataclass
class BlockPoolStats:
    """Cumulative block-level counters, updated by ``BlockPool`` (engine thread only).

    Attributes:
        evictions: ``(owner, reason, evicted_by) -> blocks``; ``evicted_by`` is the tenant whose
            allocation popped the block (reason ``capacity``), else None.
        num_evictions: ``reason -> blocks`` (global, kept independently of ``evictions``).
        resident_blocks: ``owner -> blocks that carry a hash now`` (free or in use; a gauge).
            A ``Counter``: an unknown owner reads 0; owners whose count fell to 0 stay, with 0.
        over_share_evictions: ``owner -> capacity evictions`` that took the owner's block
            because it was over its cache share (not plain LRU order).
        num_over_share_evictions: the same, global (kept independently).
    """

    evictions: dict[tuple[TenantId, str, TenantId], int] = field(default_factory=dict)
    num_evictions: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    resident_blocks: Counter[TenantId] = field(default_factory=Counter)
    over_share_evictions: dict[TenantId, int] = field(default_factory=dict)
    num_over_share_evictions: int = 0

    def record_cached(self, owner: TenantId) -> None:
        """A block of ``owner`` became hittable."""
        _add(self.resident_blocks, owner, 1)

    def record_uncached(self, owner: TenantId) -> None:
        """A private block of ``owner`` lost its hash when its last holder freed it (not an
        eviction: ``EngineRequest.private_cache``)."""
        assert self.resident_blocks.get(owner, 0) > 0, "uncaching a block that is not resident"
        self.resident_blocks[owner] -= 1

    def record_eviction(self, owner: TenantId, reason: str, evicted_by: TenantId,
                        over_share: bool = False) -> None:
        """A block of ``owner`` lost its hash for ``reason`` (one of ``EVICTION_REASONS``);
        ``over_share``: taken because the owner was over its cache share (capacity only)."""
        assert reason in EVICTION_REASONS, f"unknown eviction reason {reason!r}"
        assert self.resident_blocks.get(owner, 0) > 0, "eviction of a block that is not resident"
        assert not over_share or reason == "capacity"
        self.resident_blocks[owner] -= 1
        _add(self.evictions, (owner, reason, evicted_by if reason == "capacity" else None), 1)
        self.num_evictions[reason] += 1
        if over_share:
            _add(self.over_share_evictions, owner, 1)
            self.num_over_share_evictions += 1


@dataclass
class SchedulerStats:
    """Cumulative scheduler counters (tokens unless named otherwise; engine thread only).

    Queries and hits are counted once per request, at its first admission, and only for requests
    that look the cache up (prefix caching on globally and for the request), as in vLLM v1. A
    waiting request that is retried because the pool was full counts nothing until admitted; a
    preempted request's re-admission counts only ``num_recomputed_tokens`` (never a hit).
    """

    prefix_cache_queries: int = 0      # prompt tokens looked up at first admission
    prefix_cache_hits: int = 0         # of those, tokens served from the cache
    num_preemptions: int = 0           # requests preempted (count)
    num_share_preemptions: int = 0     # of those, preempted to admit a tenant under its share
    num_recomputed_tokens: int = 0     # tokens recomputed after preemption
    per_tenant_queries: dict[TenantId, int] = field(default_factory=dict)
    per_tenant_hits: dict[TenantId, int] = field(default_factory=dict)
    per_tenant_recomputed_tokens: dict[TenantId, int] = field(default_factory=dict)
    # Of the hits, tokens loaded from the offload tiers (engine.kv_offload).
    prefix_cache_tier_hits: int = 0
    per_tenant_tier_hits: dict[TenantId, int] = field(default_factory=dict)

    def record_first_admission(self, tenant: TenantId, num_query_tokens: int,
                               num_hit_tokens: int, num_tier_tokens: int = 0) -> None:
        """Counts one request's prefix-cache lookup (tokens; ``num_tier_tokens`` of the hits
        came from the offload tier)."""
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens
        _add(self.per_tenant_queries, tenant, num_query_tokens)
        _add(self.per_tenant_hits, tenant, num_hit_tokens)
        if num_tier_tokens:
            self.prefix_cache_tier_hits += num_tier_tokens
            _add(self.per_tenant_tier_hits, tenant, num_tier_tokens)

    def record_recompute(self, tenant: TenantId, num_tokens: int) -> None:
        """Counts tokens a re-admitted preempted request computes again."""
        self.num_recomputed_tokens += num_tokens
        _add(self.per_tenant_recomputed_tokens, tenant, num_tokens)


@dataclass(frozen=True)
class EvictionCount:
    """Blocks of ``tenant`` evicted for ``reason``; ``evicted_by`` set for ``capacity`` only."""

    tenant: TenantId
    reason: str
    evicted_by: TenantId
    num_blocks: int


@dataclass(frozen=True)
class TenantStats:
    """One tenant's prefix-cache accounting at snapshot time.

    Attributes:
        prefix_cache_queries: prompt tokens looked up (cumulative).
        prefix_cache_hits: of those, tokens served from the cache (cumulative).
        prefix_cache_recomputed_tokens: tokens recomputed after preemption (cumulative).
        resident_blocks: the tenant's blocks that carry a hash now, free or in use (gauge).
        evictions: ``reason -> blocks`` of this tenant evicted (cumulative; every reason present).
        evictions_caused: ``victim tenant -> blocks`` that this tenant's allocations evicted for
            capacity (cumulative; may include the tenant itself).
        cache_share_blocks: the tenant's guaranteed share of the pool now (blocks; see
            ``engine.block_pool``).
        over_share_evictions: the tenant's blocks evicted because it was over its share
            (cumulative; part of ``evictions["capacity"]``).
        prefix_cache_tier_hits: of the hits, tokens loaded from the offload tiers
            (cumulative).
        offload_bytes: ``tier name -> the tenant's bytes in that tier now`` (gauge; a shared
            tier counts what every replica wrote for the tenant).
        offload_share_bytes: ``tier name -> the bytes the tenant's fair share of that tier
            guarantees now`` (gauge; the tier's ``prefix_cache_share_blocks``), for the tiers
            that hold its blobs.
    """

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_recomputed_tokens: int = 0
    resident_blocks: int = 0
    evictions: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType(dict.fromkeys(EVICTION_REASONS, 0)))
    evictions_caused: Mapping[TenantId, int] = field(
        default_factory=lambda: MappingProxyType({}))
    cache_share_blocks: int = 0
    prefix_cache_tier_hits: int = 0
    offload_bytes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    over_share_evictions: int = 0
    offload_share_bytes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def hit_rate(self) -> float | None:
        """hits / queries, or None before the first query."""
        if self.prefix_cache_queries == 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


# Upper bounds (seconds) of the tier load-latency histogram's buckets, per load (one request's
# run of blocks).
LOAD_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class TierSnapshot:
    """One offload tier at one instant (blocks and bytes cumulative unless a gauge)."""

    name: str  # "host", "disk", "redis"
    up: bool  # gauge: False while a remote tier is unreachable
    capacity_bytes: int  # gauge
    used_bytes: int  # gauge
    blobs: int  # gauge
    unclaimed_bytes: int  # gauge: of tenants not served by this process since start
    evicted_blobs: int  # evicted to stay in the budget (reason "capacity")
    dropped_blobs: int  # deleted by a reset, rotation or disable (reason "reset")
    written_blocks: int
    written_bytes: int
    write_failed: int
    loaded_blocks: int
    loaded_bytes: int
    load_failed: int  # stored but unopenable, then deleted (reason "invalid"): tampered,
    # truncated, another generation


@dataclass(frozen=True)
class OffloadSnapshot:
    """The offload tiers at one instant (counters cumulative).

    ``load_seconds_buckets[i]`` counts loads (one request's run of blocks) that took at most
    ``LOAD_SECONDS_BUCKETS[i]`` seconds and more than the bucket before (the last: more than
    every bound), for a Prometheus histogram.
    """

    tiers: tuple[TierSnapshot, ...]
    write_dropped: int  # the writer's queue was full
    loaded_blocks: int
    loaded_bytes: int
    load_missing: int  # loads that stopped on a block no tier gave
    load_jobs: int
    load_seconds: float
    load_seconds_buckets: tuple[int, ...]
    loads_in_flight: int  # gauge: requests waiting for their load


@dataclass(frozen=True)
class EngineStatsSnapshot:
    """Engine counters and gauges at one instant (plain frozen data, safe across threads).

    Blocks: ``num_blocks_free`` counts every block with ``ref_cnt == 0`` (cached ones included,
    they are evictable, vLLM semantics); ``num_blocks_used`` those pinned by requests;
    ``num_blocks_cached`` those carrying a hash, free or in use. ``kv_cache_usage`` is
    ``used / total`` in [0, 1] (vLLM ``kv_cache_usage_perc`` is a fraction too).
    Counters are cumulative since engine start (tokens, blocks or requests as named).
    """

    num_blocks_total: int
    num_blocks_free: int
    num_blocks_used: int
    num_blocks_cached: int
    kv_cache_usage: float
    num_requests_running: int
    num_requests_waiting: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_recomputed_tokens: int
    evictions: Mapping[str, int]
    eviction_counts: tuple[EvictionCount, ...]
    tenants: Mapping[TenantId, TenantStats]
    over_share_evictions: int = 0
    offload: OffloadSnapshot | None = None  # the offload tiers, when there are any
    num_share_preemptions: int = 0  # of num_preemptions, for a tenant within its pool share

    @property
    def hit_rate(self) -> float | None:
        """Global hits / queries, or None before the first query."""
        if self.prefix_cache_queries == 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    def check_integrity(self) -> None:
        """Asserts that per-tenant sums equal the globals and the block gauges add up.

        Raises:
            AssertionError: with a message naming the broken invariant.
        """
        tenants = self.tenants.values()
        assert self.num_blocks_free + self.num_blocks_used == self.num_blocks_total, \
            "free + used != total blocks"
        assert 0 <= self.num_blocks_cached <= self.num_blocks_total, "cached blocks out of range"
        assert abs(self.kv_cache_usage - self.num_blocks_used / self.num_blocks_total) < 1e-12, \
            "kv_cache_usage != used / total"
        assert sum(t.prefix_cache_queries for t in tenants) == self.prefix_cache_queries, \
            "per-tenant queries do not sum to the global counter"
        assert sum(t.prefix_cache_hits for t in tenants) == self.prefix_cache_hits, \
            "per-tenant hits do not sum to the global counter"
        assert sum(t.prefix_cache_recomputed_tokens for t in tenants) \
            == self.prefix_cache_recomputed_tokens, \
            "per-tenant recomputed tokens do not sum to the global counter"
        assert sum(t.resident_blocks for t in tenants) == self.num_blocks_cached, \
            "per-tenant resident blocks do not sum to the cached blocks"
        for t in tenants:
            assert 0 <= t.prefix_cache_hits <= t.prefix_cache_queries, "hits exceed queries"
            assert t.resident_blocks >= 0, "negative resident blocks"
        for reason in EVICTION_REASONS:
            total = self.evictions[reason]
            assert sum(t.evictions[reason] for t in tenants) == total, \
                f"per-tenant {reason} evictions do not sum to the global counter"
            assert sum(c.num_blocks for c in self.eviction_counts if c.reason == reason) \
                == total, f"{reason} eviction rows do not sum to the global counter"
        assert sum(sum(t.evictions_caused.values()) for t in tenants) \
            == self.evictions["capacity"], "caused evictions != capacity evictions"
        assert sum(t.over_share_evictions for t in tenants) == self.over_share_evictions, \
            "per-tenant over-share evictions do not sum to the global counter"
        assert self.over_share_evictions <= self.evictions["capacity"], \
            "more over-share evictions than capacity evictions"
