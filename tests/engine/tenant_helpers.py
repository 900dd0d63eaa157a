"""The hostile-tenant check shared by the engine tests of formats whose rows keep their bits in
any batch (``test_kv_cache_dtype.py``, ``test_quantization.py``)."""

from __future__ import annotations

from collections.abc import Callable

from engine.llm import run_to_completion
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams


def b_request(b_ids: list[int], rid: str, salt: bytes) -> EngineRequest:
    """Tenant B's greedy request of 12 tokens with 2 logprobs each, under ``salt``."""
    return EngineRequest(rid, tuple(b_ids), SamplingParams(max_tokens=12, temperature=0.0,
                                                           logprobs=2),
                         tenant_id="b", cache_salt=salt)


def check_a_flood_leaves_b_as_alone(engine, b_ids: list[int],
                                    chat: Callable[[str], list[int]]) -> None:
    """Tenant A floods 20 requests (every other one B's very prompt) beside tenant B's one.

    Asserts: B's run under a new salt beside the flood has B's tokens and logprobs alone, the
    same floats; B finds nothing cached there (so nothing of A's); A's requests all run; B's
    own repeat under its first salt hits. The repeat's tokens are not compared: after a hit the
    uncached rows attend through our kernel rather than SDPA, which may move a token on formats
    that round (a bf16 cache, 8-bit activations).
    """
    (alone,) = run_to_completion(engine, [b_request(b_ids, "b-alone", b"b" * 16)])
    assert alone.num_cached_tokens == 0
    flood = [EngineRequest(f"a{i}", tuple(b_ids if i % 2 else chat(f"Count to {i}.")),
                           SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                           tenant_id="a", cache_salt=b"a" * 16) for i in range(20)]
    results = run_to_completion(engine, [*flood, b_request(b_ids, "b-flooded", b"c" * 16)])
    beside = results[-1]
    assert beside.num_cached_tokens == 0  # A sent B's very prompt ten times: no hit across
    assert all(len(r.token_ids) == 24 for r in results[:-1])
    assert beside.token_ids == alone.token_ids and len(alone.token_ids) >= 4
    assert len(beside.logprobs) == len(alone.logprobs) == len(alone.token_ids)
    for got, want in zip(beside.logprobs, alone.logprobs, strict=True):
        assert got == want  # the same floats, not close ones
    (again,) = run_to_completion(engine, [b_request(b_ids, "b-again", b"b" * 16)])
    assert again.num_cached_tokens > 0 and len(again.token_ids) >= 4
