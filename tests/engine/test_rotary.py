"""engine.models.rotary against Hugging Face transformers: every rope type's cos/sin rows bit for
bit (``torch.equal``) against the models' own rotary classes, the config.json forms
``RopeConfig.from_hf_config`` reads, and ``apply_rotary_`` against ``apply_rotary_pos_emb``."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import (
    apply_rotary_pos_emb as llama_apply_rotary_pos_emb,
)
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import (
    apply_rotary_pos_emb as phi3_apply_rotary_pos_emb,
)

from engine.models.rotary import (
    RopeConfig,
    RotaryEmbedding,
    apply_rotary_,
    rotary_dim,
    rotary_table,
)

SUPPORTED = "default, dynamic, linear, llama3, longrope, yarn"


def hf_cos_sin(module: torch.nn.Module, length: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' fp32 cos/sin [length, dim] for positions 0..length-1 of one sequence."""
    cos, sin = module(torch.zeros(1), torch.arange(length)[None], **kwargs)
    return cos[0], sin[0]


def ours(config: transformers.PreTrainedConfig, max_position: int, head_dim: int,
         layer_type: str | None = None) -> tuple[RopeConfig, torch.Tensor, torch.Tensor]:
    rope = RopeConfig.from_hf_config(config.to_dict(), layer_type)
    cos, sin = rotary_table(rope, rotary_dim(rope, head_dim), max_position)
    return rope, cos, sin


def llama(head_dim: int, max_position_embeddings: int, **rope_parameters
          ) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rope_parameters=rope_parameters)


# --- each rope type against its Hugging Face model's rotary class ---------------------------------

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(("name", "config", "length"), [
    ("default", llama(64, 4096, rope_type="default", rope_theta=10000.0), 2048),
    ("llama3 (Llama 3.1)", llama(128, 131072, **LLAMA3), 2048),
    ("linear x4", llama(64, 16384, rope_type="linear", rope_theta=10000.0, factor=4.0), 2048),
    ("yarn (Qwen2.5)", llama(128, 32768, rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                             original_max_position_embeddings=32768), 2048),
    ("yarn with mscale (DeepSeek)", llama(64, 163840, rope_type="yarn", rope_theta=10000.0,
                                          factor=40.0, mscale=0.707, mscale_all_dim=1.0,
                                          beta_fast=32, beta_slow=1,
                                          original_max_position_embeddings=4096), 1024),
    ("yarn with attention_factor", llama(64, 65536, rope_type="yarn", rope_theta=10000.0,
                                         factor=16.0, attention_factor=1.25,
                                         original_max_position_embeddings=4096), 1024),
])
def test_table_rows_equal_transformers(name, config, length):
    rope, cos, sin = ours(config, length, config.head_dim)
    hf_cos, hf_sin = hf_cos_sin(LlamaRotaryEmbedding(config), length)
    assert rope.rope_type == config.rope_parameters["rope_type"]
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.shape == sin.shape == (length, config.head_dim)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin), name


def test_llama3_scales_only_the_low_frequencies():
    config = llama(128, 131072, **LLAMA3)
    _, cos, _ = ours(config, 4096, 128)
    _, plain, _ = ours(llama(128, 131072, rope_type="default", rope_theta=500000.0), 4096, 128)
    assert torch.equal(cos[:, :16], plain[:, :16])  # wavelengths under 8192 / 4: untouched
    assert not torch.equal(cos[:, 50:64], plain[:, 50:64])  # over 8192: divided by 8


def test_yarn_attention_factors():
    qwen = RopeConfig(rope_type="yarn", theta=1e6, factor=4.0,
                      original_max_position_embeddings=32768)
    cos, _ = rotary_table(qwen, 128, 4)
    scale = 0.1 * math.log(4.0) + 1.0
    assert cos[0, 0].item() == pytest.approx(scale, rel=1e-7)  # cos(0) * mscale
    deepseek = RopeConfig(rope_type="yarn", theta=1e4, factor=40.0, mscale=1.0,
                          mscale_all_dim=1.0, original_max_position_embeddings=4096)
    assert rotary_table(deepseek, 64, 1)[0][0, 0].item() == 1.0  # equal terms cancel


