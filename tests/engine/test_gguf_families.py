"""``--quantization gguf`` for every tiny family llama.cpp names: each checkpoint is written as a
GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` writes it, and read back as its weights.

Each family's tiny checkpoint (``tests/tiny_checkpoints.py``) is converted here as llama.cpp's
converter would: GGUF names from the ``gguf`` package's tables (``get_tensor_name_map``), q/k
rows permuted for ``llama`` / ``granite`` / ``smollm3`` (``LlamaModel.permute``), Gemma norms
stored as ``w + 1``, Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` kept fused, and experts
stacked into 3-D tensors; F32, F16 and Q8_0 tensors mixed (``gguf.quants.quantize``; K-quants
need rows of 256 and are covered in ``test_gguf_kquants.py``). Then the GGUF reads as exactly
the checkpoint (Q8_0: its ``gguf`` dequantization), an engine serves it with greedy tokens close
to the same engine on the safetensors, and mismatched or unsupported files are refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from tiny_checkpoints import FAMILIES, SMALL, VOCAB, StubTokenizer, build_checkpoint

gguf = pytest.importorskip("gguf")

from engine.config import EngineConfig
from engine.llm import run_to_completion
from engine.llm_engine import LLMEngine
from engine.models.config import ModelConfig
from engine.models.gguf import read_gguf_state, supported_architectures
from engine.quantization import KQuantWeight
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

Q = gguf.GGMLQuantizationType

# tiny family -> the GGUF architecture llama.cpp's converter writes it as (its
# ``ModelBase.register``: Mistral and Mixtral are ``llama``, Phi-4-mini is ``phi3``).
GGUF_ARCH = {
    "llama": "llama", "llama3": "llama", "llama-linear": "llama", "mistral-window": "llama",
    "mixtral": "llama", "qwen2-yarn": "qwen2", "qwen3": "qwen3", "qwen3-moe": "qwen3moe",
    "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "phi4-mini": "phi3",
    "olmo2": "olmo2", "granite": "granite", "smollm3": "smollm3",
}
NOT_GGUF = {"gpt-oss"}  # MXFP4 experts in its GGUFs: refused
PERMUTED_QK = {"llama", "granite", "smollm3"}  # converted by llama.cpp's LlamaModel
NORM_PLUS_ONE = {"gemma2", "gemma3"}
# What a checkpoint must be for llama.cpp to convert it at all: its gemma2 has no output tensor
# (the converter drops lm_head), its qwen3moe no dense MLP tensors (MODEL_TENSORS).
LLAMA_CPP_SHAPE = {"gemma2": {"tie_word_embeddings": True}, "qwen3-moe": {"mlp_only_layers": []}}


def test_every_family_is_read_or_refused():
    assert set(GGUF_ARCH) | NOT_GGUF == set(FAMILIES)
    assert set(GGUF_ARCH.values()) <= set(supported_architectures())
    assert "gpt-oss" not in supported_architectures()


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (weights or biases)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def convert(model_dir: Path, arch: str) -> dict[str, tuple[torch.Tensor, Q, np.ndarray]]:
    """Writes ``model_dir/model.gguf`` from its safetensors as llama.cpp's converter would
    (module docstring), matrices whose rows are whole 32-blocks cycling Q8_0 / F32 / F16.
    Returns, per Hugging Face name (an expert's stacked name ``...experts.w1.weight`` for its
    3-D tensor), (the tensor as converted, before quantizing; its type; what was written)."""
    from safetensors.torch import load_file

    hf = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, w in load_file(str(model_dir / "model.safetensors")).items():
        if arch in PERMUTED_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = permute(w, heads)
        if arch in PERMUTED_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = permute(w, kv_heads)
        if arch in NORM_PLUS_ONE and name.endswith("norm.weight"):
            w = w + 1
        m = re.fullmatch(r"(.*\.experts\.)(\d+)\.(\w+\.weight)", name)
        if m:  # stacked per layer and projection: [E, out, in]
            experts.setdefault(m[1] + m[3], {})[int(m[2])] = w
        else:
            tensors[name] = w
    for name, per in experts.items():
        tensors[name] = torch.stack([per[e] for e in sorted(per)])
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, hf["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(model_dir / "model.gguf"), arch)
    writer.add_block_count(hf["num_hidden_layers"])
    written = {}
    matrices = 0
    for name in sorted(tensors):
        w = tensors[name]
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, f"llama.cpp's {arch} tables cannot name {name}"
        data = w.numpy()
        kind = Q.F32
        if w.dim() >= 2 and w.shape[-1] % 32 == 0:
            kind = (Q.Q8_0, Q.F32, Q.F16)[matrices % 3]
            matrices += 1
        if kind == Q.Q8_0:
            raw = gguf.quants.quantize(data, Q.Q8_0)
            writer.add_tensor(gname, raw, raw_dtype=Q.Q8_0)
        else:
            raw = data.astype(np.float16 if kind == Q.F16 else np.float32)
            writer.add_tensor(gname, raw)
        written[name] = (w, kind, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    return {}


def family(converted, tmp_path_factory, name: str) -> tuple[Path, dict]:
    """The family's tiny checkpoint (as llama.cpp can convert it) with its GGUF beside it."""
    if name not in converted:
        cls, extra = FAMILIES[name]
        with mock.patch.dict(FAMILIES, {name: (cls, {**extra, **LLAMA_CPP_SHAPE.get(name, {})})}):
            model_dir = build_checkpoint(name, tmp_path_factory.mktemp("gguf"))
        converted[name] = model_dir, convert(model_dir, GGUF_ARCH[name])
    return converted[name]


