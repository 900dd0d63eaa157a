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
    ({"architectures": ["MyLlamaVariant"], "model_type": "llama"}, "LlamaForCausalLM"),
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


def test_gpt_oss_mxfp4_weights_are_refused_by_name():
    from engine.models.spec import UnsupportedFeatureError

    cfg = {**BASE, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
           "num_local_experts": 4, "num_experts_per_tok": 2,
           "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(UnsupportedFeatureError, match="quantized as 'mxfp4'"):
        ModelConfig.from_hf_config(cfg)