def test_yarn_gpt_oss():
    config = transformers.GptOssConfig(
        hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096})
    rope, cos, sin = ours(config, 2048, 64)
    hf_cos, hf_sin = hf_cos_sin(GptOssRotaryEmbedding(config), 2048)
    assert rope.truncate is False and rope.beta_fast == 32.0
    assert hf_cos.shape == (2048, 32)  # gpt-oss keeps one half; ours repeats it
    assert torch.equal(cos[:, :32], hf_cos) and torch.equal(cos[:, 32:], hf_cos)
    assert torch.equal(sin[:, :32], hf_sin) and torch.equal(sin[:, 32:], hf_sin)
    truncated, _ = rotary_table(RopeConfig(**{**rope.__dict__, "truncate": True}), 64, 2048)
    assert not torch.equal(truncated, cos)


# --- length-dependent types: exact below the threshold, per position beyond it --------------------

def test_dynamic_ntk():
    config = llama(64, 1024, rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    rope, cos, sin = ours(config, 3000, 64)
    assert rope.max_position_embeddings == 1024
    hf_cos, hf_sin = hf_cos_sin(LlamaRotaryEmbedding(config), 1024)
    assert torch.equal(cos[:1024], hf_cos) and torch.equal(sin[:1024], hf_sin)
    plain, _ = rotary_table(RopeConfig(theta=10000.0), 64, 1024)
    assert torch.equal(cos[:1024], plain)  # short sequences are unscaled
    # Position L-1: HF's numbers for a sequence of L tokens. The lengths include some where a
    # vectorised pow of the base (fp32 exponent) would be one bit off.
    for length in (1025, 1039, 1092, 1130, *range(1200, 3001, 150)):
        hf_cos, hf_sin = hf_cos_sin(LlamaRotaryEmbedding(config), length)
        assert torch.equal(cos[length - 1], hf_cos[-1]), length
        assert torch.equal(sin[length - 1], hf_sin[-1]), length
    # Past the threshold HF rescales every position by the sequence's length, ours by position.
    hf_cos, _ = hf_cos_sin(LlamaRotaryEmbedding(config), 3000)
    assert not torch.equal(cos[1499], hf_cos[1499])


PHI3_SHORT = [1.0 + 0.01 * i for i in range(48)]
PHI3_LONG = [1.0 + 0.5 * i for i in range(48)]


def phi3(head_dim: int, partial: float, short: list[float], long: list[float]
         ) -> transformers.Phi3Config:
    return transformers.Phi3Config(
        hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        partial_rotary_factor=partial,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                         "long_factor": long, "partial_rotary_factor": partial})


