"""``paged_attention`` (Triton, interpreted on CPU) == ``paged_attention_ref`` (fp32 torch loops),
and with the attention variants (sliding window, logit soft-cap, sinks) ==
``kernel_utils.paged_attention_variants_ref``.

Batches are ``[(context_len, query_len), ...]``; block tables are random permutations of the pool,
so blocks are never contiguous, and ``seq_len % block_size != 0`` gives partial last blocks.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, assert_close, make_batch, paged_attention_variants_ref
from triton_reference import paged_attention_ref

from engine.attention import AttentionMetadata, paged_attention_torch
from kernels.triton.paged_attention import paged_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _dtype_id(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


# Every case of the unified kernel in one batch: prefill with empty context, prefill on a cached
# prefix (partial last block), decode, "fully cached but the last token" (a prefix-cache hit of
# 48 = 3 full blocks of 16), chunked prefill across the 64-token key tile boundary.
MIXED = [(0, 23), (37, 1), (20, 14), (48, 1), (70, 9)]

SCENARIOS = {
    "prefill-empty-context": [(0, 37), (0, 5), (0, 1)],
    "prefill-cached-prefix": [(32, 20), (16, 3), (45, 30)],
    "last-token-only": [(64, 1), (32, 1), (96, 1)],
    "decode": [(40, 1), (17, 1), (0, 1), (130, 1)],
    "chunked-prefill": [(16, 16), (64, 64), (3, 5)],
    "empty-query-seq": [(10, 4), (30, 0), (0, 6)],
}


def _check(batch, **kwargs) -> None:
    out = paged_attention(*batch.args, **kwargs)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert_close(out, paged_attention_ref(*batch.args))


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (80, 16)],
                         ids=["d64-bs16", "d128-bs32", "d80-bs16"])
@pytest.mark.parametrize("group", [1, 3, 4], ids=lambda g: f"gqa{g}")
def test_mixed_batch_matches_reference(dtype, head_dim, block_size, group):
    batch = make_batch(MIXED, num_kv_heads=2, group=group, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, seed=head_dim + group)
    _check(batch)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("block_size", [16, 32])
def test_scenarios_match_reference(scenario, block_size):
    batch = make_batch(SCENARIOS[scenario], num_kv_heads=2, group=4, head_dim=96,
                       block_size=block_size, dtype=torch.bfloat16, seed=block_size)
    _check(batch, max_query_len=max(batch.query_lens))


@pytest.mark.parametrize("seqs", [[(130, 1), (5, 1), (64, 1)], MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_k_matches_reference(seqs, num_splits):
    """Split-K is only chosen automatically on CUDA; forced here, including more segments than
    key tiles (empty segments) and a mixed batch."""
    batch = make_batch(seqs, num_kv_heads=1, group=3, head_dim=64, block_size=16,
                       dtype=torch.float16, seed=num_splits)
    _check(batch, num_splits=num_splits)


def test_strided_query_and_out_buffer():
    """Query sliced out of a fused qkv projection; output written into a strided ``out``."""
    batch = make_batch(MIXED, num_kv_heads=2, group=2, head_dim=64, block_size=16,
                       dtype=torch.float32)
    t, h, d = batch.query.shape
    fused = torch.randn(t, h * d + 2 * d, device=DEVICE)
    query = fused[:, :h * d].view(t, h, d)
    query.copy_(batch.query)
    assert not query.is_contiguous()
    out_buf = torch.full((t, h, d + 5), float("nan"), device=DEVICE)
    out = out_buf[..., :d]
    ret = paged_attention(query, *batch.args[1:], out=out)
    assert ret is out
    assert_close(out, paged_attention_ref(*batch.args))
    assert torch.isnan(out_buf[..., d:]).all()


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("path", ["torch", "ours"])
def test_reference_agrees_with_engine_torch_backend(group, path, monkeypatch):
    """The reference and the engine's torch backend agree, on both of its decode paths: SDPA
    (our CPU kernels off) and our CPU decode kernel (``kernels.cpu_ops``)."""
    from kernels import cpu_linear
    from kernels.cpu import build
    if path == "ours" and not cpu_linear.load():
        pytest.skip(f"our CPU kernels are off: {cpu_linear.unavailable_reason()}")
    if path == "torch":
        monkeypatch.setitem(build._state, "ok", False)
    batch = make_batch(MIXED, num_kv_heads=2, group=group, head_dim=64, block_size=16,
                       dtype=torch.float32)
    seq_lens = tuple(batch.seq_lens.tolist())
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64),
                             query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                             block_tables=batch.block_tables, query_lens_cpu=batch.query_lens,
                             seq_lens_cpu=seq_lens, block_size=16)
    expected = paged_attention_torch(batch.query, batch.key_cache, batch.value_cache, meta,
                                     batch.args[-1])
    torch.testing.assert_close(paged_attention_ref(*batch.args), expected, rtol=1e-5, atol=1e-5)


def test_rejects_bad_inputs():
    batch = make_batch([(3, 2)], num_kv_heads=2, group=2, head_dim=64, block_size=16,
                       dtype=torch.float32)
    q, kc, vc, qsl, sl, bt, scale = batch.args
    with pytest.raises(AssertionError):           # heads not a multiple of kv heads
        paged_attention(q[:, :3], kc, vc, qsl, sl, bt, scale)
    with pytest.raises(AssertionError):           # int64 metadata
        paged_attention(q, kc, vc, qsl.long(), sl, bt, scale)
    with pytest.raises(AssertionError):           # dtype mismatch
        paged_attention(q.half(), kc, vc, qsl, sl, bt, scale)
    with pytest.raises(AssertionError):           # head_dim mismatch
        paged_attention(q[..., :32], kc, vc, qsl, sl, bt, scale)


# -- attention variants -----------------------------------------------------------------------


def _sinks(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Per-head sink logits spread wide enough to take from a few percent to most of the weight."""
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(num_heads, generator=gen)).to(DEVICE)


