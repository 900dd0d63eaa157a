"""Weight-only quantization (``--quantization int8`` / ``gguf``): the kernels against their
dequantized reference, the GGUF reader against the converted safetensors, and the real model
served from 4-bit and int8 weights against fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine import quantization as quantization_module
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm import run_to_completion
from engine.models.config import ModelConfig
from engine.models.decoder import BlockEmbedding
from engine.models.gguf import grouped_from_blocks, hf_name, read_gguf_state
from engine.quantization import (
    DENSE_FROM_TOKENS,
    DenseLinear,
    GroupedInt4,
    Int4Linear,
    Int8Linear,
    KernelPolicy,
    KQuantLinear,
    KQuantWeight,
    check_quantization,
    make_linear,
)
from engine.quantization import policy as policy_module
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.weights import find_gguf, locate_bundled_gguf
from kernels import cpu_linear
from tests.engine.policy_helpers import no_int8_dot
from tests.engine.tenant_helpers import b_request, check_a_flood_leaves_b_as_alone

CPU = torch.device("cpu")
# Our int8-dot kernels (kernels/cpu/q4_vnni.cpp) run wherever the CPU kernels load: AVX-512 VNNI
# where the CPU has it, else AVX2.
VNNI = cpu_linear.load()


@pytest.fixture
def no_vnni(monkeypatch):
    """The 4-bit paths with our int8-dot kernels off (``KernelPolicy.int8_dot`` False: torch's int4
    kernel, the dense copy, our Q4 kernel), on any CPU."""
    no_int8_dot(monkeypatch)


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
    # Codes are taken against the bf16 scales the kernel uses: within half a step of w.
    dequantized = lin.qweight.float() * scales[:, None]
    assert torch.all((dequantized - w).abs() <= scales[:, None] / 2 + 1e-6)


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


def test_quantized_activation_bits_are_16_or_8_and_need_a_quantization():
    """``--quantized-activation-bits``: 16 (the default) or 8, and 8 only with quantized
    layers to round activations for."""
    assert EngineConfig(model="m").quantized_activation_bits == 16
    assert EngineConfig(model="m", quantization="gguf",
                        quantized_activation_bits=8).quantized_activation_bits == 8
    for bad in (4, 32, 0, 8.0, True):
        with pytest.raises(ValueError, match="--quantized-activation-bits must be 16 or 8"):
            EngineConfig(model="m", quantization="gguf", quantized_activation_bits=bad)
    with pytest.raises(ValueError, match="needs --quantization int8 or gguf"):
        EngineConfig(model="m", quantized_activation_bits=8)
    with pytest.raises(ValueError, match="needs --dtype auto or float32"):
        EngineConfig(model="m", quantization="int8", dtype="bfloat16",
                     quantized_activation_bits=8)


@pytest.mark.usefixtures("no_vnni")
def test_8_bit_activations_without_our_kernels_warn_that_they_change_nothing(make_llm_engine,
                                                                             caplog):
    """Where our int8-dot kernels do not run, ``--quantized-activation-bits 8`` has nothing to
    round: the engine still starts, on torch's kernels, and says so once at start-up."""
    with caplog.at_level("WARNING", logger="engine.model_runner"):
        engine = make_llm_engine(quantization="gguf", quantized_activation_bits=8)
    warned = [r.getMessage() for r in caplog.records if "quantized-activation-bits" in
              r.getMessage()]
    assert warned == [("--quantized-activation-bits 8: our int8-dot kernels are off here (no "
                       "CPU build of them, or switched off), so the quantized layers use "
                       "torch's kernels and the flag changes nothing")]
    assert all(layer.qkv.vnni is None for layer in engine.model.layers)


