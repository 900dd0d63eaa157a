"""A decoder declared as data: what each architecture's layer is made of (torch-free).

Every architecture we serve is one ``DecoderSpec``, built from its Hugging Face ``config.json``
by a function in its model file (``engine/models/llama.py``, ``qwen3.py``, ...), and executed by
one implementation (``engine.models.decoder.DecoderForCausalLM``). The fields name the choices
the families make (after vLLM's per-family model files and Hugging Face's modeling code):

- norms: which RMSNorms a layer has and where (before or after attention and the MLP), and
  whether the checkpoint's weight ``w`` scales as ``w`` (Llama) or ``1 + w`` (Gemma);
- q/k norm: RMSNorm of each query/key head (Qwen3, Gemma 3) or of the whole q/k projection
  (OLMo 2), before the rotation;
- rotary: on or off per layer (SmolLM3's no-rope layers), its scaling, its share of the head;
- attention: full or a sliding window of W tokens, logit soft-capping, per-head sinks, the
  softmax scale;
- MLP: SwiGLU, GeGLU (tanh GELU), or a mixture of experts (router, top-k, renormalisation);
- model: embedding scale, residual multiplier, final-logit soft-cap and scale, tied head.

A path that cannot run a declaration (our fused CPU decode runs only the plain Llama layer)
leaves it to the per-op path; ``DecoderSpec.fused_decode_blockers`` says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from engine.models.rotary import RopeConfig

if TYPE_CHECKING:
    from engine.models.config import ModelConfig

Activation = Literal["silu", "gelu_tanh", "swiglu_oai"]


class UnsupportedFeatureError(ValueError):
    """A checkpoint asks for a feature of its architecture that we do not implement; the
    message names it (one line: it stops the start, never a wrong answer)."""


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss).

    Attributes:
        num_experts: experts per layer.
        top_k: experts per token.
        routing: ``softmax_topk`` (softmax over all experts in fp32, then the top k: Mixtral,
            Qwen3-MoE) or ``topk_softmax`` (top k logits, then softmax over them: gpt-oss).
        renormalize: divide the top-k weights by their sum (Mixtral always; Qwen3-MoE's
            ``norm_topk_prob``).
        router: the router's weight name under the layer, without ``.weight``.
        router_bias: the router has a bias (gpt-oss).
        expert: the name of expert ``e``'s weights, a format string with ``{e}``.
        gate, up, down: the projections' names under an expert (gate and up may be one fused
            tensor, ``gate_up``).
        intermediate_size: each expert's MLP width.
        weights_in_activation_dtype: the routing weights are cast to the activations' dtype
            before they scale the experts' outputs (Qwen3-MoE); else they stay fp32 (Mixtral).
        packed: the experts are stored as 3-D tensors ``{expert}gate_up_proj`` [E, hidden,
            2 * I] with gate and up columns interleaved, ``{expert}down_proj`` [E, I, hidden]
            and their ``_bias`` (gpt-oss), not one set of 2-D weights per expert.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: Literal["softmax_topk", "topk_softmax"] = "softmax_topk"
    renormalize: bool = True
    router: str = "mlp.gate"
    router_bias: bool = False
    expert: str = "mlp.experts.{e}."
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    weights_in_activation_dtype: bool = True
    packed: bool = False


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer.

    Attributes:
        attn_in_norm, attn_out_norm, mlp_in_norm, mlp_out_norm: the checkpoint name (under the
            layer) of the RMSNorm before attention, after it (on its output, before the
            residual add), before the MLP and after it; None where the layer has none.
            Llama: ``input_layernorm`` and ``post_attention_layernorm`` (before the MLP);
            Gemma: all four; OLMo 2: only the two after.
        qk_norm: None, ``head`` (one RMSNorm of head_dim over each q and k head) or ``full``
            (one over the whole q and k projections); before the rotation.
        rope: the layer's rotary embedding, or None for a layer without one (SmolLM3).
        sliding_window: the layer attends to its last W tokens only, or None (all).
        logit_softcap: attention scores become ``c * tanh(s / c)`` (Gemma 2), or None.
        sinks: the layer has a learned per-head attention sink (gpt-oss).
        scale: the softmax scale.
        activation: the MLP's gate activation.
        moe: the layer's MLP is a mixture of experts, or None (a dense MLP).
        qkv: checkpoint names of q, k, v (fused into one projection at load), or one name
            for a checkpoint that stores them fused (Phi-3).
        gate_up: the same for the MLP's gate and up projections.
        attention_bias: q/k/v have biases (Qwen2); ``o_bias`` the output projection too.
        mlp_bias: the dense MLP's projections have biases.
    """

    rope: RopeConfig | None
    attn_in_norm: str | None = "input_layernorm"
    attn_out_norm: str | None = None
    mlp_in_norm: str | None = "post_attention_layernorm"
    mlp_out_norm: str | None = None
    qk_norm: Literal["head", "full"] | None = None
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: bool = False
    scale: float = 1.0
    activation: Activation = "silu"
    moe: MoESpec | None = None
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    o: str = "self_attn.o_proj"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    down: str = "mlp.down_proj"
    attention_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    sinks_name: str = "self_attn.sinks"


