"""``--kv-cache-dtype bfloat16`` (vLLM's flag): a bf16 paged KV cache under an fp32 model on CPU.

Half the bytes a block (twice the blocks in one budget); decode attention on avx512_bf16's
products where the CPU has them (``kernels/cpu/decode_attention.cpp``), else the torch path
reading the cache as fp32. Not token-identical to fp32: agreement is measured here and in
``benchmarks/bench_quantization.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.attention import AttentionMetadata, paged_attention_torch
from engine.config import EngineConfig
from engine.llm import run_to_completion
from engine.model_runner import resolve_kv_cache_dtype
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from kernels import cpu_linear, cpu_ops
from tests.engine.tenant_helpers import check_a_flood_leaves_b_as_alone

cpu_linear.load()
BF16_KERNEL = cpu_ops.bf16_decode_attention_usable(64)


def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def test_the_flag_takes_auto_and_bfloat16_only():
    assert EngineConfig(model="m").kv_cache_dtype == "auto"
    assert EngineConfig(model="m", kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="fp8")
    fp32, bf16 = torch.float32, torch.bfloat16
    assert resolve_kv_cache_dtype("auto", fp32, "torch") == fp32
    assert resolve_kv_cache_dtype("auto", bf16, "triton") == bf16
    assert resolve_kv_cache_dtype("bfloat16", fp32, "torch") == bf16
    assert resolve_kv_cache_dtype("bfloat16", bf16, "triton") == bf16
    with pytest.raises(ValueError, match="--attention-backend torch"):  # triton: model's dtype
        resolve_kv_cache_dtype("bfloat16", fp32, "triton")
    with pytest.raises(ValueError, match="--dtype float32 or bfloat16"):
        resolve_kv_cache_dtype("bfloat16", torch.float16, "torch")


def test_a_bf16_cache_holds_twice_the_blocks_in_the_same_budget(make_llm_engine):
    budget = 64 << 20
    fp32 = make_llm_engine(num_gpu_blocks_override=None, kv_cache_memory_bytes=budget)
    bf16 = make_llm_engine(num_gpu_blocks_override=None, kv_cache_memory_bytes=budget,
                           kv_cache_dtype="bfloat16")
    assert fp32.runner.kv_caches.dtype == torch.float32
    assert bf16.runner.kv_caches.dtype == torch.bfloat16
    # 30 layers x K and V x 16 tokens x 3 KV heads x 64 dims x 4 (2) bytes
    assert fp32.cache_info.bytes_per_block == 30 * 2 * 16 * 3 * 64 * 4
    assert bf16.cache_info.bytes_per_block == fp32.cache_info.bytes_per_block // 2
    assert bf16.cache_info.num_blocks == 2 * fp32.cache_info.num_blocks
    assert bf16.cache_info.dtype == "float32"  # the model stays fp32


def _decode(engine, prompts, max_tokens=24):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
    return run_to_completion(engine, [EngineRequest(f"r{i}", tuple(p), params)
                                      for i, p in enumerate(prompts)])


@pytest.mark.skipif(not BF16_KERNEL, reason="needs our kernels and avx512_bf16")
def test_the_bundled_model_answers_on_a_bf16_cache_close_to_fp32(make_llm_engine, tokenizer,
                                                                 monkeypatch):
    """Greedy decoding on a bf16 cache, through our bf16 kernel and (monkeypatched off, as on a
    CPU without avx512_bf16) through the torch path that reads the cache widened to fp32: both
    compute fp32 attention over the same bf16 values (per call within 5e-6, measured), so they
    give the same tokens (here; at least the first 12 of 24 anywhere). Their logprobs differ by up to ~2e-2, not fp32's ~1e-5: a 1e-6
    difference upstream of a K/V write now and then flips that element's bf16 rounding (one
    bf16 ulp, 4e-3), which later layers and tokens carry; the same happens between a prefix-
    cache hit and a miss, or a prefill beside other requests and alone. The capital question is
    answered; and teacher-forced on fp32's output, the most likely token is fp32's at nearly
    every position."""
    prompts = [_chat(tokenizer, t) for t in ("What is the capital of France?",
                                             "Why is the sky blue?",
                                             "Write a haiku about the sea.")]
    ref = [r.token_ids for r in _decode(make_llm_engine(), prompts)]
    kernel = make_llm_engine(kv_cache_dtype="bfloat16")
    assert kernel.runner.kv_caches.dtype == torch.bfloat16
    via_kernel = _decode(kernel, prompts)
    with monkeypatch.context() as m:
        m.setattr(cpu_ops, "bf16_decode_attention_usable", lambda head_dim: False)
        via_torch = _decode(make_llm_engine(kv_cache_dtype="bfloat16"), prompts)
    assert "Paris" in tokenizer.decode(via_kernel[0].token_ids)
    worst = 0.0
    for a, b in zip(via_kernel, via_torch):
        # Usually identical; a near-tie on some CPUs may part them late, not early.
        same = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                    len(a.token_ids))
        assert a.token_ids == b.token_ids or same >= 12, (same, a.token_ids, b.token_ids)
        worst = max(worst, *(abs(x.logprob - y.logprob)
                             for x, y in zip(a.logprobs[:same], b.logprobs[:same])))
    assert worst < 0.1, worst
    agree = total = 0
    for i, (p, want) in enumerate(zip(prompts, ref)):
        (res,) = run_to_completion(kernel, [EngineRequest(
            f"t{i}", tuple(p + want), SamplingParams(max_tokens=1, temperature=0.0,
                                                     prompt_logprobs=0))])
        ranks = [lp.rank for lp in res.prompt_logprobs[len(p):]]
        agree += sum(r == 1 for r in ranks)
        total += len(ranks)
    assert total == sum(map(len, ref)) and agree >= 0.9 * total, (agree, total)


@pytest.mark.skipif(not BF16_KERNEL, reason="needs our kernels and avx512_bf16")
def test_a_flooding_tenant_leaves_another_tenants_bf16_cache_tokens_as_they_are(
        make_llm_engine, tokenizer):
    """On a bf16 cache (gguf weights, whose int8-dot kernels give a row the same bits in any
    batch), tenant A floods 20 requests beside tenant B's one: B's tokens and logprobs are the
    bits of its run alone (its rows' attention does not depend on the batch either).
    B's first request and its run under a new salt find nothing cached (so nothing of A's);
    B's own repeat hits. (Its tokens may differ from the miss's: its uncached rows attend
    through our kernel, not SDPA, and on a bf16 cache a 1e-6 difference can flip a K/V
    rounding; see the test above.)"""
    engine = make_llm_engine(kv_cache_dtype="bfloat16", quantization="gguf")
    check_a_flood_leaves_b_as_alone(engine, _chat(tokenizer, "Why is the sky blue?"),
                                    lambda text: _chat(tokenizer, text))


def _meta(seq_lens, query_lens, tables, block_size=16):
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    bt = torch.tensor(tables, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
        query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens), block_size=block_size,
        token_slots=AttentionMetadata.expand_token_slots(bt, block_size))


def test_the_torch_path_reads_a_bf16_cache_as_fp32(monkeypatch):
    """Off our kernels (a CPU without them), decodes (padded batch, and cascade-split on a
    shared prefix) and a prefill chunk over context read the bf16 cache widened to fp32: the
    output equals the torch path's on the widened cache, bit for bit."""
    monkeypatch.setattr(cpu_ops, "decode_attention_usable", lambda *a: False)
    gen = torch.Generator().manual_seed(3)
    kc = torch.randn(12, 16, 3, 64, generator=gen).bfloat16()
    vc = torch.randn(12, 16, 3, 64, generator=gen).bfloat16()
    q = torch.randn(7, 9, 64, generator=gen)
    mixed = _meta([40, 70, 33], [1, 5, 1], [[0, 1, 2, 0, 0], [3, 4, 5, 6, 7], [8, 9, 10, 0, 0]])
    shared = replace(_meta([40, 45, 36], [1, 1, 1], [[0, 1, 2], [0, 1, 3], [0, 1, 4]]),
                     cascade_prefix_len=32)  # three decodes on two common blocks
    for meta in (mixed, shared):
        rows = q[:int(meta.query_start_loc[-1])]
        got = paged_attention_torch(rows, kc, vc, meta, 0.125)
        want = paged_attention_torch(rows, kc.float(), vc.float(), meta, 0.125)
        assert torch.equal(got, want) and not torch.isnan(got).any()


