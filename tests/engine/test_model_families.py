"""Every architecture in the registry is token-identical to Hugging Face ``generate`` (fp32,
greedy, CPU) on a tiny random-weight checkpoint these tests build with transformers: through the
engine with prefix caching on, cold and warm, in chunked prefill batched with other requests and
their decodes, after preemption, and through the Triton backend under its interpreter.

Each checkpoint is made by transformers' own config class and ``save_pretrained``, so its
``config.json`` and weight names are what the family's real checkpoints carry. Sliding windows
are set narrower than the prompts, so the windows bind."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import FAMILIES, SMALL, VOCAB, StubTokenizer, build_checkpoint

from engine.config import EngineConfig
from engine.llm import run_to_completion
from engine.llm_engine import LLMEngine
from engine.models.registry import supported_architectures
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

MAX_NEW = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {}


def checkpoint(checkpoints, tmp_path_factory, name: str) -> Path:
    if name not in checkpoints:
        checkpoints[name] = build_checkpoint(name, tmp_path_factory.mktemp("families"))
    return checkpoints[name]


def hf_greedy_each(model_dir: Path, prompts: list[list[int]], outputs: list[list[int]]
                   ) -> list[list[int]]:
    """Hugging Face's greedy choice after each prefix of prompt + our output, one forward per
    prompt (no padding: a sliding window over padding is not what ``generate`` runs). Equals
    ``generate(do_sample=False)`` wherever ``outputs`` are its tokens; where ours first departs
    the row holds HF's token there."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    for p, o in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            best = hf(torch.tensor([p + o])).logits[0].argmax(-1).tolist()
        refs.append(best[len(p) - 1:len(p) - 1 + len(o)])
    return refs


def engine_for(model_dir: Path, **overrides) -> LLMEngine:
    kwargs = {"model": str(model_dir), "device": "cpu", "dtype": "float32",
              "max_model_len": 256, "num_gpu_blocks_override": 64, "block_size": 16,
              "max_num_batched_tokens": 32}
    return LLMEngine(EngineConfig(**{**kwargs, **overrides}), tokenizer=StubTokenizer())


def run(engine: LLMEngine, prompts: list[list[int]], tag: str, max_new: int = MAX_NEW
        ) -> tuple[list[list[int]], list[int]]:
    """All prompts at once (continuous batching). Returns (tokens, cached prompt tokens)."""
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    done = run_to_completion(engine, [EngineRequest(f"{tag}-{i}", tuple(p), params,
                                                    tenant_id="t")
                                      for i, p in enumerate(prompts)],
                             on_step=lambda _: engine.kv_cache_manager.check_integrity())
    pool = engine.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks, "idle engine must hold no blocks"
    return [r.token_ids for r in done], [r.num_cached_tokens for r in done]