@pytest.mark.skipif(not VNNI, reason="our CPU kernels are off here")
@pytest.mark.parametrize("act_bits", [16, 8])
def test_int8_layers_round_activations_with_the_bits_they_were_built_with(act_bits):
    """``--quantization int8`` (per-channel int8 of float weights): the layer keeps the bits it
    was built with and its forward is our kernel's at those bits, which differ from the other
    rounding's (so the bits are not ignored)."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    lin = make_linear(w, None, "int8", torch.float32, CPU, act_bits)
    assert isinstance(lin, Int8Linear) and lin.vnni is not None and lin.act_bits == act_bits
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    got = lin(x)
    assert torch.equal(got, cpu_linear.q8_linear_vnni(x, *lin.vnni, None, act_bits))
    other = cpu_linear.q8_linear_vnni(x, *lin.vnni, None, 24 - act_bits)
    assert not torch.equal(got, other)
    # Within the activations' rounding of the exact product with the int8 weights: half an
    # int8 step of the group's max / 127 a value, 1/256 of that with the 16-bit residual.
    plain = Int8Linear.quantize(w, None, torch.bfloat16)  # the same codes, torch's layout
    assert lin.qweight is None  # our kernel's layout only: no second copy of the weights
    exact = plain.qweight.float() * plain.scales.float()[:, None]
    step = (x.view(5, 4, 32).abs().amax(-1) / 127).repeat_interleave(32, dim=1)
    bound = (step / (256 if act_bits == 16 else 2)) @ exact.abs().t() + 1e-4
    assert ((got - x @ exact.t()).abs() <= bound).all()


@pytest.mark.usefixtures("no_vnni")
@pytest.mark.parametrize("native", [False, True], ids=["fp32-copy", "bf16-copy"])
def test_fp32_activations_run_the_bf16_kernel_for_decode_and_a_dense_copy_for_prefill(
        native, monkeypatch):
    """With fp32 activations a quantized layer converts decode rows to bf16 for torch's kernel,
    and runs forwards of ``dense_from_tokens()`` rows or more through a dense copy of the same
    weights: their exact fp32 dequantization, or on CPUs with native bf16 its bf16 rounding
    under torch's bf16 GEMM (from 24 rows)."""
    monkeypatch.setattr(policy_module, "native_bf16", lambda: native)
    w = _grouped(64, 128)
    bias = torch.randn(64)
    lin = make_linear(w, bias, "gguf", torch.float32, CPU)
    assert isinstance(lin, Int4Linear) and lin.scales_and_zeros.dtype == torch.bfloat16
    assert torch.equal(lin.dense, w.dequantize().to(lin.dense.dtype))
    assert lin.dense.dtype == (torch.bfloat16 if native else torch.float32)
    rows = KernelPolicy.detect().dense_from_tokens
    if native:
        assert rows == quantization_module.DENSE_FROM_TOKENS_NATIVE_BF16 == 24
    decode, prefill = torch.randn(3, 128), torch.randn(rows, 128)
    y = lin(decode)
    assert y.dtype == torch.float32
    expected = decode @ w.dequantize().t() + bias
    assert 0 < (y - expected).abs().max() < 0.02 * expected.abs().max()  # bf16 kernel
    if native:
        bf16 = F.linear(prefill.bfloat16(), w.dequantize().bfloat16()).float() + bias
        assert torch.equal(lin(prefill), bf16)
        exact = prefill @ w.dequantize().t() + bias
        assert 0 < (bf16 - exact).abs().max() < 0.02 * exact.abs().max()
        # One row fewer: torch's int4 kernel, not the dense copy.
        below = prefill[:rows - 1]
        assert not torch.equal(lin(below), bf16[:rows - 1])
    else:
        assert torch.equal(lin(prefill), cpu_linear.linear(prefill, w.dequantize(), bias))
    # bf16 activations: no dense copy, the kernel at every size.
    assert make_linear(w, None, "gguf", torch.bfloat16, CPU).dense is None
    weight = torch.randn(64, 128)
    int8 = make_linear(weight, None, "int8", torch.float32, CPU)
    assert int8.dense is not None and int8(decode).dtype == torch.float32
    assert torch.equal(int8.dense, weight.to(int8.dense.dtype))
    assert (int8.dense is weight) == (not native)  # an fp32 weight is kept, not copied