def unconverted(name: str, w: torch.Tensor, arch: str, hf: dict) -> torch.Tensor:
    """What the converter's ``w`` was before its q/k permutation (the row order undone)."""
    heads = {"q_proj": hf["num_attention_heads"], "k_proj": hf["num_key_value_heads"]}
    proj = name.split(".")[-2]
    if arch not in PERMUTED_QK or proj not in heads:
        return w
    order = permute(torch.arange(w.shape[0]), heads[proj])
    out = torch.empty_like(w)
    out[order] = w
    return out


@pytest.mark.parametrize("name", sorted(GGUF_ARCH))
def test_gguf_reads_as_the_checkpoint(name, converted, tmp_path_factory):
    """Every name the loader needs, each equal to the checkpoint's tensor: F32 exactly, F16 its
    fp16 rounding, Q8_0 the ``gguf`` dequantization of what was written; Gemma's norms such
    that the loader's ``1 + w`` is the checkpoint's fp32 ``1 + w`` exactly; an expert read
    from its slice of the 3-D tensor."""
    from safetensors.torch import load_file

    model_dir, written = family(converted, tmp_path_factory, name)
    arch = GGUF_ARCH[name]
    hf = json.loads((model_dir / "config.json").read_text())
    reference = load_file(str(model_dir / "model.safetensors"))
    read = read_gguf_state(model_dir / "model.gguf", ModelConfig.from_pretrained(model_dir))
    assert set(read) == set(reference)
    kinds = set()
    for hf_name, want in reference.items():
        got = read[hf_name]
        m = re.fullmatch(r"(.*\.experts\.)(\d+)\.(\w+\.weight)", hf_name)
        stacked = m[1] + m[3] if m else hf_name
        _, kind, raw = written[stacked]
        kinds.add(kind)
        if kind == Q.Q8_0:  # kept as stored
            assert isinstance(got, KQuantWeight) and got.type_names == ("Q8_0",), hf_name
            got = got.dequantize()
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, hf_name
        if arch in NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
            assert torch.equal(got + 1, want + 1), hf_name  # the loader's 1 + w, exactly
            continue
        if kind == Q.F32:
            assert torch.equal(got, want), hf_name
            continue
        if kind == Q.F16:
            assert torch.equal(got, want.half().float()), hf_name
            continue
        deq = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0).astype(np.float32))
        deq = deq[int(m[2])] if m else deq
        assert torch.equal(got, unconverted(hf_name, deq, arch, hf)), hf_name
    assert kinds == {Q.F32, Q.F16, Q.Q8_0}