def _check_variant(batch, variant: dict, **kwargs) -> torch.Tensor:
    """The kernel with ``variant`` == the variants reference, and != plain attention."""
    out = paged_attention(*batch.args, **variant, **kwargs)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert_close(out, paged_attention_variants_ref(*batch.args, **variant))
    return out


def test_variants_reference_without_variants_is_the_reference():
    batch = make_batch(MIXED, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                       dtype=torch.float32, seed=5)
    assert torch.equal(paged_attention_variants_ref(*batch.args), paged_attention_ref(*batch.args))


# MIXED's sequences are 23, 38, 34, 49 and 79 long: windows from one key, inside a block, one
# block, across block (16) and key-tile (32) boundaries, a decode's context (37) and length (38),
# the longest sequence, and beyond every sequence.
@pytest.mark.parametrize("window", [1, 9, 16, 33, 37, 38, 79, 200])
def test_sliding_window_matches_reference(window):
    batch = make_batch(MIXED, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                       dtype=torch.float32, seed=window)
    out = _check_variant(batch, {"sliding_window": window})
    plain = paged_attention(*batch.args)
    if window >= 79:                              # covers every sequence: no window at all
        assert torch.equal(out, plain)
    else:
        assert (out - plain).abs().max() > 1e-2


@pytest.mark.parametrize("softcap", [0.5, 2.0, 30.0])
def test_logit_softcap_matches_reference(softcap):
    batch = make_batch(MIXED, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                       dtype=torch.float32, seed=3)
    batch.query.mul_(4)                           # scores around +-4: even c = 30 bends them
    out = _check_variant(batch, {"logit_softcap": softcap})
    assert (out - paged_attention(*batch.args)).abs().max() > 1e-3


def test_sinks_match_reference():
    batch = make_batch(MIXED, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                       dtype=torch.float32, seed=4)
    out = _check_variant(batch, {"sinks": _sinks(6)})
    assert (out - paged_attention(*batch.args)).abs().max() > 1e-2
    # A sink of -inf takes no weight (gpt-oss's rule with an empty extra column).
    none = paged_attention(*batch.args, sinks=torch.full((6,), float("-inf"), device=DEVICE))
    assert_close(none, paged_attention(*batch.args))


