"""Weight-only quantization (``--quantization int8`` / ``gguf``): the kernels against their
dequantized reference, the GGUF reader against the converted safetensors, and the real model
served from 4-bit and int8 weights against fp32."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm import run_to_completion
from engine.models.config import ModelConfig
from engine.models.gguf import hf_name, read_gguf_state
from engine.quantization import (
    DENSE_FROM_TOKENS,
    DenseLinear,
    GroupedInt4,
    Int4Linear,
    Int8Linear,
    check_quantization,
    make_linear,
)
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.weights import find_gguf, locate_bundled_gguf

CPU = torch.device("cpu")


def _grouped(n: int, k: int, seed: int = 0) -> GroupedInt4:
    gen = torch.Generator().manual_seed(seed)
    return GroupedInt4(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                       torch.rand(n, k // 32, generator=gen) * 0.05,
                       -torch.rand(n, k // 32, generator=gen) * 0.4)


def test_int4_linear_computes_the_gguf_dequantization():
    """w = code * scale + minimum (Q4_1), through torch's (code - 8) * scale + zero kernel."""
    w = _grouped(96, 128)
    ref = w.dequantize()
    assert ref[0, 0] == w.codes[0, 0] * w.scale[0, 0] + w.minimum[0, 0]
    x = torch.randn(5, 128)
    bias = torch.randn(96)
    lin = Int4Linear.from_grouped(w, bias, torch.bfloat16)
    y = lin(x.bfloat16()).float()
    expected = x @ ref.t() + bias
    # bf16 activations, scales and zeros: within 2% of the output's scale.
    assert (y - expected).abs().max() < 0.02 * expected.abs().max()
    assert y.shape == (5, 96) and lin.out_features == 96
    # 4 bits per weight, plus a bf16 scale and zero per 32 weights, plus the bias.
    assert lin.weight_bytes == 96 * 128 // 2 + 96 * 4 * 2 * 2 + 96 * 2


def test_int4_rejects_shapes_the_kernel_cannot_take():
    w = _grouped(8, 64)
    with pytest.raises(ValueError, match="group"):
        Int4Linear.from_grouped(GroupedInt4(w.codes, w.scale, w.minimum, 48), None,
                                torch.bfloat16)


def test_grouped_rows_and_cat_keep_whole_blocks():
    a, b = _grouped(4, 64, 1), _grouped(2, 64, 2)
    fused = GroupedInt4.cat([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    order = torch.tensor([3, 0, 2, 1])
    assert torch.equal(a.rows(order).dequantize(), a.dequantize()[order])
    with pytest.raises(ValueError, match="group sizes"):
        GroupedInt4.cat([a, GroupedInt4(b.codes, b.scale, b.minimum, 64)])


def test_int8_linear_is_per_channel_round_to_nearest():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen)
    w[3] = 0  # a zero row: scale 1, not a division by zero
    lin = Int8Linear.quantize(w, None, torch.bfloat16)
    scales = lin.scales.float()
    assert scales[3] == 1 and torch.all(lin.qweight[3] == 0)
    assert lin.qweight.abs().max() == 127  # each row's largest weight maps to +-127
    assert torch.allclose(scales[0], w[0].abs().max() / 127, rtol=1e-2)
    x = torch.randn(3, 96, generator=gen)
    y = lin(x.bfloat16()).float()
    expected = x @ w.t()
    assert (y - expected).abs().max() < 0.02 * expected.abs().max()
    rows = lin.rows(torch.tensor([0, 5]), torch.float32)
    assert (rows - w[[0, 5]]).abs().max() <= scales[[0, 5]].max()


def test_make_linear_picks_the_kernel_for_each_weight():
    dense = torch.randn(64, 64)
    grouped = _grouped(64, 64)
    bf16 = torch.bfloat16
    assert isinstance(make_linear(dense, None, None, torch.float32, CPU), DenseLinear)
    assert isinstance(make_linear(dense, None, "int8", bf16, CPU), Int8Linear)
    assert isinstance(make_linear(grouped, None, "gguf", bf16, CPU), Int4Linear)
    # A GGUF's float tensor under gguf: int8; 4-bit blocks without gguf: dequantized.
    assert isinstance(make_linear(dense, None, "gguf", bf16, CPU), Int8Linear)
    lin = make_linear(grouped, None, None, torch.float32, CPU)
    assert isinstance(lin, DenseLinear) and torch.equal(lin.weight, grouped.dequantize())


def test_quantization_runs_on_cpu_only():
    check_quantization(None, torch.device("cuda"))  # nothing to check
    check_quantization("gguf", CPU)
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="--quantization must be one of"):
        EngineConfig(model="m", quantization="int4")