@pytest.mark.parametrize(("head_dim", "partial"), [(96, 1.0), (64, 0.75)])
def test_longrope(head_dim, partial):
    """Phi-3-mini-128k's layout (head_dim 96, 48 factors); Phi-4-mini's partial rotary."""
    dim = int(head_dim * partial)
    config = phi3(head_dim, partial, PHI3_SHORT[:dim // 2], PHI3_LONG[:dim // 2])
    rope, cos, sin = ours(config, 6000, head_dim)
    assert (rope.original_max_position_embeddings, rope.max_position_embeddings) == (4096, 131072)
    assert cos.shape == (6000, dim)
    hf_cos, hf_sin = hf_cos_sin(Phi3RotaryEmbedding(config), 4096)
    assert torch.equal(cos[:4096], hf_cos) and torch.equal(sin[:4096], hf_sin)
    scale = math.sqrt(1 + math.log(131072 / 4096) / math.log(4096))
    assert cos[0, 0].item() == pytest.approx(scale, rel=1e-7)
    for length in (4097, 6000):  # long_factor from position 4096 on
        hf_cos, hf_sin = hf_cos_sin(Phi3RotaryEmbedding(config), length)
        assert torch.equal(cos[length - 1], hf_cos[-1]), length
        assert torch.equal(sin[length - 1], hf_sin[-1]), length
    assert not torch.equal(cos[4095], hf_cos[4095])  # HF: long factors for the whole sequence


def test_longrope_factor_count_must_match():
    rope = RopeConfig(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[1, 1] * 4,
                      original_max_position_embeddings=4096, max_position_embeddings=8192)
    assert rope.long_factor == (1.0,) * 8 and hash(rope) == hash(RopeConfig(**rope.__dict__))
    with pytest.raises(ValueError, match="longrope short_factor has 8 values; rotary_dim 32 "
                                         "needs 16"):
        rotary_table(rope, 32, 16)


# --- Gemma 3: per layer type ----------------------------------------------------------------------

GEMMA3_SHAPE = {"model_type": "gemma3_text", "head_dim": 32, "hidden_size": 128,
                "num_attention_heads": 4, "num_key_value_heads": 1, "num_hidden_layers": 6,
                "intermediate_size": 256, "vocab_size": 100, "max_position_embeddings": 131072}


def test_gemma3_per_layer_type():
    legacy = {**GEMMA3_SHAPE, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    config = transformers.Gemma3TextConfig(**legacy)
    written = config.to_dict()  # transformers 5.x: rope_parameters keyed by layer type
    assert set(written["rope_parameters"]) == {"sliding_attention", "full_attention"}
    module = Gemma3RotaryEmbedding(config)
    expect = {"sliding_attention": RopeConfig(theta=10000.0),
              "full_attention": RopeConfig(rope_type="linear", theta=1000000.0, factor=8.0)}
    for layer_type, rope in expect.items():
        assert RopeConfig.from_hf_config(written, layer_type) == rope
        assert RopeConfig.from_hf_config(legacy, layer_type) == rope
        cos, sin = rotary_table(rope, 32, 512)
        hf_cos, hf_sin = hf_cos_sin(module, 512, layer_type=layer_type)
        assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin), layer_type
    with pytest.raises(ValueError, match="per layer type .*pass the layer type"):
        RopeConfig.from_hf_config(written)
    with pytest.raises(ValueError, match="no rope parameters for layer type 'chunked'"):
        RopeConfig.from_hf_config(written, "chunked")


def test_gemma3_legacy_defaults():
    """No rope fields: Gemma3TextConfig.default_theta, 1e6 for full and 1e4 for sliding layers."""
    hf = transformers.Gemma3TextConfig(**GEMMA3_SHAPE).rope_parameters
    for layer_type in ("sliding_attention", "full_attention"):
        rope = RopeConfig.from_hf_config(dict(GEMMA3_SHAPE), layer_type)
        assert rope == RopeConfig(theta=hf[layer_type]["rope_theta"])
    assert RopeConfig.from_hf_config(dict(GEMMA3_SHAPE), "full_attention").theta == 1e6
    with pytest.raises(ValueError, match="pass the layer type"):
        RopeConfig.from_hf_config(dict(GEMMA3_SHAPE))


# --- from_hf_config: the other config.json forms --------------------------------------------------

def test_missing_rope_fields_mean_default_base_10000():
    assert RopeConfig.from_hf_config({}) == RopeConfig()
    assert RopeConfig.from_hf_config({"max_position_embeddings": 2048}) == RopeConfig(
        rope_type="default", theta=10000.0, partial_rotary_factor=1.0)
    assert transformers.LlamaConfig().rope_parameters["rope_theta"] == 10000.0


def test_legacy_rope_scaling_and_top_level_theta():
    linear = {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert RopeConfig.from_hf_config(linear) == RopeConfig(rope_type="linear", theta=500000.0,
                                                           factor=2.0)
    llama31 = {"rope_theta": 500000.0, "max_position_embeddings": 131072,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}
    rope = RopeConfig.from_hf_config(llama31)
    assert rope == RopeConfig.from_hf_config({"max_position_embeddings": 131072,
                                              "rope_parameters": LLAMA3})
    hf = transformers.LlamaConfig(**llama31).rope_parameters
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings) == (
        hf["rope_type"], hf["rope_theta"], hf["factor"], hf["original_max_position_embeddings"])
    dynamic = {"rope_theta": 10000, "max_position_embeddings": 2048,
               "rope_scaling": {"type": "dynamic", "factor": 2}}
    assert RopeConfig.from_hf_config(dynamic) == RopeConfig(
        rope_type="dynamic", theta=10000.0, factor=2.0, max_position_embeddings=2048)


def test_partial_rotary_factor_top_level_or_inside():
    top = {"partial_rotary_factor": 0.5, "rope_theta": 10000.0}
    inside = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5}}
    for cfg in (top, inside):
        rope = RopeConfig.from_hf_config(cfg)
        assert rope.partial_rotary_factor == 0.5
        assert rotary_dim(rope, 64) == 32 and rotary_dim(rope, 80) == 40
    assert transformers.LlamaConfig(**top).rope_parameters["partial_rotary_factor"] == 0.5


