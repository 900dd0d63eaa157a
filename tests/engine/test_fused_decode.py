"""The fused CPU decode layer (``kernels/cpu/decode_layer.cpp``) against the per-op Python layer
(``LlamaDecoderLayer.forward``): bit-identical outputs, residuals and K/V caches for every
projection kind (dense fp32, torch's int4 and int8, our Q4, with and without bias), and used
only for steps of decodes (where it also replaces a cascade split)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import quantization
from engine import quantization as quantization_module
from engine.attention import get_attention_backend
from engine.attention.metadata import AttentionMetadata
from engine.llm import run_to_completion
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.quantization import (
    SPEC_DENSE,
    SPEC_INT4,
    SPEC_INT8,
    SPEC_LINEAR,
    SPEC_LINEAR_BF16,
    SPEC_LINEAR_ONEDNN,
    SPEC_Q4,
    SPEC_Q4_VNNI,
    GroupedInt4,
    Int4Linear,
    KernelPolicy,
)
from engine.quantization import policy as policy_module
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from kernels import cpu_linear, cpu_ops
from tests.engine.policy_helpers import no_int8_dot

pytestmark = pytest.mark.skipif(not cpu_linear.load(), reason="our CPU kernels are not built")


@pytest.fixture(autouse=True)
def _inference():  # as the engine runs the model
    with torch.inference_mode():
        yield


VNNI = cpu_linear.load()  # our int8-dot kernels: AVX-512 VNNI where the CPU has it, else AVX2
needs_vnni = pytest.mark.skipif(not VNNI, reason="our CPU kernels are off here")


@pytest.fixture(autouse=True)
def _q4_path(request, monkeypatch):
    """The 4-bit paths with our int8-dot kernels off (torch's int4 kernel, the dense copy, our
    Q4 kernel), on any CPU, except in tests marked ``vnni`` (our kernels)."""
    if "vnni" not in request.keywords:
        no_int8_dot(monkeypatch)


CPU = torch.device("cpu")
BLOCK = 16
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 128, 4, 2, 32, 96


def _config(bias: bool) -> ModelConfig:
    arch = "Qwen2ForCausalLM" if bias else "LlamaForCausalLM"  # Qwen2: q/k/v biases
    return ModelConfig(arch, vocab_size=64, hidden_size=HIDDEN,
                       intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=128,
                       tie_word_embeddings=True, attention_bias=bias, eos_token_ids=(0,))


def _model(quantization: str | None, bias: bool, act_bits: int = 16) -> DecoderForCausalLM:
    cfg = _config(bias)
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (64, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER)})
        if bias:
            shapes.update({p + f"self_attn.{n}_proj.bias": (HEADS * HEAD_DIM if n == "q"
                                                            else KV_HEADS * HEAD_DIM,)
                           for n in "qkv"})
    state: dict = {n: torch.randn(*s, generator=gen) * 0.2 for n, s in shapes.items()}
    if quantization == "gguf":  # every projection as 4-bit groups, as the GGUF holds them
        for name, w in list(state.items()):
            if name.endswith("proj.weight"):
                n, k = w.shape
                state[name] = GroupedInt4(
                    torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                    torch.rand(n, k // 32, generator=gen) * 0.05,
                    -torch.rand(n, k // 32, generator=gen) * 0.4)
    model = DecoderForCausalLM(cfg, 128, get_attention_backend("torch", CPU))
    model.load_weights(state, quantization, act_bits)
    model.bind_weights()
    return model


def _decode_step(seq_lens: list[int], query_lens: list[int] | None = None
                 ) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of one step (default: every sequence decodes one token), each sequence in its
    own run of blocks (sequence s starts at block 4 s), and its positions."""
    query_lens = query_lens or [1] * len(seq_lens)
    tables = [[4 * s + b for b in range(4)] for s in range(len(seq_lens))]
    slots, positions = [], []
    for s, (q, n) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(n - q, n):
            slots.append(tables[s][pos // BLOCK] * BLOCK + pos % BLOCK)
            positions.append(pos)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(starts, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor(tables, dtype=torch.int32), tuple(query_lens),
                             tuple(seq_lens), BLOCK)
    meta = get_attention_backend("torch", CPU).build_metadata(meta, [tuple(t) for t in tables])
    return meta, torch.tensor(positions)


def _caches(num_seqs: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 2, 4 * num_seqs, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)


@pytest.fixture(params=[False, True], ids=["fp32-copy", "bf16-copy"])
def native_bf16(request, monkeypatch) -> bool:
    """Runs a test as on a CPU without native bf16 (quantized layers' dense copy in fp32) and
    as on one with it (the copy in bf16, from 24 rows; int8 layers from 12), whatever this CPU is."""
    monkeypatch.setattr(policy_module, "native_bf16", lambda: request.param)
    return request.param


# Row counts on both sides of the kernels' thresholds: our fp32 kernel up to 32 rows, the
# quantized layers' dense copy from 4 (fp32; this module needs our kernels) or 24 (bf16; int8
# layers from 12) rows.
CASES = [(None, False, 1), (None, True, 3), (None, False, 32), (None, False, 33),
         ("int8", True, 1), ("int8", False, 5), ("int8", True, 16), ("int8", True, 24),
         ("int8", True, 33),
         ("gguf", True, 1), ("gguf", False, 3), ("gguf", True, 5), ("gguf", True, 24),
         ("gguf", False, 32)]


BF16_KV = pytest.mark.skipif(not cpu_ops.bf16_decode_attention_usable(HEAD_DIM),
                             reason="bf16 KV caches need our kernels and avx512_bf16")


@pytest.mark.parametrize(("quantization", "bias", "rows"), CASES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, pytest.param(torch.bfloat16, marks=BF16_KV)],
                         ids=["fp32-kv", "bf16-kv"])
def test_fused_layer_is_bit_identical_to_the_python_layer(quantization, bias, rows, native_bf16,
                                                          kv_dtype):
    model = _model(quantization, bias)
    seq_lens = [3 + 7 * s for s in range(rows)]  # 3 .. 227: one to four blocks deep
    seq_lens = [1 + (n - 1) % 60 for n in seq_lens]
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(rows, HIDDEN, generator=gen)
    residual = torch.randn(rows, HIDDEN, generator=gen)
    caches = _caches(rows, kv_dtype)  # bf16: --kv-cache-dtype bfloat16
    meta, positions = _decode_step(seq_lens)
    cos, sin = model.rotary.cos_sin(positions, torch.float32)
    layer = model.layers[1]
    args = layer.decode_args(rows)
    assert args is not None
    # The bf16 copy's kind is taken exactly where the layer's own call would use that copy.
    dense_from = (quantization_module.DENSE_FROM_TOKENS_INT8_NATIVE_BF16 if quantization == "int8"
                  else KernelPolicy.detect().dense_from_tokens)
    assert (SPEC_LINEAR_BF16 in args[1]) == (native_bf16 and quantization is not None
                                              and rows >= dense_from)
    # fp32 weights above our kernel's rows: oneDNN, in both paths.
    assert (SPEC_LINEAR_ONEDNN in args[1]) == (rows > cpu_linear.MAX_ROWS and not (
        native_bf16 and quantization is not None))
    for first in (True, False):
        plain_caches, fused_caches = caches.clone(), caches.clone()
        h, r = hidden.clone(), None if first else residual.clone()
        want_h, want_r = layer.forward(h, r, cos, sin, plain_caches[1, 0], plain_caches[1, 1],
                                       meta, model.attn)
        h, r = hidden.clone(), None if first else residual.clone()
        got_h, got_r = layer.forward_decode(h, r, cos, sin, fused_caches[1, 0],
                                            fused_caches[1, 1], meta, args)
        assert torch.equal(got_h, want_h) and torch.equal(got_r, want_r)
        assert torch.equal(fused_caches, plain_caches)
        assert not torch.equal(fused_caches, caches)  # this step's K/V were written


def test_each_linear_method_names_the_kernel_its_call_runs(native_bf16):
    gguf = _model("gguf", bias=False).layers[0]
    gguf.qkv.own_below = 0  # torch's int4 kernel from 1 row (CPUs with native bf16)
    assert [s.kind for s in (gguf.qkv.decode_spec(1), gguf.qkv.decode_spec(3))] == [SPEC_INT4] * 2
    assert gguf.qkv.decode_spec(1).group == 32
    dense_from = KernelPolicy.detect().dense_from_tokens  # the dense copy from there (24 or 4 rows)
    assert dense_from == (quantization.DENSE_FROM_TOKENS_NATIVE_BF16 if native_bf16
                          else quantization.DENSE_FROM_TOKENS_OWN_KERNEL)
    assert gguf.qkv.decode_spec(dense_from - 1).kind == SPEC_INT4
    if native_bf16:  # the bf16 copy at every row count from there
        assert gguf.qkv.dense.dtype == torch.bfloat16
        assert {gguf.qkv.decode_spec(n).kind for n in (dense_from, 33, 512)} == {SPEC_LINEAR_BF16}
    else:
        assert gguf.qkv.decode_spec(dense_from).kind == SPEC_DENSE
        # Above our kernel's rows, oneDNN's GEMM, as cpu_linear.linear runs it.
        assert gguf.qkv.decode_spec(cpu_linear.MAX_ROWS + 1).kind == SPEC_LINEAR_ONEDNN
        gguf.qkv.policy = replace(gguf.qkv.policy, onednn_large_m=False)
        assert gguf.qkv.decode_spec(cpu_linear.MAX_ROWS + 1).kind == SPEC_LINEAR
    assert gguf.qkv.decode_spec(dense_from).tensors[0] is gguf.qkv.dense
    assert isinstance(gguf.qkv, Int4Linear) and gguf.qkv.own is not None
    gguf.qkv.own_below = 2  # as on CPUs without native bf16
    assert gguf.qkv.decode_spec(1).kind == SPEC_Q4 and gguf.qkv.decode_spec(2).kind == SPEC_INT4
    assert _model("int8", bias=True).layers[0].o.decode_spec(1).kind == SPEC_INT8
    dense = _model(None, bias=True).layers[0]
    assert dense.qkv.decode_spec(1).bias is dense.qkv.bias
    # A bf16 model has no fused path.
    dense.qkv.weight = dense.qkv.weight.bfloat16()
    assert dense.qkv.decode_spec(1) is None


@pytest.mark.parametrize("quantization", [None, "int8", "gguf"])
def test_every_row_count_runs_the_kernel_the_projection_would(quantization, native_bf16):
    """Each projection's ``decode_spec``, run as the fused layer runs it, equals its own call
    bit for bit at 1-40 rows (the Q4 kernel included: own_below 2)."""
    model = _model(quantization, bias=True)
    gen = torch.Generator().manual_seed(4)
    for m, in_features in ((model.layers[0].qkv, HIDDEN), (model.layers[0].down, INTER)):
        if isinstance(m, Int4Linear):
            m.own_below = 2
        for rows in range(1, 41):
            x = torch.randn(rows, in_features, generator=gen)
            spec = m.decode_spec(rows)
            assert torch.equal(_run_spec(spec, x), m(x)), (quantization, rows, spec.kind)


def _run_spec(spec, x: torch.Tensor) -> torch.Tensor:
    """What kernels/cpu/decode_layer.cpp's ``project`` runs for ``spec`` (its reference)."""
    if spec.kind == SPEC_DENSE:
        return torch.ops.saltserve_cpu.linear_small_m(x, spec.tensors[0], spec.bias)
    if spec.kind == SPEC_LINEAR:
        return torch.nn.functional.linear(x, spec.tensors[0], spec.bias)
    if spec.kind == SPEC_LINEAR_ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, spec.tensors[0], spec.bias, "none", [], "")
    if spec.kind == SPEC_Q4:
        return torch.ops.saltserve_cpu.q4_linear(x, *spec.tensors, spec.bias)
    if spec.kind == SPEC_Q4_VNNI:
        return torch.ops.saltserve_cpu.q4_linear_vnni(x, *spec.tensors, spec.bias, spec.group)
    xb = x.to(torch.bfloat16)
    if spec.kind == SPEC_INT4:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, spec.tensors[0], spec.group,
                                                       spec.tensors[1])
    elif spec.kind == SPEC_INT8:
        y = torch._weight_int8pack_mm(xb, *spec.tensors)
    else:
        assert spec.kind == SPEC_LINEAR_BF16 and spec.tensors[0].dtype == torch.bfloat16
        y = torch.nn.functional.linear(xb, spec.tensors[0])
    y = y.float()
    return y if spec.bias is None else y + spec.bias


