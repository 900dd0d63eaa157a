"""Torch paged-attention backend: cascade decode (shared prefix once) == one-pass decode; prefill
chunks over context (our decode kernel or SDPA) == dense causal attention."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from engine.attention import AttentionMetadata, paged_attention_torch, shared_prefix_blocks
from kernels import cpu_linear
from kernels.cpu import build


@pytest.fixture(params=["torch", "ours"])
def decode_path(request, monkeypatch):
    """Both decode paths of the torch backend, whatever ran before in this process: the padded
    SDPA batch (our CPU kernels off: bf16, GPU, no compiler) and our CPU decode kernel."""
    if request.param == "ours":
        if not cpu_linear.load():
            pytest.skip(f"our CPU kernels are off: {cpu_linear.unavailable_reason()}")
    else:
        monkeypatch.setitem(build._state, "ok", False)
    return request.param


def _meta(tables: list[list[int]], seq_lens: list[int], block_size: int,
          cascade_prefix_len: int) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    n = len(tables)
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
        query_lens_cpu=(1,) * n, seq_lens_cpu=tuple(seq_lens), block_size=block_size,
        token_slots=AttentionMetadata.expand_token_slots(bt, block_size),
        cascade_prefix_len=cascade_prefix_len)


def test_shared_prefix_blocks_keeps_one_own_token_per_sequence():
    assert shared_prefix_blocks([(0, 1, 2, 3), (0, 1, 2, 9), (0, 1, 5)], [64, 60, 40], 16) == 2
    assert shared_prefix_blocks([(0, 1, 2), (0, 1, 2)], [48, 48], 16) == 2   # not all 3
    assert shared_prefix_blocks([(0, 1), (4, 1)], [32, 32], 16) == 0


def test_cascade_decode_matches_one_pass_decode(decode_path):
    torch.manual_seed(0)
    block_size, kv_heads, heads, dim = 16, 3, 9, 64
    shared = list(range(20))                                     # 320 shared tokens
    tables = [shared + [20 + 3 * i, 21 + 3 * i, 22 + 3 * i] for i in range(5)]
    seq_lens = [320 + 1, 320 + 17, 320 + 40, 320 + 48, 320 + 33]
    key_cache = torch.randn(40, block_size, kv_heads, dim)
    value_cache = torch.randn(40, block_size, kv_heads, dim)
    query = torch.randn(5, heads, dim)
    n = shared_prefix_blocks([tuple(t) for t in tables], seq_lens, block_size)
    assert n == 20
    plain = paged_attention_torch(query, key_cache, value_cache,
                                  _meta(tables, seq_lens, block_size, 0), dim ** -0.5)
    cascade = paged_attention_torch(query, key_cache, value_cache,
                                    _meta(tables, seq_lens, block_size, n * block_size),
                                    dim ** -0.5)
    torch.testing.assert_close(cascade, plain, rtol=1e-5, atol=1e-5)


def test_prefill_chunks_over_context_equal_the_dense_reference(decode_path, monkeypatch):
    """A batch as the engine builds it (``build_metadata``): a decode row, a 20-token chunk over
    300 cached tokens (a prefix-cache hit), a 70-token chunk over 100 (above
    ``CHUNK_VIA_DECODE_KERNEL_MAX_TOKENS``: SDPA), a whole 24-token prompt and a 17-token chunk
    on the first 288 of the 300 cached tokens' blocks (two requests on one cached prefix). With
    ours on, the decode and both short chunks run in one call of our decode kernel, a row per
    token; every row equals causal attention computed densely in float64."""
    from engine.attention import torch_backend
    from kernels import cpu_ops

    calls = []
    real = cpu_ops.decode_attention
    monkeypatch.setattr(cpu_ops, "decode_attention", lambda out, q, k, v, qsl, *a: (
        calls.append(int((qsl.diff() == 1).sum())), real(out, q, k, v, qsl, *a)))
    assert torch_backend.CHUNK_VIA_DECODE_KERNEL_MAX_TOKENS == 64
    torch.manual_seed(3)
    block_size, kv_heads, heads, dim = 16, 3, 9, 64
    q_lens, seq_lens = [1, 20, 70, 24, 17], [45, 320, 170, 24, 305]
    tables, next_block = [], 0
    for n in seq_lens:
        blocks = -(-n // block_size)
        tables.append(list(range(next_block, next_block + blocks))[::-1])  # not in order
        next_block += blocks
    tables[4] = tables[1][:18] + tables[4][18:]
    key_cache = torch.randn(next_block + 2, block_size, kv_heads, dim)
    value_cache = torch.randn(next_block + 2, block_size, kv_heads, dim)
    query = torch.randn(sum(q_lens), heads, dim)
    qsl = [0, *itertools.accumulate(q_lens)]
    meta = torch_backend.TorchAttentionBackend().build_metadata(dataclasses.replace(
        _meta(tables, seq_lens, block_size, 0), token_slots=None,
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_lens_cpu=tuple(q_lens)),
        [tuple(t) for t in tables])
    width = meta.block_tables.shape[1]
    rows_qsl, rows_lens, rows_tables = meta.kernel_rows
    assert rows_qsl.tolist()[:4] == [0, 1, 2, 3] and rows_qsl[-1] == sum(q_lens)
    assert rows_lens.tolist()[:3] == [45, 301, 302] and rows_lens.tolist()[-1] == 305
    assert rows_tables.shape == (1 + 20 + 1 + 1 + 17, width)
    got = paged_attention_torch(query, key_cache, value_cache, meta, dim ** -0.5)
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        k = key_cache[tables[i]].flatten(0, 1)[:seq_len].double()    # [S, KVH, D]
        v = value_cache[tables[i]].flatten(0, 1)[:seq_len].double()
        q = query[qsl[i]:qsl[i + 1]].double()
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,shd->hqs", q, k) * dim ** -0.5
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > pos, float("-inf"))
        ref = torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)
        torch.testing.assert_close(got[qsl[i]:qsl[i + 1]].double(), ref, rtol=1e-5, atol=1e-5)
    # ours: one call for the decode row and both short chunks; the rest ran SDPA
    assert calls == ([1 + 20 + 17] if decode_path == "ours" else [])
