"""The attention-backend interface: how a decoder layer writes K/V and attends (vLLM's
``AttentionBackend`` + ``AttentionMetadataBuilder`` + ``AttentionImpl``, in one object)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """One attention implementation; the model calls ``write_kv`` then ``forward`` per layer.

    Attributes:
        name: the ``--attention-backend`` value that selects it.
    """

    name: str

    def build_metadata(self, meta: AttentionMetadata,
                       block_tables_cpu: list[tuple[int, ...]]) -> AttentionMetadata:
        """Adds what this backend needs to the runner's common metadata (default: nothing).

        Args:
            meta: the common fields, built once per step by the model runner.
            block_tables_cpu: the same block tables as Python tuples (no device sync).
        """
        return meta

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Writes this step's K/V rows ([num_tokens, num_kv_heads, head_dim]) into one layer's
        cache ([num_blocks, block_size, num_kv_heads, head_dim]) at ``meta.slot_mapping``."""

    @abstractmethod
    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logit_softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its paged context.

        The variants (all None: plain causal attention) follow Hugging Face transformers.

        Args:
            query: [num_tokens, num_heads, head_dim].
            key_cache, value_cache: one layer's cache, this step's K/V already written.
            scale: softmax scale (head_dim ** -0.5).
            sliding_window: W >= 1: the token at position p attends keys p - W < k <= p, W keys
                with itself (HF ``masking_utils.sliding_window_overlay``).
            logit_softcap: c > 0: scores = c * tanh(q.k * scale / c), before masking and
                softmax (Gemma 2, HF ``gemma2.eager_attention_forward``).
            sinks: [num_heads] fp32 on ``query``'s device: one logit per query head, an extra
                softmax column that takes weight but adds no value (gpt-oss, HF
                ``gpt_oss.eager_attention_forward``).

        Returns:
            [num_tokens, num_heads, head_dim], ``query``'s dtype.

        Raises:
            ValueError: a variant argument out of range (``check_attention_variants``).
        """

    def fused_cpu_decode_usable(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                meta: AttentionMetadata, num_heads: int) -> bool:
        """Whether a layer may run this step as one ``kernels.cpu_ops.decode_layer`` call,
        which writes K/V and attends as this backend's CPU decode kernels do (default: no)."""
        return False


def check_attention_variants(query: torch.Tensor, sliding_window: int | None,
                             logit_softcap: float | None, sinks: torch.Tensor | None) -> None:
    """Validates ``AttentionBackend.forward``'s variant arguments for ``query``
    ([num_tokens, num_heads, head_dim]), as ``kernels.triton.paged_attention`` does.

    Raises:
        ValueError: ``sliding_window`` not an int >= 1, ``logit_softcap`` not a finite number
            > 0, or ``sinks`` not a [num_heads] float32 tensor on ``query``'s device.
    """
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window!r}")
    if logit_softcap is not None and (isinstance(logit_softcap, bool)
                                      or not isinstance(logit_softcap, (int, float))
                                      or not math.isfinite(logit_softcap)
                                      or logit_softcap <= 0):
        raise ValueError(f"logit_softcap must be a finite number > 0, got {logit_softcap!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor)
                              or sinks.shape != (query.shape[1],)
                              or sinks.dtype != torch.float32 or sinks.device != query.device):
        got = (f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}"
               if isinstance(sinks, torch.Tensor) else type(sinks).__name__)
        raise ValueError(f"sinks must be a [{query.shape[1]}] float32 tensor on {query.device}, "
                         f"got {got}")
