"""Fair cache share in ``BlockPool``: which cached block is evicted when tenants compete.

Each scenario builds resident cached blocks per tenant directly on the pool (allocate, hash,
free), then allocates and asserts exactly which block ids were evicted, whose, and the
over-share counters; ``check_integrity()`` runs after every step.
"""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.request import TenantShare
from engine.stats_snapshot import take_snapshot

_next_hash = iter(range(10**9))


def cache(pool: BlockPool, tenant: str | None, n: int) -> list[int]:
    """Caches ``n`` blocks of ``tenant`` and frees them (LRU: in this order). Returns ids."""
    blocks = pool.get_new_blocks(n, tenant)
    for b in blocks:
        pool.cache_full_block(b, f"h{next(_next_hash)}".encode(), tenant)
    pool.free_blocks(blocks)
    pool.check_integrity()
    return [b.block_id for b in blocks]


def evictions(pool: BlockPool) -> list[tuple[int, str | None, str | None]]:
    """Records (block id, owner, evicted_by) of every capacity eviction from now on."""
    seen: list[tuple[int, str | None, str | None]] = []
    pool.on_evict = lambda b, reason, by: seen.append((b.block_id, b.owner, by))
    return seen


def take(pool: BlockPool, n: int, tenant: str | None) -> list[int]:
    blocks = pool.get_new_blocks(n, tenant)
    pool.check_integrity()
    return [b.block_id for b in blocks]


def test_one_tenant_is_plain_lru() -> None:
    pool = BlockPool(6)
    first, second = cache(pool, "A", 3), cache(pool, "A", 3)
    seen = evictions(pool)
    assert take(pool, 4, "A") == first + second[:1]
    assert [s[0] for s in seen] == first + second[:1]
    assert pool.stats.num_over_share_evictions == 0


def test_all_tenants_within_share_is_plain_lru() -> None:
    pool = BlockPool(6)  # A and B: 3 blocks each
    a_old, b, a_new, b_new = (cache(pool, "A", 2), cache(pool, "B", 2), cache(pool, "A", 1),
                              cache(pool, "B", 1))
    seen = evictions(pool)
    # C (no cached blocks, taking 2: within its share) evicts in plain LRU order.
    assert take(pool, 2, "C") == a_old
    assert [o for _, o, _ in seen] == ["A", "A"]
    assert pool.stats.num_over_share_evictions == 0
    assert a_new and b and b_new
    assert pool.stats.resident_blocks == {"A": 1, "B": 3}


def test_a_tenant_at_its_share_pays_for_its_own_growth() -> None:
    pool = BlockPool(8)  # equal weights: 4 blocks each
    a_old, b, a_new, b_new = (cache(pool, "A", 2), cache(pool, "B", 3), cache(pool, "A", 2),
                              cache(pool, "B", 1))
    seen = evictions(pool)
    # B holds its share (4); taking 3 more would put it over: it pays from its own LRU blocks,
    # not from A's older ones (A keeps its guaranteed share).
    assert take(pool, 3, "B") == b
    assert [o for _, o, _ in seen] == ["B", "B", "B"]
    assert pool.stats.over_share_evictions == {"B": 3}
    assert pool.stats.resident_blocks == {"A": 4, "B": 1} and a_old and a_new and b_new


def test_tenant_over_its_share_loses_its_own_lru_block_first() -> None:
    pool = BlockPool(10)  # equal weights: 5 blocks each
    a = cache(pool, "A", 2)        # A's hot prompt: the oldest blocks in the pool
    b = cache(pool, "B", 8)        # B floods: 8 > 5
    seen = evictions(pool)
    # A allocates: plain LRU would take A's own hot blocks; B is over its share, so B pays.
    assert take(pool, 3, "A") == b[:3]
    assert seen == [(i, "B", "A") for i in b[:3]]
    assert pool.stats.over_share_evictions == {"B": 3}
    assert pool.stats.resident_blocks == {"A": 2, "B": 5}
    # A (2, taking 1) and every other tenant within its share: plain LRU (A's block 0) ...
    assert take(pool, 1, "A") == a[:1]
    assert pool.stats.over_share_evictions == {"B": 3}
    # ... but B at exactly its share (5 of 10), taking one more, pays for it itself.
    assert take(pool, 1, "B") == b[3:4]
    assert pool.stats.over_share_evictions == {"B": 4}


