"""Model registry: Hugging Face ``architectures`` -> our model class; clear errors otherwise."""

from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.config import ModelConfig
from engine.models.registry import (
    UnsupportedArchitectureError,
    model_file,
    resolve_architecture,
    supported_architectures,
)

BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def test_supported_architectures():
    assert supported_architectures() == (
        "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM",
        "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Olmo2ForCausalLM",
        "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
        "SmolLM3ForCausalLM")


@pytest.mark.parametrize("cfg,arch", [
    ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, "Qwen2ForCausalLM"),
    ({"architectures": ["SomethingElse", "MistralForCausalLM"]}, "MistralForCausalLM"),
    ({"model_type": "mistral"}, "MistralForCausalLM"),
    ({"architectures": ["MyLlamaVariantForCausalLM"], "model_type": "llama"},
     "LlamaForCausalLM"),
    ({}, "LlamaForCausalLM"),  # transformers' LlamaConfig defaults
])
def test_resolve_architecture(cfg, arch):
    assert resolve_architecture(cfg) == arch


@pytest.mark.parametrize("cfg,named", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"model_type": "gpt2"}, "gpt2"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
     "DeepseekV3ForCausalLM"),
])
def test_unknown_architecture_names_the_supported_ones(cfg, named):
    with pytest.raises(UnsupportedArchitectureError) as e:
        resolve_architecture(cfg)
    msg = str(e.value)
    assert repr(named) in msg
    assert all(a in msg for a in supported_architectures())
    assert isinstance(e.value, ValueError)


def test_model_config_carries_the_architecture_and_qwen2_bias():
    qwen = ModelConfig.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"],
                                       "model_type": "qwen2"})
    assert (qwen.architecture, qwen.attention_bias, qwen.head_dim) == ("Qwen2ForCausalLM",
                                                                       True, 8)
    llama = ModelConfig.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"]})
    assert (llama.architecture, llama.attention_bias) == ("LlamaForCausalLM", False)
    assert llama.kv_bytes_per_block(16, 4) == 2 * 1 * 16 * 2 * 8 * 4


def test_model_file_names_the_family_module():
    assert model_file("Qwen3MoeForCausalLM") == "engine.models.qwen3"
    with pytest.raises(UnsupportedArchitectureError, match="supported: Gemma2ForCausalLM"):
        model_file("Nope")


def test_engine_refuses_an_unknown_architecture_before_loading_anything(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["BertModel"],
                                                      "model_type": "bert"}))
    with pytest.raises(ValueError, match=r"unsupported model architecture 'BertModel' "
                                         r"\(model_type 'bert'\); supported: Gemma2ForCausalLM, "
                                         "Gemma3ForCausalLM, GptOssForCausalLM"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu"), tokenizer=object())


@pytest.mark.parametrize("extra,named", [
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
     ("rope type 'proportional' is not supported; supported: default, dynamic, linear, llama3, "
     "longrope, yarn")),
    ({"hidden_act": "relu"}, ("hidden_act 'relu' is not supported for LlamaForCausalLM; "
                             "supported: silu")),
    ({"layer_types": ["chunked_attention"]}, "layer type 'chunked_attention' is not supported"),
])
def test_an_unsupported_feature_stops_the_start_with_one_line(tmp_path, extra, named):
    """A rope type, activation or attention kind we do not implement is refused before any
    weight is read, in one line naming it: never a wrong answer."""
    from engine.models.spec import UnsupportedFeatureError

    cfg = {**BASE, "architectures": ["LlamaForCausalLM"], **extra}
    with pytest.raises(UnsupportedFeatureError) as e:
        ModelConfig.from_hf_config(cfg)
    assert str(e.value) == named and "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu"), tokenizer=object())


@pytest.mark.parametrize("arch,model_type,method", [
    ("GptOssForCausalLM", "gpt_oss", "mxfp4"), ("Qwen3ForCausalLM", "qwen3", "fp8"),
    ("LlamaForCausalLM", "llama", "bitsandbytes"), ("MistralForCausalLM", "mistral", "gptq")])
