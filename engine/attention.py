"""Attention metadata and the pure-torch paged attention backend (CPU, and reference on GPU).

Layouts (shared with the Triton kernels in ``kernels/``)::

    query:        [num_tokens, num_heads, head_dim]
    key, value:   [num_tokens, num_kv_heads, head_dim]          new tokens of this step
    key_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache:  [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset, -1 = padding

Sequence s owns query rows ``query_start_loc[s] : query_start_loc[s+1]`` (its ``query_len`` new
tokens) and attends causally over its first ``seq_lens[s]`` tokens, read through
``block_tables[s]``; the first ``seq_lens[s] - query_len`` of them were cached before this step::

    |<------------- seq_len ------------->|
    |<--- context (cached) --->|<- query ->|
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step batch description passed explicitly through the model to every attention layer.

    Attributes:
        slot_mapping: [num_tokens] int64.
        query_start_loc: [num_seqs + 1] int32, prefix sums of query lengths.
        seq_lens: [num_seqs] int32, context + query tokens per sequence.
        block_tables: [num_seqs, max_num_blocks] int32, padded with 0 (never read past seq_len).
        query_lens_cpu / seq_lens_cpu: the same lengths as Python lists (no device sync).
        block_size: tokens per block.
        token_slots: [num_seqs, max_num_blocks * block_size] int64, the cache slot of every
            context position (``block_tables`` expanded once per step for the torch backend).
        has_padding: whether ``slot_mapping`` contains -1 entries.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_size: int
    token_slots: torch.Tensor | None = None
    has_padding: bool = False

    @staticmethod
    def expand_token_slots(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
        """[num_seqs, max_blocks] int32 -> [num_seqs, max_blocks * block_size] int64 slots."""
        offsets = torch.arange(block_size, device=block_tables.device)
        return (block_tables.long()[:, :, None] * block_size + offsets).flatten(1)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes new K/V rows into the paged cache at ``slot_mapping`` (slot -1 skipped).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype.
        slot_mapping: [num_tokens] int64.
    """
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    _write(key, value, key_cache, value_cache, slot_mapping, num_kv_heads, head_dim)


def write_kv_cache_no_padding(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``write_kv_cache`` for a step whose ``slot_mapping`` has no -1 (skips the check)."""
    _write(key, value, key_cache, value_cache, slot_mapping, key.shape[1], key.shape[2])


def _write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
           value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_kv_heads: int,
           head_dim: int) -> None:
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, meta: AttentionMetadata, seq: int, seq_len: int) -> torch.Tensor:
    """Sequence ``seq``'s first ``seq_len`` cached rows: [seq_len, num_kv_heads, head_dim]."""
    flat = cache.view(-1, cache.shape[2], cache.shape[3])
    if meta.token_slots is not None:
        return flat[meta.token_slots[seq, :seq_len]]
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[meta.block_tables[seq, :num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context, with GQA.

    Decode sequences (query_len 1) run as one padded batch; prefill chunks run one by one.

    Args:
        query: [num_tokens, num_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]; this step's K/V
            must already be written.
        meta: batch description.
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [num_tokens, num_heads, head_dim], query's dtype.
    """
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    decode_ids = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    if len(decode_ids) > 1:
        _decode_batch(query, key_cache, value_cache, meta, scale, decode_ids, starts, out)
        prefill_ids = [i for i, q in enumerate(meta.query_lens_cpu) if q != 1]
    else:
        prefill_ids = list(range(meta.num_seqs))
    for i in prefill_ids:
        q_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        if q_len == 0:
            continue
        start = starts[i]
        q = query[start:start + q_len].transpose(0, 1).unsqueeze(0)       # [1, H, q, D]
        k = _gather(key_cache, meta, i, seq_len).transpose(0, 1).unsqueeze(0)
        v = _gather(value_cache, meta, i, seq_len).transpose(0, 1).unsqueeze(0)
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        elif q_len == 1:
            o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        else:
            ctx = seq_len - q_len
            mask = (torch.arange(seq_len, device=query.device)[None, :]
                    <= ctx + torch.arange(q_len, device=query.device)[:, None])
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[start:start + q_len] = o[0].transpose(0, 1)
    return out


def _decode_batch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, ids: list[int], starts: list[int],
                  out: torch.Tensor) -> None:
    block_size = key_cache.shape[1]
    seq_lens = [meta.seq_lens_cpu[i] for i in ids]
    max_len = max(seq_lens)
    max_blocks = -(-max_len // block_size)
    idx = torch.tensor(ids, device=query.device)
    rows = torch.tensor([starts[i] for i in ids], device=query.device)
    if meta.token_slots is not None:
        slots = meta.token_slots[idx, :max_len]                              # [B, L]
        k = key_cache.view(-1, *key_cache.shape[2:])[slots].transpose(1, 2)  # [B, KVH, L, D]
        v = value_cache.view(-1, *value_cache.shape[2:])[slots].transpose(1, 2)
    else:
        tables = meta.block_tables[idx, :max_blocks].long()                  # [B, nb]
        k = key_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
        v = value_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    lens = torch.tensor(seq_lens, device=query.device)
    mask = (torch.arange(max_len, device=query.device)[None, :] < lens[:, None])[:, None, None, :]
    q = query[rows].unsqueeze(2)                                           # [B, H, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[rows] = o.squeeze(2)
