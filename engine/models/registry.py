"""Model registry: Hugging Face ``architectures`` name -> our model class (vLLM's
``ModelRegistry`` idea). Torch-free: classes are imported only when a model is built.

Adding an architecture is one line in ``_MODELS`` (module, class name), pointing at a class with
the constructor ``(ModelConfig, max_position, attention_backend)``,
``load_weights(state, quantization, act_bits)`` and the forward of
``engine.models.llama.LlamaForCausalLM``.
"""

from __future__ import annotations

import importlib
from typing import Any

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
}
# No implemented ``architectures`` entry: fall back on ``model_type``.
_MODEL_TYPES: dict[str, str] = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                "qwen2": "Qwen2ForCausalLM"}


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no implementation here; the message lists those we have."""


def supported_architectures() -> tuple[str, ...]:
    """Registry keys, sorted."""
    return tuple(sorted(_MODELS))


def resolve_architecture(hf_config: dict) -> str:
    """The registry key for a Hugging Face ``config.json`` dict.

    The first of ``architectures`` that we implement; else the Llama-family class of
    ``model_type`` (default ``llama``, as transformers' ``LlamaConfig``), so a Llama-family
    checkpoint with a custom ``architectures`` name still loads.

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


def get_model_class(architecture: str) -> Any:
    """The model class for a registry key (imports torch via the model module).

    Raises:
        UnsupportedArchitectureError: unknown key.
    """
    if architecture not in _MODELS:
        raise UnsupportedArchitectureError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