def prompts_for(name: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(3, VOCAB, (40,), generator=gen).tolist()
    return [shared + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (9, 30)] + [
        torch.randint(3, VOCAB, (21,), generator=gen).tolist()]


def test_every_registered_architecture_has_a_parity_case():
    import transformers

    covered = set()
    for cls_name, extra in FAMILIES.values():
        cfg = getattr(transformers, cls_name)(**{**SMALL, **extra})
        covered.update(cfg.architectures or [transformers.AutoModelForCausalLM
                                             ._model_mapping[type(cfg)].__name__])
    assert set(supported_architectures()) <= covered


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_hf_cold_warm_chunked_batched(name, checkpoints, tmp_path_factory):
    model_dir = checkpoint(checkpoints, tmp_path_factory, name)
    prompts = prompts_for(name)
    engine = engine_for(model_dir)
    cold, cold_cached = run(engine, prompts, "cold")
    ref = hf_greedy_each(model_dir, prompts, cold)
    assert cold == ref, f"{name}: our greedy tokens differ from Hugging Face's"
    assert len({t for o in cold for t in o}) > 3, "a degenerate model tests nothing"
    warm, warm_cached = run(engine, prompts, "warm")
    assert warm == cold
    assert warm_cached == [16 * ((len(p) - 1) // 16) for p in prompts]
    assert sum(warm_cached) > sum(cold_cached)


@pytest.mark.parametrize("name", ["llama3", "mistral-window", "gemma2", "qwen3-moe"])
def test_family_matches_hf_after_preemption(name, checkpoints, tmp_path_factory):
    model_dir = checkpoint(checkpoints, tmp_path_factory, name)
    prompts = prompts_for(name)
    engine = engine_for(model_dir, num_gpu_blocks_override=7, max_num_batched_tokens=64,
                        max_model_len=96)
    out, _ = run(engine, prompts, "tiny", max_new=16)
    assert engine.scheduler.stats.num_preemptions > 0
    assert out == hf_greedy_each(model_dir, prompts, out)


@pytest.mark.parametrize("name", ["llama3", "mistral-window", "gemma2", "qwen3", "mixtral",
                                  "phi4-mini", "gpt-oss", "olmo2"])
def test_family_through_the_triton_backend_matches_hf(name, checkpoints, tmp_path_factory):
    model_dir = checkpoint(checkpoints, tmp_path_factory, name)
    prompts = prompts_for(name)[:2]
    engine = engine_for(model_dir, attention_backend="triton")
    out, _ = run(engine, prompts, "triton", max_new=4)
    assert out == hf_greedy_each(model_dir, prompts, out)
    again, cached = run(engine, prompts, "triton-warm", max_new=4)
    assert again == out and min(cached) > 0


def test_spec_is_frozen_data():
    from engine.models.config import ModelConfig

    cfg = ModelConfig.from_hf_config({**SMALL, "architectures": ["Gemma2ForCausalLM"],
                                      "model_type": "gemma2", "sliding_window": 24,
                                      "layer_types": ["sliding_attention", "full_attention"] * 2,
                                      "attn_logit_softcapping": 50.0,
                                      "final_logit_softcapping": 30.0})
    spec = cfg.spec
    assert [layer.sliding_window for layer in spec.layers] == [24, None, 24, None]
    assert spec.layers[0].logit_softcap == 50.0 and spec.final_logit_softcap == 30.0
    assert spec.norm_offset == 1.0 and spec.embedding_scale == 64 ** 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.layers[0].scale = 1.0  # type: ignore[misc]
    assert "sliding-window attention" in spec.fused_decode_blockers(16, 256)


@pytest.mark.parametrize("name", ["gemma2", "granite", "llama3", "gpt-oss"])
def test_family_logprobs_match_hf(name, checkpoints, tmp_path_factory):
    """Logprobs see what greedy tokens cannot: a final soft-cap or logit scale (both keep the
    argmax) changes every logprob. Ours equal HF's ``log_softmax`` of its logits."""
    from transformers import AutoModelForCausalLM

    model_dir = checkpoint(checkpoints, tmp_path_factory, name)
    prompt = prompts_for(name)[0]
    engine = engine_for(model_dir)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    (done,) = run_to_completion(engine, [EngineRequest("lp", tuple(prompt), params,
                                                       tenant_id="t")])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + done.token_ids])).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:-1]
    ours = torch.tensor([lp.logprob for lp in done.logprobs])
    chosen = ref[torch.arange(len(done.token_ids)), torch.tensor(done.token_ids)]
    torch.testing.assert_close(ours, chosen, atol=2e-4, rtol=1e-4)
    seconds = torch.tensor([lp.top[1][1] for lp in done.logprobs])
    torch.testing.assert_close(seconds, ref.topk(2, dim=-1).values[:, 1], atol=2e-4, rtol=1e-4)