def test_phi3_original_max_position_and_old_type_names():
    cfg = {"model_type": "phi3", "max_position_embeddings": 131072,
           "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
           "rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                            "original_max_position_embeddings": 8192}}
    rope = RopeConfig.from_hf_config(cfg)
    assert rope.rope_type == "longrope"
    assert rope.original_max_position_embeddings == 4096  # the top level wins, as in HF
    assert rope.short_factor == (1.0,) * 4 and rope.long_factor == (2.0,) * 4
    with pytest.raises(ValueError, match="rope type 'su' is not supported"):
        RopeConfig.from_hf_config({**cfg, "model_type": "llama"})


@pytest.mark.parametrize("rope_type", ["foo", "proportional", "mrope"])
def test_unsupported_type_is_one_clear_line(rope_type):
    expected = f"rope type '{rope_type}' is not supported; supported: {SUPPORTED}"
    for cfg in ({"rope_parameters": {"rope_type": rope_type, "rope_theta": 1e4}},
                {"rope_scaling": {"type": rope_type, "factor": 2.0}}):
        with pytest.raises(ValueError) as raised:
            RopeConfig.from_hf_config(cfg)
        assert str(raised.value) == expected


def test_missing_parameters_are_named():
    with pytest.raises(ValueError, match="^rope type 'linear' needs factor$"):
        RopeConfig.from_hf_config({"rope_scaling": {"type": "linear"}})
    with pytest.raises(ValueError, match="rope type 'dynamic' needs max_position_embeddings"):
        RopeConfig.from_hf_config({"rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="rotary_dim must be a positive even number, got 7"):
        rotary_table(RopeConfig(), 7, 4)


# --- the module and the rotation ------------------------------------------------------------------

def test_rotary_embedding_module_on_cpu_inside_meta_context():
    rope = RopeConfig(rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192)
    with torch.device("meta"):
        module = RotaryEmbedding(rope, 64, 100)
    assert module.cos.device.type == "cpu" and module.sin.device.type == "cpu"
    assert module.state_dict() == {}  # non-persistent: never read from a checkpoint
    table_cos, table_sin = rotary_table(rope, 64, 100)
    positions = torch.tensor([0, 7, 99, 7])
    cos, sin = module.cos_sin(positions, torch.bfloat16)
    assert cos.shape == sin.shape == (4, 1, 64) and cos.dtype == torch.bfloat16
    assert torch.equal(cos[:, 0], table_cos[positions].to(torch.bfloat16))
    assert torch.equal(sin[:, 0], table_sin[positions].to(torch.bfloat16))


def hf_rotated(apply, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's layout: q [batch, heads, seq, head_dim], cos [batch, seq, dim]."""
    q = x.permute(1, 0, 2)[None]
    out, _ = apply(q, q, cos[:, 0][None], sin[:, 0][None])
    return out[0].permute(1, 0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("partial", "apply"), [(1.0, llama_apply_rotary_pos_emb),
                                                (0.75, phi3_apply_rotary_pos_emb)])
def test_apply_rotary_matches_apply_rotary_pos_emb(partial, apply, dtype):
    t, heads, head_dim = 5, 3, 64
    rope = RopeConfig(theta=10000.0, partial_rotary_factor=partial)
    module = RotaryEmbedding(rope, rotary_dim(rope, head_dim), 4096)
    cos, sin = module.cos_sin(torch.tensor([0, 1, 17, 1000, 4095]), dtype)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (heads + 2) * head_dim, generator=gen).to(dtype)  # q, then k and v
    before = qkv.clone()
    x = qkv[:, :heads * head_dim].view(t, heads, head_dim)  # strided: rows of the wider qkv
    assert not x.is_contiguous()
    before_x = x.clone()
    expect = hf_rotated(apply, x.clone(), cos, sin)
    apply_rotary_(x, cos, sin)
    assert torch.equal(x, expect)
    assert torch.equal(qkv[:, heads * head_dim:], before[:, heads * head_dim:])  # k, v untouched
    dim = cos.shape[-1]
    assert dim == int(head_dim * partial)
    assert torch.equal(x[..., dim:], before_x[..., dim:])  # the pass-through features
    assert not torch.equal(x[1:, :, :dim], before_x[1:, :, :dim])  # position 0 is the identity


@pytest.mark.parametrize("rope", [
    RopeConfig(rope_type="dynamic", factor=2.0, max_position_embeddings=16),
    RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    RopeConfig(rope_type="longrope", short_factor=(1.0,) * 4, long_factor=(2.0,) * 4,
               original_max_position_embeddings=16, max_position_embeddings=64),
], ids=lambda rope: rope.rope_type)
def test_tables_are_built_on_the_cpu_inside_a_meta_context(rope):
    expect = rotary_table(rope, 8, 40)
    with torch.device("meta"):
        cos, sin = rotary_table(rope, 8, 40)
    assert cos.device.type == sin.device.type == "cpu"
    assert torch.equal(cos, expect[0]) and torch.equal(sin, expect[1])
