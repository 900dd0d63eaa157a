"""The fake model the app tests run on (``tests/fake_engine.py``): deterministic tokens over the
real engine, so block accounting and prefix-cache hits are the real ones."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeExecutor, make_fake_engine_client, make_fake_llm_engine

from engine.errors import EngineDeadError
from engine.llm import run_to_completion
from engine.protocol import EngineClient
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

PROMPT = tuple(range(500, 540))  # 40 tokens: blocks 0 and 1 are hittable on a repeat


def _req(rid: str, tenant: str, salt: bytes, prompt=PROMPT, n: int = 6) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                         tenant_id=tenant, cache_salt=salt)


def test_tokens_are_a_deterministic_function_of_the_sequence(model_dir, tokenizer):
    engine = make_fake_llm_engine(model_dir, tokenizer)
    a1, a2, other = run_to_completion(engine, [_req("a1", "t", b"s"), _req("a2", "t", b"s"),
                                               _req("b", "t", b"s", PROMPT[:-1] + (7,))])
    assert a1.token_ids == a2.token_ids and len(a1.token_ids) == 6
    assert other.token_ids != a1.token_ids
    fake = engine.runner
    expected, seq = [], list(PROMPT)
    for _ in range(6):
        expected.append(fake.next_token(seq))
        seq.append(expected[-1])
    assert a1.token_ids == expected
    assert set(a1.token_ids) <= set(fake.words)
    assert a1.text == tokenizer.decode(expected)


def test_prefix_cache_and_block_accounting_are_the_real_engines(model_dir, tokenizer):
    engine = make_fake_llm_engine(model_dir, tokenizer, num_gpu_blocks_override=32)
    fake: FakeExecutor = engine.runner
    [cold] = run_to_completion(engine, [_req("cold", "A", b"salt-a")])
    computed_cold = fake.tokens_computed
    [warm] = run_to_completion(engine, [_req("warm", "A", b"salt-a")])
    [other] = run_to_completion(engine, [_req("other", "B", b"salt-b")])
    [own] = run_to_completion(engine, [_req("own", "B", b"salt-b")])
    assert [cold.num_cached_tokens, warm.num_cached_tokens] == [0, 32]
    assert [other.num_cached_tokens, own.num_cached_tokens] == [0, 32]  # B: miss, then its own hit
    assert computed_cold == 40 + 5  # 40 prompt tokens + 5 decodes (the 6th token is the last)
    assert fake.tokens_computed == 4 * 45 - 2 * 32  # the two warm runs skipped 32 tokens each
    engine.kv_cache_manager.check_integrity()
    assert engine.block_pool.get_num_free_blocks() == 32
    snapshot = engine.stats_snapshot()
    snapshot.check_integrity()
    assert snapshot.tenants["A"].prefix_cache_hits == 32


def test_fake_client_is_an_engine_client_and_fails_like_the_real_one(model_dir, tokenizer):
    client = make_fake_engine_client(model_dir, tokenizer, max_consecutive_step_failures=1)
    assert isinstance(client, EngineClient)
    assert client.model_info().vocab_size == len(tokenizer)
    client.start()

    async def scenario() -> tuple[list[int], bool]:
        outs = [o async for o in client.generate(_req("x", "t", b"s"))]
        client.engine.runner.fail = True
        with pytest.raises(EngineDeadError):
            async for _ in client.generate(_req("y", "t", b"s")):
                pass
        return [t for o in outs for t in o.new_token_ids], client.errored

    try:
        tokens, errored = asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        client.shutdown()
    assert len(tokens) == 6 and errored
    with pytest.raises(EngineDeadError):
        asyncio.run(client.check_health())
