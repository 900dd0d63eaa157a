"""The attention-backend interface: how a decoder layer writes K/V and attends (vLLM's
``AttentionBackend`` + ``AttentionMetadataBuilder`` + ``AttentionImpl``, in one object)."""

from __future__ import annotations

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
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its paged context.

        Args:
            query: [num_tokens, num_heads, head_dim].
            key_cache, value_cache: one layer's cache, this step's K/V already written.
            scale: softmax scale (head_dim ** -0.5).

        Returns:
            [num_tokens, num_heads, head_dim], ``query``'s dtype.
        """

    def fused_cpu_decode_usable(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                meta: AttentionMetadata, num_heads: int) -> bool:
        """Whether a layer may run this step as one ``kernels.cpu_ops.decode_layer`` call,
        which writes K/V and attends as this backend's CPU decode kernels do (default: no)."""
        return False
