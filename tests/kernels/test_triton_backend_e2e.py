"""End to end: the engine with ``attention_backend="triton"`` (kernels interpreted on CPU) produces
the same greedy tokens as the torch backend on a tiny random-weight Llama, through cold prefill,
chunked prefill, prefix-cache hits (a cached prefix, and all but the last token cached),
continuous batching of prefills with decodes, and decode.

Runs on CPU under the interpreter, and on CUDA when the suite runs natively (TRITON_INTERPRET=0).
The tokenizer is a stub (the engine only decodes ids to text), so no model files are needed."""

from __future__ import annotations

import json

import pytest
import torch
from kernel_utils import DEVICE
from tiny_checkpoints import StubTokenizer

from engine.attention.triton_backend import TritonAttentionBackend
from engine.config import EngineConfig
from engine.llm import run_to_completion
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

VOCAB = 1024
MAX_NEW = 5


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """2 layers, hidden 64, 4 query heads / 2 kv heads of head_dim 64.

    Untied lm_head and strong attention/MLP outputs: with tied embeddings and small residual
    updates a random model just echoes its last token, whatever attention computes.
    """
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
           "tie_word_embeddings": False, "eos_token_id": 0, "torch_dtype": "float32"}
    gen = torch.Generator().manual_seed(1234)

    def w(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) * (gain / in_f ** 0.5)

    h, q, kv, inter = 64, 4 * 64, 2 * 64, 128
    state = {"model.embed_tokens.weight": torch.randn(VOCAB, h, generator=gen),
             "lm_head.weight": w(VOCAB, h, 8.0), "model.norm.weight": torch.ones(h)}
    for i in range(2):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": w(q, h),
                      p + "self_attn.k_proj.weight": w(kv, h),
                      p + "self_attn.v_proj.weight": w(kv, h),
                      p + "self_attn.o_proj.weight": w(h, q, 4.0),
                      p + "mlp.gate_proj.weight": w(inter, h),
                      p + "mlp.up_proj.weight": w(inter, h),
                      p + "mlp.down_proj.weight": w(h, inter, 2.0),
                      p + "input_layernorm.weight": torch.ones(h),
                      p + "post_attention_layernorm.weight": torch.ones(h)})
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(d / "model.safetensors"))
    return d


def _engine(model_dir, backend: str) -> LLMEngine:
    cfg = EngineConfig(model=str(model_dir), attention_backend=backend, device=DEVICE,
                       dtype="float32", num_gpu_blocks_override=64, max_model_len=256,
                       max_num_batched_tokens=24, block_size=16)
    return LLMEngine(cfg, tokenizer=StubTokenizer())


def _run(engine: LLMEngine, waves: list[list[list[int]]]) -> list[tuple[list[int], int]]:
    """Runs each wave of prompts concurrently, waves one after another.
    Returns (tokens, cached prompt tokens) per prompt in order."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    results = []
    for w, prompts in enumerate(waves):
        done = run_to_completion(engine, [EngineRequest(f"w{w}-{i}", tuple(p), params,
                                                        tenant_id="t")
                                          for i, p in enumerate(prompts)])
        results.extend((r.token_ids, r.num_cached_tokens) for r in done)
    return results


def test_triton_backend_matches_torch_backend(tiny_llama):
    gen = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(100, VOCAB, (n,), generator=gen).tolist()

    shared = rand(40)
    waves = [
        [shared + rand(9)],                         # cold: 49 tokens, chunked 24 + 24 + 1
        [shared + rand(5), rand(20), rand(3)],      # prefix hit (32 cached) batched with colds
        [None],                                     # wave 0's prompt again: 48 of 49 cached
    ]
    waves[2] = [waves[0][0]]

    triton_engine = _engine(tiny_llama, "triton")
    assert isinstance(triton_engine.model.attn, TritonAttentionBackend)
    assert triton_engine.cache_info.attention_backend == "triton"
    got = _run(triton_engine, waves)
    expected = _run(_engine(tiny_llama, "torch"), waves)

    assert [c for _t, c in got] == [0, 32, 0, 0, 48]
    assert [c for _t, c in expected] == [0, 32, 0, 0, 48]
    assert all(len(t) == MAX_NEW for t, _c in got)
    assert [t for t, _c in got] == [t for t, _c in expected]
