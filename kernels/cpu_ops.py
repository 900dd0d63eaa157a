"""Our fused CPU ops for the decode step besides the linears (vLLM has the same CPU ops), built
by ``kernels.cpu.build.load()`` into one extension with ``kernels.cpu_linear``'s kernels:

- ``rms_norm`` and ``add_rms_norm`` (``kernels/cpu/norm.cpp``; vLLM's ``rms_norm`` and
  ``fused_add_rms_norm``): torch 2.13's CPU ``rms_norm`` is five ops, about 40 us a call at 576
  features; ours is one pass over the row. Results match transformers' ``LlamaRMSNorm`` to fp32
  rounding (the sum of squares runs in 8 lanes).
- ``decode_attention`` (``kernels/cpu/decode_attention.cpp``; vLLM's ``paged_attention_v1``):
  the torch backend's decode rows read K/V straight through the block table instead of
  gathering them (two ``aten::index`` a layer) for SDPA. Equal to SDPA to fp32 rounding.
- ``rotary_neox_`` and ``reshape_and_cache`` (``kernels/cpu/rotary_cache.cpp``; vLLM's
  ``rotary_embedding`` and ``reshape_and_cache``): q and k rotated in place in the fused qkv
  output, bit-identical to the torch formula; K/V rows copied to their cache slots.

Where our CPU kernels are not loaded (no compiler, no AVX2/FMA/F16C,
``SALTSERVE_CPU_KERNELS=0``), on other devices or dtypes, the norms, the rotation and the cache
write compute the same thing with torch ops, and ``decode_attention_usable`` is False. No result
depends on the other rows of its batch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.cpu import build

if TYPE_CHECKING:
    from engine.attention.metadata import AttentionMetadata


def _our_rows(x: torch.Tensor) -> bool:
    """Rows our CPU ops take: [num_tokens, n] contiguous fp32 on CPU, no autograd."""
    return (build.loaded() and x.device.type == "cpu" and x.dtype == torch.float32
            and x.dim() == 2 and x.is_contiguous() and not x.requires_grad)


def _ours(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _our_rows(x) and weight.dtype == torch.float32 and weight.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x ** 2, -1) + eps))`` per row, fp32 math (transformers'
    ``LlamaRMSNorm``).

    Args:
        x: [num_tokens, hidden] float.
        weight: [hidden], x's dtype.

    Returns:
        [num_tokens, hidden], x's dtype (a new tensor).
    """
    if _ours(x, weight):
        return torch.ops.saltserve_cpu.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add fused into the next RMSNorm (vLLM's
    ``fused_add_rms_norm``): ``residual + x``, and its ``rms_norm``.

    Args:
        residual, x: [num_tokens, hidden], same dtype; ``residual`` may be updated in place
            (pass one the caller no longer needs as it was).
        weight: [hidden].

    Returns:
        (the new residual ``residual + x``, its RMSNorm), both [num_tokens, hidden].
    """
    if _ours(x, weight) and _ours(residual, weight) and residual.shape == x.shape:
        return residual, torch.ops.saltserve_cpu.add_rms_norm(residual, x, weight, eps)
    residual = residual + x
    return residual, rms_norm(residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The Llama MLP's activation (vLLM's ``silu_and_mul``): ``silu(x[:, :d]) * x[:, d:]``.

    Args:
        x: [num_tokens, 2 * d] (the fused gate/up projection's output).

    Returns:
        [num_tokens, d], x's dtype: our op for contiguous fp32 CPU rows (one pass; its exp is
        ours, about 1 ulp from torch's), else ``F.silu`` and a product.
    """
    if _our_rows(x):
        return torch.ops.saltserve_cpu.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its maximum (greedy sampling): ``x.max(dim=-1).indices``, the same
    values (equal maxima: the first; a row with a NaN: its first NaN).

    Args:
        x: [rows, n] float, n > 0.

    Returns:
        [rows] int64: our op for contiguous fp32 CPU rows (``kernels/cpu/sampling.cpp``; 43 us
        of torch's for a [1, 49,152] row), else torch's.
    """
    if _our_rows(x) and x.shape[1] > 0:
        return torch.ops.saltserve_cpu.argmax_rows(x)
    return x.max(dim=-1).indices


def _int32_cpu_metadata(meta: AttentionMetadata) -> bool:
    """The metadata's query_start_loc, seq_lens and block_tables as the engine builds them."""
    return all(t.dtype == torch.int32 and t.is_contiguous() and t.device.type == "cpu"
               for t in (meta.query_start_loc, meta.seq_lens, meta.block_tables))


def _caches_usable(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """fp32 caches, or bf16 ones that ``decode_attention`` takes on this CPU (the callers check
    the caches' shape)."""
    if key_cache.dtype != value_cache.dtype:
        return False
    return key_cache.dtype == torch.float32 or (
        key_cache.dtype == torch.bfloat16 and bf16_decode_attention_usable(key_cache.shape[-1]))


def decode_attention_usable(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether ``decode_attention`` runs for these operands (an fp32 query on CPU, kernels
    loaded, fp32 caches or bf16 ones where ``bf16_decode_attention_usable``, the metadata's
    int32 tensors as the engine builds them)."""
    return (build.loaded() and query.device.type == "cpu" and query.dtype == torch.float32
            and _caches_usable(key_cache, value_cache)
            and query.dim() == 3 and key_cache.dim() == 4 and query.shape[-1] % 8 == 0
            and query.shape[1] % key_cache.shape[2] == 0
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and _int32_cpu_metadata(meta))


def bf16_decode_attention_usable(head_dim: int) -> bool:
    """Whether ``decode_attention`` takes bf16 caches here: our kernels loaded with their bf16
    path (GCC 11+), a CPU with avx512_bf16 (its VDPBF16PS does the products) and head_dim a
    multiple of 32."""
    return build.loaded() and head_dim % 32 == 0 and _bf16_kv_cache()


def decode_attention_avx512(enabled: bool | None = None) -> bool:
    """Whether ``decode_attention`` runs fp32 caches on its AVX-512 tiles (two of the AVX2
    path's 8-lane registers in each zmm: the same FMA chains and add trees, so the same bits;
    ``benchmarks/bench_decode_attention.py`` times both). On by default where the CPU has
    avx512f/bw/vl/dq and the kernels were built with it (GCC). ``enabled`` switches it for this
    process (tests and benchmarks compare the paths in one process); True only takes effect
    where it is available. Requires ``build.load()``."""
    return bool(torch.ops.saltserve_cpu.attention_avx512(-1 if enabled is None else int(enabled)))


def decode_attention_amx(enabled: bool | None = None) -> bool:
    """Whether ``decode_attention`` runs bf16 caches on AMX-BF16 tiles (TDPBF16PS, 16 query
    rows a tile) instead of avx512_bf16's VDPBF16PS: the same operands (Q and P as bf16 high and
    low parts), results equal to fp32 rounding but not bit for bit, so every bf16 item of a call
    takes the one path. On by default where the CPU has amx-tile and amx-bf16, Linux grants the
    tile registers, the kernels were built with AMX (GCC 11+) and ``SALTSERVE_AMX=0`` is not
    set. ``enabled`` switches it for this process (tests and benchmarks compare the paths);
    True only takes effect where it is available. Requires ``build.load()``."""
    return bool(torch.ops.saltserve_cpu.attention_amx(-1 if enabled is None else int(enabled)))


@functools.cache
def _bf16_kv_cache() -> bool:
    return bool(torch.ops.saltserve_cpu.bf16_kv_cache())


def decode_layer_usable(key_cache: torch.Tensor, value_cache: torch.Tensor,
                        meta: AttentionMetadata, num_heads: int) -> bool:
    """Whether ``decode_layer``'s attention, rotation and cache write take these operands
    (fp32 caches on CPU, or bf16 ones where ``bf16_decode_attention_usable``; head_dim a
    multiple of 16, the metadata's tensors as the engine builds them); the caller checks that
    every row is a decode."""
    head_dim = key_cache.shape[-1]
    return (build.loaded() and key_cache.device.type == "cpu" and key_cache.dim() == 4
            and _caches_usable(key_cache, value_cache)
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and head_dim % 16 == 0 and num_heads % key_cache.shape[2] == 0
            and meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.device.type == "cpu"
            and _int32_cpu_metadata(meta))


def decode_layer(hidden: torch.Tensor, residual: torch.Tensor, first: bool,
                 ln1: torch.Tensor, ln2: torch.Tensor, eps: float,
                 weights: list[torch.Tensor | None], kinds: list[int], groups: list[int],
                 cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int,
                 intermediate_size: int, scale: float) -> torch.Tensor:
    """One Llama decoder layer for a step of decodes only, in one call
    (``kernels/cpu/decode_layer.cpp``): the same kernels in the same order as
    ``LlamaDecoderLayer.forward``, so bit-identical to it. ``decode_layer_usable`` must hold
    and every row must be a sequence's one new token (a cascade split in ``meta`` is not
    needed: ``decode_attention`` reads chunks shared by several sequences once itself).

    Args:
        hidden, residual: [num_tokens, hidden_size] fp32; ``residual`` is updated in place to
            ``residual + hidden + attention output`` (``first``: the layer's input is ``hidden``
            alone, and ``residual`` must be ``hidden`` itself).
        ln1, ln2: the two RMSNorm weights [hidden_size].
        weights, kinds, groups: the four projections (qkv, o, gate_up, down) as their
            ``LinearMethod.decode_spec``s: four tensors each (three operands, the bias; None
            where unused), a kind and a group size each.
        cos, sin: [num_tokens, 1, head_dim] fp32 contiguous.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] (fp32, or bf16:
            ``decode_layer_usable``); this step's K/V are written at ``meta.slot_mapping``.

    Returns:
        The layer's MLP output [num_tokens, hidden_size] (the layer's output is it plus the
        updated ``residual``).

    Raises:
        RuntimeError: operands the kernels do not take. Each kernel checks its own before
            writing, but a failure in a later one leaves ``residual`` and this step's K/V
            slots written, as the Python layer would.
    """
    return torch.ops.saltserve_cpu.decode_layer(
        hidden, residual, first, ln1, ln2, eps, weights, kinds, groups, cos, sin, key_cache,
        value_cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        num_heads, key_cache.shape[2], key_cache.shape[3], intermediate_size, scale)


def decode_layers(hidden: torch.Tensor, norms: list[torch.Tensor], eps: float,
                  weights: list[torch.Tensor | None], kinds: list[int], groups: list[int],
                  cos: torch.Tensor, sin: torch.Tensor, kv_caches: torch.Tensor,
                  meta: AttentionMetadata, num_heads: int, intermediate_size: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer of a step of decodes only, in one call: ``decode_layer`` for layer
    i with ``norms[2 i]``, ``norms[2 i + 1]``, projections ``4 i .. 4 i + 3`` of ``weights``
    (four tensors each), ``kinds`` and ``groups``, and the caches ``kv_caches[i, 0]``,
    ``kv_caches[i, 1]``: the same calls in the same order, so the same bits, without a Python
    call and an argument conversion a layer (about 10 us each).

    Args:
        hidden: [num_tokens, hidden_size] fp32, the embeddings; it becomes the residual
            stream (updated in place).
        kv_caches: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] fp32, or
            bf16 where ``bf16_decode_attention_usable`` (``--kv-cache-dtype bfloat16``).

    Returns:
        (the last layer's MLP output, the residual stream: ``hidden`` itself); the model's
        output before its final norm is their sum.

    Raises:
        RuntimeError: list lengths that do not match the layers, or what ``decode_layer``
            refuses.
    """
    return torch.ops.saltserve_cpu.decode_layers(
        hidden, norms, eps, weights, kinds, groups, cos, sin, kv_caches, meta.slot_mapping,
        meta.query_start_loc, meta.seq_lens, meta.block_tables, num_heads,
        kv_caches.shape[-2], kv_caches.shape[-1], intermediate_size, scale)


def decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> None:
    """Attention of every sequence with one new token (query_len 1) over its paged context,
    written into ``out``'s rows of those sequences; other rows are left as they are.

    Args:
        out: [num_tokens, num_heads, head_dim] fp32, contiguous.
        query: the same shape, fp32 (copied when not contiguous).
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] fp32, or both
            bf16 (``bf16_decode_attention_usable``: Q and P are then split into bf16 high and
            low parts, each multiplied with K and V on VDPBF16PS, or on AMX tiles where
            ``decode_attention_amx()``, and summed in fp32: fp32 attention over the cache's
            bf16 values to about 3e-6 relative); this step's K/V already written.
        query_start_loc: [num_seqs + 1] int32; seq_lens: [num_seqs] int32;
        block_tables: [num_seqs, max_blocks] int32 (``AttentionMetadata``'s).
        scale: softmax scale.

    Raises:
        RuntimeError: shapes or dtypes it does not take (bf16 caches without avx512_bf16, or a
            head_dim that is not a multiple of 32), a seq_len past its block table, or a block id
            outside the cache (checked before anything is read).
    """
    torch.ops.saltserve_cpu.decode_attention(out, query.contiguous(), key_cache, value_cache,
                                             query_start_loc, seq_lens, block_tables, scale)


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [T, heads, D] by cos/sin [T, 1, D] (the reference formula)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotary_neox_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                 head_dim: int) -> None:
    """Rotates the first ``num_heads`` heads of every row of ``x`` in place (neox style:
    ``x * cos + cat(-x2, x1) * sin``, the same bits as that torch formula).

    Args:
        x: [num_tokens, width] (rows may be strided, e.g. the fused qkv output, whose q and k
            heads come first); ``num_heads * head_dim <= width``.
        cos, sin: [num_tokens, 1, head_dim] in x's dtype.
    """
    t = x.shape[0]
    if (build.loaded() and x.device.type == "cpu" and x.dtype == torch.float32
            and cos.dtype == torch.float32 and sin.dtype == torch.float32 and x.dim() == 2
            and x.stride(1) == 1 and (t < 2 or x.stride(0) >= x.shape[1])
            and head_dim % 16 == 0 and cos.is_contiguous() and sin.is_contiguous()):
        torch.ops.saltserve_cpu.rotary_neox_(x, cos.view(t, head_dim), sin.view(t, head_dim),
                                             num_heads, head_dim)
        return
    heads = x[:, :num_heads * head_dim].view(t, num_heads, head_dim)
    heads.copy_(_rotate_torch(heads, cos, sin))


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes this step's K/V rows into the paged cache at ``slot_mapping``.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim] (rows may be strided).
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], both of
            key's dtype, or both bf16 under fp32 rows (``--kv-cache-dtype bfloat16``: rounded
            to nearest even, as ``Tensor.to`` does).
        slot_mapping: [num_tokens] int64, every entry a valid slot.

    Raises:
        RuntimeError: a slot outside the cache (nothing written), or shapes that do not match.
    """
    if (build.loaded() and key.device.type == "cpu" and key.dtype == torch.float32
            and key_cache.dtype in (torch.float32, torch.bfloat16) and key.stride(2) == 1 and value.stride(2) == 1
            and key.stride(1) == key.shape[2] and value.stride(1) == value.shape[2]
            and key_cache.is_contiguous() and value_cache.is_contiguous()):
        torch.ops.saltserve_cpu.reshape_and_cache(key, value, key_cache, value_cache,
                                                  slot_mapping)
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                           key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                             value.to(value_cache.dtype))