@dataclass(frozen=True)
class DecoderSpec:
    """A whole decoder.

    Attributes:
        layers: one ``LayerSpec`` per layer.
        norm_offset: 1.0 where norms scale by ``1 + w`` (Gemma), else 0.0.
        norm_in_fp32: the norms multiply by their weight in fp32 and round once (Gemma's
            ``(x * (1 + w.float())).type_as(x)``, OLMo 2's ``(w * x_fp32).to(dtype)``), which
            differs from Llama's order under bf16 activations.
        embedding_scale: the embeddings are multiplied by it (Gemma: sqrt(hidden); Granite's
            ``embedding_multiplier``), or None.
        residual_multiplier: each sublayer's output is multiplied by it before the residual add
            (Granite), or 1.0.
        final_logit_softcap: logits become ``c * tanh(l / c)`` (Gemma 2), or None.
        logits_divisor: logits are divided by it (Granite's ``logits_scaling``), or 1.0.
        rotary_dim: the features of each head that rotate (``head_dim`` unless a partial
            rotary factor says fewer: Phi-4-mini).
        prefix: where the decoder's weights sit in the checkpoint (``model.``).
    """

    layers: tuple[LayerSpec, ...]
    rotary_dim: int
    norm_offset: float = 0.0
    norm_in_fp32: bool = False
    embedding_scale: float | None = None
    residual_multiplier: float = 1.0
    final_logit_softcap: float | None = None
    logits_divisor: float = 1.0
    prefix: str = "model."

    def fused_decode_blockers(self, head_dim: int, max_position: int) -> list[str]:
        """Why our fused CPU decode (``kernels/cpu/decode_layer.cpp``: the Llama layer) cannot
        run this decoder, in words; empty when it can. A sliding window at least
        ``max_position`` tokens wide never binds, so it does not block."""
        found: list[str] = []

        def note(why: str) -> None:
            if why not in found:
                found.append(why)

        if self.norm_offset or self.embedding_scale is not None or self.residual_multiplier != 1:
            note("norm or scaling variants")
        if self.rotary_dim != head_dim:
            note("partial rotary")
        for layer in self.layers:
            if (layer.attn_in_norm is None or layer.mlp_in_norm is None
                    or layer.attn_out_norm or layer.mlp_out_norm):
                note("norms after attention or the MLP")
            if layer.qk_norm:
                note("q/k norm")
            if layer.rope is None:
                note("layers without rotary")
            if layer.sliding_window is not None and layer.sliding_window < max_position:
                note("sliding-window attention")
            if layer.logit_softcap is not None:
                note("attention soft-capping")
            if layer.sinks:
                note("attention sinks")
            if layer.activation != "silu":
                note(f"{layer.activation} MLP")
            if layer.moe is not None:
                note("mixture of experts")
        return found


def require(condition: bool, feature: str) -> None:
    """Raises ``UnsupportedFeatureError`` naming ``feature`` unless ``condition`` holds."""
    if not condition:
        raise UnsupportedFeatureError(f"{feature} is not supported")


def hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg``'s ``config.json``; for a config made by hand, its rotary base alone."""
    return cfg.hf_config or {"rope_theta": cfg.rope_theta}


def rope_of(cfg: ModelConfig, layer_type: str | None = None) -> RopeConfig:
    """The rotary of ``cfg`` (of its ``layer_type`` layers where it has one per type).

    Raises:
        UnsupportedFeatureError: a rope type we do not implement (named).
    """
    try:
        return RopeConfig.from_hf_config(hf_fields(cfg), layer_type)
    except UnsupportedFeatureError:
        raise
    except ValueError as e:
        raise UnsupportedFeatureError(str(e)) from None


def layer_types(cfg: ModelConfig, sliding: Callable[[int], bool] | None = None
                ) -> list[str]:
    """Each layer's ``full_attention`` or ``sliding_attention``, as transformers decides it:
    none slide where ``use_sliding_window`` is false (Qwen2, Qwen3, SmolLM3; missing means
    false there) or ``sliding_window`` is null; else ``layer_types`` of ``config.json`` where it
    has one; else the family's rule ``sliding(layer index)`` (None: every layer full).

    Raises:
        UnsupportedFeatureError: a layer type other than those two (named).
    """
    hf = hf_fields(cfg)
    n = cfg.num_hidden_layers
    types = hf.get("layer_types")
    if types is not None:
        for t in types:
            require(t in ("full_attention", "sliding_attention"), f"layer type {t!r}")
        if len(types) != n:
            raise UnsupportedFeatureError(f"layer_types has {len(types)} entries for {n} "
                                          "layers")
    if hf.get("use_sliding_window") is False or hf.get("sliding_window") is None:
        return ["full_attention"] * n
    if types is None:
        types = ["sliding_attention" if sliding is not None and sliding(i) else "full_attention"
                 for i in range(n)]
    return list(types)


def window_of(cfg: ModelConfig, layer_type: str) -> int | None:
    """The sliding window of a ``layer_type`` layer (tokens), None for a full one."""
    if layer_type != "sliding_attention":
        return None
    window = hf_fields(cfg).get("sliding_window")
    require(isinstance(window, int) and window > 0,
            f"sliding_window {window!r} (a sliding layer needs a positive width)")
    return window


def activation_of(cfg: ModelConfig, supported: dict[str, Activation],
                  key: str = "hidden_act", default: str = "silu") -> Activation:
    """The MLP activation named by ``config.json``'s ``key``, mapped through ``supported``
    (Hugging Face names -> ours).

    Raises:
        UnsupportedFeatureError: another activation (named, with the supported ones).
    """
    name = hf_fields(cfg).get(key) or default
    if name not in supported:
        raise UnsupportedFeatureError(
            f"{key} {name!r} is not supported for {cfg.architecture}; supported: "
            f"{', '.join(sorted(supported))}")
    return supported[name]
