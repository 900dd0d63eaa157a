"""Attention backends over the paged KV cache, selected by name (``--attention-backend``).

- ``torch`` (``engine.attention.torch_backend``): SDPA over gathered blocks; any device.
- ``triton`` (``engine.attention.triton_backend``): the kernels in ``kernels/``; CUDA.

``auto`` picks triton for CUDA tensors and torch otherwise. The names (``engine.config``'s
``ATTENTION_BACKENDS``) live outside this package, which imports torch.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import (
    CASCADE_MIN_PREFIX_TOKENS,
    CASCADE_MIN_SEQS,
    TorchAttentionBackend,
    paged_attention_torch,
    shared_prefix_blocks,
    write_kv_cache,
)

__all__ = ["CASCADE_MIN_PREFIX_TOKENS", "CASCADE_MIN_SEQS", "AttentionBackend",
           "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend",
           "paged_attention_torch", "shared_prefix_blocks", "write_kv_cache"]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` (``auto`` | ``torch`` | ``triton``) for ``device``.

    Raises:
        ValueError: an unknown name, or triton off CUDA without the interpreter.
    """
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