def test_pre_quantized_weights_are_refused_by_name(arch, model_type, method):
    """Loading a quantized checkpoint's codes as floats would serve garbage: refused, named."""
    from engine.models.config import UnsupportedQuantizationError

    cfg = {**BASE, "architectures": [arch], "model_type": model_type, "num_local_experts": 4,
           "num_experts_per_tok": 2, "quantization_config": {"quant_method": method}}
    with pytest.raises(UnsupportedQuantizationError, match=f"quantized as '{method}'"):
        ModelConfig.from_hf_config(cfg)
    assert ModelConfig.from_hf_config({**cfg, "quantization_config": None}).architecture == arch


@pytest.mark.parametrize("archs", [["Qwen2ForSequenceClassification"], ["MistralModel"],
                                   ["LlamaForTokenClassification"]])
def test_a_head_that_is_not_a_language_model_is_not_served_as_one(archs):
    with pytest.raises(UnsupportedArchitectureError, match=repr(archs[0])):
        resolve_architecture({"architectures": archs, "model_type": "qwen2"})


def test_missing_fields_take_the_familys_defaults_as_transformers_does():
    """A config.json written by older tools often leaves fields out; each means what the
    family's transformers config class says, not a generic default (a Gemma 2 without
    layer_types still alternates its windows, a Gemma 3 in the older rope form still starts)."""
    gemma2 = ModelConfig.from_hf_config({**BASE, "num_hidden_layers": 4, "head_dim": 8,
                                         "architectures": ["Gemma2ForCausalLM"],
                                         "model_type": "gemma2"})
    assert [layer.sliding_window for layer in gemma2.spec.layers] == [4096, None] * 2
    assert gemma2.spec.final_logit_softcap == 30.0 and gemma2.spec.layers[0].logit_softcap == 50
    assert gemma2.rms_norm_eps == 1e-6 and gemma2.tie_word_embeddings
    gemma3 = ModelConfig.from_hf_config({**BASE, "num_hidden_layers": 6, "head_dim": 8,
                                         "architectures": ["Gemma3ForCausalLM"],
                                         "model_type": "gemma3_text", "rope_theta": 1e6,
                                         "rope_local_base_freq": 1e4})
    windows = [layer.sliding_window for layer in gemma3.spec.layers]
    assert windows == [4096] * 5 + [None]
    assert [layer.rope.theta for layer in gemma3.spec.layers] == [1e4] * 5 + [1e6]
    mixtral = ModelConfig.from_hf_config({**BASE, "architectures": ["MixtralForCausalLM"],
                                          "model_type": "mixtral", "num_local_experts": 4,
                                          "num_experts_per_tok": 2})
    assert (mixtral.rms_norm_eps, mixtral.spec.layers[0].rope.theta) == (1e-5, 1e6)
    qwen2 = ModelConfig.from_hf_config({**BASE, "num_hidden_layers": 30,
                                        "architectures": ["Qwen2ForCausalLM"],
                                        "model_type": "qwen2", "use_sliding_window": True})
    assert [layer.sliding_window for layer in qwen2.spec.layers] == [None] * 28 + [4096] * 2
    mistral = ModelConfig.from_hf_config({**BASE, "architectures": ["MistralForCausalLM"],
                                          "model_type": "mistral"})
    assert mistral.spec.layers[0].sliding_window == 4096  # the key missing: 4096
    v03 = ModelConfig.from_hf_config({**BASE, "architectures": ["MistralForCausalLM"],
                                      "model_type": "mistral", "sliding_window": None})
    assert v03.spec.layers[0].sliding_window is None  # an explicit null: no window
    assert ModelConfig.from_hf_config({**BASE, "num_key_value_heads": None}).num_key_value_heads \
        == BASE["num_attention_heads"]
