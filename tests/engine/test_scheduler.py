"""Scripted ``Scheduler`` scenarios: chunked prefill, continuous batching, preemption, stop rules.

No model: a fake runner answers every scheduled chunk that ``samples`` with a token id. Every step
asserts exact token counts and block ids and calls ``check_integrity()``.
"""

from __future__ import annotations

import pytest

from engine.block_hash import get_hash_fn
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from tests.engine.sched_helpers import (
    BS,
    EOS,
    assert_idle,
    check,
    make_request,
    make_scheduler,
    step,
)


# -- chunked prefill and batching -----------------------------------------------------------------
def test_chunked_prefill_32_32_6_then_decode() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    req = make_request("a", list(range(100, 170)), max_tokens=3)     # 70 tokens
    sched.add_request(req)

    out, rows = step(sched)
    assert rows == [("a", 0, 32, False)]
    assert out.scheduled[0].block_ids == (0, 1)
    assert req.num_computed_tokens == 32 and req.output_token_ids == []
    out, rows = step(sched)
    assert rows == [("a", 32, 32, False)]
    assert out.scheduled[0].block_ids == (0, 1, 2, 3)
    assert req.output_token_ids == []
    out, rows = step(sched)
    assert rows == [("a", 64, 6, True)]
    assert out.scheduled[0].block_ids == (0, 1, 2, 3, 4)
    assert req.output_token_ids == [1000]
    assert req.num_cached_tokens == 0
    out, rows = step(sched, 1001)
    assert rows == [("a", 70, 1, True)]
    assert out.scheduled[0].block_ids == (0, 1, 2, 3, 4)
    out, rows = step(sched, 1002)
    assert rows == [("a", 71, 1, True)]
    assert req.output_token_ids == [1000, 1001, 1002]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert sched.stats.prefix_cache_queries == 70
    assert sched.stats.prefix_cache_hits == 0
    assert_idle(sched)


def test_chunked_prefill_shares_budget_with_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    a = make_request("a", list(range(100, 110)), max_tokens=8)
    sched.add_request(a)
    assert step(sched)[1] == [("a", 0, 10, True)]
    b = make_request("b", list(range(200, 250)), max_tokens=1)        # 50 tokens
    sched.add_request(b)
    # Running decode first (1 token), then b's first chunk takes the remaining 31.
    assert step(sched)[1] == [("a", 10, 1, True), ("b", 0, 31, False)]
    assert step(sched)[1] == [("a", 11, 1, True), ("b", 31, 19, True)]
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv.get_block_ids("b") == []