def test_our_q4_kernel_fused_is_bit_identical_too():
    model = _model("gguf", bias=True)
    for layer in model.layers:
        for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
            m.own_below = 2
    layer = model.layers[0]
    layer.bind_weights()  # clears the cached decode args
    assert layer.decode_args(1)[1] == [SPEC_Q4] * 4
    caches = _caches(1)
    meta, positions = _decode_step([20])
    cos, sin = model.rotary.cos_sin(positions, torch.float32)
    hidden = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(3))
    a, b = caches.clone(), caches.clone()
    want = layer.forward(hidden.clone(), None, cos, sin, a[0, 0], a[0, 1], meta, model.attn)
    got = layer.forward_decode(hidden.clone(), None, cos, sin, b[0, 0], b[0, 1], meta,
                               layer.decode_args(1))
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert torch.equal(a, b)


def test_the_model_fuses_decode_steps_only(fused_layer_calls):
    model = _model("gguf", bias=False)
    calls = fused_layer_calls

    def forward(seq_lens, query_lens=None, fused=True):
        caches = _caches(len(seq_lens))
        meta, positions = _decode_step(seq_lens, query_lens)
        ids = torch.arange(len(positions)) % 64
        model.policy = replace(model.policy, fused_decode=fused)
        return model.forward(ids, positions, caches, meta), caches

    got, got_caches = forward([9, 30, 17])
    assert len(calls) == 2  # one call a layer
    want, want_caches = forward([9, 30, 17], fused=False)
    assert len(calls) == 2 and torch.equal(got, want) and torch.equal(got_caches, want_caches)
    forward([9, 30], query_lens=[1, 4])  # a prefill chunk in the step: per-op layers
    assert len(calls) == 2
    # A cascade split in the metadata (decodes sharing a long prefix) is not needed by the
    # fused layers, at any batch: the decode kernel reads shared chunks once itself, with the
    # same bits as the per-op layers without the split.
    for n in (4, 40):
        meta, positions = _decode_step([40] * n)
        ids = torch.arange(n)
        outs = []
        for fused, cascade in ((True, 32), (False, 0)):
            model.policy = replace(model.policy, fused_decode=fused)
            caches = _caches(n)
            split = replace(meta, cascade_prefix_len=cascade)
            assert model.attn.fused_cpu_decode_usable(caches[0, 0], caches[0, 1], split, HEADS)
            outs.append((model.forward(ids, positions, caches, split), caches))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert len(calls) == 2 + 2 * 2


