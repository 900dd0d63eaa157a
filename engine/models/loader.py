"""Builds a registered model from a Hugging Face folder of safetensors files."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engine.attention import AttentionBackend
from engine.models.config import ModelConfig
from engine.quantization import DEFAULT_ACT_BITS, KernelPolicy


def load_model(model_dir: str | Path, model_config: ModelConfig, max_position: int,
               dtype: torch.dtype, device: torch.device, attn: AttentionBackend,
               quantization: str | None = None,
               act_bits: int = DEFAULT_ACT_BITS,
               policy: KernelPolicy | None = None) -> torch.nn.Module:
    """Builds ``model_config``'s decoder (its ``DecoderSpec``) and loads its weights.

    Args:
        max_position: rotary table length in tokens (the engine's max_model_len).
        attn: the attention backend the layers call.
        quantization: None, ``int8`` (the safetensors weights, quantized per channel) or
            ``gguf`` (the model folder's GGUF, its 4-bit blocks kept: ``engine.models.gguf``).
        act_bits: the quantized layers' activation rounding in our int8-dot kernels, 16 or 8
            (``--quantized-activation-bits``).
        policy: the engine's kernel choices (default: this CPU's, ``KernelPolicy.detect``).

    Raises:
        FileNotFoundError: no ``*.safetensors`` (or, for ``gguf``, no GGUF) for ``model_dir``.
        ValueError: a required weight is missing (named), or a GGUF that does not match the
            model.
    """
    model_dir = Path(model_dir)
    if quantization == "gguf":
        from engine.models.gguf import read_gguf_state
        from engine.weights import find_gguf

        state: Mapping[str, Any] = read_gguf_state(find_gguf(model_dir), model_config)
    else:
        from safetensors.torch import load_file

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
        state = {}
        for f in files:
            state.update(load_file(str(f)))
    from engine.models.decoder import DecoderForCausalLM

    # Built on the CPU, not on the meta device: the model's constructors allocate weights with
    # torch.empty (no random init) and the rotary table on the CPU, and meta tensors would
    # import torch._dynamo and sympy (about a third of a server start-up).
    model = DecoderForCausalLM(model_config, max_position, attn, policy)
    model = model.to(device=device, dtype=dtype).eval()
    model.load_weights(state, quantization, act_bits)
    model.bind_weights()
    return model
