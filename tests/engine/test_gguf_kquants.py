"""GGUF beyond Q4_0/Q4_1: Q4_K, Q5_K, Q6_K and Q8_0 kept as the file stores them (exactly, one
tensor at a time), Qwen3's q/k norms, and a model served from such a file (one type, or Q4_K
with Q6_K as a Q4_K_M file mixes them) agrees with the same model in fp32.

The GGUF files are written with the ``gguf`` package. It quantizes Q8_0 itself; for the K-quants
(which it can only dequantize) the tests draw random valid blocks, take the ``gguf`` package's
dequantization of them as the model's fp32 weights (the reference checkpoint), and write the
blocks themselves into the GGUF."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_checkpoints import StubTokenizer

gguf = pytest.importorskip("gguf")

from engine.config import EngineConfig
from engine.llm import run_to_completion
from engine.llm_engine import LLMEngine
from engine.models.config import ModelConfig
from engine.models.gguf import kquant_blocks, read_gguf_state
from engine.quantization import SPEC_KQUANT, KernelPolicy, KQuantLinear, KQuantWeight
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

Q = gguf.GGMLQuantizationType
BLOCK = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210, Q.Q8_0: 34}
FP16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of fp16 d/dmin


def random_blocks(kind, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random valid ``kind`` blocks for a [rows, cols] tensor: random codes and scales, with
    finite fp16 super-block scales of a sensible size. [rows, cols / 256 * bytes] uint8."""
    rng = np.random.default_rng(seed)
    nb = cols // 256
    raw = rng.integers(0, 256, size=(rows, nb, BLOCK[kind]), dtype=np.uint8)
    for off in FP16_FIELDS[kind]:
        typical = {Q.Q4_K: 256, Q.Q5_K: 512, Q.Q6_K: 1024}[kind]  # mean |scale * code| / d
        d = (rng.uniform(0.5, 1.5, size=(rows, nb)) * (2.0 / cols ** 0.5 / typical))
        d = d.astype(np.float16)
        raw[..., off:off + 2] = d[..., None].view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, -1)


def blocks_of(kind, rows: int, cols: int, seed: int) -> np.ndarray:
    """``random_blocks`` for the K-quants; Q8_0 quantized by the ``gguf`` package itself."""
    if kind == Q.Q8_0:
        w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(w / cols ** 0.5, Q.Q8_0)
    return random_blocks(kind, rows, cols, seed)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0], ids=lambda k: k.name)
def test_k_quants_unpack_to_exactly_the_gguf_dequantization(kind):
    raw = blocks_of(kind, 24, 512, 0)
    blocks = kquant_blocks(raw, kind.name)
    assert blocks.shape == (24, 512) and blocks.codes.dtype == torch.uint8
    top = {Q.Q4_K: 15, Q.Q5_K: 31, Q.Q6_K: 63, Q.Q8_0: 255}[kind]
    assert int(blocks.codes.max()) <= top
    if kind != Q.Q8_0:  # random blocks use every code
        assert int(blocks.codes.max()) == top
    ref = torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32))
    assert torch.equal(blocks.dequantize(), ref)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(1))
    assert torch.equal(blocks.rows(order).dequantize(), ref[order])


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0], ids=lambda k: k.name)
def test_k_quants_refuse_a_row_of_partial_blocks(kind):
    with pytest.raises(ValueError, match=f"whole {BLOCK[kind]}-byte blocks"):
        kquant_blocks(np.zeros((2, BLOCK[kind] + 1), dtype=np.uint8), kind.name)


HIDDEN, INTER, VOCAB, LAYERS = 256, 512, 512, 2


def write_model(tmp_path, kind, arch: str = "llama"):
    """A [LAYERS]-layer model of ``arch`` whose projections are ``kind`` blocks in the GGUF and
    their dequantization in the safetensors reference, the output matrix too; norms and
    embeddings F32. ``kind`` None: Q4_K, with v_proj, down_proj and the output Q6_K (llama.cpp's
    Q4_K_M mix). A llama GGUF's q/k rows are permuted as llama.cpp's converter writes them."""
    from safetensors.torch import save_file

    hf_arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    cfg = {"architectures": [hf_arch], "model_type": arch, "vocab_size": VOCAB,
           "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": False,
           "eos_token_id": 0, "rope_theta": 10000.0}
    gen = torch.Generator().manual_seed(3)
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen),
        "model.norm.weight": torch.rand(HIDDEN, generator=gen) + 0.5}
    blocks: dict[str, np.ndarray] = {}
    shapes = {"self_attn.q_proj": (256, HIDDEN), "self_attn.k_proj": (128, HIDDEN),
              "self_attn.v_proj": (128, HIDDEN), "self_attn.o_proj": (HIDDEN, 256),
              "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
              "mlp.down_proj": (HIDDEN, INTER)}
    seed = 0
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            state[p + n + ".weight"] = torch.rand(HIDDEN, generator=gen) + 0.5
        if arch == "qwen3":
            for n in ("q_norm", "k_norm"):
                state[p + f"self_attn.{n}.weight"] = torch.rand(64, generator=gen) + 0.5
        for n, (rows, cols) in shapes.items():
            seed += 1
            k = kind or (Q.Q6_K if n in ("self_attn.v_proj", "mlp.down_proj") else Q.Q4_K)
            raw = blocks_of(k, rows, cols, seed)
            state[p + n + ".weight"] = torch.from_numpy(
                gguf.quants.dequantize(raw, k).astype(np.float32).copy())
            if arch == "llama" and n in ("self_attn.q_proj", "self_attn.k_proj"):
                # llama.cpp's converter permutes q/k rows (LlamaModel.permute); the reader
                # undoes it. Rows are whole blocks, so the raw rows permute as they are.
                heads = cfg["num_attention_heads" if "q_proj" in n else "num_key_value_heads"]
                raw = raw.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(
                    rows, -1)
            blocks[p + n + ".weight"] = (raw, k)
    head = kind or Q.Q6_K  # the output matrix in the file's type (Q4_K_M: Q6_K)
    raw = blocks_of(head, VOCAB, HIDDEN, 99)
    if head == Q.Q8_0:
        raw = gguf.quants.quantize(gguf.quants.dequantize(raw, head) * 8, head)
    blocks["lm_head.weight"] = (raw, head)
    state["lm_head.weight"] = torch.from_numpy(
        gguf.quants.dequantize(raw, head).astype(np.float32).copy())
    d = tmp_path / f"{arch}-{kind.name if kind else 'Q4_K_M'}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    writer = gguf.GGUFWriter(str(d / "model.gguf"), arch)
    for name, value in state.items():
        if name in names:
            gname = names[name]
        else:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{layer[rest.removesuffix('.weight')]}.weight"
        if name in blocks:
            writer.add_tensor(gname, blocks[name][0], raw_dtype=blocks[name][1])
        else:
            writer.add_tensor(gname, value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return d, state


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, None],
                         ids=lambda k: k.name if k else "Q4_K_M")
