"""Scripted prefix-cache scenarios over ``BlockPool`` + ``KVCacheManager`` (block_size 16).

Every scenario asserts exact block ids, hit counts and free-queue order, and calls
``check_integrity()`` after every step (STYLE.md, "Tests and tooling").
"""

from __future__ import annotations

from collections import OrderedDict

import pytest

from engine.block_hash import get_hash_fn
from engine.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache_manager import KVCacheManager
from engine.request import EngineRequest, Request
from engine.sampling_params import SamplingParams

BS = 16
SALT_A = b"\xaa" * 32
SALT_B = b"\xbb" * 32

PROMPT_55 = list(range(1000, 1055))                       # 3 full blocks + 7 tokens
PROMPT_60 = PROMPT_55[:48] + list(range(2000, 2012))      # shares 48 tokens, 60 in all


def make_request(rid: str, tokens: list[int], salt: bytes | None = SALT_A,
                 tenant: str | None = "t1", enable_prefix_caching: bool = True) -> Request:
    return Request(EngineRequest(rid, tuple(tokens), SamplingParams(max_tokens=1),
                                 tenant_id=tenant, cache_salt=salt,
                                 enable_prefix_caching=enable_prefix_caching))


def make_kv(num_blocks: int, enable_caching: bool = True,
            on_evict=None) -> KVCacheManager:
    pool = BlockPool(num_blocks, enable_caching=enable_caching, on_evict=on_evict)
    kv = KVCacheManager(pool, BS, get_hash_fn("sha256"), enable_caching=enable_caching)
    kv.check_integrity()
    return kv


def admit(kv: KVCacheManager, req: Request) -> tuple[list[int], int, list[int] | None]:
    """Prefix lookup + allocation of the whole prompt, as the scheduler does for one step.

    Returns:
        (hit block ids, hit tokens, new block ids or None when the pool cannot fit).
    """
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    req.num_computed_tokens = num_hit_tokens
    new = kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits)
    if new is None:
        req.num_computed_tokens = 0
    else:
        req.num_computed_tokens = req.num_tokens
    kv.check_integrity()
    return ([b.block_id for b in hits], num_hit_tokens,
            None if new is None else [b.block_id for b in new])


def free_ids(kv: KVCacheManager) -> list[int]:
    return kv.block_pool.free_block_queue.block_ids()


def ref_cnts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.block_pool.blocks]


def cached_ids(kv: KVCacheManager) -> set[int]:
    return {b.block_id for b in kv.block_pool.cached_block_hash_to_block.values()}


def snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.block_pool
    return (free_ids(kv), ref_cnts(kv),
            {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
            [(b.block_hash, b.owner) for b in pool.blocks],
            {rid: [b.block_id for b in bl] for rid, bl in kv.req_to_blocks.items()},
            dict(kv.num_cached_block), pool.get_num_free_blocks())


# -- the shared-prefix scenario, step by step -----------------------------------------------------
def test_shared_prefix_scenario_free_order_and_eviction() -> None:
    evicted: list[tuple[int, str, str | None, str | None]] = []

    def on_evict(block: KVCacheBlock, reason: str, by: str | None) -> None:
        evicted.append((block.block_id, reason, by, block.owner))

    kv = make_kv(10, on_evict=on_evict)
    pool = kv.block_pool

    # 1. 55-token prompt: 4 blocks, only the 3 full ones cached.
    a = make_request("a", PROMPT_55)
    assert admit(kv, a) == ([], 0, [0, 1, 2, 3])
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert pool.get_num_free_blocks() == 6
    assert pool.get_num_cached_blocks() == 3
    assert cached_ids(kv) == {0, 1, 2}
    assert pool.blocks[3].block_hash is None, "partial tail block must not be cached"
    assert [pool.blocks[i].owner for i in range(4)] == ["t1", "t1", "t1", None]
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9]

    # 2. 60-token prompt sharing 48 tokens, same salt: 3 hits, 1 new block.
    b = make_request("b", PROMPT_60)
    assert admit(kv, b) == ([0, 1, 2], 48, [4])
    assert kv.get_block_ids("b") == [0, 1, 2, 4]
    assert ref_cnts(kv)[:5] == [2, 2, 2, 1, 1]
    assert pool.get_num_free_blocks() == 5
    assert pool.get_num_cached_blocks() == 3, "60 tokens: block 3 of b is partial"
    assert free_ids(kv) == [5, 6, 7, 8, 9]

    # 3. Free a, then b. Unhashed blocks go to the head (b's tail 4 last, so first); hashed ones
    #    join the tail as their ref_cnt reaches 0: b's blocks tail first 2, 1, 0.
    kv.free(a)
    kv.check_integrity()
    assert free_ids(kv) == [3, 5, 6, 7, 8, 9]
    assert ref_cnts(kv)[:5] == [1, 1, 1, 0, 1]
    kv.free(b)
    kv.check_integrity()
    assert free_ids(kv) == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]
    assert pool.get_num_free_blocks() == 10
    assert pool.get_num_cached_blocks() == 3, "freed hashed blocks stay hittable"

    # Still hittable while free.
    a2 = make_request("a2", PROMPT_55)
    assert [blk.block_id for blk in kv.get_computed_blocks(a2)[0]] == [0, 1, 2]
    kv.check_integrity()
    assert evicted == []

    # 4. A unique 160-token request takes all 10 blocks in free-queue order, evicting every old
    #    cached block ("capacity", by the evicting tenant), head of the prefix last.
    big = make_request("big", list(range(5000, 5160)), salt=SALT_B, tenant="t2")
    assert admit(kv, big) == ([], 0, [4, 3, 5, 6, 7, 8, 9, 2, 1, 0])
    assert pool.get_num_free_blocks() == 0
    assert evicted == [(2, "capacity", "t2", "t1"), (1, "capacity", "t2", "t1"),
                       (0, "capacity", "t2", "t1")]
    assert kv.get_computed_blocks(a2) == ([], 0), "old prefix must be gone"
    for h in a2.block_hashes:
        assert pool.get_cached_block(h) is None
    # 0 of the old cached blocks remain; what is cached now is big's own 10 full blocks.
    assert {blk.owner for blk in pool.cached_block_hash_to_block.values()} == {"t2"}
    assert pool.get_num_cached_blocks() == 10
    kv.check_integrity()


