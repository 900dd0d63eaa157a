"""The ``torch`` attention backend: paged attention in torch ops (CPU, and the reference on GPU).

Prefill chunks run through ``scaled_dot_product_attention`` one sequence at a time; decodes run as
one padded batch, split at a shared prefix into cascade attention when enough sequences share
enough blocks (vLLM's cascade attention, merged by log-sum-exp). Context is read through per-token
cache slots expanded once per step (``AttentionMetadata.token_slots``). On CPU in fp32, where our
CPU kernels are built (``kernels.cpu_ops``), decode rows run our paged decode kernel instead
(which reads chunks shared by several sequences once, itself: no cascade split needed), as do
prefill chunks of up to ``CHUNK_VIA_DECODE_KERNEL_MAX_TOKENS`` tokens over cached context (one
decode row per token), and the K/V write is our ``reshape_and_cache``.

With an attention variant (sliding window, logit soft-cap, sinks) every sequence runs the explicit
fp32 path of ``paged_attention_variants_torch`` instead: neither SDPA, cascade attention nor our
CPU decode kernel knows the variants.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, check_attention_variants
from engine.attention.metadata import AttentionMetadata
from kernels import cpu_ops


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes new K/V rows into the paged cache at ``slot_mapping`` (no padding slots).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], key's dtype
            or both bf16 (``--kv-cache-dtype bfloat16``: the rows are rounded to it).
        slot_mapping: [num_tokens] int64, every entry a valid slot.
    """
    cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def _gather(cache: torch.Tensor, meta: AttentionMetadata, seq: int, seq_len: int) -> torch.Tensor:
    """Sequence ``seq``'s first ``seq_len`` cached rows: [seq_len, num_kv_heads, head_dim]."""
    flat = cache.view(-1, cache.shape[2], cache.shape[3])
    if meta.token_slots is not None:
        return flat[meta.token_slots[seq, :seq_len]]
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[meta.block_tables[seq, :num_blocks].long()].flatten(0, 1)[:seq_len]


# A prefill chunk over cached context (a prefix-cache hit, or a later chunk of a long prompt) of
# at most this many tokens runs through our decode kernel, each of its tokens a "sequence" of
# context + its position on the chunk's block table, in the same call as the step's decodes: the
# kernel reads the blocks they share (within a chunk, and across sequences on one cached
# prefix) once for all of them, in place, and the causal mask is each row's own length. Larger
# chunks, and prompts without context, run scaled_dot_product_attention (flash attention on
# CPU). For a short chunk over a long cached context, the SDPA path spends a third of its
# attention time again gathering the context; the kernel skips that, which speeds such a
# request up about 1.2x (docs/benchmarks.md). Results differ from SDPA's at fp32 rounding.
CHUNK_VIA_DECODE_KERNEL_MAX_TOKENS = 64


def _via_decode_kernel(q_len: int, seq_len: int) -> bool:
    """Whether a sequence's rows run through our decode kernel (when it is usable)."""
    return q_len == 1 or 1 < q_len < seq_len and q_len <= CHUNK_VIA_DECODE_KERNEL_MAX_TOKENS


