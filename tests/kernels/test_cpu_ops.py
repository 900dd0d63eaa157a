"""Our fused CPU ops (``kernels/cpu/norm.cpp``, ``kernels/cpu/decode_attention.cpp`` through
``kernels.cpu_ops``): equal to torch's ops to fp32 rounding, the same bits for a row whatever its
batch, the torch fallback where they do not apply, and clear refusals of what they cannot take."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention_torch
from kernels import cpu_linear, cpu_ops
from kernels.cpu import build

_LOADED = cpu_linear.load()
pytestmark = pytest.mark.skipif(
    not _LOADED and not cpu_linear.unavailable_reason().startswith("build failed"),
    reason=f"kernels do not apply here: {cpu_linear.unavailable_reason()}")


def _hf_rms_norm(x, w, eps):
    """transformers' LlamaRMSNorm, op for op."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("t,h", [(1, 576), (7, 576), (33, 13), (2, 8), (3, 1)])
def test_rms_norm_equals_transformers_to_fp32_rounding_and_is_batch_invariant(t, h):
    gen = torch.Generator().manual_seed(t * 1000 + h)
    x, w = torch.randn(t, h, generator=gen) * 3, torch.randn(h, generator=gen)
    got = torch.ops.saltserve_cpu.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, _hf_rms_norm(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-5), got)  # the wrapper runs our op
    for i in range(t):
        assert torch.equal(torch.ops.saltserve_cpu.rms_norm(x[i:i + 1].clone(), w, 1e-5),
                           got[i:i + 1])
    zero = torch.zeros(1, h)
    assert torch.equal(cpu_ops.rms_norm(zero, w, 1e-5), zero)  # eps keeps 0 / 0 away


def test_add_rms_norm_adds_in_place_and_normalises_the_sum():
    gen = torch.Generator().manual_seed(1)
    r, x, w = (torch.randn(5, 576, generator=gen), torch.randn(5, 576, generator=gen),
               torch.randn(576, generator=gen))
    expected_sum = r + x
    before = r.clone()
    new_r, normed = cpu_ops.add_rms_norm(r, x, w, 1e-6)
    assert new_r.data_ptr() == r.data_ptr() and torch.equal(new_r, expected_sum)
    assert not torch.equal(r, before)  # updated in place, as documented
    torch.testing.assert_close(normed, _hf_rms_norm(expected_sum, w, 1e-6), rtol=2e-6,
                               atol=2e-6)
    # The torch fallback (bf16 here) computes the same thing and leaves its inputs alone.
    rb, xb = before.bfloat16(), x.bfloat16()
    new_rb, normed_b = cpu_ops.add_rms_norm(rb, xb, w.bfloat16(), 1e-6)
    assert torch.equal(rb, before.bfloat16()) and torch.equal(new_rb, rb + xb)
    torch.testing.assert_close(normed_b.float(), normed, rtol=0.05, atol=0.05)


def test_norms_refuse_what_they_cannot_take():
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.saltserve_cpu.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.saltserve_cpu.rms_norm(torch.randn(2, 8).double(), torch.randn(8).double(),
                                         1e-5)
    with pytest.raises(RuntimeError, match="shape"):
        torch.ops.saltserve_cpu.add_rms_norm(torch.randn(3, 8), torch.randn(2, 8),
                                             torch.randn(8), 1e-5)


@pytest.mark.parametrize("t,d", [(1, 1536), (16, 1536), (3, 13), (2, 8), (40, 1000)])
def test_silu_and_mul_equals_torch_to_fp32_rounding_and_is_batch_invariant(t, d):
    """vLLM's ``silu_and_mul`` over [T, 2 d]: torch's ``silu(gate) * up`` to a few ulp (our exp
    is Cephes', not Sleef's), every row the same bits alone, a tail of d % 8, rows split across
    threads from 16 K elements (40 x 1000), and large |x| (exp's clamp) finite."""
    gen = torch.Generator().manual_seed(t * 7 + d)
    x = torch.randn(t, 2 * d, generator=gen) * 4
    x[0, 0], x[0, 1] = 100.0, -100.0
    got = torch.ops.saltserve_cpu.silu_and_mul(x)
    want = F.silu(x[:, :d]) * x[:, d:]
    torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)
    assert torch.isfinite(got).all() and got.shape == (t, d)
    assert torch.equal(cpu_ops.silu_and_mul(x), got)  # the wrapper runs our op
    for i in range(t):
        assert torch.equal(torch.ops.saltserve_cpu.silu_and_mul(x[i:i + 1].clone()), got[i:i + 1])
    # Elsewhere (bf16 here) the wrapper computes the same thing with torch's ops.
    torch.testing.assert_close(cpu_ops.silu_and_mul(x.bfloat16()).float(), want,
                               rtol=0.02, atol=0.05)