def test_weights_set_the_share() -> None:
    pool = BlockPool(8)
    pool.set_tenant_share("A", TenantShare(weight=3))   # shares: A 6, B 2
    a = cache(pool, "A", 5)
    b = cache(pool, "B", 3)
    assert (pool.cache_share("A"), pool.cache_share("B")) == (6, 2)
    seen = evictions(pool)
    assert take(pool, 1, "A") == b[:1]      # B (3 > 2) is over; A (5 <= 6) is not
    assert seen == [(b[0], "B", "A")]
    assert take(pool, 1, "A") == a[:1]      # B at 2 = its share: plain LRU, A's oldest
    # Equal weights again: A (4 of 8 > ... no, 4 = 4) within, B 2 within: LRU order.
    pool.set_tenant_share("A", TenantShare(weight=1))
    pool.check_integrity()
    assert (pool.cache_share("A"), pool.cache_share("B")) == (4, 4)


def test_graded_tenants_the_furthest_over_pays_first() -> None:
    pool = BlockPool(15)  # three tenants, equal weights: 5 blocks each
    a = cache(pool, "A", 1)
    b = cache(pool, "B", 6)
    c = cache(pool, "C", 8)
    seen = evictions(pool)
    # C (8) is further over its share than B (6): C pays until it is level with B ...
    assert take(pool, 2, "A") == c[:2]
    # ... then both pay, one block each, down to their share of 5 ...
    assert sorted(take(pool, 2, "A")) == sorted([b[0], c[2]])
    assert pool.stats.over_share_evictions == {"C": 3, "B": 1}
    assert pool.stats.resident_blocks == {"A": 1, "B": 5, "C": 5}
    # ... and with everyone within its share, plain LRU takes A's old block (A taking it).
    assert take(pool, 1, "A") == a
    assert [o for _, o, _ in seen][:2] == ["C", "C"] and len(seen) == 5


def test_min_cache_blocks_protects_and_max_cache_blocks_caps() -> None:
    pool = BlockPool(10)
    pool.set_tenant_share("B", TenantShare(min_cache_blocks=8))
    a = cache(pool, "A", 2)
    b = cache(pool, "B", 8)          # over its weighted share (5) but within its minimum
    seen = evictions(pool)
    assert take(pool, 1, "A") == a[:1]  # no one evictable is over its share: plain LRU
    assert pool.stats.num_over_share_evictions == 0
    assert pool.cache_share("B") == 8
    # A cap below the weighted share makes a tenant over it.
    pool.set_tenant_share("A", TenantShare(max_cache_blocks=0))
    pool.check_integrity()
    assert take(pool, 1, "B") == a[1:]
    assert seen[-1] == (a[1], "A", "B") and pool.stats.over_share_evictions == {"A": 1}
    assert b


def test_over_share_tenant_with_only_pinned_blocks_falls_back_to_lru() -> None:
    pool = BlockPool(10)
    a = cache(pool, "A", 2)
    b_blocks = pool.get_new_blocks(7, "B")    # B: 7 cached blocks, all pinned (in use)
    for blk in b_blocks:
        pool.cache_full_block(blk, f"h{next(_next_hash)}".encode(), "B")
    pool.check_integrity()
    assert take(pool, 1, "C") == [9]          # the unhashed free block goes first
    assert take(pool, 1, "C") == a[:1]        # B is over but has nothing free: LRU
    assert pool.stats.num_over_share_evictions == 0
    pool.free_blocks(b_blocks[:2])            # two of B's become evictable
    pool.check_integrity()
    assert take(pool, 1, "C") == [b_blocks[0].block_id]
    assert pool.stats.over_share_evictions == {"B": 1}


def test_explicit_evictions_and_touch_keep_the_owner_lists() -> None:
    pool = BlockPool(8)
    a = cache(pool, "A", 3)
    cache(pool, "B", 3)
    pool.touch([pool.blocks[a[1]]])            # a hit pins A's middle block
    pool.check_integrity()
    assert list(pool.evictable["A"]) == [a[0], a[2]]
    assert pool.evict_cached_blocks(lambda blk: blk.owner == "B", "salt_rotation") == 3
    pool.check_integrity()
    assert list(pool.evictable["B"]) == [] and pool.resident_weight == 1
    pool.free_blocks([pool.blocks[a[1]]])
    pool.check_integrity()
    assert list(pool.evictable["A"]) == [a[0], a[2], a[1]]


