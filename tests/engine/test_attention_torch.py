"""Torch paged-attention backend: cascade decode (shared prefix once) == one-pass decode."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, paged_attention_torch, shared_prefix_blocks
from kernels import cpu_linear


@pytest.fixture(params=["torch", "ours"])
def decode_path(request, monkeypatch):
    """Both decode paths of the torch backend, whatever ran before in this process: the padded
    SDPA batch (our CPU kernels off: bf16, GPU, no compiler) and our CPU decode kernel."""
    if request.param == "ours":
        if not cpu_linear.load():
            pytest.skip(f"our CPU kernels are off: {cpu_linear.unavailable_reason()}")
    else:
        monkeypatch.setitem(cpu_linear._state, "ok", False)
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
