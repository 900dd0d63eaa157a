"""Mixtral: the Mistral layer with a mixture of experts for its MLP (softmax over all experts
in fp32, top k, renormalised: transformers' ``MixtralTopKRouter``); experts ``w1`` (gate),
``w3`` (up), ``w2`` (down) under ``block_sparse_moe``."""

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
    """The spec of a ``MixtralForCausalLM``.

    Raises:
        UnsupportedFeatureError: a rope type, activation or layer type we do not implement.
    """
    hf = hf_fields(cfg)
    rope = rope_of(cfg)
    act = activation_of(cfg, {"silu": "silu"})
    moe = MoESpec(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                  intermediate_size=cfg.intermediate_size, renormalize=True,
                  router="block_sparse_moe.gate", expert="block_sparse_moe.experts.{e}.",
                  gate="w1", up="w3", down="w2", weights_in_activation_dtype=False)
    layers = tuple(LayerSpec(rope=rope, sliding_window=window_of(cfg, t),
                             scale=cfg.head_dim ** -0.5, activation=act, moe=moe)
                   for t in layer_types(cfg, lambda i: True))
    return DecoderSpec(layers=layers, rotary_dim=rotary_dim(rope, cfg.head_dim))
