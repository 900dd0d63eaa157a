"""Property test: any sequence of allocate / grow / free / reset / evict keeps the pool invariants.

Prompts come from three shared base prompts plus a random tail over a 2-token alphabet, with
block_size 4, so prefixes (and whole blocks) collide often; salts come from two tenants, so the
test also checks that a hit is always the same salted token prefix (a shadow map of what each
cached block holds).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from engine.block_hash import get_hash_fn
from engine.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache_manager import KVCacheManager
from engine.request import EngineRequest, Request, TenantShare
from engine.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 10
TENANTS = {"t1": b"\x01" * 32, "t2": b"\x02" * 32, "t3": b"\x03" * 32}
# Three shared base prompts, cut anywhere and followed by a random tail, so hits are frequent.
BASES = ([0, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1],
         [0, 1, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 0],
         [1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0, 1, 1, 0])
TOKENS = st.builds(lambda base, cut, tail: (base[:cut] + tail) or [0],
                   st.sampled_from(BASES), st.integers(0, 16),
                   st.lists(st.integers(0, 1), max_size=2 * BS))


class BlockPoolMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, on_evict=self._on_evict)
        self.kv = KVCacheManager(self.pool, BS, get_hash_fn("sha256"))
        self.live: dict[str, Request] = {}
        # block_id -> (salt, token prefix up to the end of that block) for every hashed block.
        self.shadow: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self.next_id = 0

    def _on_evict(self, block: KVCacheBlock, reason: str, by: str | None) -> None:
        assert reason in ("capacity", "reset")
        assert block.block_hash is not None, "eviction callback on an unhashed block"
        self.shadow.pop(block.block_id, None)

    def _snapshot(self) -> tuple:
        return (self.pool.free_block_queue.block_ids(),
                [(b.ref_cnt, b.block_hash, b.owner) for b in self.pool.blocks],
                dict(self.pool.cached_block_hash_to_block),
                {rid: list(bl) for rid, bl in self.kv.req_to_blocks.items()},
                dict(self.kv.num_cached_block))

    def _record_cached(self, req: Request) -> None:
        """Every hashed block in ``req``'s table carries ``req``'s hash for that position."""
        for i, block in enumerate(self.kv.req_to_blocks.get(req.request_id, [])):
            if block.block_hash is None:
                continue
            assert i < len(req.block_hashes) and block.block_hash == req.block_hashes[i], \
                f"{block} at position {i} of {req!r} holds a foreign hash"
            content = (req.cache_salt, tuple(req.all_token_ids[:(i + 1) * BS]))
            assert self.shadow.setdefault(block.block_id, content) == content, \
                f"{block} changed content while hashed"

    @rule(target=requests, tokens=TOKENS, tenant=st.sampled_from(sorted(TENANTS)))
    def add(self, tokens: list[int], tenant: str) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(EngineRequest(rid, tuple(tokens), SamplingParams(max_tokens=1),
                                    tenant_id=tenant, cache_salt=TENANTS[tenant]))
        before = self._snapshot()
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        assert self._snapshot() == before, "get_computed_blocks modified the pool"
        assert num_hit_tokens == len(hits) * BS
        assert len(hits) <= (req.num_tokens - 1) // BS, "last-token rule violated"
        for i, block in enumerate(hits):
            assert block.block_hash == req.block_hashes[i]
            assert self.shadow[block.block_id] == (req.cache_salt, tuple(tokens[:(i + 1) * BS])), \
                "hit on a block holding a different salted prefix"
        req.num_computed_tokens = num_hit_tokens
        new = self.kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits)
        if new is None:
            assert self._snapshot() == before, "failed allocate_slots changed state"
            return rid  # never admitted; rules on it are no-ops
        req.num_computed_tokens = req.num_tokens
        assert len(self.kv.req_to_blocks[rid]) == -(-req.num_tokens // BS)
        self.live[rid] = req
        self._record_cached(req)
        return rid

    @rule(rid=requests, tokens=st.lists(st.integers(0, 1), min_size=1, max_size=2 * BS))
    def grow(self, rid: str, tokens: list[int]) -> None:
        """Decode: append tokens, then allocate slots for every not-yet-computed token."""
        req = self.live.get(rid)
        if req is None:
            return
        for t in tokens:
            req.append_output_token(t)
        num_new = req.num_tokens - req.num_computed_tokens
        before = self._snapshot()
        new = self.kv.allocate_slots(req, num_new)
        if new is None:
            assert self._snapshot() == before, "failed allocate_slots changed state"
            return
        req.num_computed_tokens = req.num_tokens
        assert len(self.kv.req_to_blocks[rid]) == -(-req.num_tokens // BS)
        self._record_cached(req)

    @rule(rid=consumes(requests))
    def free(self, rid: str) -> None:
        req = self.live.pop(rid, None)
        if req is None:
            return
        held = list(self.kv.req_to_blocks[rid])
        self.kv.free(req)
        assert rid not in self.kv.req_to_blocks
        free = self.pool.free_block_queue.block_ids()
        for block in held:
            if block.ref_cnt == 0:
                assert block.block_id in free

    @rule(dice=st.integers(0, 3))
    def reset(self, dice: int) -> None:
        if dice:  # rarer than the other rules, so the cache has time to fill
            return
        num_cached = self.pool.get_num_cached_blocks()
        num_free = self.pool.get_num_free_blocks()
        assert self.pool.reset_prefix_cache() == num_cached
        assert self.pool.get_num_cached_blocks() == 0
        assert self.pool.get_num_free_blocks() == num_free
        assert self.shadow == {}

    @rule(tenant=st.sampled_from(sorted(TENANTS)), dice=st.integers(0, 3))
    def evict_tenant(self, tenant: str, dice: int) -> None:
        if dice:
            return
        owners = [b.owner for b in self.pool.cached_block_hash_to_block.values()]
        refs = [b.ref_cnt for b in self.pool.blocks]
        dropped = self.pool.evict_cached_blocks(lambda b: b.owner == tenant, "reset")
        assert dropped == owners.count(tenant)
        assert self.pool.get_num_cached_blocks() == len(owners) - dropped
        assert all(b.owner != tenant for b in self.pool.cached_block_hash_to_block.values())
        assert [b.ref_cnt for b in self.pool.blocks] == refs, "eviction changed ref counts"

    @rule(tokens=TOKENS, tenant=st.sampled_from(sorted(TENANTS)))
    def lookup_is_pure(self, tokens: list[int], tenant: str) -> None:
        """A lookup for a request that is never admitted changes nothing in the pool."""
        req = Request(EngineRequest("probe", tuple(tokens), SamplingParams(max_tokens=1),
                                    tenant_id=tenant, cache_salt=TENANTS[tenant]))
        before = self._snapshot()
        self.kv.get_computed_blocks(req)
        assert self._snapshot() == before

    @rule(tenant=st.sampled_from(sorted(TENANTS)), weight=st.integers(1, 3),
          min_blocks=st.none() | st.integers(0, 4), max_blocks=st.none() | st.integers(0, 6))
    def set_share(self, tenant: str, weight: int, min_blocks: int | None,
                  max_blocks: int | None) -> None:
        """Weights and cache bounds change at any time; eviction then follows the new shares."""
        refs = [b.ref_cnt for b in self.pool.blocks]
        self.pool.set_tenant_share(tenant, TenantShare(weight, min_blocks, max_blocks))
        assert [b.ref_cnt for b in self.pool.blocks] == refs

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()
        num_free = self.pool.get_num_free_blocks()
        num_in_use = sum(1 for b in self.pool.blocks if b.ref_cnt > 0)
        assert num_free + num_in_use == NUM_BLOCKS
        assert set(self.kv.req_to_blocks) == set(self.live)
        hashed = {b.block_id for b in self.pool.blocks if b.block_hash is not None}
        assert set(self.shadow) == hashed
        # Per-tenant resident counts: from the blocks themselves, not from the counters.
        for tenant in TENANTS:
            owned = sum(1 for b in self.pool.blocks
                        if b.block_hash is not None and b.owner == tenant)
            assert self.pool.stats.resident_blocks.get(tenant, 0) == owned
            assert len(self.pool.evictable.get(tenant, ())) == sum(
                1 for b in self.pool.blocks
                if b.block_hash is not None and b.owner == tenant and b.ref_cnt == 0)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestBlockPoolMachine = BlockPoolMachine.TestCase
