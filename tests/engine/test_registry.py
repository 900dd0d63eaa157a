"""Model registry: Hugging Face ``architectures`` -> our model class; clear errors otherwise."""

from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.config import ModelConfig
from engine.models.registry import (
    UnsupportedArchitectureError,
    get_model_class,
    resolve_architecture,
    supported_architectures,
)

BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def test_supported_architectures():
    assert supported_architectures() == ("LlamaForCausalLM", "MistralForCausalLM",
                                         "Qwen2ForCausalLM")


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


def test_get_model_class():
    from engine.models.llama import LlamaForCausalLM

    assert get_model_class("MistralForCausalLM") is LlamaForCausalLM
    with pytest.raises(UnsupportedArchitectureError, match="supported: LlamaForCausalLM"):
        get_model_class("Nope")


def test_engine_refuses_an_unknown_architecture_before_loading_anything(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["BertModel"],
                                                      "model_type": "bert"}))
    with pytest.raises(ValueError, match=r"unsupported model architecture 'BertModel' "
                                         r"\(model_type 'bert'\); supported: LlamaForCausalLM, "
                                         "MistralForCausalLM, Qwen2ForCausalLM"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu"), tokenizer=object())