def test_last_token_rule() -> None:
    kv = make_kv(10)
    a = make_request("a", PROMPT_55)
    admit(kv, a)
    # Exactly 48 identical tokens: floor((48 - 1) / 16) = 2 blocks may be reused.
    c = make_request("c", PROMPT_55[:48])
    hits, n = kv.get_computed_blocks(c)
    assert ([blk.block_id for blk in hits], n) == ([0, 1], 32)
    kv.check_integrity()
    # 49 tokens: 3 blocks.
    d = make_request("d", PROMPT_55[:49])
    assert [blk.block_id for blk in kv.get_computed_blocks(d)[0]] == [0, 1, 2]
    # 16 tokens: none; 17 tokens: block 0.
    assert kv.get_computed_blocks(make_request("e", PROMPT_55[:16])) == ([], 0)
    assert kv.get_computed_blocks(make_request("f", PROMPT_55[:17]))[1] == 16
    # Admitting c computes its 3rd block itself; the duplicate hash keeps block 2 cached and c's
    # own copy unhashed.
    assert admit(kv, c) == ([0, 1], 32, [4])
    assert kv.get_block_ids("c") == [0, 1, 4]
    assert pool_hash_of(kv, 4) is None
    assert ref_cnts(kv)[:5] == [2, 2, 1, 1, 1]
    kv.free(c)
    kv.check_integrity()
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9]


def pool_hash_of(kv: KVCacheManager, block_id: int) -> bytes | None:
    return kv.block_pool.blocks[block_id].block_hash


def test_lookup_stops_at_first_miss() -> None:
    kv = make_kv(10)
    admit(kv, make_request("a", PROMPT_55))
    changed = PROMPT_55[:16] + [9] * 16 + PROMPT_55[32:] + [1]   # block 1 differs
    hits, n = kv.get_computed_blocks(make_request("x", changed))
    assert ([blk.block_id for blk in hits], n) == ([0], 16)
    kv.check_integrity()


def test_salt_isolation_then_same_salt_hits() -> None:
    kv = make_kv(10)
    a = make_request("a", PROMPT_55, salt=SALT_A, tenant="t1")
    admit(kv, a)
    kv.free(a)
    kv.check_integrity()
    other = make_request("o", PROMPT_55, salt=SALT_B, tenant="t2")
    assert kv.get_computed_blocks(other) == ([], 0)
    unsalted = make_request("u", PROMPT_55, salt=None, tenant=None)
    assert kv.get_computed_blocks(unsalted) == ([], 0)
    same = make_request("s", PROMPT_55, salt=SALT_A, tenant="t1")
    hits, n = kv.get_computed_blocks(same)
    assert ([blk.block_id for blk in hits], n) == ([0, 1, 2], 48)
    kv.check_integrity()