def test_gguf_tensors_read_as_their_dequantization_one_at_a_time(tmp_path, kind):
    model_dir, state = write_model(tmp_path, kind, arch="qwen3")
    cfg = ModelConfig.from_pretrained(model_dir)
    read = read_gguf_state(model_dir / "model.gguf", cfg)
    assert set(read) == set(state)
    for name, value in state.items():
        got = read[name]
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            assert isinstance(got, KQuantWeight), name  # kept as stored
            got = got.dequantize()
        assert torch.equal(got, value), name
    assert read[name] is not read[name]  # decoded on each lookup, nothing held


@pytest.mark.parametrize("kind,arch", [(Q.Q4_K, "qwen3"), (Q.Q5_K, "qwen3"), (Q.Q6_K, "qwen3"),
                                       (Q.Q8_0, "qwen3"), (None, "qwen3"), (None, "llama"),
                                       (Q.Q8_0, "llama")],
                         ids=["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_K_M", "llama-Q4_K_M",
                              "llama-Q8_0"])
def test_a_k_quant_gguf_serves_its_fp32_dequantization(tmp_path, kind, arch):
    """The engine over the GGUF (``--quantization gguf``) against the engine over its exact
    dequantization in fp32: the same greedy tokens and logprobs within the activations'
    16-bit rounding, since no weight is rounded again; where our kernel runs, every projection
    (a fused q/k/v of Q4_K and Q6_K too) is in it, in about the file's bytes, and a Llama's
    decode steps run it inside the fused CPU decode layer."""
    model_dir, _ = write_model(tmp_path, kind, arch=arch)

    def run(quantization, **policy):
        engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                        max_model_len=256, num_gpu_blocks_override=32,
                                        quantization=quantization), tokenizer=StubTokenizer(),
                           kernel_policy=KernelPolicy.detect(**policy))
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (20, 37)]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
        done = run_to_completion(engine, [EngineRequest(f"r{i}", tuple(p), params,
                                                        tenant_id="t")
                                          for i, p in enumerate(prompts)])
        return engine, done

    dense_engine, dense = run(None)
    gguf_engine, quant = run("gguf")
    assert [d.token_ids for d in dense] == [q.token_ids for q in quant]
    if arch == "llama":  # the fused decode layer runs the same kernel: the same bits
        _, per_op = run("gguf", fused_decode=False)
        assert [[lp.logprob for lp in q.logprobs] for q in quant] == \
            [[lp.logprob for lp in q.logprobs] for q in per_op]
    lps = [(a.logprob, b.logprob) for d, q in zip(dense, quant, strict=True)
           for a, b in zip(d.logprobs, q.logprobs, strict=True)]
    assert max(abs(a - b) for a, b in lps) < 2e-3, lps
    model = gguf_engine.model
    layers = [model.lm_head] + [m for layer in model.layers for m in layer.linears()]
    if model.policy.cpu_kernels and model.policy.int8_dot:
        assert all(isinstance(m, KQuantLinear) for m in layers)
        file_bytes = sum(BLOCK[k] / (32 if k == Q.Q8_0 else 256) * rows * cols
                         for k, rows, cols in _projections(kind))
        ratio = sum(m.weight_bytes for m in layers) / file_bytes
        assert 1.0 <= ratio < 1.07, ratio
        assert {m.decode_spec(1).kind for m in layers} == {SPEC_KQUANT}
        assert model.fused_decode_supported == (arch == "llama")
    assert model.weight_bytes() < dense_engine.model.weight_bytes() / 3


def _projections(kind):
    """(type, rows, cols) of every projection ``write_model`` writes."""
    shapes = {"q": (256, HIDDEN), "k": (128, HIDDEN), "v": (128, HIDDEN), "o": (HIDDEN, 256),
              "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    return [(kind or Q.Q6_K, VOCAB, HIDDEN)] + [
        (kind or (Q.Q6_K if n in ("v", "down") else Q.Q4_K), rows, cols)
        for _ in range(LAYERS) for n, (rows, cols) in shapes.items()]
