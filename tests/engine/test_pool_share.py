"""The pool shared by weight between tenants (``Scheduler._admit_fair``): a tenant within its
share of the KV blocks is admitted, preempting tenants over theirs; a tenant beyond its share
waits without holding up the others; nothing changes with one tenant or under ``fcfs``."""

from __future__ import annotations

import pytest

from engine.request import RequestStatus
from tests.engine.sched_helpers import BS, make_request, make_scheduler, step


def _fill(sched, tenant: str, n: int, tokens: int, first: int = 0, **kw) -> list:
    """Adds ``n`` requests of ``tokens`` prompt tokens for ``tenant`` (distinct prompts)."""
    reqs = []
    for i in range(n):
        base = 10_000 * (first + i + 1) + (hash(tenant) % 1000) * 10
        req = make_request(f"{tenant}{first + i}", range(base, base + tokens), tenant=tenant,
                           **{"max_tokens": 64, **kw})
        sched.add_request(req)
        reqs.append(req)
    return reqs


def _held(sched, tenant: str) -> int:
    return sum(sched.kv.num_blocks_of(r.request_id) for r in sched.running
               if r.tenant_id == tenant)


def _heavy_fills_the_pool(policy: str = "fair"):
    """32 blocks, all held by tenant h's 4 running requests (8 blocks each: exact exhaustion)."""
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=512, policy=policy)
    heavy = _fill(sched, "h", 4, 8 * BS - 4)
    step(sched)
    assert all(r.status == RequestStatus.RUNNING for r in heavy)
    assert sched.kv.block_pool.get_num_free_blocks() == 0
    return sched, heavy


def test_a_tenant_within_its_share_preempts_the_one_over_it_latest_first() -> None:
    sched, heavy = _heavy_fills_the_pool()
    light = _fill(sched, "l", 1, 20)[0]
    out, rows = step(sched)
    assert light.status == RequestStatus.RUNNING
    assert rows == [("h0", 124, 1, True), ("h1", 124, 1, True), ("h2", 124, 1, True),
                    ("l0", 0, 20, True)]  # the victim's decode this step went back
    assert out.preempted_ids == ("h3",)  # ties: the latest admitted goes first
    assert [r.num_preemptions for r in heavy] == [0, 0, 0, 1]
    assert sched.stats.num_share_preemptions == 1 == sched.stats.num_preemptions
    assert _held(sched, "h") == 24 and _held(sched, "l") == 2


def test_with_one_tenant_a_full_pool_makes_a_new_request_wait() -> None:
    sched, _ = _heavy_fills_the_pool()
    late = _fill(sched, "h", 1, 20, first=4)[0]
    out, _ = step(sched)
    assert late.status == RequestStatus.WAITING
    assert out.preempted_ids == () and sched.stats.num_preemptions == 0


def test_fcfs_policy_never_preempts_for_a_share() -> None:
    sched, _ = _heavy_fills_the_pool(policy="fcfs")
    light = _fill(sched, "l", 1, 20)[0]
    out, _ = step(sched)
    assert light.status == RequestStatus.WAITING and out.preempted_ids == ()


@pytest.mark.parametrize("blocks, admitted", [(2, True), (3, False)])
def test_a_tenant_exactly_at_its_share_is_admitted_one_block_more_waits(blocks, admitted) -> None:
    # l holds 14 of its 16 blocks; a prompt of 2 more blocks brings it to exactly its share
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=512, max_num_seqs=16)
    _fill(sched, "l", 1, 14 * BS - 8, first=0)   # 14 blocks, 8 slots left for decodes
    _fill(sched, "h", 9, 2 * BS - 4)             # 9 x 2 blocks: the pool is full
    step(sched)
    assert _held(sched, "l") == 14 and _held(sched, "h") == 18
    assert sched.kv.block_pool.get_num_free_blocks() == 0
    new = _fill(sched, "l", 1, blocks * BS - 4, first=1)[0]
    out, _ = step(sched)
    assert (new.status == RequestStatus.RUNNING) is admitted
    # h keeps exactly its share after giving up one request
    assert out.preempted_ids == (("h8",) if admitted else ())
    assert _held(sched, "h") == (16 if admitted else 18)


def test_a_tenants_only_request_is_not_preempted_for_a_share() -> None:
    # h's one request holds 24 blocks, 8 over its share; without it h would hold 0
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=512)
    big = _fill(sched, "h", 1, 24 * BS - 4)[0]
    _fill(sched, "x", 1, 8 * BS - 4)
    step(sched)
    assert sched.kv.block_pool.get_num_free_blocks() == 0
    light = _fill(sched, "l", 1, 20)[0]
    out, _ = step(sched)
    assert out.preempted_ids == () and light.status == RequestStatus.WAITING
    assert big.status == RequestStatus.RUNNING


def test_a_tenant_over_its_share_is_passed_over_not_a_wall() -> None:
    sched, _ = _heavy_fills_the_pool()
    more = _fill(sched, "h", 2, 20, first=4)       # h waits beyond its share: first in line
    light = _fill(sched, "l", 1, 20)[0]
    step(sched)
    assert light.status == RequestStatus.RUNNING
    assert all(r.status == RequestStatus.WAITING for r in more)


def test_a_request_preempted_before_is_the_last_victim_of_its_tenant() -> None:
    sched, heavy = _heavy_fills_the_pool()
    heavy[3].num_preemptions = 1  # as if preempted once already
    _fill(sched, "l", 1, 20)
    out, rows = step(sched)
    assert out.preempted_ids == ("h2",)
    assert [r.num_preemptions for r in heavy] == [0, 0, 1, 1]
    # a victim's grant in the same step went back: it is not scheduled without blocks
    assert {r[0] for r in rows} == {"h0", "h1", "h3", "l0"}


def test_the_victim_is_not_readmitted_onto_the_blocks_it_gave_up() -> None:
    sched, heavy = _heavy_fills_the_pool()
    light = _fill(sched, "l", 1, 20, max_tokens=30)[0]
    step(sched)
    victim = heavy[3]
    assert victim.status == RequestStatus.PREEMPTED
    while not light.status.finished:
        step(sched)
        if not light.status.finished:  # l keeps its blocks while it runs; h never thrashes
            assert light.status == RequestStatus.RUNNING
        assert victim.num_preemptions == 1
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert all(r.status.finished for r in heavy)


def test_equal_tenants_converge_to_equal_holdings() -> None:
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=512)
    _fill(sched, "a", 4, 8 * BS - 4)
    step(sched)                      # a holds the whole pool
    _fill(sched, "b", 4, 8 * BS - 4)
    for _ in range(3):
        step(sched)
    assert _held(sched, "a") == 16 == _held(sched, "b")


def test_beyond_its_share_a_tenant_takes_free_blocks_nobody_claims() -> None:
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=512)
    _fill(sched, "l", 1, 20)
    _fill(sched, "h", 3, 8 * BS - 4)  # 24 blocks: 8 beyond h's share of 16, free otherwise
    step(sched)
    assert _held(sched, "h") == 24 and _held(sched, "l") == 2
    assert sched.stats.num_preemptions == 0
