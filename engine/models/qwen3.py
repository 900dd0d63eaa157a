"""Qwen3 and Qwen3-MoE: the Llama layer with an RMSNorm over each query and key head before
the rotation (transformers' ``Qwen3Attention``); Qwen3-MoE's MLPs are mixtures of experts
(softmax over all experts, top k, renormalised where ``norm_topk_prob``) except on the layers
``mlp_only_layers`` and ``decoder_sparse_step`` leave dense."""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.rotary import rotary_dim
from engine.models.spec import (
    DecoderSpec,
    LayerSpec,
    MoESpec,
    activation_of,
    hf_fields,
    layer_types,
    rope_of,
    window_of,
)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    """The spec of a ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM``.

    Raises:
        UnsupportedFeatureError: a rope type, activation or layer type we do not implement.
    """
    hf = hf_fields(cfg)
    rope = rope_of(cfg)
    act = activation_of(cfg, {"silu": "silu"})
    moe_layers: set[int] = set()
    moe = None
    if cfg.architecture == "Qwen3MoeForCausalLM":
        step = hf.get("decoder_sparse_step", 1) or 1
        dense = set(hf.get("mlp_only_layers") or ())
        experts = hf.get("num_experts", hf.get("num_local_experts"))  # older files: num_experts
        moe = MoESpec(num_experts=experts, top_k=hf["num_experts_per_tok"],
                      intermediate_size=hf["moe_intermediate_size"],
                      renormalize=bool(hf.get("norm_topk_prob", False)))
        if moe.num_experts > 0:
            moe_layers = {i for i in range(cfg.num_hidden_layers)
                          if i not in dense and (i + 1) % step == 0}
    if moe is not None:  # Qwen3-MoE: every layer slides where the window is on
        types = layer_types(cfg, lambda i: True)
    else:  # Qwen3: from layer max_window_layers on
        first = hf.get("max_window_layers", 28)
        types = layer_types(cfg, lambda i: i >= first)
    layers = tuple(LayerSpec(rope=rope, sliding_window=window_of(cfg, t), qk_norm="head",
                             scale=cfg.head_dim ** -0.5, activation=act,
                             attention_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                             moe=moe if i in moe_layers else None)
                   for i, t in enumerate(types))
    return DecoderSpec(layers=layers, rotary_dim=rotary_dim(rope, cfg.head_dim))