def next_tokens(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 1,
                logprobs: int | None = None) -> list:
    """Each prompt's greedy completion (all in one batch), in prompt order."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            logprobs=logprobs)
    return run_to_completion(engine, [EngineRequest(f"r{i}", tuple(p), params, tenant_id="t")
                                      for i, p in enumerate(prompts)])


def engine_for(model_dir: Path, quantization: str | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), quantization=quantization, device="cpu",
                                  dtype="float32", max_model_len=128,
                                  num_gpu_blocks_override=32), tokenizer=StubTokenizer())


MAX_NEW = 8


@pytest.mark.parametrize("name", sorted(GGUF_ARCH))
def test_gguf_serves_close_to_the_safetensors(name, converted, tmp_path_factory):
    """The engine over the GGUF (``--quantization gguf``) against the engine over the
    safetensors in fp32, on eight short prompts. Q8_0, and the int8 every float tensor becomes
    under gguf, move these tiny models' logprobs by up to ~0.3 nats (~0.9 for Mixtral, whose
    routing flips), as ``--quantization int8`` on the safetensors does, so a near-tie may go
    either way: the first token agrees on the prompt where fp32's first token wins by the
    widest margin, and on most prompts; and most of fp32's greedy tokens are the GGUF engine's
    choice too, each taken after fp32's own tokens so far (one near-tie does not decide every
    later token). A misread weight (rows out of order, a wrong expert) agrees on almost none."""
    model_dir, _ = family(converted, tmp_path_factory, name)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (10,), generator=gen).tolist() for _ in range(8)]
    dense = next_tokens(engine_for(model_dir, None), prompts, MAX_NEW, logprobs=2)
    margins = [d.logprobs[0].top[0][1] - d.logprobs[0].top[1][1] for d in dense]
    dense_tokens = [d.token_ids for d in dense]
    forced = [d.token_ids[0] for d in next_tokens(
        engine_for(model_dir, "gguf"), [p + t[:k] for p, t in zip(prompts, dense_tokens)
                                        for k in range(MAX_NEW)])]
    forced_tokens = [forced[i:i + MAX_NEW] for i in range(0, len(forced), MAX_NEW)]
    firsts = [d[0] == f[0] for d, f in zip(dense_tokens, forced_tokens, strict=True)]
    assert firsts[margins.index(max(margins))], (dense_tokens, forced_tokens)
    assert sum(firsts) > len(prompts) // 2, (dense_tokens, forced_tokens)
    same = sum(a == b for d, f in zip(dense_tokens, forced_tokens)
               for a, b in zip(d[1:], f[1:], strict=True))
    assert same > len(prompts) * (MAX_NEW - 1) // 2, (same, dense_tokens, forced_tokens)


def write_empty_gguf(path: Path, arch: str, blocks: int | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    if blocks is not None:
        writer.add_block_count(blocks)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def config_of(architecture: str, **extra) -> ModelConfig:
    return ModelConfig.from_hf_config({**SMALL, "architectures": [architecture], **extra})


def test_refuses_gpt_oss_and_unknown_architectures_naming_the_supported(tmp_path):
    listed = ", ".join(supported_architectures())
    cfg = config_of("LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"^GGUF m\.gguf: architecture 'gpt-oss' is not "
                       r"supported by --quantization gguf \(its experts are MXFP4 blocks.*\); "
                       f"supported: {listed}$"):
        read_gguf_state(write_empty_gguf(tmp_path / "m.gguf", "gpt-oss"), cfg)
    with pytest.raises(ValueError, match=r"architecture 'falcon' is not supported by "
                       f"--quantization gguf; supported: {listed}$"):
        read_gguf_state(write_empty_gguf(tmp_path / "f.gguf", "falcon"), cfg)


def test_refuses_a_gguf_of_another_family_than_config_json(tmp_path):
    cfg = config_of("Qwen3ForCausalLM")
    path = write_empty_gguf(tmp_path / "m.gguf", "gemma2")
    with pytest.raises(ValueError, match=r"^GGUF m\.gguf: architecture 'gemma2' does not match "
                       r"config\.json's Qwen3ForCausalLM \(a 'gemma2' GGUF holds "
                       r"Gemma2ForCausalLM\)$"):
        read_gguf_state(path, cfg)
    path = write_empty_gguf(tmp_path / "l.gguf", "llama", blocks=2)
    with pytest.raises(ValueError, match="has 2 blocks but config.json has 4 layers"):
        read_gguf_state(path, config_of("LlamaForCausalLM"))


def test_refuses_a_config_whose_weights_the_architecture_cannot_name(tmp_path):
    """llama.cpp's qwen3moe has no dense MLP tensors: a Qwen3-MoE with ``mlp_only_layers``
    cannot be one of its GGUFs."""
    cfg = config_of("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, mlp_only_layers=[1])
    path = write_empty_gguf(tmp_path / "m.gguf", "qwen3moe")
    with pytest.raises(ValueError, match=r"needs model\.layers\.1\.mlp\.gate_proj\.weight and 2 "
                       r"more, which a qwen3moe GGUF cannot hold \(its layers: attn_norm, .*"
                       r"ffn_gate_exps"):
        read_gguf_state(path, cfg)


def test_an_engine_refuses_a_mismatched_gguf_at_start(converted, tmp_path_factory):
    model_dir, _ = family(converted, tmp_path_factory, "qwen3")
    other = tmp_path_factory.mktemp("mismatch")
    for f in model_dir.iterdir():
        if f.suffix != ".gguf":
            (other / f.name).write_bytes(f.read_bytes())
    write_empty_gguf(other / "model.gguf", "olmo2")
    with pytest.raises(ValueError, match="'olmo2' does not match config.json's Qwen3ForCausalLM"):
        engine_for(other, "gguf")


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_refuses_an_embedding_or_experts_of_another_size(tmp_path):
    """Gemma 3's converter drops the embedding rows past the tokenizer's vocabulary; such a
    file does not match config.json. A 3-D expert tensor must hold config.json's experts."""
    hidden = SMALL["hidden_size"]
    path = write_gguf(tmp_path / "g.gguf", "gemma3",
                      {"token_embd.weight": np.zeros((VOCAB - 8, hidden), np.float32)})
    with pytest.raises(ValueError, match=f"token_embd is {VOCAB - 8} x {hidden}, config.json's "
                       f"vocab x hidden {VOCAB} x {hidden}$"):
        read_gguf_state(path, config_of("Gemma3ForCausalLM"))
    cfg = config_of("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32)
    path = write_gguf(tmp_path / "q.gguf", "qwen3moe",
                      {"blk.0.ffn_gate_exps.weight": np.zeros((3, 32, hidden), np.float32)})
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight holds 3 experts; "
                       "config.json's model has 4"):
        read_gguf_state(path, cfg)
