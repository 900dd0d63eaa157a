"""Plain-torch references for the Triton kernels: slow, loop-based, obviously correct.

Same signatures and layouts as ``kernels.triton.store_kv_cache`` and
``kernels.triton.paged_attention``; the tests (and ``benchmarks/gpu_check.py``) compare every
kernel against these with ``torch.testing.assert_close``.
"""

from __future__ import annotations

import torch


def store_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes token ``t``'s K/V rows at slot ``slot_mapping[t]`` (skips -1), one token at a time.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype.
        slot_mapping: [num_tokens] int64, ``block_id * block_size + offset`` or -1.
    """
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[t]
        value_cache[block, offset] = value[t]


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal paged attention computed in fp32, one sequence at a time.

    Args:
        query: [num_tokens, num_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        query_start_loc: [num_seqs + 1] int32.
        seq_lens: [num_seqs] int32.
        block_tables: [num_seqs, max_blocks] int32.
        scale: softmax scale.

    Returns:
        [num_tokens, num_heads, head_dim] in ``query``'s dtype. Rows of sequences with no
        query tokens do not exist; every row is written.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        # Position j of the sequence lives in block block_tables[s, j // bs] at offset j % bs.
        positions = torch.arange(seq_len, device=key_cache.device)
        blocks = block_tables[s].long().to(key_cache.device)[positions // block_size]
        k = key_cache[blocks, positions % block_size].float()          # [seq_len, kvh, d]
        v = value_cache[blocks, positions % block_size].float()
        k = k.repeat_interleave(group, dim=1)                          # [seq_len, h, d]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()                                # [q_len, h, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale             # [h, q_len, seq_len]
        q_pos = context_len + torch.arange(q_len, device=key_cache.device)
        visible = positions[None, :] <= q_pos[:, None]                  # [q_len, seq_len]
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(query.dtype)