@pytest.mark.usefixtures("no_vnni")
def test_fp32_decode_rows_run_our_q4_kernel_below_its_threshold(monkeypatch):
    """With our CPU kernels loaded, a 4-bit layer under fp32 activations runs our Q4 kernel on
    its fp16 scales and minimums below ``own_below`` rows (1 row on AVX2, none with native
    bf16) and torch's kernels from there; bf16 activations never take it."""
    if not cpu_linear.load():
        pytest.skip(f"our CPU kernels are off: {cpu_linear.unavailable_reason()}")
    w = _grouped(64, 128, seed=3)
    bias = torch.randn(64)
    lin = make_linear(w, bias, "gguf", torch.float32, CPU)
    assert lin.own is not None and lin.own.scale.dtype == lin.own.minimum.dtype == torch.float16
    native = policy_module.native_bf16()
    assert lin.own_below == (quantization_module.Q4_OWN_KERNEL_BELOW_TOKENS_NATIVE_BF16 if native
                             else quantization_module.Q4_OWN_KERNEL_BELOW_TOKENS)
    own = cpu_linear.q4_linear
    # At the threshold (and above it) torch's kernels run: not our kernel's bits.
    x = torch.randn(max(lin.own_below, 1), 128)
    assert not torch.equal(lin(x), own(x, lin.own.codes, lin.own.scale, lin.own.minimum, bias))
    monkeypatch.setattr(lin, "own_below", 2)
    one = x[:1]
    assert torch.equal(lin(one), own(one, lin.own.codes, lin.own.scale, lin.own.minimum, bias))
    # The threshold is the layer's own: forced to 16, 3 rows take our kernel too.
    monkeypatch.setattr(lin, "own_below", 16)
    three = torch.randn(3, 128)
    assert torch.equal(lin(three), own(three, lin.own.codes, lin.own.scale, lin.own.minimum,
                                       bias))
    assert make_linear(w, None, "gguf", torch.bfloat16, CPU).own is None


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_gguf_4bit_blocks_unpack_as_the_gguf_library_dequantizes_them(type_name):
    """Our reading of Q4_0 (w = (q - 8) d) and Q4_1 (w = q d + m) blocks, on blocks written by
    the gguf library's own quantizer, equals its dequantizer exactly."""
    gguf = pytest.importorskip("gguf")
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    w = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    grouped = grouped_from_blocks(raw, type_name)
    assert grouped.codes.shape == (6, 128) and int(grouped.codes.max()) <= 15
    assert torch.equal(grouped.dequantize(),
                       torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)))


def _tiny_llama(tie: bool, bias: bool = False, arch: str | None = None
                ) -> tuple[ModelConfig, dict]:
    """A one-layer Llama-family config and weights; ``bias``: q/k/v biases (a Qwen2, unless
    ``arch`` says otherwise)."""
    arch = arch or ("Qwen2ForCausalLM" if bias else "LlamaForCausalLM")
    cfg = ModelConfig(arch, vocab_size=64, hidden_size=64, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=64, tie_word_embeddings=tie,
                      attention_bias=bias, eos_token_ids=(0,))
    gen = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (64, 64), "model.norm.weight": (64,),
              p + "input_layernorm.weight": (64,), p + "post_attention_layernorm.weight": (64,),
              p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
              p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
              p + "mlp.gate_proj.weight": (64, 64), p + "mlp.up_proj.weight": (64, 64),
              p + "mlp.down_proj.weight": (64, 64)}
    if not tie:
        shapes["lm_head.weight"] = (64, 64)
    if bias:
        shapes.update({p + f"self_attn.{n}_proj.bias": (64 if n == "q" else 32,) for n in "qkv"})
    return cfg, {n: torch.randn(*shape, generator=gen) * 0.1 for n, shape in shapes.items()}


def _build(cfg: ModelConfig, state: dict, quantization: str | None):
    from engine.attention import get_attention_backend
    from engine.models.decoder import DecoderForCausalLM

    model = DecoderForCausalLM(cfg, 64, get_attention_backend("torch", CPU))
    model.load_weights(state, quantization)
    return model