def test_caching_disabled_never_hits() -> None:
    kv = make_kv(10, enable_caching=False)
    a = make_request("a", PROMPT_55)
    assert admit(kv, a) == ([], 0, [0, 1, 2, 3])
    assert kv.block_pool.get_num_cached_blocks() == 0
    kv.free(a)
    kv.check_integrity()
    assert free_ids(kv) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert admit(kv, make_request("a2", PROMPT_55)) == ([], 0, [0, 1, 2, 3])
    assert kv.block_pool.get_num_cached_blocks() == 0


def test_caching_disabled_per_request() -> None:
    kv = make_kv(10)
    a = make_request("a", PROMPT_55, enable_prefix_caching=False)
    assert admit(kv, a) == ([], 0, [0, 1, 2, 3])
    assert kv.block_pool.get_num_cached_blocks() == 0
    admit(kv, make_request("a2", PROMPT_55))
    kv.free(a)
    kv.check_integrity()
    assert kv.get_computed_blocks(make_request("a3", PROMPT_55, enable_prefix_caching=False)) \
        == ([], 0)


def test_allocate_slots_none_changes_nothing() -> None:
    kv = make_kv(10)
    a = make_request("a", PROMPT_55)
    admit(kv, a)                                  # blocks 0..3
    b = make_request("b", list(range(3000, 3040)))
    admit(kv, b)                                  # blocks 4..6, 4 and 5 cached
    kv.free(b)
    kv.check_integrity()
    assert free_ids(kv) == [6, 7, 8, 9, 5, 4]

    # 160 tokens sharing a's 48-token prefix: 10 blocks = 3 hits (pinned by a) + 7 new > 6 free.
    big = make_request("big", PROMPT_55[:48] + list(range(7000, 7112)))
    before = snapshot(kv)
    hits, n = kv.get_computed_blocks(big)
    assert ([blk.block_id for blk in hits], n) == ([0, 1, 2], 48)
    big.num_computed_tokens = n
    assert kv.allocate_slots(big, big.num_tokens - n, hits) is None
    assert snapshot(kv) == before
    assert "big" not in kv.req_to_blocks
    kv.check_integrity()

    # A running request that cannot grow: 55 + 112 tokens need 11 blocks, a holds 4, 6 free.
    before = snapshot(kv)
    assert kv.allocate_slots(a, 7 * BS) is None
    assert snapshot(kv) == before
    kv.check_integrity()
    # ... while growth that fits (80 tokens, 5 blocks) takes the head of the free queue.
    assert [blk.block_id for blk in kv.allocate_slots(a, 9 + 16)] == [6]
    kv.check_integrity()


def test_free_hit_blocks_count_toward_fit_check() -> None:
    kv = make_kv(4)
    a = make_request("a", PROMPT_55[:48])
    assert admit(kv, a) == ([], 0, [0, 1, 2])
    kv.free(a)
    kv.check_integrity()
    assert free_ids(kv) == [3, 2, 1, 0]
    assert kv.block_pool.get_num_cached_blocks() == 3

    # 80 tokens sharing 48: 3 free hits + 2 new = 5 > 4 blocks -> None, nothing changes.
    c = make_request("c", PROMPT_55[:48] + list(range(8000, 8032)))
    before = snapshot(kv)
    hits, n = kv.get_computed_blocks(c)
    assert ([blk.block_id for blk in hits], n) == ([0, 1, 2], 48)
    c.num_computed_tokens = n
    assert kv.allocate_slots(c, c.num_tokens - n, hits) is None
    assert snapshot(kv) == before
    kv.check_integrity()

    # 64 tokens sharing 48: 3 free hits + 1 new = 4 -> fits; the new block is 3, no eviction.
    b = make_request("b", PROMPT_55[:48] + list(range(9000, 9016)))
    assert admit(kv, b) == ([0, 1, 2], 48, [3])
    assert kv.get_block_ids("b") == [0, 1, 2, 3]
    assert free_ids(kv) == []
    assert ref_cnts(kv) == [1, 1, 1, 1]
    assert kv.block_pool.get_num_cached_blocks() == 4


