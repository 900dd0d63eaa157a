"""Per-step attention metadata shared by every backend.

Layouts (shared with the Triton kernels in ``kernels/``)::

    query:        [num_tokens, num_heads, head_dim]
    key, value:   [num_tokens, num_kv_heads, head_dim]          new tokens of this step
    key_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache:  [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset

Sequence s owns query rows ``query_start_loc[s] : query_start_loc[s+1]`` (its ``query_len`` new
tokens) and attends causally over its first ``seq_lens[s]`` tokens, read through
``block_tables[s]``; the first ``seq_lens[s] - query_len`` of them were cached before this step::

    |<------------- seq_len ------------->|
    |<--- context (cached) --->|<- query ->|
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step batch description passed explicitly through the model to every attention layer.

    Built by ``AttentionBackend.build_metadata``; the common fields come from the model runner,
    the optional ones from the backend that needs them.

    Attributes:
        slot_mapping: [num_tokens] int64.
        query_start_loc: [num_seqs + 1] int32, prefix sums of query lengths.
        seq_lens: [num_seqs] int32, context + query tokens per sequence.
        block_tables: [num_seqs, max_num_blocks] int32, padded with 0 (never read past seq_len).
        query_lens_cpu / seq_lens_cpu: the same lengths as Python tuples (no device sync).
        block_size: tokens per block.
        token_slots: torch backend only: [num_seqs, max_num_blocks * block_size] int64, the
            cache slot of every context position (``block_tables`` expanded once per step).
        cascade_prefix_len: torch backend only: tokens of context (whole blocks) shared by the
            block tables of every decode sequence (query_len 1) in the batch, or 0; attention
            over that shared prefix then runs once for all of them (cascade attention, as vLLM).
        kernel_rows: torch backend on CPU only, when some sequence has a short prefill chunk over
            cached context: ``(query_start_loc, seq_lens, block_tables)`` int32 with every
            token of those chunks (and every decode) as a sequence of query_len 1, of length
            its position + 1, on its sequence's block table; other sequences keep their one
            entry. Our decode kernel then runs all of them in one call (``torch_backend``).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_size: int
    token_slots: torch.Tensor | None = None
    cascade_prefix_len: int = 0
    kernel_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def expand_token_slots(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
        """[num_seqs, max_blocks] int32 -> [num_seqs, max_blocks * block_size] int64 slots."""
        offsets = torch.arange(block_size, device=block_tables.device)
        return (block_tables.long()[:, :, None] * block_size + offsets).flatten(1)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