def test_continuous_batching_two_decodes_in_one_step() -> None:
    sched = make_scheduler()
    a = make_request("a", list(range(100, 120)), max_tokens=3)
    b = make_request("b", list(range(200, 205)), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out, rows = step(sched)
    assert rows == [("a", 0, 20, True), ("b", 0, 5, True)]
    assert [s.block_ids for s in out.scheduled] == [(0, 1), (2,)]
    out, rows = step(sched)
    assert rows == [("a", 20, 1, True), ("b", 5, 1, True)]
    assert out.total_num_scheduled_tokens == 2
    step(sched)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert_idle(sched)


def test_max_num_seqs_keeps_second_waiting() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a = make_request("a", list(range(100, 120)), max_tokens=2)
    b = make_request("b", list(range(200, 205)), max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    assert step(sched)[1] == [("a", 0, 20, True)]
    assert b.status == RequestStatus.WAITING and list(sched.waiting) == [b]
    assert step(sched)[1] == [("a", 20, 1, True)]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert step(sched)[1] == [("b", 0, 5, True)]
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert_idle(sched)


def test_generated_tokens_fill_cached_blocks_for_next_turn() -> None:
    sched = make_scheduler()
    turn1 = make_request("turn1", list(range(100, 120)), max_tokens=30, ignore_eos=True)
    sched.add_request(turn1)
    k = iter(range(600, 700))
    while sched.has_unfinished_requests():
        step(sched, lambda r: next(k))
    assert turn1.num_tokens == 50     # 49 computed: blocks 0..2 (tokens 0..47) full and cached
    assert sched.kv.block_pool.get_num_cached_blocks() == 3
    turn2 = make_request("turn2", turn1.all_token_ids + [7, 7, 7, 7, 7, 7], max_tokens=1)
    sched.add_request(turn2)
    out, rows = step(sched)
    assert rows == [("turn2", 48, 8, True)]
    assert out.scheduled[0].block_ids == (0, 1, 2, 3)
    assert turn2.num_cached_tokens == 48, "blocks of generated tokens must be hits"
    assert_idle(sched)


def test_same_prompt_admitted_in_one_step_hits_blocks_cached_that_step() -> None:
    sched = make_scheduler()
    prompt = list(range(100, 140))                                    # 40 tokens
    a = make_request("a", prompt, max_tokens=1)
    b = make_request("b", prompt, max_tokens=1, tenant="t1")
    c = make_request("c", prompt, max_tokens=1, tenant="t2", salt=b"\x08" * 32)
    for r in (a, b, c):
        sched.add_request(r)
    out, rows = step(sched)
    # Fair admission: after a (t1) runs, t2's c goes before t1's second request b.
    assert rows == [("a", 0, 40, True), ("c", 0, 40, True), ("b", 32, 8, True)]
    assert [s.block_ids for s in out.scheduled] == [(0, 1, 2), (3, 4, 5), (0, 1, 6)]
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 32, 0)
    assert sched.stats.per_tenant_hits == {"t1": 32, "t2": 0}
    assert sched.stats.per_tenant_queries == {"t1": 80, "t2": 40}
    assert sched.stats.prefix_cache_hits == sum(sched.stats.per_tenant_hits.values())
    assert sched.stats.prefix_cache_queries == sum(sched.stats.per_tenant_queries.values())
    assert_idle(sched)


def test_requests_on_a_cached_prompt_are_planned_their_uncached_tokens() -> None:
    """The budget plans a waiting request's prompt less its cache hits (vLLM v1): 8 requests
    on one cached 96-token prompt compute 4 tokens each, all in one step of 128. Planning
    whole prompts (100 each) admitted two of them a step."""
    sched = make_scheduler(num_blocks=64, max_num_seqs=16, max_num_batched_tokens=128)
    base = list(range(100, 196))                                      # 96 tokens: 6 blocks
    first = make_request("first", base + [7], max_tokens=1)
    sched.add_request(first)
    while sched.has_unfinished_requests():
        step(sched)
    reqs = [make_request(f"r{i}", base + [10 * i + j for j in range(1, 5)], max_tokens=1)
            for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    out, rows = step(sched)
    assert rows == [(f"r{i}", 96, 4, True) for i in range(8)]
    assert all(s.block_ids[:6] == out.scheduled[0].block_ids[:6] for s in out.scheduled)
    assert [r.num_cached_tokens for r in reqs] == [96] * 8
    assert_idle(sched)


def test_a_flood_of_cache_hits_leaves_another_tenant_its_seat_and_budget() -> None:
    """A tenant flooding requests that hit its own cached prompt (each planned 4 tokens now)
    does not crowd out another tenant's long cold prompt: with 6 seats and a budget of 128,
    the other tenant's request is admitted in the flood's first step, with its fair half of
    the budget, and the flood takes the other seats and the rest."""
    sched = make_scheduler(num_blocks=64, max_num_seqs=6, max_num_batched_tokens=128)
    base = list(range(100, 196))
    warm = make_request("warm", base + [7], max_tokens=1, tenant="t1")
    sched.add_request(warm)
    while sched.has_unfinished_requests():
        step(sched)
    flood = [make_request(f"f{i}", base + [10 * i + j for j in range(1, 5)], max_tokens=1,
                          tenant="t1") for i in range(20)]
    other = make_request("other", list(range(2000, 2200)), max_tokens=1, tenant="t2",
                         salt=b"\x09" * 32)
    for r in flood[:10]:
        sched.add_request(r)
    sched.add_request(other)
    for r in flood[10:]:
        sched.add_request(r)
    _, rows = step(sched)
    got = {rid: n for rid, _, n, _ in rows}
    assert "other" in got and got["other"] >= 64                      # its fair half or more
    assert len(rows) == 6 and sum(got.values()) <= 128
    assert all(n == 4 for rid, n in got.items() if rid != "other")
    assert other.num_cached_tokens == 0                               # t1's blocks never hit
    while sched.has_unfinished_requests():
        step(sched)
    assert other.status == RequestStatus.FINISHED_LENGTH
    assert [r.num_cached_tokens for r in flood] == [96] * 20          # t1's own hits do
    assert_idle(sched)


def test_admission_is_fair_across_tenants_and_fcfs_within_one() -> None:
    sched = make_scheduler()
    sched.max_num_seqs = 2
    flood = [make_request(f"a{i}", list(range(100 * i, 100 * i + 20)), max_tokens=1,
                          tenant="t1") for i in range(1, 5)]
    late = make_request("b1", list(range(900, 920)), max_tokens=1, tenant="t2")
    for r in (*flood, late):
        sched.add_request(r)
    _, rows = step(sched)
    assert [r[0] for r in rows] == ["a1", "b1"]      # t2 is not stuck behind t1's backlog
    _, rows = step(sched)
    assert [r[0] for r in rows] == ["a2", "a3"]      # t1's own requests stay in order
    _, rows = step(sched)
    assert [r[0] for r in rows] == ["a4"]
    assert_idle(sched)


# -- preemption -----------------------------------------------------------------------------------
def test_preemption_by_recompute() -> None:
    sched = make_scheduler(num_blocks=6)
    pool = sched.kv.block_pool
    shared = list(range(100, 116))                                    # one shared full block
    a = make_request("a", shared + list(range(200, 214)), max_tokens=25, ignore_eos=True)
    b = make_request("b", shared + list(range(300, 314)), max_tokens=25, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)

    # Step 0: both admitted; b hits a's block 0, cached as soon as a's slots were allocated.
    out, rows = step(sched, lambda r: 500)
    assert rows == [("a", 0, 30, True), ("b", 16, 14, True)]
    assert [s.block_ids for s in out.scheduled] == [(0, 1), (0, 2)]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 16)
    assert sched.stats.prefix_cache_queries == 60
    assert sched.stats.prefix_cache_hits == 16
    assert sched.stats.per_tenant_hits == {"t1": 16}

    # Steps 1..18: both decode; the 3rd block of each is allocated at 33 tokens.
    for k in range(1, 19):
        out, rows = step(sched, lambda r: 500)
        assert rows == [("a", 29 + k, 1, True), ("b", 29 + k, 1, True)]
        assert out.preempted_ids == ()
    assert sched.kv.get_block_ids("a") == [0, 1, 3]
    assert sched.kv.get_block_ids("b") == [0, 2, 4]
    assert pool.free_block_queue.block_ids() == [5]

    # Step 19: a (49 tokens) takes the last free block; b needs a 4th block -> b, the most
    # recently admitted, is preempted: blocks freed tail first, back at the head of waiting.
    out, rows = step(sched, lambda r: 500)
    assert rows == [("a", 48, 1, True)]
    assert out.preempted_ids == ("b",)
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert sched.kv.get_block_ids("b") == []
    assert list(sched.waiting) == [b]
    assert sched.running == [a]
    assert pool.free_block_queue.block_ids() == [4, 2]
    assert [blk.ref_cnt for blk in pool.blocks] == [1, 1, 0, 1, 0, 1]
    assert sched.stats.num_preemptions == 1
    assert b.num_tokens == 49 and b.num_output_tokens == 19

    # Steps 20..24: b's 3 cached blocks are hits (48 tokens) but it needs 1 more block and none
    # is free beyond the hits themselves: b keeps waiting, unchanged.
    for k in range(20, 25):
        out, rows = step(sched, lambda r: 500)
        assert rows == [("a", 29 + k, 1, True)]
        assert b.status == RequestStatus.PREEMPTED and list(sched.waiting) == [b]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 25
    assert pool.free_block_queue.block_ids() == [5, 4, 2, 3, 1, 0]

    # Step 25: b resumes from its own cached blocks and recomputes the uncomputed token.
    out, rows = step(sched, lambda r: 500)
    assert rows == [("b", 48, 1, True)]
    assert out.scheduled[0].block_ids == (0, 2, 4, 5)
    assert b.status == RequestStatus.RUNNING
    # Re-admission is never a hit: stats and num_cached_tokens keep the first admission's values.
    assert b.num_cached_tokens == 16
    assert sched.stats.prefix_cache_queries == 60
    assert sched.stats.prefix_cache_hits == 16
    assert sched.stats.per_tenant_queries == {"t1": 60}
    assert sched.stats.per_tenant_hits == {"t1": 16}
    assert sched.stats.num_recomputed_tokens == 1

    while sched.has_unfinished_requests():
        step(sched, lambda r: 500)
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.num_output_tokens == 25
    assert sched.stats.num_preemptions == 1
    assert_idle(sched)


def test_preempted_without_cache_recomputes_everything() -> None:
    kv = KVCacheManager(BlockPool(4), BS, get_hash_fn("sha256"), enable_caching=False)
    sched = Scheduler(kv, 8, 256, 1024, eos_token_ids=[EOS])
    a = make_request("a", list(range(100, 130)), max_tokens=6, ignore_eos=True)
    b = make_request("b", list(range(200, 230)), max_tokens=6, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)                                   # 30 + 30 tokens: blocks [0, 1], [2, 3]
    step(sched)                                   # 31 each
    out, rows = step(sched)                       # 32 each
    assert out.preempted_ids == ()
    out, rows = step(sched)                       # a needs a 3rd block: b preempted
    assert rows == [("a", 32, 1, True)] and out.preempted_ids == ("b",)
    while a.status == RequestStatus.RUNNING:
        step(sched)
    out, rows = step(sched)
    assert rows == [("b", 0, 33, True)]
    assert sched.stats.num_recomputed_tokens == 33
    assert sched.stats.prefix_cache_hits == 0
    while sched.has_unfinished_requests():
        step(sched)
    assert b.num_output_tokens == 6
    assert_idle(sched)


def test_waiting_request_without_blocks_counts_hits_once() -> None:
    sched = make_scheduler(num_blocks=5)
    kv = sched.kv
    calls = []
    orig = kv.get_computed_blocks

    def counting(req: Request):  # type: ignore[no-untyped-def]
        calls.append(req.request_id)
        return orig(req)

    kv.get_computed_blocks = counting  # type: ignore[method-assign]

    base = list(range(100, 132))
    c = make_request("c", base + [7], max_tokens=1)                  # 33 tokens, 2 cached blocks
    sched.add_request(c)
    step(sched)
    assert c.status == RequestStatus.FINISHED_LENGTH
    assert kv.block_pool.free_block_queue.block_ids() == [2, 3, 4, 1, 0]

    a = make_request("a", list(range(500, 533)), max_tokens=4)        # 3 blocks: 2, 3, 4
    b = make_request("b", base + list(range(900, 932)), max_tokens=1)  # 64 tokens: 2 hits + 2 new
    sched.add_request(a)
    sched.add_request(b)
    calls.clear()
    out, rows = step(sched)
    assert rows == [("a", 0, 33, True)]
    assert kv.get_block_ids("a") == [2, 3, 4]
    for _ in range(3):
        assert b.status == RequestStatus.WAITING
        assert b.num_computed_tokens == 0 and b.num_cached_tokens == -1
        assert kv.get_block_ids("b") == []
        assert kv.block_pool.free_block_queue.block_ids() == [1, 0]
        assert sched.stats.prefix_cache_queries == 33 + 33
        assert sched.stats.prefix_cache_hits == 0
        step(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH
    # Looked up twice a step while b waits (its plan, then its admission), read-only each time.
    assert calls.count("b") == 8, "lookup is repeated while b waits"

    out, rows = step(sched)
    assert rows == [("b", 32, 32, True)]
    assert out.scheduled[0].block_ids == (0, 1, 4, 3)
    assert calls.count("b") == 10
    assert b.num_cached_tokens == 32
    assert sched.stats.prefix_cache_queries == 33 + 33 + 64
    assert sched.stats.prefix_cache_hits == 32
    assert sched.stats.num_recomputed_tokens == 0
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert_idle(sched)


# -- stop rules -----------------------------------------------------------------------------------
def test_eos_finishes_stopped() -> None:
    sched = make_scheduler()
    a = make_request("a", [5, 6, 7], max_tokens=10)
    sched.add_request(a)
    step(sched, 11)
    step(sched, EOS)
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids == [11, EOS]
    assert a.stop_reason is None
    assert_idle(sched)


def test_stop_token_id_finishes_stopped_with_reason() -> None:
    sched = make_scheduler()
    a = make_request("a", [5, 6, 7], max_tokens=10, stop_token_ids=(42,), ignore_eos=True)
    sched.add_request(a)
    step(sched, EOS)
    assert a.status == RequestStatus.RUNNING
    step(sched, 42)
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.stop_reason == 42
    assert_idle(sched)


def test_max_tokens_finishes_length() -> None:
    sched = make_scheduler()
    a = make_request("a", [5, 6, 7], max_tokens=2)
    sched.add_request(a)
    step(sched, 11)
    assert a.status == RequestStatus.RUNNING
    step(sched, 12)
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [11, 12]
    assert_idle(sched)


def test_max_model_len_finishes_length() -> None:
    sched = make_scheduler(max_model_len=20)
    a = make_request("a", list(range(100, 117)), max_tokens=None)     # 17 tokens
    sched.add_request(a)
    step(sched, 11)
    step(sched, 12)
    assert a.status == RequestStatus.RUNNING and a.num_tokens == 19
    step(sched, 13)
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.num_tokens == 20 and a.output_token_ids == [11, 12, 13]
    assert_idle(sched)


def test_ignore_eos_keeps_going() -> None:
    sched = make_scheduler()
    a = make_request("a", [5, 6, 7], max_tokens=3, ignore_eos=True)
    sched.add_request(a)
    step(sched, EOS)
    step(sched, EOS)
    assert a.status == RequestStatus.RUNNING
    step(sched, EOS)
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [EOS, EOS, EOS]
    assert_idle(sched)


# -- abort and validation -------------------------------------------------------------------------
def test_abort_waiting_and_running_frees_blocks() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a = make_request("a", list(range(100, 140)), max_tokens=10)
    b = make_request("b", list(range(200, 240)), max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.kv.get_block_ids("a") == [0, 1, 2]
    assert b.status == RequestStatus.WAITING

    done = sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    check(sched)
    assert done == [b] and b.status == RequestStatus.FINISHED_ABORTED
    assert list(sched.waiting) == []

    done = sched.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
    check(sched)
    assert done == [a] and a.status == RequestStatus.FINISHED_ABORTED
    assert_idle(sched)
    assert sched.schedule().scheduled == ()


def test_abort_while_step_runs_drops_its_token() -> None:
    sched = make_scheduler()
    a = make_request("a", [5, 6, 7], max_tokens=10)
    sched.add_request(a)
    out = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, {"a": 11}) == []
    check(sched)
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    assert_idle(sched)


def test_abort_preempted_request() -> None:
    sched = make_scheduler(num_blocks=2)
    a = make_request("a", list(range(100, 116)), max_tokens=20, ignore_eos=True)
    b = make_request("b", list(range(200, 215)), max_tokens=20, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    out, rows = step(sched)                            # a: 16 tokens, b: 15 tokens
    assert rows == [("a", 0, 16, True), ("b", 0, 15, True)]
    out, rows = step(sched)                            # a needs block 2: b preempted
    assert out.preempted_ids == ("b",)
    assert b.status == RequestStatus.PREEMPTED
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    check(sched)
    assert b.status == RequestStatus.FINISHED_ABORTED
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert_idle(sched)


def test_add_request_validation() -> None:
    sched = make_scheduler(max_model_len=20)
    sched.add_request(make_request("a", [1, 2, 3]))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_request("a", [4, 5]))
    sched.add_request(make_request("ok", list(range(19))))
    assert [r.request_id for r in sched.waiting] == ["a", "ok"]
    with pytest.raises(AssertionError, match="unvalidated request"):  # no room for a token
        sched.add_request(make_request("full", list(range(20))))
    for bad in ({"max_num_batched_tokens": 0}, {"max_num_seqs": 0}, {"fair_quantum_tokens": 0}):
        with pytest.raises(ValueError, match="must be at least 1"):
            make_scheduler(**bad)
    make_scheduler(max_num_batched_tokens=1, max_num_seqs=1, fair_quantum_tokens=1)


def test_a_finished_loads_held_blocks_give_way_before_any_preemption() -> None:
    """A tier load finished at the start of a step holds its blocks for its admission in that
    step (``KVCacheManager.release_pins``); a running request short of a block takes them
    first, and nobody is preempted for them."""
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    req = make_request("r", range(100, 132), max_tokens=40)
    sched.add_request(req)
    step(sched)  # its 32 prompt tokens and a sampled one: its next token needs a third block
    pool = sched.kv.block_pool
    held = pool.get_new_blocks(pool.get_num_free_blocks(), "t2")  # as a finished load's
    sched.kv._pinned["loaded"] = held
    out = sched.schedule()
    assert out.preempted_ids == () and req.status == RequestStatus.RUNNING
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("r", 1)]
    assert not sched.kv._pinned and pool.get_num_free_blocks() == len(held) - 1
    sched.update_from_output(out, {"r": 1000})
    check(sched)