@pytest.mark.parametrize("quantization", [None, "gguf", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("cache_dtype", [torch.float32, pytest.param(torch.bfloat16,
                                                                     marks=BF16_KV)])
def test_every_layer_in_one_call_gives_the_bits_of_a_call_a_layer(quantization, rows,
                                                                  cache_dtype,
                                                                  fused_layer_calls):
    """``decode_layers`` (the step's layers in one C++ call, the default) against
    ``decode_layer`` called a layer at a time and the per-op layers: the same output and the
    same caches, bit for bit, at 1, 3 and 17 rows (the 4-bit layers' row tiles differ), on fp32
    and bf16 caches (the second layer's cache views start a layer of bf16 elements on)."""
    model = _model(quantization, bias=quantization is None)
    meta, positions = _decode_step([9 + 3 * i for i in range(rows)])
    ids = torch.arange(rows) % 64
    outs = []
    for fused, whole, kinds in ((True, True, ["whole"] * 2), (True, False, ["one"] * 2),
                                (False, False, [])):
        model.policy = replace(model.policy, fused_decode=fused, fused_decode_whole=whole)
        caches = _caches(rows, cache_dtype)
        fused_layer_calls.clear()
        outs.append((model.forward(ids, positions, caches, meta), caches))
        assert [kind for kind, _ in fused_layer_calls] == kinds  # 2 layers
    model.policy = replace(model.policy, fused_decode_whole=True)
    for got, got_caches in outs[:2]:
        assert torch.equal(got, outs[2][0]) and torch.equal(got_caches, outs[2][1])
    before = _caches(rows, cache_dtype)
    assert not torch.equal(outs[0][1][0], before[0])  # this step's K/V were written,
    assert not torch.equal(outs[0][1][1], before[1])  # in both layers


def test_every_layer_in_one_call_follows_a_layer_rebound_after_a_step():
    """A layer's weight replaced (and ``bind_weights`` called on that layer alone) after a step
    has cached the joined arguments: the next step's one call uses the new weight, as the
    per-op layers do."""
    model = _model("gguf", bias=False)
    meta, positions = _decode_step([9, 12])
    ids = torch.arange(2)
    before = model.forward(ids, positions, _caches(2), meta)
    layer = model.layers[1]
    layer.post_attention_layernorm.weight = torch.nn.Parameter(
        layer.post_attention_layernorm.weight.detach() * 3, requires_grad=False)
    layer.bind_weights()
    got = model.forward(ids, positions, _caches(2), meta)
    model.policy = replace(model.policy, fused_decode=False)
    want = model.forward(ids, positions, _caches(2), meta)
    model.policy = replace(model.policy, fused_decode=True)
    assert torch.equal(got, want) and not torch.equal(got, before)


def test_the_steps_joined_arguments_are_kept_and_follow_each_threshold(monkeypatch):
    """The joined arguments are made once per row count and reused by later steps (the same
    objects), and made again when a 4-bit layer's ``own_below`` changes, or when projections
    get another kernel policy (then rebound: ``bind_weights``), after a step has cached them:
    each step runs the kernels its projections name."""
    no_int8_dot(monkeypatch)  # the Q4 / int4 choice applies
    model = _model("gguf", bias=False)
    meta, _ = _decode_step([9, 12])
    hidden, caches = torch.randn(2, HIDDEN), _caches(2)
    first = model._fused_decode_args(hidden, caches, meta)
    assert model._fused_decode_args(hidden, caches, meta) is first
    qkv = model.layers[1].qkv
    assert isinstance(qkv, Int4Linear)
    kinds = first[1][2]
    qkv.own_below = 3  # two rows now run our Q4 kernel
    second = model._fused_decode_args(hidden, caches, meta)
    assert second is not first and second[1][2][4] == SPEC_Q4 and kinds[4] != SPEC_Q4
    assert second[1][2][:4] == kinds[:4]  # the other layers' projections as before
    qkv.own_below = 0
    assert model._fused_decode_args(hidden, caches, meta)[1][2] == kinds
    for layer in model.layers:  # the dense copy from 2 rows
        for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
            m.policy = replace(m.policy, dense_from_tokens=2, int8_dense_from_tokens=2)
        layer.bind_weights()
    dense = model._fused_decode_args(hidden, caches, meta)[1][2]
    assert dense != kinds and {k for k in dense} <= {SPEC_DENSE, SPEC_LINEAR_BF16}


def test_decode_layers_refuses_lists_that_do_not_match_the_layers():
    model = _model("gguf", bias=False)
    meta, positions = _decode_step([9, 12])
    hidden, caches = torch.randn(2, HIDDEN), _caches(2)
    norms, weights, kinds, groups = model._fused_decode_args(hidden, caches, meta)[1]
    cos, sin = model.rotary.cos_sin(positions, hidden.dtype)
    layer = model.layers[0]
    args = (cos, sin, caches, meta, layer.num_heads, layer.intermediate_size, layer.scale)
    with pytest.raises(RuntimeError, match="2 norms and 4 projections"):
        cpu_ops.decode_layers(hidden, norms[:2], 1e-5, weights, kinds, groups, *args)
    with pytest.raises(RuntimeError, match="2 norms and 4 projections"):
        cpu_ops.decode_layers(hidden, norms, 1e-5, weights[:-1], kinds, groups, *args)
    with pytest.raises(RuntimeError, match="kv_caches"):
        cpu_ops.decode_layers(hidden, norms, 1e-5, weights, kinds, groups, cos, sin,
                              caches[0], meta, *args[4:])


@pytest.mark.parametrize(("quantization", "kv_cache_dtype"), [
    (None, "auto"), ("gguf", "auto"),
    pytest.param("gguf", "bfloat16", marks=pytest.mark.skipif(
        not cpu_ops.bf16_decode_attention_usable(64), reason="needs avx512_bf16"))])
def test_real_model_decodes_the_same_tokens_and_logprobs_fused(make_llm_engine, tokenizer,
                                                              fused_layer_calls, quantization,
                                                              kv_cache_dtype):
    calls = fused_layer_calls
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def add(a, b):",
                                             "Once upon a time, in a small village,")]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    results = {}
    # Every layer of a step in one call (the default), a call a layer, and the per-op layers.
    for mode, (fused, whole) in {"whole": (True, True), "one": (True, False),
                                 "per-op": (False, False)}.items():
        engine = make_llm_engine(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
        engine.model.policy = replace(engine.model.policy, fused_decode=fused,
                                      fused_decode_whole=whole)
        calls.clear()
        for n in (1, 3):  # one stream, then three
            out = run_to_completion(engine, [EngineRequest(f"{mode}-{n}-{i}", tuple(p), params,
                                                           tenant_id="t")
                                             for i, p in enumerate(prompts[:n])])
            results[mode, n] = [(r.token_ids, [(lp.token_id, lp.logprob, lp.top)
                                               for lp in r.logprobs]) for r in out]
        layers = 30  # every decode step (11 a request) of each run fused, through mode's op
        assert [kind for kind, _ in calls] == ([mode] * layers * 11 * 2 if fused else [])
    for n in (1, 3):
        assert results["whole", n] == results["per-op", n] == results["one", n]


@needs_vnni
@pytest.mark.vnni
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act_bits", [16, 8])
def test_the_vnni_kernel_fused_is_bit_identical_at_every_row_count(bias, act_bits):
    """With our VNNI kernel every 4-bit projection names it at any row count (its group slot
    carrying the activation bits loaded with the weights), each spec equals the projection's own
    call bit for bit, and the fused layer equals the Python layer at 1, 9 and 40 rows."""
    model = _model("gguf", bias, act_bits)
    layer = model.layers[1]
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    assert all(m.vnni is not None and m.dense is None for m in projections)
    gen = torch.Generator().manual_seed(6)
    for rows in (1, 2, 8, 9, 17, 40):
        specs = [m.decode_spec(rows) for m in projections]
        assert [(s.kind, s.group) for s in specs] == [(SPEC_Q4_VNNI, act_bits)] * 4
        x = torch.randn(rows, HIDDEN, generator=gen)
        assert torch.equal(_run_spec(specs[0], x), layer.qkv(x))
    for rows in (1, 9, 40):
        seq_lens = [1 + (3 + 7 * s) % 60 for s in range(rows)]
        hidden = torch.randn(rows, HIDDEN, generator=gen)
        caches = _caches(rows)
        meta, positions = _decode_step(seq_lens)
        cos, sin = model.rotary.cos_sin(positions, torch.float32)
        a, b = caches.clone(), caches.clone()
        want = layer.forward(hidden.clone(), None, cos, sin, a[1, 0], a[1, 1], meta, model.attn)
        got = layer.forward_decode(hidden.clone(), None, cos, sin, b[1, 0], b[1, 1], meta,
                                   layer.decode_args(rows))
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        assert torch.equal(a, b)