def test_snapshot_reports_share_and_over_share_evictions() -> None:
    from engine.block_hash import get_hash_fn
    from engine.kv_cache_manager import KVCacheManager
    from engine.scheduler import Scheduler

    pool = BlockPool(10)
    sched = Scheduler(KVCacheManager(pool, 16, get_hash_fn("sha256")), 4, 64, 160)
    cache(pool, "A", 2)
    cache(pool, "B", 8)
    take(pool, 3, "A")
    snap = take_snapshot(sched)
    snap.check_integrity()
    assert (snap.tenants["A"].cache_share_blocks, snap.tenants["B"].cache_share_blocks) == (5, 5)
    assert (snap.tenants["A"].over_share_evictions, snap.tenants["B"].over_share_evictions) \
        == (0, 3)
    assert snap.over_share_evictions == 3 and snap.evictions["capacity"] == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_tenant_share_rejects_bad_weights(bad) -> None:
    with pytest.raises(ValueError, match="weight"):
        TenantShare(weight=bad)
    with pytest.raises(ValueError, match="min_cache_blocks"):
        TenantShare(min_cache_blocks=-1)


def test_max_cache_blocks_boundary_and_precedence_over_density() -> None:
    pool = BlockPool(17)  # three tenants, equal weights: 5.67 blocks each
    pool.set_tenant_share("C", TenantShare(max_cache_blocks=2))
    a = cache(pool, "A", 2)
    b = cache(pool, "B", 12)       # over its share (12 > 5.67), densest
    c = cache(pool, "C", 3)        # within its share, but over its cap of 2
    seen = evictions(pool)
    # C over its cap goes first, although B is further over its weighted share.
    assert take(pool, 1, "A") == c[:1]
    # C at exactly its cap (2) is no longer over it: now B pays.
    assert take(pool, 1, "A") == b[:1]
    assert [o for _, o, _ in seen] == ["C", "B"]
    assert pool.stats.over_share_evictions == {"C": 1, "B": 1} and a


def test_density_is_resident_blocks_per_unit_of_weight() -> None:
    pool = BlockPool(20)
    pool.set_tenant_share("B", TenantShare(weight=2))
    # Weights 1 (A), 2 (B), 1 (C): shares 5, 10, 5. A holds 7 (7 per weight), B 12 (6 per
    # weight), C 1. A is further over its share per unit of weight although B holds more.
    a = cache(pool, "A", 7)
    b = cache(pool, "B", 12)
    cache(pool, "C", 1)
    assert take(pool, 1, "C") == a[:1]
    # A 6 per weight, B 6 per weight: a tie, either may pay; both are over their share.
    assert take(pool, 1, "C") in ([a[1]], [b[0]])
    assert pool.stats.num_over_share_evictions == 2


def test_skipped_pinned_tenant_is_found_again_once_its_blocks_are_free() -> None:
    pool = BlockPool(12)
    a = cache(pool, "A", 2)
    b_blocks = pool.get_new_blocks(8, "B")         # B over its share, all pinned
    for blk in b_blocks:
        pool.cache_full_block(blk, f"h{next(_next_hash)}".encode(), "B")
    c = cache(pool, "C", 2)
    assert take(pool, 1, "C") == a[:1]            # B skipped (pinned): plain LRU, twice
    assert take(pool, 1, "C") == a[1:]
    pool.free_blocks(b_blocks[:3])
    pool.check_integrity()
    assert take(pool, 2, "C") == [b.block_id for b in b_blocks[:2]]  # B found again
    assert pool.stats.over_share_evictions == {"B": 2} and c
    assert all(len(e) == 4 and e[3] is not None or e[3] is None for e in pool._heap)


