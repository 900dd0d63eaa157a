"""OLMo 2: no norm before attention or the MLP; an RMSNorm on each sublayer's output before its
residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``) and one over the
whole q and k projections before the rotation (transformers' ``Olmo2DecoderLayer``)."""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.rotary import rotary_dim
from engine.models.spec import DecoderSpec, LayerSpec, activation_of, rope_of


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    """The spec of an ``Olmo2ForCausalLM``.

    Raises:
        UnsupportedFeatureError: a rope type or activation we do not implement.
    """
    rope = rope_of(cfg)
    act = activation_of(cfg, {"silu": "silu"})
    layers = tuple(LayerSpec(rope=rope, attn_in_norm=None, attn_out_norm="post_attention_layernorm",
                             mlp_in_norm=None, mlp_out_norm="post_feedforward_layernorm",
                             qk_norm="full", scale=cfg.head_dim ** -0.5, activation=act,
                             attention_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
                   for _ in range(cfg.num_hidden_layers))
    return DecoderSpec(layers=layers, rotary_dim=rotary_dim(rope, cfg.head_dim),
                       norm_in_fp32=True)