COMBINED = {
    "window-softcap": {"sliding_window": 20, "logit_softcap": 2.0},
    "window-sinks": {"sliding_window": 9, "sinks": True},
    "softcap-sinks": {"logit_softcap": 5.0, "sinks": True},
    "all-three": {"sliding_window": 33, "logit_softcap": 3.0, "sinks": True},
}


def _variant(name: str, num_heads: int) -> dict:
    v = dict(COMBINED[name])
    if v.get("sinks"):
        v["sinks"] = _sinks(num_heads, seed=len(name))
    return v


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("combo", list(COMBINED))
def test_combined_variants_match_reference(combo, dtype):
    batch = make_batch(MIXED, num_kv_heads=2, group=4, head_dim=64, block_size=16, dtype=dtype,
                       seed=len(combo))
    _check_variant(batch, _variant(combo, 8))


@pytest.mark.parametrize("scenario", ["prefill-empty-context", "prefill-cached-prefix",
                                      "decode", "chunked-prefill", "empty-query-seq"])
def test_all_variants_in_each_scenario(scenario):
    """bf16, head_dim 96 (padded to 128), block size 32: windows start mid-block and mid-tile."""
    batch = make_batch(SCENARIOS[scenario], num_kv_heads=2, group=4, head_dim=96, block_size=32,
                       dtype=torch.bfloat16, seed=7)
    _check_variant(batch, _variant("all-three", 8), max_query_len=max(batch.query_lens))


@pytest.mark.parametrize("seqs", [[(130, 1), (5, 1), (64, 1)], MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("num_splits", [2, 4, 8])
@pytest.mark.parametrize("combo", ["window-sinks", "all-three"])
def test_split_k_variants_match_reference(seqs, num_splits, combo):
    """Split-K over the window's tiles only; the sink joins one segment's softmax, so it counts
    once however many segments there are (also empty ones: 8 segments over 3 tiles)."""
    batch = make_batch(seqs, num_kv_heads=1, group=3, head_dim=64, block_size=16,
                       dtype=torch.float32, seed=num_splits)
    variant = _variant(combo, 3)
    out = _check_variant(batch, variant, num_splits=num_splits)
    assert_close(out, paged_attention(*batch.args, **variant, num_splits=1))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_window_never_reads_tiles_before_it(num_splits):
    """K/V positions in key tiles wholly before the window of a sequence's first new token are
    NaN; a read of one would reach the output (0 * NaN in P @ V). fp32 key tiles are 32 wide."""
    seqs, window = [(130, 1), (100, 9), (70, 40)], 20
    batch = make_batch(seqs, num_kv_heads=2, group=2, head_dim=64, block_size=16,
                       dtype=torch.float32, seed=1)
    expected = paged_attention_variants_ref(*batch.args, sliding_window=window, logit_softcap=4.0)
    for s, (ctx, _q) in enumerate(seqs):
        first_tile_start = max(0, ctx - window + 1) // 32 * 32
        for pos in range(first_tile_start):
            block = batch.block_tables[s, pos // 16]
            batch.key_cache[block, pos % 16] = float("nan")
            batch.value_cache[block, pos % 16] = float("nan")
    out = paged_attention(*batch.args, sliding_window=window, logit_softcap=4.0,
                          num_splits=num_splits)
    assert not torch.isnan(out).any()
    assert_close(out, expected)


def test_rejects_bad_variants():
    batch = make_batch([(3, 2)], num_kv_heads=2, group=2, head_dim=64, block_size=16,
                       dtype=torch.float32)
    bad = [{"sliding_window": 0}, {"sliding_window": -1}, {"sliding_window": 2.5},
           {"sliding_window": True}, {"logit_softcap": 0.0}, {"logit_softcap": -2.0},
           {"logit_softcap": float("nan")}, {"logit_softcap": float("inf")},
           {"sinks": torch.zeros(3, device=DEVICE)},
           {"sinks": torch.zeros(4, dtype=torch.float16, device=DEVICE)},
           {"sinks": torch.zeros(1, 4, device=DEVICE)}, {"sinks": [0.0] * 4}]
    if DEVICE == "cpu" and torch.cuda.is_available():
        bad.append({"sinks": torch.zeros(4, device="cuda")})
    for kwargs in bad:
        with pytest.raises(ValueError):
            paged_attention(*batch.args, **kwargs)
