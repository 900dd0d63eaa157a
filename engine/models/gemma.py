"""Gemma 2 and Gemma 3 (text): four RMSNorms a layer (before and after attention and the MLP)
that scale by ``1 + w``, GeGLU with the tanh GELU, embeddings times sqrt(hidden_size), the
softmax scale ``query_pre_attn_scalar ** -0.5``, sliding-window layers alternating with global
ones (``layer_types``); Gemma 2 soft-caps attention scores and the final logits, Gemma 3 norms
each q/k head instead and gives its sliding layers their own rotary base (transformers'
``Gemma2DecoderLayer``, ``Gemma3DecoderLayer``)."""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.rotary import rotary_dim
from engine.models.spec import (
    DecoderSpec,
    LayerSpec,
    activation_of,
    hf_fields,
    layer_types,
    require,
    rope_of,
    window_of,
)

_GELU_TANH = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    """The spec of a ``Gemma2ForCausalLM`` or ``Gemma3ForCausalLM`` (text only).

    Raises:
        UnsupportedFeatureError: a rope type, activation or layer type we do not implement.
    """
    hf = hf_fields(cfg)
    gemma3 = cfg.architecture == "Gemma3ForCausalLM"
    act = activation_of(cfg, _GELU_TANH, key="hidden_activation", default="gelu_pytorch_tanh")
    require(not hf.get("use_bidirectional_attention"), "bidirectional attention")
    scale = float(hf.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5
    attn_cap = hf.get("attn_logit_softcapping")
    if gemma3:  # transformers: every ``sliding_window_pattern``-th layer is global
        pattern = hf.get("sliding_window_pattern", 6)
        types = layer_types(cfg, lambda i: (i + 1) % pattern != 0)
    else:  # Gemma 2: sliding and global alternate
        types = layer_types(cfg, lambda i: (i + 1) % 2 != 0)
    layers = []
    for t in types:
        rope = rope_of(cfg, t if gemma3 else None)
        layers.append(LayerSpec(
            rope=rope, attn_in_norm="input_layernorm", attn_out_norm="post_attention_layernorm",
            mlp_in_norm="pre_feedforward_layernorm", mlp_out_norm="post_feedforward_layernorm",
            qk_norm="head" if gemma3 else None, sliding_window=window_of(cfg, t),
            logit_softcap=attn_cap, scale=scale, activation=act,
            attention_bias=cfg.attention_bias, o_bias=cfg.attention_bias))
    return DecoderSpec(layers=tuple(layers), rotary_dim=rotary_dim(layers[0].rope, cfg.head_dim),
                       norm_offset=1.0, norm_in_fp32=True, embedding_scale=cfg.hidden_size ** 0.5,
                       final_logit_softcap=hf.get("final_logit_softcapping"))