def test_reset_prefix_cache() -> None:
    evicted: list[tuple[int, str, str | None]] = []
    kv = make_kv(10, on_evict=lambda blk, reason, by: evicted.append((blk.block_id, reason, by)))
    pool = kv.block_pool
    a = make_request("a", PROMPT_55)
    admit(kv, a)                                           # running: 0..3, 0..2 cached
    b = make_request("b", list(range(3000, 3040)))
    admit(kv, b)                                           # 4..6, 4 and 5 cached
    kv.free(b)
    kv.check_integrity()
    assert free_ids(kv) == [6, 7, 8, 9, 5, 4]
    assert pool.get_num_cached_blocks() == 5

    assert pool.reset_prefix_cache() == 5
    kv.check_integrity()
    assert pool.get_num_cached_blocks() == 0
    assert sorted(evicted) == [(0, "reset", None), (1, "reset", None), (2, "reset", None),
                               (4, "reset", None), (5, "reset", None)]
    # Free dropped blocks moved to the head (each appendleft in cache-map order: 4 then 5).
    assert free_ids(kv) == [5, 4, 6, 7, 8, 9]
    # In-use blocks keep their refs and stay in a's block table.
    assert ref_cnts(kv)[:4] == [1, 1, 1, 1]
    assert kv.get_block_ids("a") == [0, 1, 2, 3]

    # Repeat of either prompt: 0 hits.
    assert kv.get_computed_blocks(make_request("a2", PROMPT_55)) == ([], 0)
    assert kv.get_computed_blocks(make_request("b2", list(range(3000, 3040)))) == ([], 0)
    # a's blocks, now unhashed, return to the head when freed.
    kv.free(a)
    kv.check_integrity()
    assert free_ids(kv) == [0, 1, 2, 3, 5, 4, 6, 7, 8, 9]
    assert pool.reset_prefix_cache() == 0
    assert admit(kv, make_request("a3", PROMPT_55)) == ([], 0, [0, 1, 2, 3])


def test_evict_cached_blocks_by_owner() -> None:
    kv = make_kv(10)
    pool = kv.block_pool
    t1 = make_request("t1", PROMPT_55, salt=SALT_A, tenant="t1")
    t2 = make_request("t2", PROMPT_55, salt=SALT_B, tenant="t2")
    assert admit(kv, t1) == ([], 0, [0, 1, 2, 3])
    assert admit(kv, t2) == ([], 0, [4, 5, 6, 7])
    kv.free(t1)
    kv.free(t2)
    kv.check_integrity()
    assert free_ids(kv) == [7, 3, 8, 9, 2, 1, 0, 6, 5, 4]

    assert pool.evict_cached_blocks(lambda blk: blk.owner == "t1", "reset") == 3
    kv.check_integrity()
    assert free_ids(kv) == [2, 1, 0, 7, 3, 8, 9, 6, 5, 4]
    assert cached_ids(kv) == {4, 5, 6}
    assert kv.get_computed_blocks(make_request("x1", PROMPT_55, SALT_A, "t1")) == ([], 0)
    hits, n = kv.get_computed_blocks(make_request("x2", PROMPT_55, SALT_B, "t2"))
    assert ([blk.block_id for blk in hits], n) == ([4, 5, 6], 48)
    assert pool.evict_cached_blocks(lambda blk: blk.owner == "t1", "reset") == 0


def test_on_evict_capacity_reports_evicting_tenant() -> None:
    events: list[tuple[int, str, str | None, str | None]] = []

    def on_evict(block: KVCacheBlock, reason: str, by: str | None) -> None:
        events.append((block.block_id, reason, by, block.owner))

    kv = make_kv(4, on_evict=on_evict)
    a = make_request("a", PROMPT_55[:40], SALT_A, "t1")   # blocks 0, 1 cached, 2 partial
    assert admit(kv, a) == ([], 0, [0, 1, 2])
    kv.free(a)
    kv.check_integrity()
    assert free_ids(kv) == [2, 3, 1, 0]
    # Two unhashed blocks first: no eviction.
    c = make_request("c", list(range(100, 120)), SALT_B, "t2")
    assert admit(kv, c) == ([], 0, [2, 3])
    assert events == []
    # The next allocation pops cached block 1 (a's tail first) for t2.
    d = make_request("d", [5, 6, 7], SALT_B, "t2")
    assert admit(kv, d) == ([], 0, [1])
    assert events == [(1, "capacity", "t2", "t1")]
    kv.check_integrity()


