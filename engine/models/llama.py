"""Llama-family decoders: Llama 2 and 3.x, SmolLM2, Mistral, Qwen2 / Qwen2.5.

Pre-norm RMSNorm, rotary (any scaling ``engine.models.rotary`` implements: Llama 3.1's
``llama3``, ``yarn`` for Qwen2.5's long context), grouped-query attention, SwiGLU, optional
tied embeddings and q/k/v bias (Qwen2). Mistral's ``sliding_window`` applies to every layer;
Qwen2's to the layers ``layer_types`` marks sliding (transformers' rules for each).
"""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.rotary import rotary_dim
from engine.models.spec import (
    DecoderSpec,
    LayerSpec,
    activation_of,
    hf_fields,
    layer_types,
    rope_of,
    window_of,
)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    """The spec of a ``LlamaForCausalLM``, ``MistralForCausalLM`` or ``Qwen2ForCausalLM``.

    Raises:
        UnsupportedFeatureError: a rope type, activation or layer type we do not implement.
    """
    hf = hf_fields(cfg)
    rope = rope_of(cfg)
    act = activation_of(cfg, {"silu": "silu"})
    mistral = hf.get("model_type") == "mistral" or cfg.architecture == "MistralForCausalLM"
    types = layer_types(cfg, sliding_everywhere=mistral)
    mlp_bias = bool(hf.get("mlp_bias", False))
    layers = tuple(LayerSpec(rope=rope, sliding_window=window_of(cfg, t),
                             scale=cfg.head_dim ** -0.5, activation=act,
                             attention_bias=cfg.attention_bias,
                             o_bias=cfg.attention_bias and hf.get("model_type") == "llama",
                             mlp_bias=mlp_bias)
                   for t in types)
    return DecoderSpec(layers=layers, rotary_dim=rotary_dim(rope, cfg.head_dim))
