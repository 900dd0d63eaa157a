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

    The first of ``architectures`` that we implement; else the class of ``model_type``
    (default ``llama``, as transformers' ``LlamaConfig``), so a checkpoint of a family we
    serve with a custom ``architectures`` name still loads.

    Raises:
        UnsupportedArchitectureError: nothing matches; the message names the supported ones.
    """
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return arch
    model_type = hf_config.get("model_type", "llama")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    named = archs[0] if archs else model_type
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {named!r} (model_type {model_type!r}); supported: "
        f"{', '.join(supported_architectures())}")