def test_block_pool_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive, got 0"):
        BlockPool(0)
    assert [b.block_id for b in BlockPool(1).get_new_blocks(1)] == [0]  # one block is a pool
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="cannot allocate 3 blocks; 2 free"):
        pool.get_new_blocks(3)
    pool.check_integrity()
    assert pool.free_block_queue.block_ids() == [0, 1]


def test_free_block_queue_empty_and_block_repr() -> None:
    pool = BlockPool(1)
    q = pool.free_block_queue
    (block,) = pool.get_new_blocks(1)
    assert q.peek() is None and q.block_ids() == []
    with pytest.raises(IndexError, match="no free blocks"):
        q.popleft()
    assert repr(block) == "KVCacheBlock(id=0, ref_cnt=1, cached=False)"
    pool.cache_full_block(block, b"h0", "t1")
    assert repr(block) == "KVCacheBlock(id=0, ref_cnt=1, cached=True)"  # never the hash
    pool.free_blocks([block])
    assert q.peek() is block and q.popleft() is block and q.peek() is None


def test_cache_full_block_needs_caching_on_and_a_pinned_block() -> None:
    off = BlockPool(2, enable_caching=False)
    (block,) = off.get_new_blocks(1, "t1")
    off.cache_full_block(block, b"h0", "t1")
    assert block.block_hash is None and off.get_num_cached_blocks() == 0
    off.check_integrity()
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1, "t1")
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="only blocks being computed are cached"):
        pool.cache_full_block(block, b"h0", "t1")
    pool.check_integrity()


def _corrupt(pool: BlockPool, how: str) -> None:
    blocks = pool.get_new_blocks(3, "t1")
    pool.cache_full_block(blocks[0], b"h0", "t1")
    pool.cache_full_block(blocks[1], b"h1", "t1")
    pool.free_blocks(blocks[::-1])
    pool.check_integrity()
    if how == "unhashed behind hashed":  # block 2 (unhashed) moved behind the hashed ones
        pool.free_block_queue.remove(blocks[2])
        pool.free_block_queue.append(blocks[2])
    elif how == "owner list holds a pinned block":
        pool.free_block_queue.remove(blocks[0])
        blocks[0].ref_cnt = 1
        pool.num_used_blocks += 1
    elif how == "owner list holds another owner's block":
        pool.evictable["t2"] = OrderedDict([(1, pool.evictable["t1"].pop(1))])
    elif how == "unhashed block with an owner":
        blocks[2].owner = "t1"
    elif how == "free count drift":
        pool.free_block_queue.num_free_blocks += 1


@pytest.mark.parametrize("how, message", [
    ("unhashed behind hashed", "unhashed free block behind a hashed one"),
    ("owner list holds a pinned block", "holds a block that is not its free cached block"),
    ("owner list holds another owner's block", "list of 't2' holds a block that is not its"),
    ("unhashed block with an owner", "unhashed but owned"),
    ("free count drift", "free count drift"),
])
def test_check_integrity_finds_each_corruption(how, message) -> None:
    """The invariant checker that every engine test relies on does notice what it checks."""
    pool = BlockPool(4)
    _corrupt(pool, how)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_a_private_block_is_unhashed_when_its_last_holder_frees_it() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2, "t1")
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, f"p{i}".encode(), "t1", private=True)
    pool.touch(blocks[:1])                   # a sibling shares block 0
    pool.check_integrity()                   # block 1: private, one holder
    assert pool.resident_owners == {"t1"} and pool.resident_weight == 1
    pool.free_blocks(blocks)                 # block 1's last holder: unhashed at once
    assert pool.get_cached_block(b"p1") is None and pool.get_cached_block(b"p0") is blocks[0]
    pool.check_integrity()
    pool.free_blocks(blocks[:1])             # block 0's last holder
    assert pool.get_num_cached_blocks() == 0 and not any(b.private for b in pool.blocks)
    assert pool.resident_owners == set() and pool.resident_weight == 0
    assert pool.stats.resident_blocks["t1"] == 0 and sum(pool.stats.num_evictions.values()) == 0
    assert pool.free_block_queue.block_ids()[:2] == [0, 1]  # unhashed: reused first
    pool.check_integrity()
    # The checker notices a private block left free with its hash.
    (b,) = pool.get_new_blocks(1, "t1")
    pool.cache_full_block(b, b"p9", "t1", private=True)
    b.private = False
    pool.free_blocks([b])
    b.private = True
    with pytest.raises(AssertionError, match="private and free"):
        pool.check_integrity()
