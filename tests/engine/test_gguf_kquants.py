"""GGUF beyond Q4_0/Q4_1: Q4_K kept 4-bit exactly, Q8_0 / Q5_K / Q6_K read one tensor at a time,
Qwen3's q/k norms, and a model served from such a file agrees with the same model in fp32.

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
from engine.models.gguf import q4_k_grouped, read_gguf_state
from engine.quantization import GroupedInt4
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

Q = gguf.GGMLQuantizationType
BLOCK = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
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


def test_q4_k_unpacks_to_exactly_the_gguf_dequantization():
    raw = random_blocks(Q.Q4_K, 24, 512, 0)
    grouped = q4_k_grouped(raw)
    assert isinstance(grouped, GroupedInt4) and grouped.shape == (24, 512)
    assert grouped.codes.dtype == torch.uint8 and int(grouped.codes.max()) <= 15
    ref = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_K).astype(np.float32))
    assert torch.equal(grouped.dequantize(), ref)


def test_q4_k_refuses_a_row_of_partial_blocks():
    with pytest.raises(ValueError, match="whole 144-byte blocks"):
        q4_k_grouped(np.zeros((2, 100), dtype=np.uint8))


HIDDEN, INTER, VOCAB, LAYERS = 256, 512, 512, 2


def write_model(tmp_path, kind, arch: str = "llama"):
    """A [LAYERS]-layer model of ``arch`` whose projections are ``kind`` blocks in the GGUF and
    their dequantization in the safetensors reference; norms and embeddings F32. (Written as
    they are: a llama GGUF's q/k rows would also need llama.cpp's permutation, which the
    Q4_1 tests cover; qwen3 has none.)"""
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
            if kind == Q.Q8_0:
                w = torch.randn(rows, cols, generator=gen) / cols ** 0.5
                raw = gguf.quants.quantize(w.numpy(), Q.Q8_0)
            else:
                raw = random_blocks(kind, rows, cols, seed)
            blocks[p + n + ".weight"] = raw
            state[p + n + ".weight"] = torch.from_numpy(
                gguf.quants.dequantize(raw, kind).astype(np.float32).copy())
    state["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen) * (8 / HIDDEN ** 0.5)
    d = tmp_path / f"{arch}-{kind.name}"
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
            writer.add_tensor(gname, blocks[name], raw_dtype=kind)
        else:
            writer.add_tensor(gname, value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return d, state


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0], ids=lambda k: k.name)
def test_gguf_tensors_read_as_their_dequantization_one_at_a_time(tmp_path, kind):
    model_dir, state = write_model(tmp_path, kind, arch="qwen3")
    cfg = ModelConfig.from_pretrained(model_dir)
    read = read_gguf_state(model_dir / "model.gguf", cfg)
    assert set(read) == set(state)
    for name, value in state.items():
        got = read[name]
        if kind == Q.Q4_K and name.endswith("_proj.weight"):
            assert isinstance(got, GroupedInt4), name  # kept 4-bit
            got = got.dequantize()
        assert torch.equal(got, value), name
    assert read[name] is not read[name]  # decoded on each lookup, nothing held


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda k: k.name)
def test_a_k_quant_gguf_serves_close_to_its_fp32_dequantization(tmp_path, kind):
    """The engine over the GGUF (``--quantization gguf``) against the engine over its exact
    dequantization in fp32: the same greedy tokens nearly everywhere, logprobs within the
    kernels' rounding, and the 4-bit layers' weights in 4 bits."""
    model_dir, _ = write_model(tmp_path, kind, arch="qwen3")

    def run(quantization):
        engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                        max_model_len=256, num_gpu_blocks_override=32,
                                        quantization=quantization), tokenizer=StubTokenizer())
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (20, 37)]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
        done = run_to_completion(engine, [EngineRequest(f"r{i}", tuple(p), params,
                                                        tenant_id="t")
                                          for i, p in enumerate(prompts)])
        return engine, done

    dense_engine, dense = run(None)
    gguf_engine, quant = run("gguf")
    same = sum(a == b for d, q in zip(dense, quant, strict=True)
               for a, b in zip(d.token_ids, q.token_ids, strict=True))
    assert same >= 8, (same, [d.token_ids for d in dense], [q.token_ids for q in quant])
    assert [d.token_ids[0] for d in dense] == [q.token_ids[0] for q in quant]
    first = [(d.logprobs[0].logprob, q.logprobs[0].logprob) for d, q in zip(dense, quant)]
    assert all(abs(a - b) < 0.1 for a, b in first), first
    bytes_dense = dense_engine.model.weight_bytes()
    bytes_gguf = gguf_engine.model.weight_bytes()
    assert bytes_gguf < bytes_dense / 3  # 4-bit or int8 projections, not fp32
