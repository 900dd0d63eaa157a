"""The ``triton`` attention backend: the paged-attention and KV-write kernels of
``kernels/triton/``.

The kernels read the cache through ``block_tables`` directly, so no per-token slot expansion is
built. Needs CUDA tensors, or ``TRITON_INTERPRET=1`` (the slow CPU interpreter the tests use).
"""

from __future__ import annotations

import os

import torch

from engine.attention.base import AttentionBackend
from engine.attention.metadata import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """``--attention-backend triton`` (``auto`` picks it on CUDA).

    Args:
        device: where the model and KV cache live.

    Raises:
        ValueError: ``device`` is not CUDA and the Triton interpreter is off.
    """

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise ValueError("--attention-backend triton needs a CUDA device (or "
                             "TRITON_INTERPRET=1, the slow CPU interpreter used by the tests); "
                             "use --attention-backend torch on CPU")
        from kernels.triton.paged_attention import paged_attention
        from kernels.triton.store_kv_cache import store_kv_cache

        self._paged_attention = paged_attention
        self._store_kv_cache = store_kv_cache

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        self._store_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logit_softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``kernels.triton.paged_attention.paged_attention``; host-side lengths pick the launch
        shape. The variants are the kernel's constexpr switches (off when None)."""
        return self._paged_attention(query, key_cache, value_cache, meta.query_start_loc,
                                     meta.seq_lens, meta.block_tables, scale,
                                     max_query_len=max(meta.query_lens_cpu, default=0),
                                     max_seq_len=max(meta.seq_lens_cpu, default=0),
                                     sliding_window=sliding_window,
                                     logit_softcap=logit_softcap, sinks=sinks)
