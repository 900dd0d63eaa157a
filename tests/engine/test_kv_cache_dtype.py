"""``--kv-cache-dtype bfloat16`` (vLLM's flag): a bf16 paged KV cache under an fp32 model on CPU.

Half the bytes a block (twice the blocks in one budget); decode attention on avx512_bf16's
products where the CPU has them (``kernels/cpu/decode_attention.cpp``), else the torch path
reading the cache as fp32. Not token-identical to fp32: agreement is measured here and in
``benchmarks/bench_quantization.py``.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, paged_attention_torch
from engine.config import EngineConfig
from engine.llm import run_to_completion
from engine.model_runner import resolve_kv_cache_dtype
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from kernels import cpu_linear, cpu_ops

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
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="CPU only"):  # the Triton kernels take the model's
        resolve_kv_cache_dtype("bfloat16", torch.float32, cuda)


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


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=pytest.mark.skipif(
    not BF16_KERNEL, reason="needs our kernels and avx512_bf16")), False],
    ids=["bf16-kernel", "torch-path"])
def test_the_bundled_model_answers_on_a_bf16_cache_close_to_fp32(make_llm_engine, tokenizer,
                                                                 kernel, monkeypatch):
    """Greedy output on a bf16 cache, through our bf16 kernel or (monkeypatched off, as on a CPU
    without avx512_bf16) the torch path that reads the cache as fp32: the capital question is
    answered, and teacher-forced on fp32's output the most likely token is fp32's at nearly
    every position (bf16 K/V rounding, about 3e-3 relative in attention, moves a few)."""
    if not kernel:
        monkeypatch.setattr(cpu_ops, "bf16_decode_attention_usable", lambda head_dim: False)
    prompts = [_chat(tokenizer, t) for t in ("What is the capital of France?",
                                             "Why is the sky blue?",
                                             "Write a haiku about the sea.")]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    fp32 = make_llm_engine()
    ref = [r.token_ids for r in run_to_completion(
        fp32, [EngineRequest(f"f{i}", tuple(p), params) for i, p in enumerate(prompts)])]
    engine = make_llm_engine(kv_cache_dtype="bfloat16")
    assert engine.runner.kv_caches.dtype == torch.bfloat16
    out = run_to_completion(engine, [EngineRequest(f"b{i}", tuple(p), params)
                                     for i, p in enumerate(prompts)])
    assert "Paris" in tokenizer.decode(out[0].token_ids)
    agree = total = 0
    for i, (p, want) in enumerate(zip(prompts, ref)):
        (res,) = run_to_completion(engine, [EngineRequest(
            f"t{i}", tuple(p + want), SamplingParams(max_tokens=1, temperature=0.0,
                                                     prompt_logprobs=0))])
        ranks = [lp.rank for lp in res.prompt_logprobs[len(p):]]
        agree += sum(r == 1 for r in ranks)
        total += len(ranks)
    assert total == sum(map(len, ref)) and agree >= 0.9 * total, (agree, total)


@pytest.mark.skipif(not BF16_KERNEL, reason="needs our kernels and avx512_bf16")
def test_a_flooding_tenant_leaves_another_tenants_bf16_cache_tokens_as_they_are(
        make_llm_engine, tokenizer):
    """On a bf16 cache, tenant A floods 20 requests beside tenant B's one: B's tokens and
    logprobs are the bits of its run alone (its rows' attention does not depend on the batch).
    B's first request and its run under a new salt find nothing cached (so nothing of A's);
    B's own repeat hits, with the same tokens."""
    engine = make_llm_engine(kv_cache_dtype="bfloat16")
    b_ids = _chat(tokenizer, "Why is the sky blue?")

    def b_request(rid: str, salt: bytes) -> EngineRequest:
        return EngineRequest(rid, tuple(b_ids), SamplingParams(max_tokens=12, temperature=0.0,
                                                               logprobs=2),
                             tenant_id="b", cache_salt=salt)

    (alone,) = run_to_completion(engine, [b_request("b-alone", b"b" * 16)])
    assert alone.num_cached_tokens == 0
    flood = [EngineRequest(f"a{i}", tuple(b_ids if i % 2 else _chat(tokenizer, f"Count to {i}.")),
                           SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                           tenant_id="a", cache_salt=b"a" * 16) for i in range(20)]
    results = run_to_completion(engine, [*flood, b_request("b-flooded", b"c" * 16)])
    beside = results[-1]
    assert beside.num_cached_tokens == 0  # A sent B's very prompt ten times: no hit across
    assert all(len(r.token_ids) == 24 for r in results[:-1])
    assert beside.token_ids == alone.token_ids and len(alone.token_ids) >= 4
    for got, want in zip(beside.logprobs, alone.logprobs):
        assert got == want  # the same floats, not close ones
    (again,) = run_to_completion(engine, [b_request("b-again", b"b" * 16)])
    assert again.num_cached_tokens > 0 and again.token_ids == alone.token_ids


def _meta(seq_lens, query_lens, tables, block_size=16):
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    bt = torch.tensor(tables, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
        query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens), block_size=block_size,
        token_slots=AttentionMetadata.expand_token_slots(bt, block_size))


def test_the_torch_path_reads_a_bf16_cache_as_fp32(monkeypatch):
    """Off our kernels (a CPU without them), decodes and a prefill chunk over context read the
    bf16 cache widened to fp32: the output equals the torch path's on the widened cache, bit for
    bit. The cache write rounds to nearest even in our kernel and in torch alike."""
    monkeypatch.setattr(cpu_ops, "decode_attention_usable", lambda *a: False)
    gen = torch.Generator().manual_seed(3)
    kc = torch.randn(12, 16, 3, 64, generator=gen).bfloat16()
    vc = torch.randn(12, 16, 3, 64, generator=gen).bfloat16()
    meta = _meta([40, 70, 33], [1, 5, 1], [[0, 1, 2, 0, 0], [3, 4, 5, 6, 7], [8, 9, 10, 0, 0]])
    q = torch.randn(7, 9, 64, generator=gen)
    got = paged_attention_torch(q, kc, vc, meta, 0.125)
    want = paged_attention_torch(q, kc.float(), vc.float(), meta, 0.125)
    assert torch.equal(got, want)
    rows = torch.randn(4, 3, 64, generator=gen) * 3
    slots = torch.tensor([5, 17, 100, 191])
    ours, theirs = torch.zeros_like(kc), torch.zeros_like(kc)
    cpu_ops.reshape_and_cache(rows, rows, ours, ours.clone(), slots)  # our kernel when loaded
    theirs.view(-1, 3, 64)[slots] = rows.bfloat16()
    assert torch.equal(ours, theirs)
