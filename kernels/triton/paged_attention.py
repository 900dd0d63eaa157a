"""Triton unified paged attention: prefill, cached-prefix prefill, chunked prefill and decode in one
kernel over a variable-length batch (after vLLM's Triton "unified attention").

Layouts (see ``engine/attention/metadata.py``)::

    query:              [num_tokens, num_heads, head_dim]
    key/value_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc:    [num_seqs + 1] int32   sequence s owns query rows qsl[s]:qsl[s+1]
    seq_lens:           [num_seqs] int32       context + new tokens of sequence s
    block_tables:       [num_seqs, max_blocks] int32

Sequence ``s`` has ``query_len = qsl[s+1] - qsl[s]`` new tokens at positions
``seq_len - query_len ... seq_len - 1``; its first ``seq_len - query_len`` tokens (the context) were
cached before. New token at position ``p`` attends to positions ``0..p`` (causal).

Grid: ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads, num_segments)``.

* Axis 0 enumerates query blocks of ``BLOCK_Q`` tokens. Sequence ``s``'s blocks start at global
  index ``qsl[s] // BLOCK_Q + s``; a program finds its sequence by binary search over
  ``query_start_loc`` and exits when its block lies past the sequence's query (the grid is an upper
  bound computed on the host without reading device memory).
* Axis 1 is the kv head. The program handles all ``G = num_heads // num_kv_heads`` query heads that
  share it: a ``[BLOCK_M, HEAD_DIM_PADDED]`` tile whose row ``r`` is query token ``r // G`` of the
  block and head ``kv_head * G + r % G`` (``BLOCK_M = BLOCK_Q * G`` rounded up to a power of 2,
  spare rows masked). K/V are loaded once per tile for the whole group.
* The program walks key tiles of ``TILE_N`` positions up to the causal limit of its last row,
  resolving each position through ``block_tables`` (so any ``block_size`` works), and keeps an
  online softmax in fp32 (running max ``m``, sum ``l``, accumulator ``acc``; exp2 domain).
* Axis 2 (split-K, decode of few long sequences): segment ``z`` covers the z-th slice of the key
  tiles and writes ``m``, ``l`` and the unnormalised ``acc`` to fp32 scratch; a second kernel
  (``_reduce_segments_kernel``, grid ``(num_tokens, num_heads)``) rescales and sums the segments.
  With one segment the first kernel writes the normalised output directly.

Attention variants, constexpr switches (off, the kernel compiles to the plain causal code):

* ``SLIDING_WINDOW`` W > 0: the token at position ``p`` sees keys ``p - W < k <= p`` (Hugging Face
  ``masking_utils.sliding_window_overlay``); the walk starts at the tile holding the window start
  of the block's first row, so tiles wholly before every row's window are never read.
* ``SOFTCAP`` c > 0: scores become ``c * tanh(score / c)`` on the scaled natural-log scores,
  before the causal mask (Gemma 2's logit soft-capping).
* ``HAS_SINKS``: one learned logit per query head (``sinks_ptr``, fp32, natural log) joins the
  softmax as an extra column with no value (gpt-oss's attention sinks). Segment 0 starts its
  running max and sum from it, so with split-K the reduce counts it exactly once.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_MAX_SEGMENTS = 16


@triton.jit
def _tanh(x):
    """tanh in fp32 through exp2 (the interpreter has no libdevice tanh); odd and saturating."""
    t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))             # e^{-2|x|} in (0, 1]
    th = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0.0, -th, th)


# Every scalar is annotated: the JIT would turn an unannotated int equal to 1 (one sequence)
# into a constexpr, an untested variant. Strides are int64 so large pools address correctly.
@triton.jit
def _paged_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr,
    qk_scale: tl.float32, num_seqs: tl.int32, num_heads: tl.int32,
    stride_q_tok: tl.int64, stride_q_head: tl.int64,
    stride_kc_block: tl.int64, stride_kc_slot: tl.int64, stride_kc_head: tl.int64,
    stride_vc_block: tl.int64, stride_vc_slot: tl.int64, stride_vc_head: tl.int64,
    stride_o_tok: tl.int64, stride_o_head: tl.int64,
    stride_bt_seq: tl.int64,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    # The sequence owning this query block: the last s with qsl[s] // BLOCK_Q + s <= block.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    q_tok = q_block * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV        # index in the sequence's query
    q_head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = (offs_m // NUM_QUERIES_PER_KV < BLOCK_Q) & (q_tok < q_len)
    d_valid = offs_d < HEAD_DIM
    q_rows = (q_start + q_tok).to(tl.int64)                          # row in ``query``
    q_pos = context_len + q_tok                                      # absolute position
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(query_ptr + q_rows[:, None] * stride_q_tok + q_head[:, None] * stride_q_head
                + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys visible to the last row of the block (causal), split into TILE_N tiles; with a
    # sliding window, from the tile holding the window start of the block's first row.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if SLIDING_WINDOW > 0:
        first_tile = tl.maximum(context_len + q_block * BLOCK_Q - SLIDING_WINDOW + 1, 0) // TILE_N
    else:
        first_tile = 0
    if NUM_SEGMENTS == 1:
        tile_lo = first_tile
        tile_hi = num_tiles
    else:
        tiles_per_segment = tl.cdiv(num_tiles - first_tile, NUM_SEGMENTS)
        tile_lo = first_tile + segment * tiles_per_segment
        tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # The sink column, in segment 0 only: running max = the sink (log2 domain), sum = e^0.
        sink = tl.load(sinks_ptr + q_head) * 1.4426950408889634      # q_head < num_heads
        if NUM_SEGMENTS == 1:
            m_i = sink
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            m_i = tl.where(segment == 0, sink, m_i)
            l_i = tl.where(segment == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kc_head = key_cache_ptr + kv_head.to(tl.int64) * stride_kc_head
    vc_head = value_cache_ptr + kv_head.to(tl.int64) * stride_vc_head
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        n_valid = offs_n < kv_end
        block_ids = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_valid,
                            other=0).to(tl.int64)
        in_block = (offs_n % BLOCK_SIZE).to(tl.int64)
        k = tl.load(kc_head + (block_ids * stride_kc_block + in_block * stride_kc_slot)[None, :]
                    + offs_d[:, None], mask=d_valid[:, None] & n_valid[None, :], other=0.0)
        v = tl.load(vc_head + (block_ids * stride_vc_block + in_block * stride_vc_slot)[:, None]
                    + offs_d[None, :], mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale    # [BLOCK_M, TILE_N] fp32
        if SOFTCAP > 0.0:
            # s = score * log2(e): cap score / c in the natural-log domain, back to log2 after.
            cap2 = SOFTCAP * 1.4426950408889634
            s = _tanh(s * (1.0 / cap2)) * cap2
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)          # fully masked rows
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_o_tok + q_head[:, None] * stride_o_head
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (q_rows * num_heads + q_head) * NUM_SEGMENTS + segment  # int64
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PADDED + offs_d[None, :], acc,
                 mask=row_valid[:, None])


@triton.jit
def _reduce_segments_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, num_heads: tl.int32,
    stride_o_tok: tl.int64, stride_o_head: tl.int64,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * num_heads + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    d_valid = offs_d < HEAD_DIM
    m_seg = tl.load(part_m_ptr + part)
    l_seg = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PADDED + offs_d[None, :],
                  mask=d_valid[None, :], other=0.0)
    m_max = tl.max(m_seg, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.exp2(m_seg - m_max)                                          # empty segments: 0
    denom = tl.sum(l_seg * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_valid)


def _interpreting() -> bool:
    """Whether kernels run in the Triton CPU interpreter (which has no bf16 arithmetic or dot)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_num_splits(query: torch.Tensor, num_seqs: int, num_kv_heads: int,
                     max_query_len: int | None, max_seq_len: int | None) -> int:
    """Split-K segments for decode batches too small to fill the GPU with long contexts."""
    if not query.is_cuda or max_query_len != 1 or max_seq_len is None or max_seq_len < 1024:
        return 1
    programs = num_seqs * num_kv_heads
    target = 4 * _num_sms(query.device.index or 0)      # a few resident programs per SM
    if programs >= target:
        return 1
    return max(1, min(_MAX_SEGMENTS, triton.cdiv(target, programs), max_seq_len // 512))


def _launch_config(head_dim_padded: int, num_queries_per_kv: int, decode_only: bool,
                   dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, TILE_N, num_warps) for a launch."""
    if decode_only:
        block_m = max(16, triton.next_power_of_2(num_queries_per_kv))
    else:
        block_m = max(64 if dtype != torch.float32 else 32,
                      triton.next_power_of_2(num_queries_per_kv))
    tile_n = 64 if head_dim_padded <= 128 and dtype != torch.float32 else 32
    num_warps = 4 if block_m <= 64 else 8
    return block_m, tile_n, num_warps


def _check_variants(query: torch.Tensor, sliding_window: int | None,
                    logit_softcap: float | None, sinks: torch.Tensor | None
                    ) -> tuple[int, float, torch.Tensor | None]:
    """Validated variant arguments as the kernel takes them: (SLIDING_WINDOW, 0 = off;
    SOFTCAP, 0.0 = off; sinks contiguous, or None)."""
    window = 0
    if sliding_window is not None:
        if (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                or sliding_window < 1):
            raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window!r}")
        window = int(sliding_window)
    softcap = 0.0
    if logit_softcap is not None:
        if (isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float))
                or not math.isfinite(logit_softcap) or logit_softcap <= 0):
            raise ValueError(f"logit_softcap must be a finite number > 0, got {logit_softcap!r}")
        softcap = float(logit_softcap)
    if sinks is not None:
        if (not isinstance(sinks, torch.Tensor) or sinks.shape != (query.shape[1],)
                or sinks.dtype != torch.float32 or sinks.device != query.device):
            raise ValueError(
                f"sinks must be a [{query.shape[1]}] float32 tensor on {query.device}, got "
                + (f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}"
                   if isinstance(sinks, torch.Tensor) else type(sinks).__name__))
        sinks = sinks.contiguous()
    return window, softcap, sinks


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    *, max_query_len: int | None = None, max_seq_len: int | None = None,
                    num_splits: int | None = None, sliding_window: int | None = None,
                    logit_softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged K/V, with GQA.

    This step's K/V must already be in the cache (``store_kv_cache``).

    Args:
        query: [num_tokens, num_heads, head_dim], fp16/bf16/fp32, head_dim axis contiguous.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], ``query``'s dtype, head_dim
            axis contiguous; ``num_heads`` must be a multiple of ``num_kv_heads``.
        value_cache: like ``key_cache``.
        query_start_loc: [num_seqs + 1] int32, prefix sums of query lengths (``[0] = 0``,
            ``[-1] = num_tokens``).
        seq_lens: [num_seqs] int32, context + query tokens per sequence (>= query length).
        block_tables: [num_seqs, max_blocks] int32, row-contiguous; entries past a sequence's
            ``cdiv(seq_len, block_size)`` blocks are never read.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional [num_tokens, num_heads, head_dim] output in ``query``'s dtype.
        max_query_len: host-side max query length, if known (picks the decode tile shape).
        max_seq_len: host-side max ``seq_lens``, if known (enables split-K on CUDA).
        num_splits: split-K segments; None picks automatically (1 on CPU). Rounded up to a
            power of 2.
        sliding_window: W >= 1: position p attends keys p - W < k <= p (HF
            ``masking_utils.sliding_window_overlay``); None: full causal.
        logit_softcap: c > 0: scores = c * tanh(q.k * scale / c) before masking (Gemma 2).
        sinks: [num_heads] fp32 on ``query``'s device: one logit per query head, an extra
            softmax column without a value (gpt-oss ``eager_attention_forward``).

    Returns:
        [num_tokens, num_heads, head_dim] in ``query``'s dtype (``out`` when given).

    Raises:
        AssertionError: shapes, dtypes, devices or strides do not match the layouts above.
        ValueError: a sliding window < 1, a soft-cap that is not a finite number > 0, or sinks
            not of shape [num_heads], fp32, on ``query``'s device.
    """
    assert query.dim() == 3, query.shape
    num_tokens, num_heads, head_dim = query.shape
    assert key_cache.dim() == 4 and value_cache.shape == key_cache.shape, (
        key_cache.shape, value_cache.shape)
    _num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    assert cache_head_dim == head_dim, (key_cache.shape, query.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert head_dim <= 256, f"head_dim {head_dim} > 256 is not supported"
    assert query.dtype in (torch.float16, torch.bfloat16, torch.float32), query.dtype
    assert key_cache.dtype == value_cache.dtype == query.dtype, (
        query.dtype, key_cache.dtype, value_cache.dtype)
    num_seqs = seq_lens.shape[0]
    assert seq_lens.dim() == 1 and seq_lens.dtype == torch.int32, (seq_lens.shape, seq_lens.dtype)
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32, (
        query_start_loc.shape, query_start_loc.dtype)
    assert (block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
            and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1), (
        block_tables.shape, block_tables.dtype, block_tables.stride())
    for t in (query, key_cache, value_cache):
        assert t.stride(-1) == 1, "the head_dim axis must be contiguous"
    for t in (key_cache, value_cache, query_start_loc, seq_lens, block_tables):
        assert t.device == query.device, (t.device, query.device)
    window, softcap, sinks = _check_variants(query, sliding_window, logit_softcap, sinks)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    else:
        assert out.shape == query.shape and out.dtype == query.dtype, (out.shape, out.dtype)
        assert out.stride(-1) == 1 and out.device == query.device, (out.stride(), out.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    num_queries_per_kv = num_heads // num_kv_heads
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    decode_only = (max_query_len == 1 if max_query_len is not None
                   else num_tokens <= num_seqs)
    block_m, tile_n, num_warps = _launch_config(head_dim_padded, num_queries_per_kv,
                                                decode_only, query.dtype)
    block_q = block_m // num_queries_per_kv
    if num_splits is None:
        if window and max_seq_len is not None:
            max_seq_len = min(max_seq_len, window)          # the keys a decode row reads
        num_splits = _auto_num_splits(query, num_seqs, num_kv_heads, max_query_len, max_seq_len)
    assert 1 <= num_splits <= 256, num_splits
    num_splits = triton.next_power_of_2(num_splits)

    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim_padded,
                               dtype=torch.float32, device=query.device)
        part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                             device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out                    # unused by the one-segment variant
    interpreting = _interpreting()
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, part_acc, part_m, part_l,
        query_start_loc, seq_lens, block_tables, out if sinks is None else sinks,
        float(scale) * _LOG2E, num_seqs, num_heads,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_QUERIES_PER_KV=num_queries_per_kv, HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_Q=block_q, TILE_N=tile_n, NUM_SEGMENTS=num_splits,
        DOT_FP32=interpreting,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SLIDING_WINDOW=window, SOFTCAP=softcap, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=2,
    )
    if num_splits > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out, part_acc, part_m, part_l, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, NUM_SEGMENTS=num_splits,
            num_warps=4,
        )
    return out