def test_the_start_up_log_says_once_why_a_family_runs_no_fused_decode(checkpoints,
                                                                     tmp_path_factory, caplog):
    gemma = checkpoint(checkpoints, tmp_path_factory, "gemma2")
    llama = checkpoint(checkpoints, tmp_path_factory, "llama")
    with caplog.at_level("INFO", logger="engine.models.decoder"):
        engine_for(gemma)
        engine_for(llama)
    lines = [r.getMessage() for r in caplog.records if "fused CPU decode off" in r.getMessage()]
    assert lines == [("Gemma2ForCausalLM: fused CPU decode off for this model (norm or scaling "
                     "variants, norms after attention or the MLP, sliding-window attention, "
                     "attention soft-capping, gelu_tanh MLP); decode steps run the per-op "
                     "layers")]


def test_a_tenants_flood_on_a_windowed_model_leaves_another_alone(checkpoints,
                                                                  tmp_path_factory):
    """Gemma 2 (sliding windows, soft-caps: the per-op path): tenant A floods requests, half of
    them B's very prompt, beside B's one. B gets its tokens as alone (logprobs to fp32
    rounding: a padded decode batch may round differently), no cached token of A's, and its own
    repeat hits."""
    engine = engine_for(checkpoint(checkpoints, tmp_path_factory, "gemma2"),
                        num_gpu_blocks_override=96)
    b_ids = prompts_for("gemma2")[1]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)

    def b(rid: str, salt: bytes) -> EngineRequest:
        return EngineRequest(rid, tuple(b_ids), params, tenant_id="b", cache_salt=salt)

    (alone,) = run_to_completion(engine, [b("b-alone", b"b" * 16)])
    gen = torch.Generator().manual_seed(4)
    flood = [EngineRequest(f"a{i}", tuple(b_ids) if i % 2 else tuple(
        torch.randint(3, VOCAB, (60,), generator=gen).tolist()),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), tenant_id="a",
        cache_salt=b"a" * 16) for i in range(12)]
    done = run_to_completion(engine, [*flood, b("b-flooded", b"c" * 16)])
    beside = done[-1]
    assert all(len(r.token_ids) == 12 for r in done[:-1])
    assert beside.num_cached_tokens == 0  # A sent B's prompt six times: no hit across
    assert beside.token_ids == alone.token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in beside.logprobs]),
                               torch.tensor([lp.logprob for lp in alone.logprobs]),
                               rtol=1e-5, atol=1e-5)
    (again,) = run_to_completion(engine, [b("b-again", b"b" * 16)])
    assert again.num_cached_tokens > 0 and again.token_ids == alone.token_ids
    pool = engine.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


@pytest.mark.parametrize("family", ["gemma2", "olmo2"])
def test_bf16_norms_round_once_as_the_familys_norm_does(family):
    """Under bf16 activations Gemma's and OLMo 2's RMSNorm multiply by the weight in fp32 and
    round once (Llama's rounds first): our norm gives transformers' bits exactly."""
    from engine.models.decoder import RMSNorm

    module = {"gemma2": "gemma2.modeling_gemma2.Gemma2RMSNorm",
              "olmo2": "olmo2.modeling_olmo2.Olmo2RMSNorm"}[family]
    mod, name = module.rsplit(".", 1)
    hf_norm = getattr(__import__(f"transformers.models.{mod}", fromlist=[name]), name)(
        64, eps=1e-6).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        hf_norm.weight.copy_(torch.randn(64, generator=gen) * 0.5)
    x = (torch.randn(7, 64, generator=gen) * 3).bfloat16()
    ours = RMSNorm(64, 1e-6).to(torch.bfloat16)
    offset = 1.0 if family == "gemma2" else 0.0
    with torch.no_grad():
        ours.weight.copy_(hf_norm.weight.float() + offset)
    ours.weight32 = hf_norm.weight.float() + offset
    assert torch.equal(ours(x), hf_norm(x))
    plain = RMSNorm(64, 1e-6).to(torch.bfloat16)  # Llama's order: rounds before the multiply
    with torch.no_grad():
        plain.weight.copy_(ours.weight)
    assert not torch.equal(plain(x), hf_norm(x))
    residual = (torch.randn(7, 64, generator=gen)).bfloat16()
    s, normed = ours.add(residual, x)
    assert torch.equal(s, residual + x) and torch.equal(normed, hf_norm(residual + x))
