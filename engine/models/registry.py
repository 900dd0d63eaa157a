"""Model registry: Hugging Face ``architectures`` name -> the model file that declares it (vLLM's
``ModelRegistry`` idea).

Each model file (``engine/models/<family>.py``) holds one function,
``decoder_spec(cfg: ModelConfig) -> DecoderSpec``, that reads the family's fields of
``config.json`` into the decoder-as-data of ``engine.models.spec``; ``ModelConfig`` builds it
through ``model_file`` and one implementation (``engine.models.decoder.DecoderForCausalLM``)
runs every spec. Adding an architecture is its model file, one line in ``_MODELS`` and its tests
(``tests/engine/test_model_families.py``). This module imports none of them (a leaf).
"""

from __future__ import annotations

# Hugging Face architecture -> the model file declaring it.
_MODELS: dict[str, str] = {
    "Gemma2ForCausalLM": "engine.models.gemma",
    "Gemma3ForCausalLM": "engine.models.gemma",
    "GptOssForCausalLM": "engine.models.gpt_oss",
    "GraniteForCausalLM": "engine.models.granite",
    "LlamaForCausalLM": "engine.models.llama",
    "MistralForCausalLM": "engine.models.llama",
    "MixtralForCausalLM": "engine.models.mixtral",
    "Olmo2ForCausalLM": "engine.models.olmo2",
    "Phi3ForCausalLM": "engine.models.phi3",
    "Qwen2ForCausalLM": "engine.models.llama",
    "Qwen3ForCausalLM": "engine.models.qwen3",
    "Qwen3MoeForCausalLM": "engine.models.qwen3",
    "SmolLM3ForCausalLM": "engine.models.smollm3",
}
# No implemented ``architectures`` entry: fall back on ``model_type``.
_MODEL_TYPES: dict[str, str] = {
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM", "granite": "GraniteForCausalLM", "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "smollm3": "SmolLM3ForCausalLM",
}


# transformers 5.x config classes' defaults for the fields we read, by ``model_type``: what a
# ``config.json`` that leaves a field out means (files written by older tools often do). Only
# missing keys take them; an explicit ``null`` keeps its own meaning (Mistral v0.3's
# ``sliding_window: null`` is no window).
FAMILY_DEFAULTS: dict[str, dict] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                "sliding_window": 4096, "max_position_embeddings": 131072},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28,
              "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 128,
              "tie_word_embeddings": False, "attention_bias": False, "sliding_window": 4096,
              "use_sliding_window": False, "max_window_layers": 28,
              "max_position_embeddings": 32768},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                  "attention_bias": False, "sliding_window": 4096, "use_sliding_window": False,
                  "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "max_position_embeddings": 32768},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": False,
                "sliding_window": None, "max_position_embeddings": 131072},
    "gemma2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 256,
               "tie_word_embeddings": True, "attention_bias": False, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
               "max_position_embeddings": 8192},
    "gemma3_text": {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0, "head_dim": 256,
                    "tie_word_embeddings": True, "attention_bias": False,
                    "sliding_window": 4096, "sliding_window_pattern": 6,
                    "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "max_position_embeddings": 131072},
    "phi3": {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
             "sliding_window": None, "max_position_embeddings": 4096},
    "olmo2": {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "attention_bias": False, "max_position_embeddings": 2048},
    "granite": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                "attention_bias": False, "mlp_bias": False, "embedding_multiplier": 1.0,
                "attention_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
                "max_position_embeddings": 2048},
    "smollm3": {"rms_norm_eps": 1e-6, "rope_theta": 2000000.0, "tie_word_embeddings": True,
                "attention_bias": False, "mlp_bias": False, "sliding_window": None,
                "use_sliding_window": False, "no_rope_layer_interval": 4,
                "max_position_embeddings": 32768},
    "gpt_oss": {"rms_norm_eps": 1e-5, "head_dim": 64, "tie_word_embeddings": False,
                "attention_bias": True, "sliding_window": 128, "swiglu_limit": 7.0,
                "swiglu_alpha": 1.702, "max_position_embeddings": 131072,
                "rope_theta": 150000.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 4096}},
}


def with_family_defaults(hf_config: dict) -> dict:
    """``hf_config`` with the missing fields of its ``model_type`` filled in from
    ``FAMILY_DEFAULTS`` (a new dict; keys it has, ``null`` ones included, are kept)."""
    defaults = FAMILY_DEFAULTS.get(hf_config.get("model_type", "llama"), {})
    if "rope_parameters" in hf_config or "rope_scaling" in hf_config:
        defaults = {k: v for k, v in defaults.items() if k != "rope_scaling"}
    return {**defaults, **hf_config}


def causal_lm_architecture(name: str) -> bool:
    """Whether an ``architectures`` entry is a causal language model (``...ForCausalLM``), which
    the ``model_type`` fallback may serve; a classifier or an embedding model is not."""
    return name.endswith(("ForCausalLM", "LMHeadModel"))


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no implementation here; the message lists those we have."""


def supported_architectures() -> tuple[str, ...]:
    """Registry keys, sorted."""
    return tuple(sorted(_MODELS))


def model_file(architecture: str) -> str:
    """The module declaring ``architecture`` (``engine.models.<family>``).

    Raises:
        UnsupportedArchitectureError: unknown key.
    """
    if architecture not in _MODELS:
        raise UnsupportedArchitectureError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}")
    return _MODELS[architecture]


def resolve_architecture(hf_config: dict) -> str:
    """The registry key for a Hugging Face ``config.json`` dict.

    The first of ``architectures`` that we implement; else, where ``architectures`` is empty or
    names causal language models only, the class of ``model_type`` (default ``llama``, as
    transformers' ``LlamaConfig``), so a checkpoint of a family we serve with a custom causal-LM
    class name still loads (a ``Qwen2ForSequenceClassification`` or a bare ``MistralModel``
    does not: its head is not a language model's).

    Raises:
        UnsupportedArchitectureError: nothing matches; the message names the supported ones.
    """
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return arch
    model_type = hf_config.get("model_type", "llama")
    if model_type in _MODEL_TYPES and all(map(causal_lm_architecture, archs)):
        return _MODEL_TYPES[model_type]
    named = archs[0] if archs else model_type
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {named!r} (model_type {model_type!r}); supported: "
        f"{', '.join(supported_architectures())}")
