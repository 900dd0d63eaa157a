"""Attention variants of the torch backend (sliding window, logit soft-cap, sinks) == a dense
float64 reference written here: the whole masked score matrix of each sequence, with the rules of
Hugging Face transformers (``masking_utils.sliding_window_overlay``, Gemma 2's and gpt-oss's
``eager_attention_forward``), on a mixed batch built by ``TorchAttentionBackend.build_metadata``."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from engine.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    paged_attention_torch,
    torch_backend,
)
from kernels import cpu_ops

BLOCK_SIZE, KV_HEADS, HEADS, DIM = 16, 2, 6, 32
SCALE = DIM ** -0.5
# (query_len, seq_len): a whole prompt, a short chunk over cached context (our decode kernel's
# rows on the default path), a long chunk over context, four decodes (one of length 1), and a
# sequence with no query this step.
BATCH = [(40, 40), (20, 70), (45, 95), (1, 45), (1, 17), (1, 1), (1, 100), (0, 12)]


@dataclasses.dataclass
class Batch:
    query: torch.Tensor           # [num_tokens, HEADS, DIM]
    key_cache: torch.Tensor       # [num_blocks, BLOCK_SIZE, KV_HEADS, DIM]
    value_cache: torch.Tensor
    tables: list[list[int]]
    meta: AttentionMetadata


def _batch(seed: int = 0, dtype: torch.dtype = torch.float32) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    q_lens, seq_lens = [q for q, _ in BATCH], [s for _, s in BATCH]
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    perm = torch.randperm(sum(need) + 3, generator=gen).tolist()       # blocks out of order
    tables = [perm[a:a + n] for a, n in zip(itertools.accumulate([0, *need]), need)]
    bt = torch.zeros(len(tables), max(need), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    shape = (len(perm), BLOCK_SIZE, KV_HEADS, DIM)
    # Larger than unit logits, so the soft-cap and the sinks both change the result a lot.
    key_cache = (2 * torch.randn(shape, generator=gen)).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query = (2 * torch.randn(sum(q_lens), HEADS, DIM, generator=gen)).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
        query_lens_cpu=tuple(q_lens), seq_lens_cpu=tuple(seq_lens), block_size=BLOCK_SIZE)
    meta = TorchAttentionBackend().build_metadata(meta, [tuple(t) for t in tables])
    return Batch(query, key_cache, value_cache, tables, meta)


def _dense_reference(b: Batch, *, sliding_window=None, logit_softcap=None,
                     sinks=None) -> torch.Tensor:
    """Per sequence: [HEADS, q_len, seq_len] scores in float64, soft-capped, causal + window
    masked, a sink column appended and dropped after the softmax."""
    out = torch.zeros(b.query.shape, dtype=torch.float64)
    starts = b.meta.query_start_loc.tolist()
    for i, (q_len, seq_len) in enumerate(BATCH):
        if q_len == 0:
            continue
        k = b.key_cache[b.tables[i]].flatten(0, 1)[:seq_len].double()      # [S, KVH, D]
        v = b.value_cache[b.tables[i]].flatten(0, 1)[:seq_len].double()
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        q = b.query[starts[i]:starts[i] + q_len].double()
        scores = torch.einsum("qhd,shd->hqs", q, k) * SCALE
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.double()[:, None, None].expand(HEADS, q_len, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[starts[i]:starts[i] + q_len] = torch.einsum("hqs,shd->qhd", probs, v)
    return out


def _sinks(seed: int = 7) -> torch.Tensor:
    return 3 * torch.randn(HEADS, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def no_fast_paths(monkeypatch):
    """Fails the test if a variant call reaches SDPA, the cascade split or our CPU kernel."""
    def refuse(*_a, **_k):
        raise AssertionError("a fast path ran with an attention variant set")

    monkeypatch.setattr(cpu_ops, "decode_attention", refuse)
    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", refuse)
    monkeypatch.setattr(torch_backend, "_decode_cascade", refuse)
    monkeypatch.setattr(torch_backend, "_decode_batch", refuse)


VARIANTS = {
    "window-1": {"sliding_window": 1},
    "window-5": {"sliding_window": 5},
    "window-16-one-block": {"sliding_window": 16},
    "window-33-crosses-blocks": {"sliding_window": 33},
    "window-70": {"sliding_window": 70},
    "softcap": {"logit_softcap": 1.5},
    "softcap-50": {"logit_softcap": 50.0},
    "sinks": {"sinks": _sinks()},
    "window-softcap": {"sliding_window": 20, "logit_softcap": 2.0},
    "window-sinks": {"sliding_window": 9, "sinks": _sinks(3)},
    "all-three": {"sliding_window": 24, "logit_softcap": 2.5, "sinks": _sinks(5)},
}


@pytest.mark.parametrize("query_rows", [torch_backend.VARIANT_QUERY_ROWS, 16],
                         ids=["rows-default", "rows-16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_dense_reference(variant, query_rows, no_fast_paths, monkeypatch):
    """Every sequence of the mixed batch, through ``token_slots`` and through ``block_tables``;
    ``rows-16`` splits the chunks into query blocks whose windows start mid-block."""
    monkeypatch.setattr(torch_backend, "VARIANT_QUERY_ROWS", query_rows)
    kwargs = VARIANTS[variant]
    b = _batch(seed=len(variant))
    backend = TorchAttentionBackend()
    got = backend.forward(b.query, b.key_cache, b.value_cache, b.meta, SCALE, **kwargs)
    assert got.dtype == torch.float32 and got.shape == b.query.shape
    expected = _dense_reference(b, **kwargs)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # The variant really changes the result (so the comparison above is not vacuous).
    assert (got.double() - _dense_reference(b)).abs().max() > 1e-2
    no_slots = dataclasses.replace(b.meta, token_slots=None)
    assert torch.equal(backend.forward(b.query, b.key_cache, b.value_cache, no_slots, SCALE,
                                       **kwargs), got)


@pytest.mark.parametrize("window", [1, 7, 33])
def test_keys_outside_every_window_are_never_read(window):
    """Cache rows before the window of a sequence's first new token are NaN: the result is still
    finite and right, so the path gathers only keys inside some row's window."""
    b = _batch(seed=window)
    expected = _dense_reference(b, sliding_window=window, logit_softcap=3.0)
    for i, (q_len, seq_len) in enumerate(BATCH):
        for pos in range(max(0, seq_len - q_len - window + 1)):
            block, off = b.tables[i][pos // BLOCK_SIZE], pos % BLOCK_SIZE
            b.key_cache[block, off] = float("nan")
            b.value_cache[block, off] = float("nan")
    got = TorchAttentionBackend().forward(b.query, b.key_cache, b.value_cache, b.meta, SCALE,
                                          sliding_window=window, logit_softcap=3.0)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_default_is_unchanged_bit_for_bit():
    """All variants None: the fast paths run exactly as without the keyword arguments."""
    b = _batch(seed=11)
    backend = TorchAttentionBackend()
    plain = backend.forward(b.query, b.key_cache, b.value_cache, b.meta, SCALE)
    explicit = backend.forward(b.query, b.key_cache, b.value_cache, b.meta, SCALE,
                               sliding_window=None, logit_softcap=None, sinks=None)
    assert torch.equal(plain, explicit)
    assert torch.equal(plain, paged_attention_torch(b.query, b.key_cache, b.value_cache, b.meta,
                                                    SCALE))
    torch.testing.assert_close(plain.double(), _dense_reference(b), rtol=1e-5, atol=1e-5)


def test_window_longer_than_every_sequence_is_no_window():
    b = _batch(seed=12)
    backend = TorchAttentionBackend()
    longest = max(s for _, s in BATCH)
    plain = backend.forward(b.query, b.key_cache, b.value_cache, b.meta, SCALE)
    for window in (longest, longest + 1, 1 << 20):
        wide = backend.forward(b.query, b.key_cache, b.value_cache, b.meta, SCALE,
                               sliding_window=window)
        torch.testing.assert_close(wide, plain, rtol=1e-5, atol=1e-5)
        # Through the same explicit path the window changes nothing at all.
        assert torch.equal(
            backend.forward(b.query, b.key_cache, b.value_cache, b.meta, SCALE,
                            sliding_window=window, logit_softcap=4.0),
            backend.forward(b.query, b.key_cache, b.value_cache, b.meta, SCALE,
                            logit_softcap=4.0))


def test_bf16_rows_and_cache():
    b = _batch(seed=13, dtype=torch.bfloat16)
    kwargs = {"sliding_window": 10, "logit_softcap": 2.0, "sinks": _sinks()}
    got = TorchAttentionBackend().forward(b.query, b.key_cache, b.value_cache, b.meta, SCALE,
                                          **kwargs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _dense_reference(b, **kwargs), rtol=2e-2,
                               atol=2e-2)


@pytest.mark.parametrize("kwargs", [
    {"sliding_window": 0}, {"sliding_window": -3}, {"sliding_window": True},
    {"sliding_window": 4.0}, {"logit_softcap": 0.0}, {"logit_softcap": -1.0},
    {"logit_softcap": float("inf")}, {"logit_softcap": float("nan")},
    {"sinks": torch.zeros(HEADS - 1)}, {"sinks": torch.zeros(HEADS, dtype=torch.float64)},
    {"sinks": torch.zeros(1, HEADS)},
], ids=lambda kw: "-".join(f"{k}={v if not torch.is_tensor(v) else tuple(v.shape)}"
                           for k, v in kw.items()))
def test_rejects_bad_variant_arguments(kwargs):
    b = _batch()
    with pytest.raises(ValueError):
        TorchAttentionBackend().forward(b.query, b.key_cache, b.value_cache, b.meta, SCALE,
                                        **kwargs)


def test_strided_query_as_the_model_passes_it():
    """Query heads sliced out of a fused qkv projection (not contiguous), as decoder layers do."""
    b = _batch(seed=14)
    t = b.query.shape[0]
    fused = torch.randn(t, (HEADS + 2 * KV_HEADS) * DIM)
    query = fused[:, :HEADS * DIM].view(t, HEADS, DIM)
    query.copy_(b.query)
    assert not query.is_contiguous()
    kwargs = {"sliding_window": 12, "logit_softcap": 2.0, "sinks": _sinks()}
    backend = TorchAttentionBackend()
    assert torch.equal(
        backend.forward(query, b.key_cache, b.value_cache, b.meta, SCALE, **kwargs),
        backend.forward(b.query, b.key_cache, b.value_cache, b.meta, SCALE, **kwargs))
