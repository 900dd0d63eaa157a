"""Granite (3.x dense): the Llama layer with four scalars (transformers' ``GraniteModel``):
embeddings times ``embedding_multiplier``, the softmax scale ``attention_multiplier``, each
sublayer's output times ``residual_multiplier`` before its residual add, and logits divided by
``logits_scaling``."""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.rotary import rotary_dim
from engine.models.spec import DecoderSpec, LayerSpec, activation_of, hf_fields, rope_of


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    """The spec of a ``GraniteForCausalLM``.

    Raises:
        UnsupportedFeatureError: a rope type or activation we do not implement.
    """
    hf = hf_fields(cfg)
    rope = rope_of(cfg)
    act = activation_of(cfg, {"silu": "silu"})
    bias = cfg.attention_bias
    mlp_bias = bool(hf.get("mlp_bias", False))
    layers = tuple(LayerSpec(rope=rope, scale=float(hf.get("attention_multiplier", 1.0)),
                             activation=act, attention_bias=bias, o_bias=bias, mlp_bias=mlp_bias)
                   for _ in range(cfg.num_hidden_layers))
    return DecoderSpec(layers=layers, rotary_dim=rotary_dim(rope, cfg.head_dim),
                       embedding_scale=float(hf.get("embedding_multiplier", 1.0)),
                       residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                       logits_divisor=float(hf.get("logits_scaling", 1.0)))
