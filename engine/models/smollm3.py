"""SmolLM3: the Llama layer, without rotary on the layers ``no_rope_layers`` marks 0 (every
fourth: transformers' ``SmolLM3Attention.use_rope``)."""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.rotary import rotary_dim
from engine.models.spec import (
    DecoderSpec,
    LayerSpec,
    UnsupportedFeatureError,
    activation_of,
    hf_fields,
    layer_types,
    rope_of,
    window_of,
)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    """The spec of a ``SmolLM3ForCausalLM``.

    Raises:
        UnsupportedFeatureError: a rope type, activation or layer type we do not implement.
    """
    hf = hf_fields(cfg)
    rope = rope_of(cfg)
    act = activation_of(cfg, {"silu": "silu"})
    n = cfg.num_hidden_layers
    use_rope = hf.get("no_rope_layers")
    if use_rope is None:  # transformers' default: every fourth layer without rotary
        interval = hf.get("no_rope_layer_interval", 4)
        use_rope = [int((i + 1) % interval != 0) for i in range(n)]
    if len(use_rope) != n:
        raise UnsupportedFeatureError(f"no_rope_layers has {len(use_rope)} entries for {n} "
                                      "layers")
    bias = cfg.attention_bias
    layers = tuple(LayerSpec(rope=rope if use_rope[i] else None,
                             sliding_window=window_of(cfg, t), scale=cfg.head_dim ** -0.5,
                             activation=act, attention_bias=bias, o_bias=bias,
                             mlp_bias=bool(hf.get("mlp_bias", False)))
                   for i, t in enumerate(layer_types(cfg, lambda i: not use_rope[i])))
    return DecoderSpec(layers=layers, rotary_dim=rotary_dim(rope, cfg.head_dim))