def test_silu_and_mul_refuses_what_it_cannot_take():
    with pytest.raises(RuntimeError, match=r"2 \* d"):
        torch.ops.saltserve_cpu.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.saltserve_cpu.silu_and_mul(torch.randn(2, 8).double())


@pytest.mark.parametrize("t,n", [(1, 49152), (1, 1), (3, 7), (5, 8), (2, 17), (16, 1000)])
def test_argmax_rows_gives_torchs_indices(t, n):
    """Greedy sampling's argmax: ``x.max(dim=-1).indices`` exactly, on random rows (a tail of
    n % 8, rows split across threads from 4) and on the rows where only the rule decides:
    equal maxima (the first, in a lane or the tail), -0.0 beside +0.0, a NaN (the first NaN,
    even after a larger value), all -inf (masked logits), +inf."""
    gen = torch.Generator().manual_seed(t * 31 + n)
    x = torch.randn(t, n, generator=gen) * 5
    assert torch.equal(torch.ops.saltserve_cpu.argmax_rows(x), x.max(dim=-1).indices)
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1))
    if n < 8:
        return
    rows = torch.full((8, n), -1.0)
    rows[0, [3, n - 1]] = 2.0  # equal maxima: a lane and the tail
    rows[1, [n - 1, n - 2]] = 2.0
    rows[2, 5], rows[2, 2] = 0.0, -0.0  # -0.0 == +0.0: the first
    rows[3, 1], rows[3, 4], rows[3, n - 1] = 9.0, float("nan"), float("nan")
    rows[4, n - 1] = float("nan")  # a NaN in the tail only
    rows[5] = float("-inf")
    rows[6, [2, 6]] = float("inf")
    rows[7, 0] = 3.0  # the first position
    got = torch.ops.saltserve_cpu.argmax_rows(rows)
    assert torch.equal(got, rows.max(dim=-1).indices)
    assert got[:3].tolist() == [3, n - 2, 2] and got[3] == 4 and got[5] == 0 and got[6] == 2


def test_argmax_rows_falls_back_and_refuses_what_it_cannot_take():
    x = torch.randn(6, 40)
    strided = x[:, ::2]  # not contiguous: torch's
    assert torch.equal(cpu_ops.argmax_rows(strided), strided.max(dim=-1).indices)
    assert torch.equal(cpu_ops.argmax_rows(x.double()), x.double().max(dim=-1).indices)
    with pytest.raises(RuntimeError, match=r"\[rows, n\]"):
        torch.ops.saltserve_cpu.argmax_rows(torch.randn(5))
    with pytest.raises(RuntimeError, match=r"\[rows, n\]"):
        torch.ops.saltserve_cpu.argmax_rows(torch.randn(2, 0))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.saltserve_cpu.argmax_rows(x.double())


def _block_table(tables):
    """[len(tables), longest] int32 block table, each row its table then zeros."""
    bt = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return bt


