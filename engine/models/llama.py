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
    if cfg.architecture == "MistralForCausalLM":  # every layer slides
        types = layer_types(cfg, lambda i: True)
    elif cfg.architecture == "Qwen2ForCausalLM":  # from layer max_window_layers on
        first = hf.get("max_window_layers", 28)
        types = layer_types(cfg, lambda i: i >= first)
    else:
        types = layer_types(cfg)
    # transformers: Llama's q/k/v/o and MLP take the config's biases; Mistral has none; Qwen2
    # always has q/k/v biases and no others.
    llama = cfg.architecture == "LlamaForCausalLM"
    qkv_bias = cfg.architecture == "Qwen2ForCausalLM" or (llama and cfg.attention_bias)
    o_bias = llama and cfg.attention_bias
    mlp_bias = llama and bool(hf.get("mlp_bias", False))
    layers = tuple(LayerSpec(rope=rope, sliding_window=window_of(cfg, t),
                             scale=cfg.head_dim ** -0.5, activation=act,
                             attention_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias)
                   for t in types)
    return DecoderSpec(layers=layers, rotary_dim=rotary_dim(rope, cfg.head_dim))
