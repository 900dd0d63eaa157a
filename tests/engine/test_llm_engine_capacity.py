"""``LLMEngine`` capacity plumbing on the fake executor: tenant shares reach the block pool and
the scheduler, and a salt rotation stops in-flight old-salt requests from caching again."""

from __future__ import annotations

from engine.request import EngineRequest, TenantShare
from engine.sampling_params import SamplingParams
from tests.fake_engine import make_fake_llm_engine


def _req(rid: str, tenant: str, start: int, n: int, max_tokens: int, share=None,
         salt: bytes = b"old-salt") -> EngineRequest:
    return EngineRequest(rid, tuple(range(start, start + n)),
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         tenant_id=tenant, cache_salt=salt, tenant_share=share or TenantShare())


def test_tenant_share_reaches_the_pool_and_the_scheduler(model_dir, tokenizer):
    engine = make_fake_llm_engine(model_dir, tokenizer)
    share = TenantShare(weight=3, min_cache_blocks=2, max_cache_blocks=40)
    engine.add_request(_req("a", "A", 1000, 20, 2, share))
    engine.add_request(_req("b", "B", 2000, 20, 2))
    assert engine.block_pool.shares["A"] == share
    assert engine.scheduler.weights == {"A": 3, "B": 1}
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.weights == {}  # per-tenant scheduler state ends with its requests
    # The cache share outlives the requests (cached blocks stay): 3 of 4 weights of 128 blocks.
    assert engine.block_pool.cache_share("A") == 40 and engine.block_pool.cache_share("B") == 32


def test_salt_rotation_stops_old_salt_requests_from_caching_even_after_preemption(
        model_dir, tokenizer):
    # 6 blocks of 16: "a" (tenant T, 40-token prompt, 3 blocks) and "b" (tenant U) compete, so
    # "a" is preempted and recomputed after T's salt was rotated.
    engine = make_fake_llm_engine(model_dir, tokenizer, num_gpu_blocks_override=6,
                                  max_model_len=96, max_num_batched_tokens=64)
    pool = engine.block_pool
    engine.add_request(_req("a", "T", 1000, 40, 40))
    a = engine.scheduler.requests["a"]
    engine.step()
    assert pool.stats.resident_blocks["T"] == 2
    assert engine.evict_tenant_cache("T", "salt_rotation") == 2
    # U's weight 4 makes T the tenant most over its share of blocks: "a" is the victim.
    engine.add_request(_req("b", "U", 3000, 40, 40, TenantShare(weight=4), salt=b"u"))
    while engine.has_unfinished_requests():
        engine.step()
        assert pool.stats.resident_blocks["T"] == 0  # nothing of T's old salt comes back
    assert a.num_preemptions >= 1 and a.num_output_tokens == 40
    assert pool.stats.resident_blocks["U"] > 0  # U still caches (the control)
    # A reset (the salt stays valid) does not stop caching: T's next request caches again.
    engine.add_request(_req("c", "T", 5000, 40, 1, salt=b"new-salt"))
    while engine.has_unfinished_requests():
        engine.step()
    assert pool.stats.resident_blocks["T"] == 2
