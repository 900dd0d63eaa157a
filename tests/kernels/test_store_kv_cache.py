"""``store_kv_cache`` (Triton, interpreted on CPU) == ``store_kv_cache_ref``, bit for bit."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE
from triton_reference import store_kv_cache_ref

import kernels.triton.store_kv_cache as skc
from kernels.triton.store_kv_cache import store_kv_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _slots(num_blocks: int, block_size: int, num_tokens: int, seed: int) -> torch.Tensor:
    """Distinct random slots with a -1 every third token; the rest cover partial blocks."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    return slots.to(DEVICE)


def _run_both(key, value, kc, vc, slots):
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv_cache_ref(key, value, ref_k, ref_v, slots)
    store_kv_cache(key, value, kc, vc, slots)
    torch.testing.assert_close(kc, ref_k, rtol=0, atol=0)
    torch.testing.assert_close(vc, ref_v, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(dtype, head_dim, block_size):
    num_kv_heads, num_blocks, num_tokens = 2, 4, 10
    gen = torch.Generator().manual_seed(head_dim + block_size)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = _slots(num_blocks, block_size, num_tokens, seed=head_dim)
    _run_both(key, value, kc.to(DEVICE), vc.to(DEVICE), slots)


def test_strided_inputs_and_layer_views():
    """K/V sliced out of a fused qkv projection; caches are views of the model's KV tensor."""
    t, kvh, d, bs = 6, 2, 64, 16
    qkv = torch.randn(t, (4 + 2 * kvh) * d, device=DEVICE)
    _q, k, v = qkv.split([4 * d, kvh * d, kvh * d], dim=-1)
    k, v = k.view(t, kvh, d), v.view(t, kvh, d)
    assert not k.is_contiguous()
    kv_caches = torch.zeros(2, 2, 5, bs, kvh, d, device=DEVICE)
    slots = torch.tensor([0, 17, -1, 79, 40, 3], device=DEVICE)
    _run_both(k, v, kv_caches[1, 0], kv_caches[1, 1], slots)
    assert kv_caches[0].abs().sum() == 0, "another layer's cache was written"


def test_heads_split_over_grid_axis_1(monkeypatch):
    """More kv heads than one program's tile: the heads are split over grid axis 1."""
    monkeypatch.setattr(skc, "_MAX_TILE_ELEMS", 128)       # 2 heads of 64 per program
    key = torch.randn(5, 3, 64, device=DEVICE)
    value = torch.randn(5, 3, 64, device=DEVICE)
    kc = torch.zeros(2, 16, 3, 64, device=DEVICE)
    _run_both(key, value, kc, kc.clone(), torch.tensor([31, -1, 0, 16, 5], device=DEVICE))


def test_all_padding_and_empty():
    kc = torch.zeros(2, 16, 1, 64, device=DEVICE)
    key = torch.randn(3, 1, 64, device=DEVICE)
    store_kv_cache(key, key, kc, kc, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    store_kv_cache(key[:0], key[:0], kc, kc, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert kc.abs().sum() == 0


def test_rejects_bad_inputs():
    key = torch.randn(3, 2, 64, device=DEVICE)
    kc = torch.zeros(2, 16, 2, 64, device=DEVICE)
    with pytest.raises(AssertionError):
        store_kv_cache(key, key, kc, kc, torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(AssertionError):
        store_kv_cache(key.half(), key.half(), kc, kc, torch.zeros(3, dtype=torch.int64,
                                                                   device=DEVICE))
    with pytest.raises(AssertionError):
        store_kv_cache(key, key, kc[..., :32], kc[..., :32],
                       torch.zeros(3, dtype=torch.int64, device=DEVICE))
