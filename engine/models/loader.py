"""Builds a registered model from a Hugging Face folder of safetensors files."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.attention import AttentionBackend
from engine.models.config import ModelConfig
from engine.models.registry import get_model_class


def load_model(model_dir: str | Path, model_config: ModelConfig, max_position: int,
               dtype: torch.dtype, device: torch.device, attn: AttentionBackend) -> torch.nn.Module:
    """Instantiates ``model_config.architecture`` from the registry and loads its weights.

    Args:
        max_position: rotary table length in tokens (the engine's max_model_len).
        attn: the attention backend the layers call.

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``model_dir``.
        KeyError: a required weight is missing.
    """
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    cls = get_model_class(model_config.architecture)
    with torch.device("meta"):
        model = cls(model_config, max_position, attn)
    model = model.to_empty(device="cpu")
    model.init_non_persistent_buffers()
    model.load_hf_state_dict(state)
    model = model.to(device=device, dtype=dtype).eval()
    model.bind_weights()
    return model
