"""Phi-3 and Phi-4 (text): the Llama layer with q/k/v and gate/up stored fused in the checkpoint
(``qkv_proj``, ``gate_up_proj``), ``longrope`` scaling for the long-context models, a partial
rotary factor (Phi-4-mini rotates 3/4 of each head) and an optional sliding window on every
layer (transformers' ``Phi3Attention``)."""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.rotary import rotary_dim
from engine.models.spec import (
    DecoderSpec,
    LayerSpec,
    activation_of,
    layer_types,
    rope_of,
    window_of,
)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    """The spec of a ``Phi3ForCausalLM``.

    Raises:
        UnsupportedFeatureError: a rope type, activation or layer type we do not implement.
    """
    rope = rope_of(cfg)
    act = activation_of(cfg, {"silu": "silu"})
    layers = tuple(LayerSpec(rope=rope, sliding_window=window_of(cfg, t),
                             scale=cfg.head_dim ** -0.5, activation=act,
                             qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",))
                   for t in layer_types(cfg, lambda i: True))
    return DecoderSpec(layers=layers, rotary_dim=rotary_dim(rope, cfg.head_dim))