def _cache_and_meta(seq_lens, query_lens, block_size=16, kvh=3, d=64, seed=0):
    """A shuffled paged cache holding every sequence's context, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_per:
        tables.append(order[used:used + n])
        used += n
    bt = _block_table(tables)
    kc = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    vc = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
        query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens), block_size=block_size,
        token_slots=AttentionMetadata.expand_token_slots(bt, block_size))
    return kc, vc, meta, tables


def _sdpa_decode(q_row, kc, vc, table, seq_len, block_size, scale):
    """One decode row [H, D] over its context, gathered and through SDPA (GQA)."""
    k = kc[torch.tensor(table)].flatten(0, 1)[:seq_len].transpose(0, 1)   # [KVH, L, D]
    v = vc[torch.tensor(table)].flatten(0, 1)[:seq_len].transpose(0, 1)
    return F.scaled_dot_product_attention(q_row[:, None], k, v, scale=scale,
                                          enable_gqa=True)[:, 0]


@pytest.mark.parametrize("seq_lens", [[1], [7], [16], [17, 40, 3], [300, 1, 129, 64],
                                      [2, 6, 130]])
@pytest.mark.parametrize("kvh,h", [(3, 9), (2, 2)])
@pytest.mark.parametrize("d", [64, 128, 72, 136, 8])
def test_decode_attention_equals_sdpa_over_the_gathered_context(seq_lens, kvh, h, d):
    """Lengths inside one block, on a block boundary, with a tail that is not a multiple of 8
    (and every remainder of the four positions scored at once), several blocks in a shuffled
    cache; GQA and plain MHA; head dims of whole 64-column register tiles (64, 128), tiles and a
    rest (72, 136), and no whole tile (8)."""
    kc, vc, meta, tables = _cache_and_meta(seq_lens, [1] * len(seq_lens), kvh=kvh, d=d,
                                           seed=len(seq_lens))
    q = torch.randn(len(seq_lens), h, d, generator=torch.Generator().manual_seed(h))
    out = torch.full_like(q, float("nan"))
    cpu_ops.decode_attention(out, q, kc, vc, meta.query_start_loc, meta.seq_lens,
                             meta.block_tables, 0.125)
    for i, (t, s) in enumerate(zip(tables, seq_lens)):
        torch.testing.assert_close(out[i], _sdpa_decode(q[i], kc, vc, t, s, 16, 0.125),
                                   rtol=1e-5, atol=1e-5)
        alone = torch.empty(1, h, d)
        cpu_ops.decode_attention(alone, q[i:i + 1], kc, vc,
                                 torch.tensor([0, 1], dtype=torch.int32), meta.seq_lens[i:i + 1],
                                 meta.block_tables[i:i + 1].contiguous(), 0.125)
        assert torch.equal(alone[0], out[i])  # the same bits alone as in the batch


def test_decode_attention_makes_its_plan_again_for_other_rows_or_tables():
    """A decode step's layers reuse the first layer's plan (which chunks are shared, the work
    items) while the rows and tables are the same: a call whose only change is one block id, one
    sequence's length or one row start must not read through the old plan."""
    seq_lens = [70, 130, 40]
    kc, vc, meta, tables = _cache_and_meta(seq_lens, [1, 1, 1], seed=5)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(5))

    def run(qsl, lens, bt):
        out = torch.full_like(q, float("nan"))
        cpu_ops.decode_attention(out, q, kc, vc, qsl, lens, bt, 0.125)
        return out

    qsl, lens, bt = meta.query_start_loc, meta.seq_lens, meta.block_tables
    # rows 0 and 1 on the same first 4 blocks: their first chunk is one group (read once) ...
    shared = bt.clone()
    shared[1, :4] = bt[0, :4]
    got = run(qsl, lens, shared)
    assert torch.equal(run(qsl, lens, shared), got)  # the plan reused: the same bits
    torch.testing.assert_close(
        got[1], _sdpa_decode(q[1], kc, vc, shared[1, :9].tolist(), 130, 16, 0.125),
        rtol=1e-5, atol=1e-5)
    # ... and apart: a stale plan would give row 1 the first chunk of row 0's blocks
    first = run(qsl, lens, bt)
    for i, (t, n) in enumerate(zip(tables, seq_lens)):
        torch.testing.assert_close(first[i], _sdpa_decode(q[i], kc, vc, t, n, 16, 0.125),
                                   rtol=1e-5, atol=1e-5)
    # one length changed
    lens2 = lens.clone()
    lens2[2] = 33
    shorter = run(qsl, lens2, bt)
    torch.testing.assert_close(shorter[2], _sdpa_decode(q[2], kc, vc, tables[2], 33, 16, 0.125),
                               rtol=1e-5, atol=1e-5)
    # row 1 no longer a decode row (query_len 2 with row 2's start moved): its out rows untouched
    qsl2 = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    q_long = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(6))
    out = torch.full_like(q_long, float("nan"))
    cpu_ops.decode_attention(out, q_long, kc, vc, qsl2, lens, bt, 0.125)
    assert out[1:3].isnan().all() and not out[0].isnan().any() and not out[3].isnan().any()
    torch.testing.assert_close(out[3], _sdpa_decode(q_long[3], kc, vc, tables[2], 40, 16, 0.125),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(run(qsl, lens, bt), first)  # and back


def _shared_tables(block_size, shared, own, seed):
    """Block tables of sequences that share the first ``shared[i]`` blocks of one common prefix
    table, each followed by ``own[i]`` blocks of its own; a shuffled cache over all of them."""
    gen = torch.Generator().manual_seed(seed)
    need = max(shared) + sum(own) + 2
    order = torch.randperm(need, generator=gen).tolist()
    common, rest = order[:max(shared)], order[max(shared):]
    tables = []
    for n_shared, n_own in zip(shared, own):
        tables.append(common[:n_shared] + rest[:n_own])
        rest = rest[n_own:]
    return tables, need


@pytest.mark.parametrize("kvh,h", [(3, 9), (2, 8), (1, 1)])
@pytest.mark.parametrize("block_size", [16, 24, 256])
def test_decode_attention_reads_shared_chunks_once_with_the_same_bits(block_size, kvh, h):
    """Sequences sharing a prefix's blocks (a cached system prompt): the kernel attends each
    chunk of 128 positions that several sequences hold in the same blocks once for all of their
    heads (kernels/cpu/decode_attention.cpp). Whole shared prefixes, ones that end inside a
    chunk, two tables that are equal but for their lengths, a sequence that shares nothing, and
    a prefill row in between: each decode row's output is the same bits as the sequence alone,
    and SDPA's to fp32 rounding. Block sizes that divide the chunk, that do not (24), and that
    are larger than it (256). Query heads per KV head of 3 (a sequence's rows fill one 3-row
    tile), 4 (tiles of 3 span two sequences' rows) and 1 (every tile spans sequences)."""
    tokens = 700
    per = -(-tokens // block_size)
    shared = [per - 1, per - 1, per // 2, per - 1, 0, per - 1]
    own = [1, 1, per - per // 2, 1, per, 1]
    tables, num_blocks = _shared_tables(block_size, shared, own, seed=block_size)
    seq_lens = [tokens - 20, tokens - 3, tokens - 5, tokens - 40, tokens - 1, tokens - 3]
    query_lens = [1, 1, 1, 1, 1, 3]  # the last one is a prefill chunk: skipped
    gen = torch.Generator().manual_seed(7)
    kc = torch.randn(num_blocks, block_size, kvh, 64, generator=gen)
    vc = torch.randn(num_blocks, block_size, kvh, 64, generator=gen)
    bt = _block_table(tables)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), h, 64, generator=gen)
    out = torch.full_like(q, float("nan"))
    cpu_ops.decode_attention(out, q, kc, vc, qsl, lens, bt, 0.125)
    assert torch.isnan(out[int(qsl[5]):]).all()  # the prefill rows are not written
    one = torch.tensor([0, 1], dtype=torch.int32)
    for i in range(5):
        row = int(qsl[i])
        alone = torch.empty(1, h, 64)
        cpu_ops.decode_attention(alone, q[row:row + 1], kc, vc, one, lens[i:i + 1],
                                 bt[i:i + 1].contiguous(), 0.125)
        assert torch.equal(alone[0], out[row]), i
        torch.testing.assert_close(out[row], _sdpa_decode(q[row], kc, vc, tables[i],
                                                          seq_lens[i], block_size, 0.125),
                                   rtol=1e-5, atol=1e-5)
    # The same query in two sequences over the same blocks and length: the same output.
    twin = torch.tensor([0, 1, 2], dtype=torch.int32)
    pair = torch.empty(2, h, 64)
    cpu_ops.decode_attention(pair, q[1:2].expand(2, h, 64).contiguous(), kc, vc, twin,
                             lens[1:2].repeat(2), bt[1:2].repeat(2, 1).contiguous(), 0.125)
    assert torch.equal(pair[0], pair[1]) and torch.equal(pair[0], out[1])


def _many_sharing(n_seqs, kvh, h, d, block_size=16, tokens=300, seed=3):
    """``n_seqs`` decode rows over one common prefix of ``tokens - 30`` positions, each with a
    tail of its own of 10 to 29 positions (chunks shared by every row, then each row's own)."""
    gen = torch.Generator().manual_seed(seed)
    prefix_blocks = (tokens - 30) // block_size
    seq_lens = [prefix_blocks * block_size + 10 + (7 * i) % 20 for i in range(n_seqs)]
    own = [-(-(s - prefix_blocks * block_size) // block_size) for s in seq_lens]
    tables, num_blocks = _shared_tables(block_size, [prefix_blocks] * n_seqs, own, seed)
    kc = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    vc = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    bt = _block_table(tables)
    q = torch.randn(n_seqs, h, d, generator=gen)
    return q, kc, vc, torch.arange(n_seqs + 1, dtype=torch.int32), \
        torch.tensor(seq_lens, dtype=torch.int32), bt, tables


@pytest.mark.parametrize("kvh,h", [(3, 9), (1, 4), (2, 2)])
@pytest.mark.parametrize("d", [64, 72, 8, 136])
def test_a_chunk_shared_by_many_rows_gives_each_row_its_bits_alone(kvh, h, d):
    """16 sequences on one prefix (a large group: up to 48 query rows read a chunk's K/V once,
    then each row's own tail chunk): every row has the bits it has alone, and SDPA's output to
    fp32 rounding. Head dims of whole 32-column V tiles (64), tiles and a rest (72, 136) and no
    whole tile (8); query heads per KV head of 3, 4 (a 3-row tile spans two sequences) and 1."""
    q, kc, vc, qsl, lens, bt, tables = _many_sharing(16, kvh, h, d, seed=d + h)
    out = torch.full_like(q, float("nan"))
    cpu_ops.decode_attention(out, q, kc, vc, qsl, lens, bt, 0.125)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for i in range(16):
        alone = torch.empty(1, h, d)
        cpu_ops.decode_attention(alone, q[i:i + 1], kc, vc, one, lens[i:i + 1],
                                 bt[i:i + 1].contiguous(), 0.125)
        assert torch.equal(alone[0], out[i]), i
        torch.testing.assert_close(out[i], _sdpa_decode(q[i], kc, vc, tables[i], int(lens[i]),
                                                        16, 0.125), rtol=1e-5, atol=1e-5)


_AVX512 = pytest.mark.skipif(not (_LOADED and cpu_ops.decode_attention_avx512()),
                             reason="the AVX-512 attention tiles need avx512f/bw/vl/dq")


@pytest.fixture
def avx2_and_avx512():
    """Runs ``decode_attention`` on the AVX2 path, then the AVX-512 one; the switch restored."""
    was = cpu_ops.decode_attention_avx512()

    def both(*args):
        outs = []
        for wide in (False, True):
            assert cpu_ops.decode_attention_avx512(wide) is wide
            out = torch.full_like(args[0], float("nan"))
            cpu_ops.decode_attention(out, *args[1:])
            outs.append(out)
        return outs
    yield both
    cpu_ops.decode_attention_avx512(was)


def test_the_avx512_attention_switch_turns_on_only_where_the_cpu_has_it():
    was = cpu_ops.decode_attention_avx512()
    try:
        assert cpu_ops.decode_attention_avx512(False) is False
        assert cpu_ops.decode_attention_avx512() is False  # it stays off
        flags = cpu_linear.cpu_flags()
        assert cpu_ops.decode_attention_avx512(True) is (
            {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags)
    finally:
        cpu_ops.decode_attention_avx512(was)


@_AVX512
@pytest.mark.parametrize("kvh,h", [(3, 9), (1, 4), (2, 2), (1, 7), (1, 8)])
@pytest.mark.parametrize("d", [64, 72, 8, 136, 16])
def test_the_avx512_and_avx2_attention_paths_give_the_same_bits(kvh, h, d, avx2_and_avx512):
    """Two AVX2 registers in each zmm are the same FMA chains and add trees, so the same bits:
    16 sequences on a shared prefix (groups of 16 to 128 query rows: tiles of 3 row pairs, of
    1 pair, a row left over), and unshared lengths with every remainder of 8 positions (score
    tiles of 8, 4 and 1 positions; the AVX-512 tiles take items of 6 rows or more, so 7 and 8
    query rows per KV head reach them). Head dims of 64-column P.V tiles, 16-column ones and a
    half register (72, 136), 16, and 8 alone."""
    q, kc, vc, qsl, lens, bt, _ = _many_sharing(16, kvh, h, d, seed=d + h)
    slow, wide = avx2_and_avx512(q, q, kc, vc, qsl, lens, bt, 0.125)
    assert not slow.isnan().any()
    assert torch.equal(slow, wide)
    seq_lens = [1, 7, 16, 17, 40, 3, 300, 129, 64, 2, 6, 130, 12, 13, 14, 15, 5]
    kc, vc, meta, _ = _cache_and_meta(seq_lens, [1] * len(seq_lens), kvh=kvh, d=d, seed=d)
    q = torch.randn(len(seq_lens), h, d, generator=torch.Generator().manual_seed(h))
    slow, wide = avx2_and_avx512(q, q, kc, vc, meta.query_start_loc, meta.seq_lens,
                                 meta.block_tables, 0.125)
    assert not slow.isnan().any()
    assert torch.equal(slow, wide)


_BF16 = pytest.mark.skipif(not cpu_ops.bf16_decode_attention_usable(64),
                           reason="bf16 caches need our kernels and avx512_bf16")


def _bf16_reference(q_row, kc, vc, table, seq_len, block_size, scale):
    """``_sdpa_decode`` in fp64 over the bf16 caches' values: what the bf16 path rounds from."""
    return _sdpa_decode(q_row.double(), kc.double(), vc.double(), table, seq_len, block_size,
                        scale).float()


_AMX_BF16 = pytest.mark.skipif(
    not (cpu_ops.bf16_decode_attention_usable(64) and cpu_ops.decode_attention_amx()),
    reason="bf16 caches on AMX need amx-tile, amx-bf16 and the tile registers")


@pytest.fixture(params=["vdpbf16ps", pytest.param("amx", marks=_AMX_BF16)])
def bf16_path(request):
    """Runs a bf16 cache test on avx512_bf16's VDPBF16PS path, then on AMX tiles (where the CPU
    has them); the switch restored."""
    was = cpu_ops.decode_attention_amx()
    assert cpu_ops.decode_attention_amx(request.param == "amx") is (request.param == "amx")
    yield request.param
    cpu_ops.decode_attention_amx(was)


@_BF16
@pytest.mark.parametrize("kvh,h", [(3, 9), (1, 4), (2, 2)])
@pytest.mark.parametrize("d", [64, 32, 128])
@pytest.mark.parametrize("n_seqs,tokens", [(16, 300), (4, 120), (3, 77), (1, 1)])
def test_decode_attention_on_bf16_caches_is_bf16_close_and_batch_invariant(kvh, h, d, n_seqs,
                                                                           tokens, bf16_path):
    """bf16 caches (products of Q's and P's bf16 high and low parts with K and V, on VDPBF16PS
    or AMX tiles, fp32 sums and softmax): 16 rows on one prefix (chunks shared by up to 64
    query rows: 6-row tiles, or four 16-row AMX tiles), own chunks of 90-109 positions (a
    second 64-position block of 2 or 3 x 16), short odd lengths (a last position pair with one
    row, a 16-position block cut short) and one position. Each row has the bits it has alone,
    and is within fp32 rounding (not bf16's: 2e-3) of exact attention over the same bf16 K/V:
    a swapped column, pair or position, or a dropped low part, would be far off."""
    q, kc, vc, qsl, lens, bt, tables = _many_sharing(n_seqs, kvh, h, d, tokens=max(tokens, 40),
                                                     seed=d + h)
    if tokens < 40:  # short contexts: cut every row to its own few positions
        lens = torch.tensor([max(1, tokens - 3 * i) for i in range(n_seqs)], dtype=torch.int32)
    kb, vb = kc.bfloat16(), vc.bfloat16()
    out = torch.full_like(q, float("nan"))
    cpu_ops.decode_attention(out, q, kb, vb, qsl, lens, bt, 0.125)
    one = torch.tensor([0, 1], dtype=torch.int32)
    worst = 0.0
    for i in range(n_seqs):
        alone = torch.empty(1, h, d)
        cpu_ops.decode_attention(alone, q[i:i + 1], kb, vb, one, lens[i:i + 1],
                                 bt[i:i + 1].contiguous(), 0.125)
        assert torch.equal(alone[0], out[i]), i
        ref = _bf16_reference(q[i], kb.float(), vb.float(), tables[i], int(lens[i]), 16, 0.125)
        worst = max(worst, ((out[i] - ref).abs().max() / ref.abs().max()).item())
    assert worst < 2e-5, worst  # measured about 3e-6; bf16 Q and P alone would give 2e-3
    # One position: a softmax weight of 1, so V's row exactly; more: fp32 rounding shows.
    assert (worst == 0) == (tokens == 1), worst


@_AMX_BF16
def test_the_amx_and_vdpbf16ps_paths_of_bf16_caches_agree_to_fp32_rounding():
    """The AMX tiles multiply the same bf16 high and low parts as VDPBF16PS, in the hardware's
    order: not the same bits, the same values to fp32 rounding; the switch turns AMX off and
    on again (and only there)."""
    was = cpu_ops.decode_attention_amx()
    try:
        q, kc, vc, qsl, lens, bt, _ = _many_sharing(16, 3, 9, 64, tokens=300, seed=5)
        kb, vb = kc.bfloat16(), vc.bfloat16()
        outs = []
        for amx in (False, True):
            assert cpu_ops.decode_attention_amx(amx) is amx
            out = torch.full_like(q, float("nan"))
            cpu_ops.decode_attention(out, q, kb, vb, qsl, lens, bt, 0.125)
            outs.append(out)
        assert not outs[1].isnan().any()
        assert (outs[0] - outs[1]).abs().max() <= 2e-5 * outs[0].abs().max()
    finally:
        cpu_ops.decode_attention_amx(was)


@_BF16
def test_decode_attention_on_bf16_caches_skips_prefill_rows_and_refuses_what_it_cannot_take():
    """A prefill row between decode rows is left as it was; bf16 K with fp32 V, and a head_dim
    that is not a multiple of 32, are refused before anything is written."""
    q, kc, vc, qsl, lens, bt, _ = _many_sharing(3, 3, 9, 64, tokens=100, seed=5)
    qsl = torch.tensor([0, 1, 3, 4], dtype=torch.int32)  # row 1: a 2-token prefill chunk
    q = torch.cat([q[:1], q[1:2].repeat(2, 1, 1), q[2:]])
    out = torch.full_like(q, float("nan"))
    cpu_ops.decode_attention(out, q, kc.bfloat16(), vc.bfloat16(), qsl, lens, bt, 0.125)
    assert torch.isnan(out[1:3]).all() and not torch.isnan(out[[0, 3]]).any()
    untouched = torch.full_like(q, 7.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 caches"):
        cpu_ops.decode_attention(untouched, q, kc.bfloat16(), vc, qsl, lens, bt, 0.125)
    assert (untouched == 7.0).all()
    q72, k72, v72, qsl72, lens72, bt72, _ = _many_sharing(2, 3, 9, 72, tokens=60, seed=6)
    untouched72 = torch.full_like(q72, 7.0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.decode_attention(untouched72, q72, k72.bfloat16(), v72.bfloat16(), qsl72, lens72,
                                 bt72, 0.125)
    assert (untouched72 == 7.0).all()


@pytest.mark.parametrize("block_size,tables", [(128, [[5, 6], [7, 5]]), (64, [[5, 6], [7, 5]]),
                                               (16, [[0, 1, 2, 3, 4], [5, 0, 1, 2, 3]])])
def test_decode_attention_keeps_a_block_at_two_places_apart(block_size, tables):
    """Tables that hold the same blocks at other logical places (the engine never builds them:
    block hashes chain to their parent) are accepted, so each row must still get its own
    chunks' partials: every row equals SDPA over its own table and the sequence alone. With
    blocks of one chunk (128), block 5 is chunk 0 of one row and chunk 1 of the other: the two
    keys differ only by the chunk's index."""
    gen = torch.Generator().manual_seed(11)
    kc = torch.randn(8, block_size, 3, 64, generator=gen)
    vc = torch.randn(8, block_size, 3, 64, generator=gen)
    lens = [len(t) * block_size for t in tables]
    bt = torch.tensor(tables, dtype=torch.int32)
    q = torch.randn(2, 9, 64, generator=gen)
    out = torch.empty_like(q)
    cpu_ops.decode_attention(out, q, kc, vc, torch.arange(3, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), bt, 0.125)
    for i in range(2):
        torch.testing.assert_close(out[i], _sdpa_decode(q[i], kc, vc, tables[i], lens[i],
                                                        block_size, 0.125), rtol=1e-5,
                                   atol=1e-5)


def test_the_torch_backend_runs_it_for_decode_rows_beside_a_prefill_chunk():
    """A batch of a prefill chunk (query_len 5) between two decodes: the decodes through our
    kernel, the chunk through SDPA, and the whole equal to the torch-only path."""
    seq_lens, query_lens = [33, 20, 50], [1, 5, 1]
    kc, vc, meta, _ = _cache_and_meta(seq_lens, query_lens, seed=4)
    q = torch.randn(7, 9, 64, generator=torch.Generator().manual_seed(5))
    assert cpu_ops.decode_attention_usable(q, kc, vc, meta)
    got = paged_attention_torch(q, kc, vc, meta, 0.125)
    build._state["ok"] = False  # the pure-torch path
    try:
        assert not cpu_ops.decode_attention_usable(q, kc, vc, meta)
        expected = paged_attention_torch(q, kc, vc, meta, 0.125)
    finally:
        build._state["ok"] = True
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.abs().amax() > 0.05 and torch.isfinite(got).all()
    # Metadata the kernel does not take (int64 lengths) falls back instead of failing.
    meta64 = replace(meta, seq_lens=meta.seq_lens.long())
    assert not cpu_ops.decode_attention_usable(q, kc, vc, meta64)
    torch.testing.assert_close(paged_attention_torch(q, kc, vc, meta64, 0.125), expected,
                               rtol=1e-5, atol=1e-5)


def test_decode_attention_refuses_bad_tables_before_reading():
    kc, vc, meta, _ = _cache_and_meta([20], [1])
    q, out = torch.randn(1, 9, 64), torch.zeros(1, 9, 64)
    bad = meta.block_tables.clone()
    bad[0, 1] = kc.shape[0]  # one past the cache
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_ops.decode_attention(out, q, kc, vc, meta.query_start_loc, meta.seq_lens, bad, 0.1)
    with pytest.raises(RuntimeError, match="seq_len outside"):
        cpu_ops.decode_attention(out, q, kc, vc, meta.query_start_loc,
                                 torch.tensor([33], dtype=torch.int32), meta.block_tables, 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ops.decode_attention(out, q, kc, vc, meta.query_start_loc, meta.seq_lens.long(),
                                 meta.block_tables, 0.1)
    assert torch.equal(out, torch.zeros(1, 9, 64))  # nothing written


@pytest.mark.parametrize("t", [1, 5, 40])
def test_rotary_in_place_is_bit_identical_to_the_torch_formula(t):
    """q and k heads of a fused qkv output (strided rows) rotated in place; v untouched."""
    gen = torch.Generator().manual_seed(t)
    h, kvh, d = 9, 3, 64
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen)
    angles = torch.rand(t, 1, d, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    heads = qkv[:, :(h + kvh) * d].view(t, h + kvh, d)
    expected = cpu_ops._rotate_torch(heads, cos, sin)
    v_before = qkv[:, (h + kvh) * d:].clone()
    assert cpu_linear.loaded()  # the kernel, not the fallback, runs first
    torch.ops.saltserve_cpu.rotary_neox_(qkv, cos.view(t, d), sin.view(t, d), h + kvh, d)
    assert torch.equal(heads, expected)
    assert torch.equal(qkv[:, (h + kvh) * d:], v_before)
    # The fallback (our kernels off) computes the same bits.
    again = torch.randn(t, (h + 2 * kvh) * d, generator=gen)
    copy = again.clone()
    cpu_ops.rotary_neox_(again, cos, sin, h + kvh, d)
    build._state["ok"] = False
    try:
        cpu_ops.rotary_neox_(copy, cos, sin, h + kvh, d)
    finally:
        build._state["ok"] = True
    assert torch.equal(again, copy)


def test_reshape_and_cache_writes_strided_rows_to_their_slots_and_refuses_bad_slots():
    gen = torch.Generator().manual_seed(9)
    kvh, d = 3, 64
    qkv = torch.randn(4, 15 * d, generator=gen)
    k = qkv[:, 9 * d:12 * d].view(4, kvh, d)
    v = qkv[:, 12 * d:].view(4, kvh, d)
    kc, vc = torch.zeros(5, 16, kvh, d), torch.zeros(5, 16, kvh, d)
    slots = torch.tensor([3, 17, 79, 40])
    torch.ops.saltserve_cpu.reshape_and_cache(k, v, kc, vc, slots)  # the kernel itself
    assert torch.equal(kc.view(-1, kvh, d)[slots], k)
    assert torch.equal(vc.view(-1, kvh, d)[slots], v)
    assert int((kc != 0).any(-1).any(-1).sum()) == 4  # nothing else written
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.reshape_and_cache(k, v, torch.zeros_like(kc), vc, torch.tensor([0, 1, 2, 80]))
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.saltserve_cpu.reshape_and_cache(k, v, kc, vc, slots.int())
