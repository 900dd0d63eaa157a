"""Scheduler test helpers shared by ``test_scheduler.py`` and ``test_fair_scheduler.py``: request
and scheduler builders, a fake-runner ``step`` and the invariant checks run around every step."""

from __future__ import annotations

from collections.abc import Callable

from engine.block_hash import get_hash_fn
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import EngineRequest, Request, RequestStatus, TenantShare
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

BS = 16
EOS = 2
SALT = b"\x07" * 32

Row = tuple[str, int, int, bool]


def make_request(rid: str, tokens: list[int] | range, tenant: str | None = "t1",
                 salt: bytes | None = SALT, weight: int = 1, **params) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(EngineRequest(rid, tuple(tokens), SamplingParams(**params),
                                 tenant_id=tenant, cache_salt=salt,
                                 tenant_share=TenantShare(weight=weight)))


def make_scheduler(num_blocks: int = 32, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 256, max_model_len: int = 1024,
                   **kwargs) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BS, get_hash_fn("sha256"))
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len,
                     eos_token_ids=[EOS], **kwargs)


def check(sched: Scheduler) -> None:
    """Pool + block-table integrity, queue states, and the per-tenant bookkeeping."""
    sched.kv.check_integrity()
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert sched.kv.get_block_ids(req.request_id) == [], f"{req} waiting with blocks"
        assert req.num_computed_tokens == 0
    assert len(sched.running) <= sched.max_num_seqs
    queued = [r.request_id for r in (*sched.running, *sched.waiting)]
    assert sorted(queued) == sorted(sched.requests), "requests map disagrees with the queues"
    assert set(sched.kv.req_to_blocks) <= {r.request_id for r in sched.running}
    tenants = {r.tenant_id for r in sched.requests.values()}
    assert set(sched.vtime) == set(sched.weights) == set(sched.num_unfinished) == tenants
    for t in tenants:
        assert sched.num_unfinished[t] == sum(
            1 for r in sched.requests.values() if r.tenant_id == t)


def step(sched: Scheduler, token: int | Callable[[Request], int] = 1000,
         ) -> tuple[SchedulerOutput, list[Row]]:
    """One engine step with a fake runner. Returns the output and (id, start, n, samples) rows."""
    cached_before = _cached_pairs(sched)
    out = sched.schedule()
    check(sched)
    for s in out.scheduled:  # a request preempted in its own step is not scheduled
        assert s.request.status == RequestStatus.RUNNING, f"{s.request} scheduled, not running"
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert all(s.num_new_tokens > 0 for s in out.scheduled), "0-token row"
    sampled = {s.request.request_id: (token(s.request) if callable(token) else token)
               for s in out.scheduled if s.samples}
    rows = [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens, s.samples)
            for s in out.scheduled]
    sched.update_from_output(out, sampled)
    check(sched)
    # Every block the step added to the prefix cache holds KV the step wrote: a hit on a
    # block whose tokens were never computed (its request preempted before the forward ran)
    # would read garbage.
    pool = sched.kv.block_pool
    written = {(b, pool.blocks[b].block_hash) for s in out.scheduled
               for b in s.block_ids[:(s.num_computed_tokens + s.num_new_tokens) // BS]}
    for block_id, block_hash in _cached_pairs(sched) - cached_before:
        assert (block_id, block_hash) in written, f"block {block_id} cached, never computed"
    return out, rows


def _cached_pairs(sched: Scheduler) -> set:
    return {(b.block_id, h) for h, b in sched.kv.block_pool.cached_block_hash_to_block.items()}


def assert_idle(sched: Scheduler) -> None:
    pool = sched.kv.block_pool
    assert not sched.has_unfinished_requests()
    assert sched.requests == {}
    assert sched.vtime == {} and sched.weights == {} and sched.num_unfinished == {}
    assert sched.kv.req_to_blocks == {} and sched.kv.num_cached_block == {}
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sched.failed == []