def test_a_bf16_cache_write_rounds_to_nearest_even_like_torch():
    """Our ``reshape_and_cache`` (when our kernels are loaded) and torch's ``.to(bfloat16)``
    write the same bits into K and V, halfway cases included: 1 + 2^-8 rounds down to 1 (even),
    1 + 3 * 2^-8 up to 1 + 2^-6."""
    gen = torch.Generator().manual_seed(4)
    key = torch.randn(4, 3, 64, generator=gen) * 3
    value = torch.randn(4, 3, 64, generator=gen)
    key[0, 0, :2] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8])
    value[1, 2, :2] = torch.tensor([-(1 + 2 ** -8), 2 + 3 * 2 ** -7])
    slots = torch.tensor([5, 17, 100, 191])
    kc, vc = torch.zeros(12, 16, 3, 64, dtype=torch.bfloat16), torch.zeros(12, 16, 3, 64,
                                                                          dtype=torch.bfloat16)
    cpu_ops.reshape_and_cache(key, value, kc, vc, slots)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    want_k.view(-1, 3, 64)[slots] = key.bfloat16()
    want_v.view(-1, 3, 64)[slots] = value.bfloat16()
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert kc.view(-1, 3, 64)[5, 0, :2].float().tolist() == [1.0, 1 + 2 ** -6]
    assert vc.view(-1, 3, 64)[17, 2, :2].float().tolist() == [-1.0, 2 + 2 ** -5]
