"""Per-tenant prefix-cache accounting over ``Scheduler`` + ``KVCacheManager`` + ``BlockPool``.

No model: a fake runner samples a fixed token for every chunk that ``samples``. Every step calls
``check_integrity()`` on the KV manager and on a fresh ``EngineStatsSnapshot`` (per-tenant sums
equal the globals, free + used = total), and every scenario ends idle with 0 used blocks. Expected
counter values are exact deltas worked out from the block-level rules in docs/prefix-caching.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from engine.block_hash import get_hash_fn
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import EngineRequest, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.stats import EVICTION_REASONS, EngineStatsSnapshot, TenantStats
from engine.stats_snapshot import take_snapshot

BS = 16
SALTS = {"A": b"\xaa" * 32, "B": b"\xbb" * 32, "C": b"\xcc" * 32}


def make_request(rid: str, tokens: list[int], tenant: str = "A", max_tokens: int = 1,
                 enable_prefix_caching: bool = True) -> Request:
    return Request(EngineRequest(rid, tuple(tokens),
                                 SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                 tenant_id=tenant, cache_salt=SALTS.get(tenant),
                                 enable_prefix_caching=enable_prefix_caching))


def make_scheduler(num_blocks: int = 32, max_num_batched_tokens: int = 256,
                   max_num_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BS, get_hash_fn("sha256"))
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, 1024, eos_token_ids=[2])


@dataclass
class Harness:
    """Steps a scheduler with a fake runner and measures prefill independently of the counters.

    ``prefill_tokens[rid]`` counts prompt tokens a request's first admission actually computed,
    read from the scheduled chunks (the "prefill tokens reported in the request log" of the seed
    article's hit-rate estimate), not from the stats.
    """

    sched: Scheduler
    prefill_tokens: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)

    def snap(self) -> EngineStatsSnapshot:
        s = take_snapshot(self.sched)
        s.check_integrity()
        return s

    def step(self) -> list[tuple[str, int, int]]:
        out = self.sched.schedule()
        self.sched.kv.check_integrity()
        self.preempted.update(out.preempted_ids)
        rows = []
        for s in out.scheduled:
            req = s.request
            rows.append((req.request_id, s.num_computed_tokens, s.num_new_tokens))
            if req.request_id not in self.preempted:
                end = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens)
                self.prefill_tokens[req.request_id] = (
                    self.prefill_tokens.get(req.request_id, 0)
                    + max(0, end - s.num_computed_tokens))
        self.sched.update_from_output(out, {s.request.request_id: 1000
                                            for s in out.scheduled if s.samples})
        self.sched.kv.check_integrity()
        self.snap()
        return rows

    def run(self, *reqs: Request) -> EngineStatsSnapshot:
        for r in reqs:
            self.sched.add_request(r)
        while self.sched.has_unfinished_requests():
            self.step()
        return self.idle()

    def idle(self) -> EngineStatsSnapshot:
        s = self.snap()
        assert not self.sched.has_unfinished_requests()
        assert s.num_blocks_used == 0 and s.kv_cache_usage == 0.0, "idle engine holds blocks"
        assert s.num_blocks_free == s.num_blocks_total
        assert (s.num_requests_running, s.num_requests_waiting) == (0, 0)
        return s


def tenant(s: EngineStatsSnapshot, t: str) -> TenantStats:
    return s.tenants.get(t, TenantStats())


def delta(after: EngineStatsSnapshot, before: EngineStatsSnapshot, t: str) -> dict[str, int]:
    """Counter deltas of tenant ``t`` (tokens / blocks) plus its resident blocks now."""
    a, b = tenant(after, t), tenant(before, t)
    d = {"queries": a.prefix_cache_queries - b.prefix_cache_queries,
         "hits": a.prefix_cache_hits - b.prefix_cache_hits,
         "recomputed": a.prefix_cache_recomputed_tokens - b.prefix_cache_recomputed_tokens,
         "resident": a.resident_blocks}
    for reason in EVICTION_REASONS:
        d[reason] = a.evictions[reason] - b.evictions[reason]
    return d


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 30000 + 100 for i in range(n)]


# -- cold / warm ----------------------------------------------------------------------------------
def test_cold_warm_pair_counts_once_per_admission() -> None:
    h = Harness(make_scheduler())
    prompt = tokens(1, 40)                                            # 2 full blocks + 8
    s0 = h.snap()
    s1 = h.run(make_request("cold", prompt))
    assert delta(s1, s0, "A") == {"queries": 40, "hits": 0, "recomputed": 0, "resident": 2,
                                  "capacity": 0, "salt_rotation": 0, "reset": 0, "fault": 0}
    s2 = h.run(make_request("warm", prompt))
    assert delta(s2, s1, "A") == {"queries": 40, "hits": 32, "recomputed": 0, "resident": 2,
                                  "capacity": 0, "salt_rotation": 0, "reset": 0, "fault": 0}
    assert h.prefill_tokens == {"cold": 40, "warm": 8}
    assert s2.num_blocks_cached == 2 and s2.hit_rate == 32 / 80
    assert tenant(s2, "A").hit_rate == 32 / 80


def test_two_tenants_same_prompt_never_share_and_add_up() -> None:
    h = Harness(make_scheduler())
    prompt = tokens(2, 50)                                            # 3 full blocks + 2
    s0 = h.snap()
    h.run(make_request("a1", prompt, "A"))
    s1 = h.run(make_request("b1", prompt, "B"))
    assert delta(s1, s0, "A")["hits"] == 0 and delta(s1, s0, "B")["hits"] == 0
    assert (tenant(s1, "A").resident_blocks, tenant(s1, "B").resident_blocks) == (3, 3)
    s2 = h.run(make_request("b2", prompt, "B"), make_request("a2", prompt, "A"))
    assert delta(s2, s1, "A") == {"queries": 50, "hits": 48, "recomputed": 0, "resident": 3,
                                  "capacity": 0, "salt_rotation": 0, "reset": 0, "fault": 0}
    assert delta(s2, s1, "B") == delta(s2, s1, "A")
    assert (s2.prefix_cache_queries, s2.prefix_cache_hits, s2.num_blocks_cached) == (200, 96, 6)


def test_same_prompt_admitted_in_one_step_counts_each_request_once() -> None:
    h = Harness(make_scheduler())
    prompt = tokens(3, 33)
    s = h.run(make_request("x", prompt), make_request("y", prompt))
    # y is admitted right after x in the same step and hits the 2 blocks x just cached.
    assert (tenant(s, "A").prefix_cache_queries, tenant(s, "A").prefix_cache_hits) == (66, 32)
    assert h.prefill_tokens == {"x": 33, "y": 1}


def test_tenant_without_prefix_caching_is_not_queried_and_caches_nothing() -> None:
    h = Harness(make_scheduler())
    prompt = tokens(4, 40)
    s = h.run(make_request("p", prompt, "C", enable_prefix_caching=False),
              make_request("q", prompt, "C", enable_prefix_caching=False))
    assert "C" not in s.tenants
    assert (s.prefix_cache_queries, s.num_blocks_cached) == (0, 0)
    assert h.prefill_tokens == {"p": 40, "q": 40}


# -- evictions ------------------------------------------------------------------------------------
def test_capacity_eviction_names_owner_and_evicting_tenant() -> None:
    h = Harness(make_scheduler(num_blocks=4))
    s0 = h.snap()
    # A: 48 tokens -> blocks 0, 1, 2 all full and cached; freed tail first.
    s1 = h.run(make_request("a1", tokens(5, 48), "A"))
    assert h.sched.kv.block_pool.free_block_queue.block_ids() == [3, 2, 1, 0]
    assert tenant(s1, "A").resident_blocks == 3
    # B: 48 other tokens -> pops 3 (unhashed), then A's 2 and 1 (capacity, caused by B).
    s2 = h.run(make_request("b1", tokens(6, 48), "B"))
    assert delta(s2, s1, "A") == {"queries": 0, "hits": 0, "recomputed": 0, "resident": 1,
                                  "capacity": 2, "salt_rotation": 0, "reset": 0, "fault": 0}
    assert delta(s2, s1, "B")["resident"] == 3
    assert tenant(s2, "B").evictions_caused == {"A": 2}
    assert [(c.tenant, c.reason, c.evicted_by, c.num_blocks) for c in s2.eviction_counts] \
        == [("A", "capacity", "B", 2)]
    # A again: hits its surviving block 0 (16 tokens), needs 2 blocks: pops B's tail blocks
    # (B freed 3(b2), 1(b1), 2(b0) -> queue [0 hit, 3, 2, 1]; 0 is touched, 3 and 2 popped).
    s3 = h.run(make_request("a2", tokens(5, 48), "A"))
    assert delta(s3, s2, "A")["hits"] == 16
    assert delta(s3, s2, "B")["capacity"] == 2
    assert tenant(s3, "A").evictions_caused == {"B": 2}
    assert sorted((c.tenant, c.evicted_by, c.num_blocks) for c in s3.eviction_counts) \
        == [("A", "B", 2), ("B", "A", 2)]
    assert s3.evictions == {"capacity": 4, "salt_rotation": 0, "reset": 0, "fault": 0}
    assert s3.num_blocks_cached == 4 and s3.num_blocks_cached == sum(
        t.resident_blocks for t in s3.tenants.values())
    assert (tenant(s3, "A").resident_blocks, tenant(s3, "B").resident_blocks) == (3, 1)
    assert s3.num_blocks_cached - s0.num_blocks_cached == 4


def test_self_eviction_is_evicted_by_the_owner() -> None:
    h = Harness(make_scheduler(num_blocks=3))
    h.run(make_request("a1", tokens(7, 48), "A"))                    # 3 cached blocks
    s = h.run(make_request("a2", tokens(8, 32), "A"))                 # pops 2 of them
    assert [(c.tenant, c.reason, c.evicted_by, c.num_blocks) for c in s.eviction_counts] \
        == [("A", "capacity", "A", 2)]
    assert tenant(s, "A").evictions_caused == {"A": 2}


def test_reset_and_tenant_eviction_count_per_owner_by_reason() -> None:
    h = Harness(make_scheduler(num_blocks=16))
    pool = h.sched.kv.block_pool
    h.run(make_request("a", tokens(9, 48), "A"), make_request("b", tokens(10, 32), "B"),
          make_request("c", tokens(11, 16), "C"))
    s0 = h.snap()
    assert [tenant(s0, t).resident_blocks for t in "ABC"] == [3, 2, 1]
    assert pool.evict_cached_blocks(lambda b: b.owner == "A", "salt_rotation") == 3
    s1 = h.snap()
    assert delta(s1, s0, "A") == {"queries": 0, "hits": 0, "recomputed": 0, "resident": 0,
                                  "capacity": 0, "salt_rotation": 3, "reset": 0, "fault": 0}
    assert delta(s1, s0, "B")["resident"] == 2
    assert pool.evict_cached_blocks(lambda b: b.owner == "B", "reset") == 2
    assert pool.reset_prefix_cache() == 1                              # only C's block is left
    s2 = h.snap()
    assert [tenant(s2, t).evictions["reset"] for t in "ABC"] == [0, 2, 1]
    assert s2.evictions == {"capacity": 0, "salt_rotation": 3, "reset": 3, "fault": 0}
    assert [(c.tenant, c.reason, c.evicted_by) for c in s2.eviction_counts] \
        == [("A", "salt_rotation", None), ("B", "reset", None), ("C", "reset", None)]
    assert s2.num_blocks_cached == 0 and all(t.resident_blocks == 0 for t in s2.tenants.values())
    # A's next request is cold: its blocks are gone.
    s3 = h.run(make_request("a2", tokens(9, 48), "A"))
    assert delta(s3, s2, "A")["hits"] == 0
    with pytest.raises(ValueError, match="reason"):
        pool.evict_cached_blocks(None, "capacity")


def test_evicting_blocks_of_a_running_request_counts_once_and_harms_nothing() -> None:
    h = Harness(make_scheduler(num_blocks=8))
    pool = h.sched.kv.block_pool
    req = make_request("r", tokens(12, 40), "A", max_tokens=4)
    h.sched.add_request(req)
    h.step()                                                          # prefill: 2 blocks cached
    assert h.snap().num_blocks_used == 3
    assert pool.evict_cached_blocks(lambda b: b.owner == "A", "salt_rotation") == 2
    s = h.snap()
    assert (tenant(s, "A").resident_blocks, tenant(s, "A").evictions["salt_rotation"]) == (0, 2)
    assert s.num_blocks_used == 3                                     # still pinned, still running
    s = h.run()
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 4
    # Its evicted blocks are unhashed now: they went to the head of the free queue, uncounted.
    assert s.evictions["salt_rotation"] == 2 and s.evictions["capacity"] == 0


# -- waiting and preemption -----------------------------------------------------------------------
def test_request_waiting_for_blocks_counts_hits_once() -> None:
    h = Harness(make_scheduler(num_blocks=5))
    base = tokens(13, 32)
    h.run(make_request("c", base + [7], "A"))                         # caches 2 blocks of A
    s0 = h.snap()
    a = make_request("a", tokens(14, 33), "B", max_tokens=4)          # 3 blocks: all free ones
    b = make_request("b", base + tokens(15, 32), "A")                 # 2 hits + 2 new blocks
    h.sched.add_request(a)
    h.sched.add_request(b)
    for _ in range(4):                                                # b retried every step
        h.step()
        assert b.status == RequestStatus.WAITING
        assert delta(h.snap(), s0, "A")["queries"] == 0
        assert h.snap().num_requests_waiting == 1
    s = h.run()
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert delta(s, s0, "A") == {"queries": 64, "hits": 32, "recomputed": 0, "resident": 4,
                                 "capacity": 0, "salt_rotation": 0, "reset": 0, "fault": 0}
    assert delta(s, s0, "B")["queries"] == 33
    assert h.prefill_tokens["b"] == 32


def test_preemption_with_unique_prompts_recomputes_and_never_hits() -> None:
    h = Harness(make_scheduler(num_blocks=4))
    a = make_request("a", tokens(16, 30), "A", max_tokens=6)          # blocks 0, 1
    b = make_request("b", tokens(17, 30), "B", max_tokens=6)          # blocks 2, 3
    s = h.run(a, b)
    assert "b" in h.preempted and s.num_preemptions == 1
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (60, 0)
    assert s.hit_rate == 0.0
    # b (33 tokens when preempted) resumes from its own surviving block 0: 33 - 16 recomputed.
    # Its block 1 (id 3) was popped by a's allocation (capacity, caused by A); on re-admission b
    # pops the unhashed block 3 and a's cached block 1 (capacity, caused by B).
    assert tenant(s, "B").prefix_cache_recomputed_tokens == 17
    assert s.prefix_cache_recomputed_tokens == 17
    assert tenant(s, "A").prefix_cache_recomputed_tokens == 0
    assert [(c.tenant, c.reason, c.evicted_by, c.num_blocks) for c in s.eviction_counts] \
        == [("A", "capacity", "B", 1), ("B", "capacity", "A", 1)]
    assert b.num_cached_tokens == 0 and b.num_output_tokens == 6


# -- the sums invariant under a random mixed workload -------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_every_invariant(seed: int) -> None:
    rng = random.Random(seed)
    h = Harness(make_scheduler(num_blocks=12, max_num_batched_tokens=48, max_num_seqs=4))
    pool = h.sched.kv.block_pool
    bases = {t: [tokens(100 + i + 10 * k, 48) for k in range(2)] for i, t in enumerate("ABC")}
    reqs = []
    for i in range(60):
        t = rng.choice("ABC")
        prompt = rng.choice(bases[t])[:rng.randint(1, 48)] + tokens(1000 + i, rng.randint(0, 20))
        reqs.append(make_request(f"r{i}", prompt, t, max_tokens=rng.randint(1, 12)))
        h.sched.add_request(reqs[-1])
        for _ in range(rng.randint(0, 3)):
            h.step()
        if rng.random() < 0.05:
            pool.evict_cached_blocks(lambda b, t=t: b.owner == t,
                                     rng.choice(["salt_rotation", "reset"]))
        if rng.random() < 0.02:
            pool.reset_prefix_cache()
    s = h.run()
    assert s.prefix_cache_queries == sum(r.num_prompt_tokens for r in reqs)
    assert s.prefix_cache_hits == sum(r.num_cached_tokens for r in reqs)
    for t in "ABC":
        mine = [r for r in reqs if r.tenant_id == t]
        assert tenant(s, t).prefix_cache_hits == sum(r.num_cached_tokens for r in mine)
    for r in reqs:
        if r.request_id not in h.preempted:
            assert h.prefill_tokens[r.request_id] == r.num_prompt_tokens - r.num_cached_tokens
    assert s.evictions["capacity"] > 0


# -- the seed article's hit-rate estimate ---------------------------------------------------------
def test_hit_rate_estimate_from_request_log_matches_counters() -> None:
    """(prefix length - prefill tokens) / prefix length, from the scheduled chunks, equals
    hits / queries per tenant, under chunked prefill and a shared system prompt."""
    h = Harness(make_scheduler(num_blocks=64, max_num_batched_tokens=40))
    system = {t: tokens(200 + i, 64) for i, t in enumerate("AB")}
    reqs = []
    for i in range(12):
        t = "AB"[i % 2]
        reqs.append((t, make_request(f"q{i}", system[t] + tokens(300 + i, 5 + 3 * i), t,
                                     max_tokens=2)))
    for _, r in reqs:
        h.run(r)
    s = h.snap()
    for t in "AB":
        mine = [r for tt, r in reqs if tt == t]
        prefix_len = sum(r.num_prompt_tokens for r in mine)
        prefill = sum(h.prefill_tokens[r.request_id] for r in mine)
        estimate = (prefix_len - prefill) / prefix_len
        assert tenant(s, t).prefix_cache_queries == prefix_len
        assert tenant(s, t).hit_rate == pytest.approx(estimate, abs=1e-12)
        assert estimate > 0.6          # the seed article's rollout gate
    # Per request too: cached tokens at admission == prompt - prefill.
    for _, r in reqs:
        assert r.num_cached_tokens == r.num_prompt_tokens - h.prefill_tokens[r.request_id]
