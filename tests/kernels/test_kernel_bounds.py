"""Bounds checker: no kernel loads or stores outside the launch's tensors.

The Triton interpreter reads and writes raw host memory without checks, so a wrong mask would
pass the reference tests silently (reading garbage that happens to be masked later, or a
neighbour's bytes). Two independent nets, both under ``TRITON_INTERPRET=1``:

1. ``bounds_checked`` (``kernel_utils``) wraps the interpreter's masked load/store and fails any
   active lane whose address is not an element of one of the launch's tensor arguments.
2. Every input lives inside a guard-filled buffer (NaN for floats, a huge id for int32 metadata,
   7 guard elements before, after and between rows): results must contain no NaN and the guards
   must be intact after the stores.

``test_checker_catches_a_wrong_mask`` proves net 1 fires on an off-by-one mask.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_utils import (
    INTERPRETING,
    assert_close,
    bounds_checked,
    guard_intact,
    guarded,
    make_batch,
    paged_attention_variants_ref,
)
from triton_reference import paged_attention_ref, store_kv_cache_ref

import kernels.triton.paged_attention as pa
import kernels.triton.store_kv_cache as skc

pytestmark = pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1 (CPU)")

NAN = float("nan")
BAD_ID = 1 << 30          # an index guard: reading it as a block id / length would jump far away


@pytest.mark.parametrize("dtype,head_dim,group,num_splits,variant", [
    (torch.float32, 80, 3, 1, {}),
    (torch.bfloat16, 64, 4, 1, {}),
    (torch.float16, 96, 1, 4, {}),
    (torch.float32, 80, 3, 1, {"sliding_window": 20, "logit_softcap": 3.0, "sinks": True}),
    (torch.float16, 96, 1, 4, {"sliding_window": 30, "sinks": True}),
], ids=["fp32-d80-gqa3", "bf16-d64-gqa4", "fp16-d96-gqa1-splitk",
        "fp32-d80-gqa3-window-softcap-sinks", "fp16-d96-gqa1-splitk-window-sinks"])
def test_paged_attention_in_bounds(dtype, head_dim, group, num_splits, variant):
    # The longest sequence (70) ends mid-tile, so a tile overhangs its block-table row.
    seqs = [(0, 21), (69, 1), (20, 14), (48, 1), (5, 0)]
    batch = make_batch(seqs, num_kv_heads=2, group=group, head_dim=head_dim, block_size=16,
                       dtype=dtype, spare_blocks=0)
    variant = dict(variant)
    guards = []
    if variant.get("sinks"):
        sinks = torch.randn(2 * group, generator=torch.Generator().manual_seed(group))
        expected = paged_attention_variants_ref(*batch.args, **{**variant, "sinks": sinks})
        variant["sinks"] = guarded(sinks, NAN)             # read through a fenced view
        guards.append((variant["sinks"], NAN))
    else:
        expected = paged_attention_variants_ref(*batch.args, **variant)
        if not variant:
            assert torch.equal(expected, paged_attention_ref(*batch.args))
    q, kc, vc = guarded(batch.query, NAN), guarded(batch.key_cache, NAN), guarded(
        batch.value_cache, NAN)
    qsl, sl = guarded(batch.query_start_loc, BAD_ID), guarded(batch.seq_lens, BAD_ID)
    # Block tables exactly as wide as needed: reading past a sequence's blocks hits the guard.
    width = -(-max(batch.seq_lens.tolist()) // 16)
    bt = guarded(batch.block_tables[:, :width].contiguous(), BAD_ID)
    out = guarded(torch.zeros_like(batch.query), NAN)
    with bounds_checked(pa._paged_attention_kernel, pa._reduce_segments_kernel):
        pa.paged_attention(q, kc, vc, qsl, sl, bt, batch.args[-1], out=out,
                           num_splits=num_splits, **variant)
    assert not torch.isnan(out).any()
    assert_close(out, expected)
    for t, g in ((q, NAN), (kc, NAN), (vc, NAN), (out, NAN), (qsl, BAD_ID), (sl, BAD_ID),
                 (bt, BAD_ID), *guards):
        assert guard_intact(t, g)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 80), (torch.bfloat16, 64)])
def test_store_kv_cache_in_bounds(dtype, head_dim, monkeypatch):
    monkeypatch.setattr(skc, "_MAX_TILE_ELEMS", 2 * 128)    # 3 heads -> tiles of 2, one partial
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(6, 3, head_dim, generator=gen).to(dtype)
    value = torch.randn(6, 3, head_dim, generator=gen).to(dtype)
    cache = torch.randn(3, 16, 3, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([47, -1, 0, 16, -1, 31])           # first and last slot of the pool
    ref_k, ref_v = cache.clone(), cache.clone()
    store_kv_cache_ref(key, value, ref_k, ref_v, slots)
    k, v = guarded(key, NAN), guarded(value, NAN)
    kc, vc = guarded(cache, NAN), guarded(cache, NAN)
    sm = guarded(slots, -(1 << 40))
    with bounds_checked(skc._store_kv_cache_kernel):
        skc.store_kv_cache(k, v, kc, vc, sm)
    torch.testing.assert_close(kc, ref_k, rtol=0, atol=0)
    torch.testing.assert_close(vc, ref_v, rtol=0, atol=0)
    for t, g in ((k, NAN), (v, NAN), (kc, NAN), (vc, NAN), (sm, -(1 << 40))):
        assert guard_intact(t, g)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, OFF_BY_ONE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    limit = n + 1 if OFF_BY_ONE else n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < limit), mask=offs < n)


@triton.jit
def _bad_store_kernel(dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.zeros([BLOCK], tl.float32), mask=offs <= n)


def test_checker_catches_a_wrong_mask():
    src = guarded(torch.arange(10, dtype=torch.float32), NAN)
    dst = guarded(torch.zeros(10), NAN)
    with bounds_checked(_copy_kernel):                       # correct mask: passes
        _copy_kernel[(1,)](src, dst, 10, OFF_BY_ONE=False, BLOCK=16)
    assert torch.equal(dst, torch.arange(10, dtype=torch.float32))
    with pytest.raises(Exception, match="out-of-bounds load"), bounds_checked(_copy_kernel):
        _copy_kernel[(1,)](src, dst, 10, OFF_BY_ONE=True, BLOCK=16)
    with pytest.raises(Exception, match="out-of-bounds store"), bounds_checked(_bad_store_kernel):
        _bad_store_kernel[(1,)](dst, 10, BLOCK=16)