def test_load_weights_takes_4bit_embeddings_mixed_fusions_and_names_missing_weights():
    """An untied GGUF may quantize its embedding to 4 bits too: it stays as stored and a lookup
    dequantizes its rows; a fused projection may mix 4-bit and other blocks: dequantized. A missing weight is a
    ValueError that names it."""
    cfg, state = _tiny_llama(tie=False, bias=True)
    p = "model.layers.0."
    quantized = dict(state)
    for name in ("model.embed_tokens.weight", p + "self_attn.q_proj.weight",
                 p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", "lm_head.weight"):
        w = state[name]
        quantized[name] = GroupedInt4(torch.zeros(w.shape, dtype=torch.uint8),
                                      torch.ones(w.shape[0], w.shape[1] // 32) * 0.01,
                                      w.view(w.shape[0], -1, 32).mean(-1))
    model = _build(cfg, quantized, "gguf")
    table = quantized["model.embed_tokens.weight"].dequantize()
    ids = torch.tensor([5, 0, 5, cfg.vocab_size - 1])
    assert isinstance(model.embed_tokens, BlockEmbedding)  # kept as stored: rows on lookup
    assert torch.equal(model.embed_tokens(ids), table[ids])
    assert model.embed_tokens.held_bytes < table.numel() * 4 / 3
    layer = model.layers[0]
    assert isinstance(layer.gate_up, Int4Linear)  # both halves 4-bit: fused as they are
    assert isinstance(layer.qkv, Int8Linear)  # q 4-bit, k and v fp32: dequantized, then int8
    assert isinstance(model.lm_head, Int4Linear) and layer.qkv.bias is not None
    del quantized[p + "mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="no model.layers.0.mlp.up_proj.weight"):
        _build(cfg, quantized, "gguf")


@pytest.mark.usefixtures("no_vnni")
@pytest.mark.parametrize("native", [False, True], ids=["fp32-copy", "bf16-copy"])
def test_tied_head_quantized_from_the_embedding_without_a_second_fp32_copy(native, monkeypatch):
    monkeypatch.setattr(policy_module, "native_bf16", lambda: native)
    cfg, state = _tiny_llama(tie=True)
    model = _build(cfg, state, "gguf")
    assert isinstance(model.lm_head, Int8Linear)
    if native:  # its dense rows: a bf16 copy of the embedding
        assert torch.equal(model.lm_head.dense, model.embed_tokens.weight.bfloat16())
    else:  # the embedding itself
        assert model.lm_head.dense is model.embed_tokens.weight


def test_gguf_q_k_rows_and_biases_are_permuted_back_for_llama(tmp_path):
    """llama.cpp permutes q/k rows, weights and biases, of Llama models; reading undoes it."""
    gguf = pytest.importorskip("gguf")
    cfg, state = _tiny_llama(tie=True, bias=True, arch="LlamaForCausalLM")
    n_head = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads}

    def permute(x: torch.Tensor, heads: int) -> torch.Tensor:  # llama.cpp's convert script
        return (x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:])
                .swapaxes(1, 2).reshape(x.shape))

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    names = {v: k for k, v in {
        "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        **{f"blk.0.{g}.{kind}": f"model.layers.0.{h}.{kind}" for g, h in (
            ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
            ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
            ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
            ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj")) for kind in ("weight", "bias")}}.items()}
    for name, value in state.items():
        proj = name.split(".")[-2]
        if proj in ("q_proj", "k_proj"):
            value = permute(value, n_head[proj[0]])
        writer.add_tensor(names[name], value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = read_gguf_state(tmp_path / "m.gguf", cfg)
    assert set(read) == set(state)
    for name, value in state.items():
        assert torch.equal(read[name], value), name


def test_gguf_tensor_names_map_to_hugging_face():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("rope_freqs.weight") is None and hf_name("blk.1.unknown.weight") is None


def test_bundled_gguf_reads_as_exactly_the_converted_weights(model_dir):
    """Every tensor of the bundled Q4_1 GGUF, 4-bit blocks unpacked and q/k rows permuted back,
    equals transformers' dequantized conversion bit for bit; the 4-bit ones stay 4-bit, its one
    Q8_0 tensor (the embedding) stays Q8_0."""
    state = read_gguf_state(find_gguf(model_dir), ModelConfig.from_pretrained(model_dir))
    reference = load_file(str(model_dir / "model.safetensors"))
    assert set(state) == set(reference)
    grouped = {n for n, v in state.items() if isinstance(v, GroupedInt4)}
    assert len(grouped) == 30 * 7  # q, k, v, o, gate, up, down of every layer
    assert {n for n, v in state.items() if isinstance(v, KQuantWeight)} == {
        "model.embed_tokens.weight"}
    for name, value in state.items():
        got = value.dequantize() if isinstance(value, (GroupedInt4, KQuantWeight)) else value
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


def _fp32_greedy(make_llm_engine, prompts: list[list[int]], max_tokens: int = 16
                 ) -> list[list[int]]:
    """fp32's greedy output for each prompt (the reference quantized formats are held to)."""
    fp32 = make_llm_engine()
    return [r.token_ids for r in run_to_completion(
        fp32, [_req(f"r{i}", p, max_tokens) for i, p in enumerate(prompts)])]


def _teacher_forced_agreement(engine, prompts: list[list[int]], reference: list[list[int]]
                              ) -> tuple[int, int]:
    """(positions where ``engine``'s most likely token is the reference's, positions), reading
    each prompt + its reference output in one request (``prompt_logprobs``)."""
    agree = total = 0
    for i, (p, out) in enumerate(zip(prompts, reference)):
        (res,) = run_to_completion(engine, [_req(f"t{i}", p + out, 1, prompt_logprobs=0)])
        ranks = [lp.rank for lp in res.prompt_logprobs[len(p):]]
        agree += sum(r == 1 for r in ranks)
        total += len(ranks)
    return agree, total


@pytest.mark.skipif(not VNNI, reason="our CPU kernels are off here")
def test_8_bit_activations_serve_gguf_near_fp32_and_a_flooding_tenant_changes_no_bits(
        make_llm_engine, tokenizer):
    """``quantized_activation_bits=8``: every 4-bit projection and the LM head (the file's Q8_0
    embedding, in our K-quant kernel) round their activations to int8 alone (llama.cpp's Q8_1), and the answers stay near fp32's
    (teacher-forced agreement, as served). Each row still has the same bits in any batch: with
    tenant A flooding 20 requests (half of them B's very prompt), B's tokens and logprobs are
    those of its run alone, and B finds none of A's blocks; B's own repeat hits."""
    prompts = [_chat(tokenizer, t) for t in ("Name the capital of France.",
                                             "Why is the sky blue?")]
    reference = _fp32_greedy(make_llm_engine, prompts)
    engine = make_llm_engine(quantization="gguf", quantized_activation_bits=8)
    layers = [engine.model.lm_head] + [m for layer in engine.model.layers
                                       for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert isinstance(engine.model.lm_head, KQuantLinear)
    assert all(m.act_bits == 8 for m in layers)
    assert all(m.vnni is not None for m in layers[1:])
    agree, total = _teacher_forced_agreement(engine, prompts, reference)
    assert total == sum(map(len, reference)) >= 20 and agree / total >= 0.8, (agree, total)

    # B's own repeat may differ from its miss at 8 bits (unlike 16): a 1e-6 difference in an
    # activation can move its int8 rounding by a whole step (docs/benchmarks.md).
    check_a_flood_leaves_b_as_alone(engine, prompts[1], lambda text: _chat(tokenizer, text))


@pytest.mark.parametrize("quantization,dtype,max_mb", [("gguf", "auto", 100),
                                                      ("int8", "bfloat16", 140)])
def test_quantized_model_agrees_with_fp32(make_llm_engine, tokenizer, quantization, dtype,
                                          max_mb, monkeypatch):
    """Teacher-forced on fp32's greedy output, the quantized kernels' most likely token is
    fp32's at (nearly) every position, with fp32 or bf16 activations; the model reads a fraction
    of fp32's 538 MB of weights per token; and a request it refuses changes nothing for the
    others."""
    prompts = [_chat(tokenizer, t) for t in ("What is the capital of France?",
                                             "Why is the sky blue?")]
    reference = _fp32_greedy(make_llm_engine, prompts)
    # Forwards of at most 16 rows: every one goes through the quantized kernels (longer
    # prefill chunks would run on the dense copy under fp32 activations: DENSE_FROM_TOKENS; with
    # our CPU kernel loaded, chunks of 4 rows already would, and 24 with native bf16, 12 for
    # int8 layers there).
    monkeypatch.setattr(policy_module, "DENSE_FROM_TOKENS_OWN_KERNEL", DENSE_FROM_TOKENS)
    monkeypatch.setattr(policy_module, "DENSE_FROM_TOKENS_NATIVE_BF16", DENSE_FROM_TOKENS)
    monkeypatch.setattr(policy_module, "DENSE_FROM_TOKENS_INT8_NATIVE_BF16",
                        DENSE_FROM_TOKENS)
    engine = make_llm_engine(quantization=quantization, dtype=dtype, max_num_batched_tokens=16)
    assert engine.cache_info.dtype == {"auto": "float32", "bfloat16": "bfloat16"}[dtype]
    assert engine.model.weight_bytes() < max_mb * 1e6
    agree, total = _teacher_forced_agreement(engine, prompts, reference)
    # A broken kernel agrees on almost nothing; near-ties flip a few of these ~24 tokens
    # (bench_quantization.py: 98-100% over 256 tokens).
    assert total == sum(map(len, reference)) >= 20 and agree / total >= 0.8, (agree, total)
    # Hostile input beside a normal request: refused alone, nothing pinned, the other served
    # exactly as before it. Compared with this engine's own tokens, not fp32's: with the bundled
    # chat prompt fp32's first two candidates are 0.09 apart (25.33 and 25.24), and the LM
    # head's bf16 output ties them on CPUs where torch dispatches its AVX2 kernels (CI saw it).
    (before,) = run_to_completion(engine, [_req("before", prompts[0], 8)])
    with pytest.raises(InvalidRequestError):
        engine.add_request(_req("bad", [tokenizer.vocab_size + 5], 4))
    (ok,) = run_to_completion(engine, [_req("ok", prompts[0], 8)])
    assert ok.num_cached_tokens == before.num_cached_tokens == 32
    assert len(ok.token_ids) == 8 and ok.token_ids == before.token_ids
    stats = engine.stats_snapshot()
    stats.check_integrity()
    assert stats.num_blocks_used == 0


@pytest.mark.usefixtures("no_vnni")
def test_gguf_served_with_the_bf16_dense_copy_agrees_with_fp32(make_llm_engine, tokenizer,
                                                              monkeypatch):
    """As served on a CPU with native bf16 (forced here on any CPU): prefill chunks run the
    bf16 dense copy through torch's bf16 GEMM, decode the 4-bit kernels; teacher-forced on
    fp32's greedy output, the most likely token is fp32's at (nearly) every position."""
    monkeypatch.setattr(policy_module, "native_bf16", lambda: True)
    prompts = [_chat(tokenizer, t) for t in ("Name the capital of France.",
                                             "Why is the sky blue?")]
    reference = _fp32_greedy(make_llm_engine, prompts)
    engine = make_llm_engine(quantization="gguf")
    qkv = engine.model.layers[0].qkv
    assert qkv.dense.dtype == torch.bfloat16 and KernelPolicy.detect().dense_from_tokens == 24
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear",
                        lambda x, w, *a: calls.append(w.dtype) or real(x, w, *a))
    # Each prompt + output is one prefill chunk through the bf16 copy.
    assert all(len(p) + len(out) >= 24 for p, out in zip(prompts, reference))
    agree, total = _teacher_forced_agreement(engine, prompts, reference)
    assert calls and set(calls) == {torch.bfloat16}  # 30 layers x 4 projections + the head
    assert total == sum(map(len, reference)) >= 20 and agree / total >= 0.8, (agree, total)
    # Free generation decodes through the 4-bit kernels after the bf16 prefill.
    (res,) = run_to_completion(engine, [_req("free", prompts[0], 8)])
    assert "Paris" in tokenizer.decode(res.token_ids)


@pytest.mark.usefixtures("no_vnni")
def test_int8_layers_take_their_bf16_copy_from_fewer_rows(monkeypatch):
    """torch's int8 kernel loses to bf16 GEMM from about 12 rows (the tied LM head of gguf,
    every layer of --quantization int8): with a bf16 copy an int8 layer switches there, while
    the 4-bit layers keep theirs to ``dense_from_tokens()``; without a copy nothing changes."""
    monkeypatch.setattr(policy_module, "native_bf16", lambda: True)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32, generator=gen)
    layer = Int8Linear.quantize(w, None, torch.float32, keep_dense=True)
    assert layer.dense.dtype == torch.bfloat16
    rows = quantization_module.DENSE_FROM_TOKENS_INT8_NATIVE_BF16
    assert layer.dense_from() == rows == 12 < KernelPolicy.detect().dense_from_tokens
    kinds = {n: layer.decode_spec(n).kind for n in (1, rows - 1, rows, 24)}
    assert kinds == {1: quantization_module.SPEC_INT8, rows - 1: quantization_module.SPEC_INT8,
                     rows: quantization_module.SPEC_LINEAR_BF16,
                     24: quantization_module.SPEC_LINEAR_BF16}
    x = torch.randn(rows, 32, generator=gen)
    assert torch.equal(layer(x), F.linear(x.bfloat16(), layer.dense).float())  # the copy
    below = x[:rows - 1]
    assert torch.equal(layer(below), torch._weight_int8pack_mm(
        below.bfloat16(), layer.qweight, layer.scales).float())  # the int8 kernel
    plain = Int8Linear.quantize(w, None, torch.float32)
    assert plain.dense is None and plain.dense_from() == KernelPolicy.detect().dense_from_tokens
    assert plain.decode_spec(rows).kind == quantization_module.SPEC_INT8


@pytest.mark.skipif(not VNNI, reason="our CPU kernels are off here")
@pytest.mark.parametrize("act_bits", [16, 8])
def test_fp32_activations_run_our_vnni_kernel_at_every_row_count(act_bits):
    """On CPUs with our kernels (AVX2 or AVX-512 VNNI) a 4-bit layer with fp32 activations keeps no dense copy and no Q4
    copy, and every forward, from one decode row to a prefill chunk, runs our VNNI kernel (the
    activation rounding ``make_linear`` was given), near the dequantized fp32 product; bf16
    activations still run torch's int4 kernel."""
    w = _grouped(64, 128)
    # fp16 scales and minimums, as a GGUF stores them (the kernel holds them so)
    w = GroupedInt4(w.codes, w.scale.half().float(), w.minimum.half().float())
    bias = torch.randn(64)
    lin = make_linear(w, bias, "gguf", torch.float32, CPU, act_bits)
    assert isinstance(lin, Int4Linear) and lin.vnni is not None
    assert lin.dense is None and lin.own is None and lin.act_bits == act_bits
    # Our kernel's layout only: torch's packed copy would double the weights' memory.
    assert lin.packed is None and lin.scales_and_zeros is None
    with pytest.raises(RuntimeError, match="fp32 CPU activations only"):
        lin(torch.randn(2, 128).bfloat16())
    assert lin.weight_bytes == 64 * 128 // 2 + 64 * 4 * 2 * 2 + 64 * 4  # codes, fp16 pairs, bias
    exact = w.dequantize()
    for rows in (1, 3, 16, 24, 100):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        got = lin(x)
        assert torch.equal(got, cpu_linear.q4_linear_vnni(x, lin.vnni.codes, lin.vnni.scale_min,
                                                          bias, act_bits))
        # Within the activations' rounding: half an int8 step of the group's max / 127, or
        # 1/256 of a step with the 16-bit residual (tests/kernels/test_cpu_linear.py).
        step = (x.view(rows, 4, 32).abs().amax(-1) / 127).repeat_interleave(32, dim=1)
        bound = (step / (256 if act_bits == 16 else 2)) @ exact.abs().t() + 1e-4
        assert ((got - F.linear(x, exact, bias)).abs() <= bound).all()
    bf16 = make_linear(w, None, "gguf", torch.bfloat16, CPU)
    assert bf16.vnni is None and bf16.dense is None
    x = torch.randn(2, 128).bfloat16()
    torch.testing.assert_close(bf16(x).float(), F.linear(x.float(), exact), rtol=3e-2,
                               atol=3e-2)
    # Groups the kernel cannot take (64 inputs) keep the other paths.
    g = _grouped(32, 128)
    odd = make_linear(GroupedInt4(g.codes, g.scale[:, ::2].contiguous(),
                                  g.minimum[:, ::2].contiguous(), 64),
                      None, "gguf", torch.float32, CPU)
    assert odd.vnni is None and odd.dense is not None


@pytest.mark.skipif(not VNNI, reason="our CPU kernels are off here")
def test_gguf_served_through_the_vnni_kernel_agrees_with_fp32(make_llm_engine, tokenizer):
    """As served on a CPU with our kernels (default chunking): every 4-bit forward, prefill chunks
    included, through our VNNI kernel with 16-bit activations; teacher-forced on fp32's greedy
    output the most likely token is fp32's at (nearly) every position, and free generation
    answers the question."""
    prompts = [_chat(tokenizer, t) for t in ("Name the capital of France.",
                                             "Why is the sky blue?")]
    reference = _fp32_greedy(make_llm_engine, prompts)
    engine = make_llm_engine(quantization="gguf")
    layers = [m for layer in engine.model.layers
              for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(m.vnni is not None and m.dense is None and m.act_bits == 16 for m in layers)
    agree, total = _teacher_forced_agreement(engine, prompts, reference)
    assert total == sum(map(len, reference)) >= 20 and agree / total >= 0.9, (agree, total)
    (res,) = run_to_completion(engine, [_req("free", prompts[0], 8)])
    assert "Paris" in tokenizer.decode(res.token_ids)


@pytest.mark.skipif(not VNNI, reason="our CPU kernels are off here")
def test_a_flooding_tenant_leaves_another_tenants_gguf_tokens_as_they_are(make_llm_engine,
                                                                           tokenizer):
    """Tenant A floods 20 requests beside tenant B's one. B's steps then hold 21 rows, and the
    4-bit layers and the LM head run them on AMX tiles where the CPU has AMX (a call counter
    shows it). B alone runs a single row per decode step, on the VNNI tiles. The paths give the
    same bits, so B's tokens and logprobs equal its run alone. B's first request and its run
    under a new salt find nothing cached (so nothing of A's), while B's own repeat hits."""
    engine = make_llm_engine(quantization="gguf")
    b_ids = _chat(tokenizer, "Why is the sky blue?")
    (alone,) = run_to_completion(engine, [b_request(b_ids, "b-alone", b"b" * 16)])
    assert alone.num_cached_tokens == 0
    flood = [EngineRequest(f"a{i}", tuple(_chat(tokenizer, f"Count to {i + 3}.")),
                           SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                           tenant_id="a", cache_salt=b"a" * 16) for i in range(20)]
    calls = cpu_linear.int8_amx_calls()
    # B under a new salt of its own: no cached block, the same prefill as alone
    results = run_to_completion(engine, [*flood, b_request(b_ids, "b-flooded", b"c" * 16)])
    beside = results[-1]
    assert beside.num_cached_tokens == 0
    assert all(len(r.token_ids) == 24 for r in results[:-1])
    if cpu_linear.int8_amx():
        assert cpu_linear.int8_amx_calls() > calls
    assert beside.token_ids == alone.token_ids and len(alone.token_ids) >= 4
    for got, want in zip(beside.logprobs, alone.logprobs):
        assert got == want  # the same floats, not close ones
    (again,) = run_to_completion(engine, [b_request(b_ids, "b-again", b"b" * 16)])
    assert again.num_cached_tokens > 0 and again.token_ids == alone.token_ids