def test_cache_share_arithmetic() -> None:
    pool = BlockPool(10)
    pool.set_tenant_share("B", TenantShare(weight=2))
    cache(pool, "A", 2)
    # A alone has the whole pool; B (no cached blocks yet) is counted as if it had some:
    # 10 x 2 // (1 + 2) = 6 blocks, whole blocks only.
    assert (pool.cache_share("A"), pool.cache_share("B")) == (10, 6)
    cache(pool, "B", 1)
    assert (pool.cache_share("A"), pool.cache_share("B")) == (3, 6)
    assert isinstance(pool.cache_share("A"), int)
    pool.set_tenant_share("C", TenantShare(min_cache_blocks=5, max_cache_blocks=7))
    assert pool.cache_share("C") == 5           # 10 x 1 // 4 = 2, raised to its minimum
    pool.set_tenant_share("C", TenantShare(weight=9, max_cache_blocks=7))
    assert pool.cache_share("C") == 7           # 10 x 9 // 12 = 7 ... at most 7 anyway
    pool.set_tenant_share("C", TenantShare(weight=30, max_cache_blocks=7))
    assert pool.cache_share("C") == 7           # 10 x 30 // 33 = 9, lowered to its maximum


def test_the_allocating_tenant_pays_only_while_it_is_the_densest() -> None:
    pool = BlockPool(8)  # equal weights: 4 blocks each; every block cached and free
    a = cache(pool, "A", 3)
    b = cache(pool, "B", 5)        # B over its share (5 > 4)
    seen = evictions(pool)
    # A takes 3: it counts as 3 + 3 = 6 blocks per weight, denser than B (5): A pays first;
    # then A (2 + 3 = 5) ties with B (5): the tie goes to B, the tenant already over; then B
    # (4) is at its share and A (5 with its allocation) is over: A pays again.
    assert take(pool, 3, "A") == [a[0], b[0], a[1]]
    assert [o for _, o, _ in seen] == ["A", "B", "A"]
    assert pool.stats.over_share_evictions == {"A": 2, "B": 1}
    assert pool.stats.resident_blocks == {"A": 1, "B": 4}


def test_a_tenant_exactly_at_its_share_with_its_allocation_takes_plain_lru() -> None:
    pool = BlockPool(12)
    pool.set_tenant_share("A", TenantShare(weight=2, max_cache_blocks=8))  # share 8 of 12
    pinned = pool.get_new_blocks(1, None)   # keeps one block out of the free queue
    b = cache(pool, "B", 4)                 # B at its share (4 of 12): within
    a = cache(pool, "A", 7)                 # A: 7 + the 1 it takes = 8 = its share and cap
    seen = evictions(pool)
    assert take(pool, 1, "A") == b[:1]      # nobody over: B's LRU block, plain LRU order
    assert seen == [(b[0], "B", "A")] and pool.stats.num_over_share_evictions == 0
    # Taking 2 puts A (7 + 2 = 9) over its share and cap: A pays for the first block itself;
    # then A (6 + 2 = 8) is at its share again and the second one is plain LRU (B's).
    assert take(pool, 2, "A") == [a[0], b[1]]
    assert pool.stats.over_share_evictions == {"A": 1} and pinned


def test_a_tenant_exactly_at_its_cap_is_not_in_the_over_cap_class() -> None:
    pool = BlockPool(12)  # three tenants, equal weights: 4 blocks each
    pool.set_tenant_share("A", TenantShare(max_cache_blocks=5))
    a = cache(pool, "A", 5)        # over its share, exactly at its cap
    b = cache(pool, "B", 6)        # over its share, densest
    cache(pool, "C", 1)
    seen = evictions(pool)
    assert take(pool, 1, "C") == b[:1]      # the densest pays; A is not over its cap
    assert take(pool, 1, "C") in ([a[0]], [b[1]])  # A 5, B 5: a tie, both over their share
    assert seen[0][1] == "B" and pool.stats.num_over_share_evictions == 2


def test_a_weight_change_reorders_eviction_at_once() -> None:
    pool = BlockPool(8)
    pool.set_tenant_share("B", TenantShare(weight=3))   # shares: A 2, B 6
    a = cache(pool, "A", 2)
    b = cache(pool, "B", 6)
    seen = evictions(pool)
    assert take(pool, 1, "C") == a[:1]  # nobody over: plain LRU (this search ranks A and B)
    pool.set_tenant_share("B", TenantShare(weight=1))   # shares: A 4, B 4: B (6) over
    assert take(pool, 1, "C") == b[:1]                  # not A's older block (plain LRU)
    assert seen == [(a[0], "A", "C"), (b[0], "B", "C")]
