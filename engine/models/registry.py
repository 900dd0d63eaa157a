"""Model registry: Hugging Face ``architectures`` name -> our model class (vLLM's
``ModelRegistry`` idea). Torch-free: classes are imported only when a model is built.

Adding an architecture is one line in ``_MODELS`` (module, class name), pointing at a class with
the constructor ``(ModelConfig, max_position, attention_backend)``, ``load_hf_state_dict(state)``
and the forward of ``engine.models.llama.LlamaForCausalLM``.
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
# config.json without ``architectures``: fall back on ``model_type``.
_MODEL_TYPES: dict[str, str] = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                "qwen2": "Qwen2ForCausalLM"}


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no implementation here; the message lists those we have."""


def supported_architectures() -> tuple[str, ...]:
    """Registry keys, sorted."""
    return tuple(sorted(_MODELS))


def resolve_architecture(hf_config: dict) -> str:
    """The registry key for a Hugging Face ``config.json`` dict.

    Uses the first of ``architectures`` that we implement, else ``model_type``.

    Raises:
        UnsupportedArchitectureError: nothing matches; the message names the supported ones.
    """
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return arch
    if not archs and hf_config.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[hf_config["model_type"]]
    named = archs[0] if archs else hf_config.get("model_type")
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {named!r}; supported: "
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
