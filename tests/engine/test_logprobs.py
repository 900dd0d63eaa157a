"""Logprobs and prompt logprobs on the bundled model == Hugging Face ``log_softmax`` (fp32),
cold, warm (a cached prefix), with chunked prefill and under preemption; plus the token-level
sampling settings (min_tokens, stop_token_ids, logit_bias, penalties) end to end."""

from __future__ import annotations

import pytest
import torch

from engine.llm import run_to_completion
from engine.request import EngineRequest, TokenLogprobs
from engine.sampling_params import SamplingParams

PROMPTS = [
    ("You are a careful assistant for a company that builds bridges. Answer with facts, cite "
     "sources when you can, and keep answers short.\n\nThe history of the Roman Empire begins"),
    "Here is a long story about a dragon who lived in a cave near the sea. One day,",
]
TOP = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def hf_log_softmax(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_matches(lp: TokenLogprobs, ref_row: torch.Tensor, token: int) -> None:
    assert lp.token_id == token
    assert abs(lp.logprob - ref_row[token].item()) < TOL
    assert lp.rank == int((ref_row > ref_row[token]).sum()) + 1
    ref_v, ref_i = ref_row.topk(TOP)
    assert [t for t, _ in lp.top] == ref_i.tolist()
    assert max(abs(v - r) for (_, v), r in zip(lp.top, ref_v.tolist())) < TOL


def run(engine, prompt_ids, tag, **params):
    p = SamplingParams(**{"max_tokens": 8, "temperature": 0, **params})
    return run_to_completion(engine, [EngineRequest(f"{tag}-{i}", tuple(ids), p, tenant_id="t")
                                      for i, ids in enumerate(prompt_ids)], max_steps=10_000)


def check_against_hf(hf_model, results, num_out: int = 8) -> None:
    for r in results:
        full = r.prompt_token_ids + r.token_ids
        ref = hf_log_softmax(hf_model, full)
        n = len(r.prompt_token_ids)
        assert len(r.logprobs) == len(r.token_ids) == num_out
        for j, lp in enumerate(r.logprobs):
            assert_matches(lp, ref[n - 1 + j], full[n + j])
            assert lp.rank == 1  # greedy
        assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == n
        assert r.prompt_logprobs[0] is None
        for p in range(1, n):
            entry = r.prompt_logprobs[p]
            assert entry is not None
            assert_matches(entry, ref[p - 1], full[p])


def test_logprobs_match_hf_cold_and_warm(make_llm_engine, hf_model, prompt_ids):
    engine = make_llm_engine()
    cold = run(engine, prompt_ids, "cold", logprobs=TOP, prompt_logprobs=TOP)
    check_against_hf(hf_model, cold)
    # The prompts are cached now: a plain repeat hits, one with prompt logprobs computes
    # its whole prompt (never a gap or a wrong value) and still matches.
    plain = run(engine, prompt_ids, "plain", logprobs=TOP)
    assert all(r.num_cached_tokens > 0 for r in plain)
    for a, b in zip(plain, cold):
        assert [(x.token_id, x.rank) for x in a.logprobs] == [(y.token_id, y.rank)
                                                            for y in b.logprobs]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < TOL
        assert a.prompt_logprobs is None
    warm = run(engine, prompt_ids, "warm", logprobs=TOP, prompt_logprobs=TOP)
    assert [r.num_cached_tokens for r in warm] == [0, 0]
    check_against_hf(hf_model, warm)


def test_prompt_logprobs_survive_chunked_prefill_and_preemption(make_llm_engine, hf_model,
                                                                prompt_ids):
    # 16-token chunks; six requests in a 12-block pool preempt and recompute each other.
    engine = make_llm_engine(max_num_batched_tokens=16, num_gpu_blocks_override=12,
                             max_model_len=192)
    results = run(engine, prompt_ids * 3, "chunked", logprobs=TOP, prompt_logprobs=TOP,
                  max_tokens=24, ignore_eos=True)
    assert engine.scheduler.stats.num_preemptions > 0
    check_against_hf(hf_model, results, 24)


def test_min_tokens_and_stop_token_ids_on_the_real_model(make_llm_engine, tokenizer):
    engine = make_llm_engine()
    chat = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)
    eos = tokenizer.eos_token_id
    free = run(engine, [chat], "free", max_tokens=64)[0]
    assert free.token_ids[-1] == eos and free.finish_reason == "stop"
    short = len(free.token_ids)
    held = run(engine, [chat], "min", max_tokens=64, min_tokens=short + 5)[0]
    assert eos not in held.token_ids[:short + 5]
    assert len(held.token_ids) >= short + 5
    # The third generated token, named as a stop id, ends the request right there.
    stop_at = free.token_ids[2]
    stopped = run(engine, [chat], "stopid", max_tokens=64, stop_token_ids=(stop_at,))[0]
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"


def test_logit_bias_and_penalties_change_greedy_output(make_llm_engine, prompt_ids):
    engine = make_llm_engine()
    base = run(engine, prompt_ids[:1], "base", max_tokens=12)[0].token_ids
    banned = run(engine, prompt_ids[:1], "ban", max_tokens=12,
                 logit_bias={base[0]: -100.0})[0].token_ids
    assert banned[0] != base[0]
    forced = run(engine, prompt_ids[:1], "force", max_tokens=12,
                 logit_bias={base[3]: 100.0})[0].token_ids
    assert forced == [base[3]] * 12
    # A strong frequency penalty forbids repeating any output token in 12 tokens.
    varied = run(engine, prompt_ids[:1], "freq", max_tokens=12,
                 frequency_penalty=2.0, logit_bias={base[3]: 8.0})[0].token_ids
    assert len(set(varied)) == len(varied)


def test_a_fault_in_a_prompt_logprobs_request_fails_it_alone(make_llm_engine, prompt_ids):
    """The prompt logprobs of a request that failed in the same step (its sampling) are not
    looked up after the request is gone: a KeyError out of step() would kill the engine loop
    for every tenant."""
    from engine.faults import inject

    engine = make_llm_engine()

    def fault(point: str, rid: str | None) -> None:
        if point == "sample" and rid == "victim":
            raise RuntimeError("injected")

    p = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    with inject(fault):
        results = run_to_completion(engine, [
            EngineRequest("victim", tuple(prompt_ids[0]), p, tenant_id="a"),
            EngineRequest("bystander", tuple(prompt_ids[1]), p, tenant_id="b")], max_steps=100)
    assert results[0].finish_reason == "error"
    assert results[1].finish_reason == "length" and len(results[1].token_ids) == 4
    assert results[1].prompt_logprobs is not None
    pool = engine.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
