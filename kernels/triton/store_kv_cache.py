"""Triton KV cache write ("reshape and cache"): new K/V rows into the paged cache.

Layouts (see ``engine/attention/metadata.py``)::

    key, value:              [num_tokens, num_kv_heads, head_dim]
    key_cache, value_cache:  [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:            [num_tokens] int64, slot = block_id * block_size + offset; -1 = padding

Grid: ``(num_tokens, cdiv(num_kv_heads, BLOCK_H))``. Program ``(t, h)`` copies token ``t``'s K and V
rows for kv heads ``h * BLOCK_H ... h * BLOCK_H + BLOCK_H - 1`` (a ``[BLOCK_H, HEAD_DIM_PADDED]``
tile, masked to the real heads and ``head_dim``) into slot ``slot_mapping[t]``; a padding slot (-1)
makes the program return without touching memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest tile (elements) one program copies; more kv heads are split over grid axis 1.
_MAX_TILE_ELEMS = 4096


# Scalars annotated (no constexpr specialization of 1s); strides int64 for large pools.
@triton.jit
def _store_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_kv_heads: tl.int32, block_size: tl.int32,
    stride_k_tok: tl.int64, stride_k_head: tl.int64,
    stride_v_tok: tl.int64, stride_v_head: tl.int64,
    stride_kc_block: tl.int64, stride_kc_slot: tl.int64, stride_kc_head: tl.int64,
    stride_vc_block: tl.int64, stride_vc_slot: tl.int64, stride_vc_head: tl.int64,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head_tile = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // block_size
    offset = slot % block_size

    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_k_tok + offs_h[:, None] * stride_k_head
                + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + offs_h[:, None] * stride_v_head
                + offs_d[None, :], mask=mask)
    tl.store(key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
             + offs_h[:, None] * stride_kc_head + offs_d[None, :], k, mask=mask)
    tl.store(value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
             + offs_h[:, None] * stride_vc_head + offs_d[None, :], v, mask=mask)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes this step's K/V rows into the paged cache (in place).

    Args:
        key: [num_tokens, num_kv_heads, head_dim], fp16/bf16/fp32, last dim contiguous (other
            strides free, e.g. a slice of a fused qkv projection).
        value: like ``key``.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], ``key``'s dtype, last dim
            contiguous (a per-layer view of the model's KV tensor is fine).
        value_cache: like ``key_cache``.
        slot_mapping: [num_tokens] int64; ``slot = block_id * block_size + offset``, -1 skips the
            token (padding). Every other slot must be in ``[0, num_blocks * block_size)``.

    Raises:
        AssertionError: shapes, dtypes, devices or strides do not match the layouts above.
    """
    assert key.dim() == 3 and value.shape == key.shape, (key.shape, value.shape)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key_cache.dim() == 4 and value_cache.shape == key_cache.shape, (
        key_cache.shape, value_cache.shape)
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), (key_cache.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64, (
        slot_mapping.shape, slot_mapping.dtype)
    assert key.dtype == value.dtype == key_cache.dtype == value_cache.dtype, (
        key.dtype, value.dtype, key_cache.dtype, value_cache.dtype)
    assert key.dtype in (torch.float16, torch.bfloat16, torch.float32), key.dtype
    for t in (key, value, key_cache, value_cache):
        assert t.stride(-1) == 1, "the head_dim axis must be contiguous"
        assert t.device == key.device, (t.device, key.device)
    assert slot_mapping.device == key.device, (slot_mapping.device, key.device)
    if num_tokens == 0:
        return
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    block_h = min(triton.next_power_of_2(num_kv_heads),
                  max(1, _MAX_TILE_ELEMS // head_dim_padded))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        num_kv_heads, key_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, BLOCK_H=block_h,
        num_warps=4,
    )
