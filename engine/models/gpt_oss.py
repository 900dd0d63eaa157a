"""gpt-oss: q/k/v/o with biases, a learned attention sink per head, sliding-window layers
alternating with full ones, yarn rotary, and a mixture of experts whose router has a bias,
takes the top k logits before its softmax, and whose experts (biased, stored as 3-D tensors with
gate and up interleaved) run a clamped SwiGLU (transformers' ``GptOssExperts``). Checkpoints in
bf16/fp32 load; the released MXFP4 expert weights are not a format we read yet."""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.rotary import rotary_dim
from engine.models.spec import (
    DecoderSpec,
    LayerSpec,
    MoESpec,
    hf_fields,
    layer_types,
    require,
    rope_of,
    window_of,
)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    """The spec of a ``GptOssForCausalLM``.

    Raises:
        UnsupportedFeatureError: a rope type / layer type / SwiGLU constant we do not
            implement.
    """
    hf = hf_fields(cfg)
    # (Its released MXFP4 weights carry a quantization_config, which ModelConfig refuses.)
    require(float(hf.get("swiglu_limit", 7.0)) == 7.0, "a swiglu_limit other than 7.0")
    require(float(hf.get("swiglu_alpha", 1.702)) == 1.702, "a swiglu_alpha other than 1.702")
    rope = rope_of(cfg)
    moe = MoESpec(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                  intermediate_size=cfg.intermediate_size, routing="topk_softmax",
                  renormalize=False, router="mlp.router", router_bias=True,
                  expert="mlp.experts.{e}", packed=True)
    bias = bool(hf.get("attention_bias", True))
    layers = tuple(LayerSpec(rope=rope, sliding_window=window_of(cfg, t), sinks=True,
                             scale=cfg.head_dim ** -0.5, activation="swiglu_oai", moe=moe,
                             attention_bias=bias, o_bias=bias)
                   for t in layer_types(cfg, lambda i: (i + 1) % 2 != 0))
    return DecoderSpec(layers=layers, rotary_dim=rotary_dim(rope, cfg.head_dim))