def kernel_rows(meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``AttentionMetadata.kernel_rows`` for a CPU batch with a short chunk over context, else
    None: query_start_loc [R + 1], seq_lens [R] and block_tables [R, max_blocks], int32, where
    each token of a decode or such a chunk is one entry of query_len 1 and length ctx + 1 + its
    offset, and every other sequence one entry as it is (the kernel skips it)."""
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    if meta.block_tables.device.type != "cpu" or not any(
            q > 1 and _via_decode_kernel(q, s) for q, s in zip(q_lens, s_lens)):
        return None
    counts, qsl, lens = [], [0], []
    for q, s in zip(q_lens, s_lens):
        if _via_decode_kernel(q, s):
            counts.append(q)
            lens.extend(range(s - q + 1, s + 1))
            qsl.extend(range(qsl[-1] + 1, qsl[-1] + q + 1))
        else:
            counts.append(1)
            lens.append(s)
            qsl.append(qsl[-1] + q)
    tables = meta.block_tables.repeat_interleave(torch.tensor(counts), dim=0)
    return (torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
            tables.contiguous())


def paged_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context, with GQA.

    Decode sequences (query_len 1) run as one padded batch, cascade-split when ``meta`` says so
    (or, fp32 on CPU with our kernels built, through ``kernels.cpu_ops.decode_attention``, which
    shares the reads of common chunks itself); prefill chunks run one by one.

    Args:
        query: [num_tokens, num_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], query's dtype
            or bf16 (read as query's dtype; our CPU kernel computes on bf16 itself); this
            step's K/V must already be written.
        meta: batch description.
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [num_tokens, num_heads, head_dim], query's dtype.
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    starts = meta.query_start_loc.tolist()
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    decode_ids = [i for i, q in enumerate(q_lens) if q == 1]
    rows = meta.kernel_rows if meta.kernel_rows is not None else kernel_rows(meta)
    if cpu_ops.decode_attention_usable(query, key_cache, value_cache, meta) and (
            decode_ids or rows is not None):
        # Our CPU kernel reads every decode row's context in place, and the chunks that several
        # rows share once for all of them (kernels/cpu/decode_attention.cpp); short prefill
        # chunks over context run in the same call, a row per token (``kernel_rows``).
        qsl, lens, tables = rows or (meta.query_start_loc, meta.seq_lens, meta.block_tables)
        cpu_ops.decode_attention(out, query, key_cache, value_cache, qsl, lens, tables, scale)
        prefill_ids = [i for i, (q, s) in enumerate(zip(q_lens, s_lens))
                       if not _via_decode_kernel(q, s)]
    elif len(decode_ids) > 1:
        _decode_batch(query, key_cache, value_cache, meta, scale, decode_ids, starts, out)
        prefill_ids = [i for i, q in enumerate(q_lens) if q != 1]
    else:
        prefill_ids = list(range(meta.num_seqs))
    for i in prefill_ids:
        q_len, seq_len = q_lens[i], s_lens[i]
        if q_len == 0:
            continue
        start = starts[i]
        q = query[start:start + q_len].transpose(0, 1).unsqueeze(0)       # [1, H, q, D]
        k = _gather(key_cache, meta, i, seq_len).to(query.dtype).transpose(0, 1).unsqueeze(0)
        v = _gather(value_cache, meta, i, seq_len).to(query.dtype).transpose(0, 1).unsqueeze(0)
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        elif q_len == 1:
            o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        else:
            ctx = seq_len - q_len
            mask = (torch.arange(seq_len, device=query.device)[None, :]
                    <= ctx + torch.arange(q_len, device=query.device)[:, None])
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[start:start + q_len] = o[0].transpose(0, 1)
    return out


# Query rows of one prefill chunk scored together on the variant path: bounds its fp32 score
# matrix to num_heads * this * keys (a sliding window also bounds the keys).
VARIANT_QUERY_ROWS = 256


def _positions_to_slots(meta: AttentionMetadata, block_size: int, seqs: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
    """Cache slots [B, N] int64 of ``positions`` [B, N] (each < its sequence's length) of the
    sequences ``seqs`` [B], through ``meta.token_slots`` when built, else ``block_tables``."""
    if meta.token_slots is not None:
        return meta.token_slots[seqs[:, None], positions]
    blocks = meta.block_tables[seqs[:, None], positions // block_size].long()
    return blocks * block_size + positions % block_size


def _attend_variants(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                     scale: float, logit_softcap: float | None,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """Masked softmax attention with soft-cap and sinks, fp32, GQA by kv-head groups.

    Args:
        q: [B, M, H, D]; k, v: [B, N, KVH, D] (any float dtype; computed in fp32).
        visible: [B, M, N] bool, every row with at least one True.
        logit_softcap: c: scores = c * tanh(scores / c) before the mask (Gemma 2).
        sinks: [H] fp32 logits, an extra softmax column without a value (gpt-oss).

    Returns:
        [B, M, H, D] fp32.
    """
    B, M, H, D = q.shape
    kvh = k.shape[2]
    g = H // kvh
    qg = q.float().view(B, M, kvh, g, D).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * M, D)
    kf = k.float().permute(0, 2, 3, 1)                                      # [B, KVH, D, N]
    vf = v.float().transpose(1, 2)                                          # [B, KVH, N, D]
    scores = torch.matmul(qg, kf).mul_(scale).view(B, kvh, g, M, -1)        # [B, KVH, G, M, N]
    if logit_softcap is not None:
        scores = scores.div_(logit_softcap).tanh_().mul_(logit_softcap)
    scores = scores.masked_fill_(~visible[:, None, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, kvh, g, 1, 1)
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
        probs = scores.sub_(top).exp_()                                     # in place
        probs = probs.div_(probs.sum(dim=-1, keepdim=True) + torch.exp(sink - top))
    out = torch.matmul(probs.view(B, kvh, g * M, -1), vf)                   # [B, KVH, G*M, D]
    return out.view(B, kvh, g, M, D).permute(0, 3, 1, 2, 4).reshape(B, M, H, D)


def paged_attention_variants_torch(query: torch.Tensor, key_cache: torch.Tensor,
                                   value_cache: torch.Tensor, meta: AttentionMetadata,
                                   scale: float, *, sliding_window: int | None = None,
                                   logit_softcap: float | None = None,
                                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention with a sliding window, logit soft-cap and/or sinks, in fp32 torch.

    Decode rows (query_len 1) run as one padded batch; prefill chunks one by one, in blocks of
    ``VARIANT_QUERY_ROWS`` rows. With a window only the keys some row of the batch or block can
    see are gathered (a decode at position p reads its last W keys).

    Args:
        query: [num_tokens, num_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], any float
            dtype (read as fp32); this step's K/V must already be written.
        meta: batch description (``token_slots`` used when present, else ``block_tables``).
        scale: softmax scale, usually head_dim ** -0.5.
        sliding_window: W >= 1: position p sees keys p - W < k <= p (HF
            ``masking_utils.sliding_window_overlay``).
        logit_softcap: c > 0: scores = c * tanh(q.k * scale / c) before masking (Gemma 2).
        sinks: [num_heads] fp32 on query's device, per-head logit of an extra softmax column
            with no value (gpt-oss ``eager_attention_forward``).

    Returns:
        [num_tokens, num_heads, head_dim], query's dtype.

    Raises:
        ValueError: a variant argument out of range (``check_attention_variants``).
    """
    check_attention_variants(query, sliding_window, logit_softcap, sinks)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    dev = query.device
    block_size = key_cache.shape[1]
    flat_k = key_cache.view(-1, key_cache.shape[2], key_cache.shape[3])
    flat_v = value_cache.view(-1, value_cache.shape[2], value_cache.shape[3])
    window = sliding_window
    starts = meta.query_start_loc.tolist()
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu

    decode_ids = [i for i, q in enumerate(q_lens) if q == 1]
    if decode_ids:
        lens = [s_lens[i] for i in decode_ids]
        firsts = [max(0, n - window) if window else 0 for n in lens]
        width = max(n - f for n, f in zip(lens, firsts))
        lens_t = torch.tensor(lens, device=dev)
        pos = torch.tensor(firsts, device=dev)[:, None] + torch.arange(width, device=dev)
        keep = pos < lens_t[:, None]                                        # [B, N]
        slots = _positions_to_slots(meta, block_size, torch.tensor(decode_ids, device=dev),
                                    torch.minimum(pos, lens_t[:, None] - 1))
        rows = torch.tensor([starts[i] for i in decode_ids], device=dev)
        o = _attend_variants(query[rows].unsqueeze(1), flat_k[slots], flat_v[slots],
                             keep[:, None, :], scale, logit_softcap, sinks)
        out[rows] = o[:, 0].to(out.dtype)

    for i, (q_len, seq_len) in enumerate(zip(q_lens, s_lens)):
        if q_len <= 1:
            continue
        ctx = seq_len - q_len
        seq = torch.tensor([i], device=dev)
        for r0 in range(0, q_len, VARIANT_QUERY_ROWS):
            r1 = min(q_len, r0 + VARIANT_QUERY_ROWS)
            first = max(0, ctx + r0 - window + 1) if window else 0
            pos = torch.arange(first, ctx + r1, device=dev)                 # keys [N]
            q_pos = ctx + torch.arange(r0, r1, device=dev)                  # rows [M]
            visible = pos[None, :] <= q_pos[:, None]
            if window:
                visible &= pos[None, :] > q_pos[:, None] - window
            slots = _positions_to_slots(meta, block_size, seq, pos[None, :])
            o = _attend_variants(query[starts[i] + r0:starts[i] + r1].unsqueeze(0),
                                 flat_k[slots], flat_v[slots], visible[None], scale,
                                 logit_softcap, sinks)
            out[starts[i] + r0:starts[i] + r1] = o[0].to(out.dtype)
    return out


# Below this many shared tokens (or decode sequences) the one-pass batched decode is cheaper
# (the torch path; our CPU decode kernel finds shared chunks itself).
CASCADE_MIN_PREFIX_TOKENS = 256
CASCADE_MIN_SEQS = 4


def shared_prefix_blocks(tables: list[tuple[int, ...]], seq_lens: list[int],
                         block_size: int) -> int:
    """Leading block ids common to every table, capped so each sequence keeps >= 1 own token.

    Args:
        tables: block tables of the decode sequences.
        seq_lens: their context + query lengths (tokens).

    Returns:
        Number of shared whole blocks.
    """
    limit = (min(seq_lens) - 1) // block_size
    first = tables[0]
    n = 0
    while n < limit and all(len(t) > n and t[n] == first[n] for t in tables):
        n += 1
    return n


def cascade_prefix_len(tables: list[tuple[int, ...]], query_lens: tuple[int, ...],
                       seq_lens: tuple[int, ...], block_size: int) -> int:
    """Tokens shared by every decode sequence's block table when worth a cascade, else 0.

    Worth it from ``CASCADE_MIN_SEQS`` decode sequences sharing ``CASCADE_MIN_PREFIX_TOKENS``.
    """
    decode = [i for i, q in enumerate(query_lens) if q == 1]
    if len(decode) < CASCADE_MIN_SEQS:
        return 0
    n = shared_prefix_blocks([tables[i] for i in decode], [seq_lens[i] for i in decode],
                             block_size)
    return n * block_size if n * block_size >= CASCADE_MIN_PREFIX_TOKENS else 0


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning (output, log-sum-exp), fp32 math.

    q: [..., M, D], k/v: [..., N, D], mask: broadcastable to [..., M, N] (True = keep).
    Returns out [..., M, D] and lse [..., M].
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out, lse


def _decode_cascade(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, idx: torch.Tensor,
                    rows: torch.Tensor, seq_lens: list[int], out: torch.Tensor) -> None:
    """Decode attention split at the shared prefix (cascade attention), merged by log-sum-exp.

    The prefix's K/V are gathered once and attended by all B queries in one matmul instead of
    being gathered B times; each sequence then attends over its own suffix.
    """
    assert meta.token_slots is not None
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    B, H = rows.shape[0], query.shape[1]
    G = H // num_kv_heads
    P, L = meta.cascade_prefix_len, max(seq_lens)
    q = query[rows].view(B, num_kv_heads, G, head_dim)                       # [B, KVH, G, D]

    prefix_slots = meta.token_slots[idx[0], :P]
    kp = flat_k[prefix_slots].to(q.dtype).permute(1, 0, 2)                   # [KVH, P, D]
    vp = flat_v[prefix_slots].to(q.dtype).permute(1, 0, 2)
    qp = q.permute(1, 0, 2, 3).reshape(num_kv_heads, B * G, head_dim)        # [KVH, B*G, D]
    o1, lse1 = _attend(qp, kp, vp, None, scale)
    o1 = o1.view(num_kv_heads, B, G, head_dim).permute(1, 0, 2, 3)           # [B, KVH, G, D]
    lse1 = lse1.view(num_kv_heads, B, G).permute(1, 0, 2)                    # [B, KVH, G]

    suffix_slots = meta.token_slots[idx, P:L]                                # [B, S]
    ks = flat_k[suffix_slots].to(q.dtype).permute(0, 2, 1, 3)                # [B, KVH, S, D]
    vs = flat_v[suffix_slots].to(q.dtype).permute(0, 2, 1, 3)
    lens = torch.tensor(seq_lens, device=query.device)
    keep = (P + torch.arange(L - P, device=query.device))[None, :] < lens[:, None]  # [B, S]
    o2, lse2 = _attend(q, ks, vs, keep[:, None, None, :], scale)             # [B, KVH, G, *]

    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)
    merged = (w1 * o1 + w2 * o2) / (w1 + w2)
    out[rows] = merged.reshape(B, H, head_dim).to(out.dtype)


def _decode_batch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, ids: list[int], starts: list[int],
                  out: torch.Tensor) -> None:
    block_size = key_cache.shape[1]
    seq_lens = [meta.seq_lens_cpu[i] for i in ids]
    max_len = max(seq_lens)
    max_blocks = -(-max_len // block_size)
    idx = torch.tensor(ids, device=query.device)
    rows = torch.tensor([starts[i] for i in ids], device=query.device)
    if meta.cascade_prefix_len and meta.token_slots is not None:
        _decode_cascade(query, key_cache, value_cache, meta, scale, idx, rows, seq_lens, out)
        return
    if meta.token_slots is not None:
        slots = meta.token_slots[idx, :max_len]                              # [B, L]
        k = key_cache.view(-1, *key_cache.shape[2:])[slots].transpose(1, 2)  # [B, KVH, L, D]
        v = value_cache.view(-1, *value_cache.shape[2:])[slots].transpose(1, 2)
    else:
        tables = meta.block_tables[idx, :max_blocks].long()                  # [B, nb]
        k = key_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
        v = value_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    lens = torch.tensor(seq_lens, device=query.device)
    mask = (torch.arange(max_len, device=query.device)[None, :] < lens[:, None])[:, None, None, :]
    q = query[rows].unsqueeze(2)                                           # [B, H, 1, D]
    k, v = k.to(q.dtype), v.to(q.dtype)  # a bf16 cache under fp32 rows (--kv-cache-dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[rows] = o.squeeze(2)


class TorchAttentionBackend(AttentionBackend):
    """``--attention-backend torch``: works on any device; the default on CPU."""

    name = "torch"

    def build_metadata(self, meta: AttentionMetadata,
                       block_tables_cpu: list[tuple[int, ...]]) -> AttentionMetadata:
        """Adds ``token_slots``, for a decode batch sharing a long prefix the cascade split
        (``cascade_prefix_len``), and on CPU the rows of our decode kernel (``kernel_rows``)."""
        return replace(meta,
                       token_slots=AttentionMetadata.expand_token_slots(meta.block_tables,
                                                                        meta.block_size),
                       cascade_prefix_len=cascade_prefix_len(block_tables_cpu,
                                                             meta.query_lens_cpu,
                                                             meta.seq_lens_cpu,
                                                             meta.block_size),
                       kernel_rows=kernel_rows(meta))

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logit_softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``paged_attention_torch``; with any variant set, ``paged_attention_variants_torch``
        for every sequence (no SDPA, cascade split or CPU decode kernel)."""
        if sliding_window is None and logit_softcap is None and sinks is None:
            return paged_attention_torch(query, key_cache, value_cache, meta, scale)
        return paged_attention_variants_torch(query, key_cache, value_cache, meta, scale,
                                              sliding_window=sliding_window,
                                              logit_softcap=logit_softcap, sinks=sinks)

    def fused_cpu_decode_usable(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                meta: AttentionMetadata, num_heads: int) -> bool:
        """Yes when every row is a decode (query_len 1) and our CPU decode kernels take the
        operands: then ``write_kv`` and ``forward`` run exactly ``reshape_and_cache`` and
        ``decode_attention``, as the fused layer does. A cascade split in ``meta`` is not needed
        there: the kernel reads chunks shared by several sequences once, bit-identically to
        reading them per sequence (kernels/cpu/decode_attention.cpp)."""
        return (all(q == 1 for q in meta.query_lens_cpu)
                and cpu_ops.decode_layer_usable(key_cache, value_cache, meta, num_heads))