def test_fp32_activations_run_the_bf16_kernel_for_decode_and_fp32_gemm_for_prefill():
    """With fp32 activations a quantized layer converts decode rows to bf16 for torch's kernel,
    and runs prefill chunks (DENSE_FROM_TOKENS rows or more) through the exact fp32
    dequantization of the same weights."""
    w = _grouped(64, 128)
    bias = torch.randn(64)
    lin = make_linear(w, bias, "gguf", torch.float32, CPU)
    assert isinstance(lin, Int4Linear) and lin.scales_and_zeros.dtype == torch.bfloat16
    assert torch.equal(lin.dense, w.dequantize())
    decode, prefill = torch.randn(3, 128), torch.randn(DENSE_FROM_TOKENS, 128)
    y = lin(decode)
    assert y.dtype == torch.float32
    expected = decode @ w.dequantize().t() + bias
    assert 0 < (y - expected).abs().max() < 0.02 * expected.abs().max()  # bf16 kernel
    assert torch.equal(lin(prefill), torch.nn.functional.linear(prefill, w.dequantize(), bias))
    # bf16 activations: no fp32 copy, the kernel at every size.
    assert make_linear(w, None, "gguf", torch.bfloat16, CPU).dense is None
    int8 = make_linear(torch.randn(64, 128), None, "int8", torch.float32, CPU)
    assert int8.dense is not None and int8(decode).dtype == torch.float32


def test_gguf_tensor_names_map_to_hugging_face():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("rope_freqs.weight") is None and hf_name("blk.1.unknown.weight") is None


def test_bundled_gguf_reads_as_exactly_the_converted_weights(model_dir):
    """Every tensor of the bundled Q4_1 GGUF, 4-bit blocks unpacked and q/k rows permuted back,
    equals transformers' dequantized conversion bit for bit; the 4-bit ones stay 4-bit."""
    state = read_gguf_state(find_gguf(model_dir), ModelConfig.from_pretrained(model_dir))
    reference = load_file(str(model_dir / "model.safetensors"))
    assert set(state) == set(reference)
    grouped = {n for n, v in state.items() if isinstance(v, GroupedInt4)}
    assert len(grouped) == 30 * 7  # q, k, v, o, gate, up, down of every layer
    for name, value in state.items():
        got = value.dequantize() if isinstance(value, GroupedInt4) else value
        assert torch.equal(got, reference[name]), name


def test_find_gguf(tmp_path, model_dir):
    assert find_gguf(model_dir) == locate_bundled_gguf()  # converted from the bundled file
    with pytest.raises(FileNotFoundError, match="needs the model's .gguf file"):
        find_gguf(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="keep one"):
        find_gguf(tmp_path)


def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def _req(rid: str, ids: list[int], max_tokens: int, **kw) -> EngineRequest:
    return EngineRequest(rid, tuple(ids), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                         **kw))


@pytest.mark.parametrize("quantization,dtype,max_mb", [("gguf", "auto", 100),
                                                      ("int8", "bfloat16", 140)])
def test_quantized_model_agrees_with_fp32(make_llm_engine, tokenizer, quantization, dtype,
                                          max_mb):
    """Teacher-forced on fp32's greedy output, the quantized kernels' most likely token is
    fp32's at (nearly) every position, with fp32 or bf16 activations; the model reads a fraction
    of fp32's 538 MB of weights per token; and a request it refuses changes nothing for the
    others."""
    prompts = [_chat(tokenizer, t) for t in ("What is the capital of France?",
                                             "Why is the sky blue?")]
    fp32 = make_llm_engine()
    reference = [r.token_ids for r in run_to_completion(
        fp32, [_req(f"r{i}", p, 16) for i, p in enumerate(prompts)])]
    del fp32
    # Forwards of at most 16 rows: every one goes through the quantized kernels (longer
    # prefill chunks would run on the fp32 copy under fp32 activations: DENSE_FROM_TOKENS).
    engine = make_llm_engine(quantization=quantization, dtype=dtype, max_num_batched_tokens=16)
    assert engine.cache_info.dtype == {"auto": "float32", "bfloat16": "bfloat16"}[dtype]
    assert engine.model.weight_bytes() < max_mb * 1e6
    agree = total = 0
    for i, (p, out) in enumerate(zip(prompts, reference)):
        (res,) = run_to_completion(engine, [_req(f"t{i}", p + out, 1, prompt_logprobs=0)])
        ranks = [lp.rank for lp in res.prompt_logprobs[len(p):]]
        agree += sum(r == 1 for r in ranks)
        total += len(ranks)
    assert total == sum(map(len, reference)) >= 20 and agree / total >= 0.9, (agree, total)
    # Hostile input beside a normal request: refused alone, nothing pinned, the other served.
    with pytest.raises(InvalidRequestError):
        engine.add_request(_req("bad", [tokenizer.vocab_size + 5], 4))
    (ok,) = run_to_completion(engine, [_req("ok", prompts[0], 8)])
    assert len(ok.token_ids) == 8 and ok.token_ids[:4] == reference[0][:4]
    stats = engine.stats_snapshot()
    stats.check_integrity()
    assert stats.num_blocks_used == 0
