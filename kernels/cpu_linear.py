"""Our CPU linear kernel for decode-sized batches (``kernels/cpu/linear.cpp``), built on first use.

``linear(x, weight, bias)`` is ``F.linear`` for fp32 CPU inputs of at most ``MAX_ROWS`` rows: the
shape of a decode step (one row per running sequence) and of the short stall-free steps the fair
scheduler runs beside another tenant's decodes. torch's sgemm (MKL) takes its generic path on
AMD CPUs for 2-32 rows, so 4 rows cost about 2-3x one row although the step is bound by reading
the weights once; the kernel reads each weight row once per call and reuses it for 4 rows from
registers (``benchmarks/bench_cpu_linear.py`` prints both against each other). Each output is
summed in the same order whatever the number of rows (1 to ``MAX_ROWS``), so within a dense fp32
decode step a sequence's logits do not depend on what else is in its batch; above ``MAX_ROWS``
rows, or on quantized layers below their dense threshold, other kernels run and that no longer holds.

The kernels are built once per machine by ``kernels.cpu.build`` into one extension with the
fused ops of ``kernels.cpu_ops`` (``load()``, ``loaded()``, ``unavailable_reason()`` and
``cpu_flags()`` here are its functions) and run as ``torch.ops.saltserve_cpu.*``. It needs a C++
compiler and a CPU with AVX2, FMA and F16C; without them, or with ``SALTSERVE_CPU_KERNELS=0``,
every call is ``F.linear`` (and every fused op its torch fallback), and one warning says why.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# The loader's functions, re-exported: many callers ask ``cpu_linear.load()`` / ``loaded()``.
from kernels.cpu.build import cpu_flags, load, loaded, unavailable_reason  # noqa: F401

Q4_GROUP = 32  # inputs per 4-bit group (GGUF's Q4_0/Q4_1 block)
Q4_VNNI_TILE = 16  # outputs per tile of kernels/cpu/q4_vnni.cpp (the lanes of a zmm)
VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})
# Up to this many rows the kernel beats MKL's sgemm at this model's shapes on AVX2 (measured by
# benchmarks/bench_cpu_linear.py); prefill chunks above it are compute-bound GEMMs MKL blocks for.
MAX_ROWS = 32
# Above MAX_ROWS, fp32 forwards run oneDNN's GEMM (torch.ops.mkldnn._linear_pointwise) instead
# of F.linear's MKL sgemm, which takes a slower path on AMD CPUs: about 2x faster at the bundled
# model's shapes with AVX-512, still faster limited to AVX2, and prefill gains about 1.5x in the
# engine (docs/benchmarks.md). Sums differ from MKL's at fp32 rounding (about 1e-6 relative);
# the HF parity tests hold. Callers pass ``onednn`` (``KernelPolicy.onednn_large_m``).
# oneDNN (and torch's ideep layer above it) caches a GEMM primitive per input shape, up to 1,024
# of each, at 0.5-0.8 MiB apiece: a server whose prefill chunks take every row count from 33
# to 2,048 grew by hundreds of MiB, and a new shape costs about 2 ms to create. So the rows go
# up to a multiple of ONEDNN_ROW_BUCKET (zero rows, sliced off the output): at most 2,048 / 64
# shapes per weight, all cached after warm-up, for at most 63 rows of extra GEMM work.
ONEDNN_ROW_BUCKET = 64


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` would run the kernel for these operands (``load()`` must be True)."""
    return (loaded() and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and weight.is_contiguous() and not x.requires_grad)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           onednn: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the kernel where ``usable``; above ``MAX_ROWS`` fp32
    rows on CPU through oneDNN's GEMM (``onednn``, once the kernels are loaded: with
    ``SALTSERVE_CPU_KERNELS=0`` every call is ``F.linear``), its rows padded to a multiple of
    ``ONEDNN_ROW_BUCKET``; else ``F.linear``.

    Args:
        x: [num_tokens, in_features] activations.
        weight: [out_features, in_features], as ``nn.Linear`` holds it.
        bias: [out_features] or None.
        onednn: allow oneDNN above ``MAX_ROWS`` (``KernelPolicy.onednn_large_m``).

    Returns:
        [num_tokens, out_features] in ``x``'s dtype.
    """
    if usable(x, weight):
        return torch.ops.saltserve_cpu.linear_small_m(x.contiguous(), weight, bias)
    if (x.dim() == 2 and x.shape[0] > MAX_ROWS and x.device.type == "cpu"
            and x.dtype == torch.float32 and not x.requires_grad
            and large_m_onednn(weight, onednn)):
        m = x.shape[0]
        rows = -(-m // ONEDNN_ROW_BUCKET) * ONEDNN_ROW_BUCKET
        if rows != m:
            x = F.pad(x, (0, 0, 0, rows - m))
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:m]
    return F.linear(x, weight, bias)


def large_m_onednn(weight: torch.Tensor, enabled: bool = True) -> bool:
    """Whether ``linear`` runs fp32 CPU forwards of more than ``MAX_ROWS`` rows with ``weight``
    through oneDNN (``enabled``: ``KernelPolicy.onednn_large_m``; kernels loaded; torch built
    with oneDNN); else ``F.linear``. The fused decode layer asks the same
    (``engine.quantization.base.dense_spec``)."""
    return (enabled and loaded() and weight.dtype == torch.float32
            and weight.device.type == "cpu" and torch.backends.mkldnn.is_available())


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [out, in] (uint8 in [0, 15], ``in`` a multiple of 32) -> [out, in / 2] uint8
    in the kernel's layout, GGUF's own: per group of 32 inputs 16 bytes, byte j holding code j
    in its low nibble and code j + 16 in its high one.

    Raises:
        ValueError: ``in`` not a multiple of 32.
    """
    n, k = codes.shape
    if k % Q4_GROUP:
        raise ValueError(f"in_features ({k}) must be a multiple of {Q4_GROUP}")
    halves = codes.to(torch.uint8).view(n, k // Q4_GROUP, 2, Q4_GROUP // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def q4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
              minimum: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` with ``w = code * scale + minimum`` in groups of 32 inputs (GGUF's
    Q4_1), through ``kernels/cpu/q4_linear.cpp`` (``load()`` must be True). The activations are
    rounded to int8 per group of 32, as llama.cpp's Q4_1 x Q8_1 dot product does, so results
    differ from the dequantized fp32 product by that rounding (about 1/254 of each input).

    Args:
        x: [num_tokens, in_features] fp32.
        codes: [out_features, in_features / 2] uint8 from ``pack_q4``.
        scale, minimum: [out_features, in_features / 32] fp16.
        bias: [out_features] fp32 or None.

    Returns:
        [num_tokens, out_features] fp32.

    Raises:
        RuntimeError: shapes, dtypes or layouts the kernel does not take (a clear message).
    """
    return torch.ops.saltserve_cpu.q4_linear(x.contiguous(), codes, scale, minimum, bias)


def q4_vnni_usable(out_features: int, in_features: int) -> bool:
    """Whether ``q4_linear_vnni`` runs here for a layer of this shape: kernels loaded (AVX2;
    AVX-512 VNNI, ``VNNI_FLAGS``, where the CPU has it), ``out_features`` a multiple of 16 and
    ``in_features`` of 32."""
    return loaded() and out_features % Q4_VNNI_TILE == 0 and in_features % Q4_GROUP == 0


def int8_dot_isa() -> str:
    """Which path ``q4_linear_vnni`` and ``q8_linear_vnni`` take here: "avx512_vnni" on CPUs
    with ``VNNI_FLAGS`` (unless ``SALTSERVE_VNNI=0``, read once per process by the kernel),
    "avx512_vnni+amx_int8" where batches of enough rows also run on AMX (``int8_amx``), else
    "avx2". The paths give the same bits."""
    if not (VNNI_FLAGS <= cpu_flags() and os.environ.get("SALTSERVE_VNNI") != "0"):
        return "avx2"
    return "avx512_vnni+amx_int8" if loaded() and int8_amx() else "avx512_vnni"


def int8_amx(enabled: bool | None = None) -> bool:
    """Whether ``q4_linear_vnni`` (from 16 rows: its whole 8-row blocks) and ``q8_linear_vnni``
    (from 6) run their integer dots on AMX-INT8 tiles (Sapphire Rapids and later Xeons), where
    the CPU has AMX, Linux grants the tile registers and ``SALTSERVE_AMX=0`` is not set: the same
    exact dots and fp32 epilogue as the VNNI path, so the same bits, 1.2-1.7x faster at 16+ rows
    (docs/benchmarks.md). ``enabled`` switches it for this process (tests and benchmarks
    compare the paths in one process); True only takes effect where AMX is available. Requires
    ``load()``. ``int8_amx_calls()`` counts the calls that took it."""
    return bool(torch.ops.saltserve_cpu.int8_amx(-1 if enabled is None else int(enabled)))


def int8_amx_calls() -> int:
    """How many ``q4_linear_vnni`` / ``q8_linear_vnni`` calls in this process ran on AMX."""
    return int(torch.ops.saltserve_cpu.int8_amx_calls())


def pack_q4_vnni(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 weights -> ``kernels/cpu/q4_vnni.cpp``'s layout: tiles of 16 outputs, per tile and
    group of 32 inputs 256 bytes of codes (sub-block s of 8 inputs k0.. is 64 bytes, byte
    4 l + b = code[l, k0 + b] | code[l, k0 + 4 + b] << 4) and 32 fp16 (16 scales, 16 minimums).

    Args:
        codes: [out, in] uint8 in [0, 15]; ``out`` a multiple of 16, ``in`` of 32.
        scale, minimum: [out, in / 32] (any float dtype; stored as fp16, exact for a GGUF's).

    Returns:
        (codes [out / 16, in / 32, 256] uint8, scale_min [out / 16, in / 32, 32] fp16).

    Raises:
        ValueError: a shape the kernel cannot take.
    """
    n, k = codes.shape
    if n % Q4_VNNI_TILE or k % Q4_GROUP or scale.shape != (n, k // Q4_GROUP) \
            or minimum.shape != scale.shape:
        raise ValueError(f"q4 vnni: codes [{n}, {k}] need out a multiple of {Q4_VNNI_TILE}, "
                         f"in of {Q4_GROUP}, scale and minimum [out, in / {Q4_GROUP}]")
    t, g = n // Q4_VNNI_TILE, k // Q4_GROUP
    c = codes.to(torch.uint8).view(t, Q4_VNNI_TILE, g, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
    packed = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(t, g, 256).contiguous()

    def tiles(v: torch.Tensor) -> torch.Tensor:  # [out, G] -> [T, G, 16]
        return v.to(torch.float16).view(t, Q4_VNNI_TILE, g).transpose(1, 2)

    return packed, torch.cat([tiles(scale), tiles(minimum)], dim=2).contiguous()


def q4_linear_vnni(x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor,
                   bias: torch.Tensor | None = None, act_bits: int = 16) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for Q4_1 weights through ``kernels/cpu/q4_vnni.cpp``: 16 outputs a
    vpdpbusd on AVX-512 VNNI CPUs, 8 a vpmaddubsw + vpmaddwd on AVX2 ones (``int8_dot_isa``;
    the same bits), exact integer dots (``q4_vnni_usable`` must be True). Activations are rounded
    per group of 32 inputs: ``act_bits`` 8 to int8 (``q4_linear``'s and llama.cpp's Q8_1
    rounding), 16 to int8 plus an int8 residual in 1/256 steps (16-bit fixed point, about
    twice the multiply-adds).

    Args:
        x: [num_tokens, in_features] fp32.
        codes, scale_min: from ``pack_q4_vnni``.
        bias: [out_features] fp32 or None.
        act_bits: 8 or 16.

    Returns:
        [num_tokens, out_features] fp32.

    Raises:
        RuntimeError: shapes, dtypes or layouts the kernel does not take (a clear message).
    """
    return torch.ops.saltserve_cpu.q4_linear_vnni(x.contiguous(), codes, scale_min, bias,
                                                  act_bits)


def pack_q8_vnni(qweight: torch.Tensor) -> torch.Tensor:
    """Per-channel int8 codes [out, in] (``out`` a multiple of 16, ``in`` of 32) ->
    ``q8_linear_vnni``'s layout [out / 16, in / 32, 512] uint8: per tile of 16 outputs and group
    of 32 inputs, sub-block s (inputs 4 s .. 4 s + 3 of the group) is 64 bytes, byte 4 l + b =
    code[l, 4 s + b] + 128.

    Raises:
        ValueError: a shape the kernel cannot take.
    """
    n, k = qweight.shape
    if n % Q4_VNNI_TILE or k % Q4_GROUP or qweight.dtype != torch.int8:
        raise ValueError(f"q8 vnni: int8 codes [{n}, {k}] need out a multiple of "
                         f"{Q4_VNNI_TILE} and in of {Q4_GROUP}")
    t, g = n // Q4_VNNI_TILE, k // Q4_GROUP
    u = (qweight.to(torch.int16) + 128).to(torch.uint8)
    return u.view(t, Q4_VNNI_TILE, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, g, 512).contiguous()


def q8_linear_vnni(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None, act_bits: int = 16) -> torch.Tensor:
    """``x @ (code * scale[:, None]).T (+ bias)`` for per-channel int8 weights through
    ``kernels/cpu/q4_vnni.cpp`` (``q4_vnni_usable`` must be True): exact integer dots, the
    activations rounded per group of 32 as ``q4_linear_vnni`` rounds them (``act_bits``).

    Args:
        x: [num_tokens, in_features] fp32.
        codes: from ``pack_q8_vnni``.
        scale: [out_features] fp32.
        bias: [out_features] fp32 or None.
        act_bits: 8 or 16.

    Returns:
        [num_tokens, out_features] fp32.

    Raises:
        RuntimeError: shapes, dtypes or layouts the kernel does not take (a clear message).
    """
    return torch.ops.saltserve_cpu.q8_linear_vnni(x.contiguous(), codes, scale, bias, act_bits)


# ggml type id -> (bytes of codes per tile and group of 32, bit planes above the nibble plane)
_KQUANT_CODES = {8: (512, None), 12: (256, 0), 13: (320, 1), 14: (384, 2)}


def _kquant_tile_codes(ggml_type: int, codes: torch.Tensor) -> torch.Tensor:
    """[out, in] unsigned codes -> [out / 16, in / 32 * bytes] in kquant_vnni.cpp's layout."""
    n, k = codes.shape
    t, g = n // Q4_VNNI_TILE, k // Q4_GROUP
    # operand o of a group: inputs 4 o .. 4 o + 3 of the tile's 16 outputs, byte 4 l + b
    ops = codes.to(torch.uint8).view(t, Q4_VNNI_TILE, g, 8, 4).permute(0, 2, 3, 1, 4)
    ops = ops.reshape(t, g, 8, 64)
    _, planes = _KQUANT_CODES[ggml_type]
    if planes is None:  # Q8_0: the codes as they are
        return ops.reshape(t, -1).contiguous()
    low = ops & 0x0F
    nibbles = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(t, g, 256)
    parts = [nibbles]
    for p in range(planes):  # bit 4 + p of each code, 64 bits (8 bytes) per operand
        bits = ((ops >> (4 + p)) & 1).view(t, g, 8, 8, 8)  # bit i of byte j: code 8 j + i
        plane = bits[..., 0].clone()
        for i in range(1, 8):  # uint8 throughout: a gate/up of 8B shapes stays ~2x its codes
            plane |= bits[..., i] << i
        parts.append(plane.reshape(t, g, 64))
    return torch.cat(parts, dim=2).reshape(t, -1).contiguous()


def _as_bytes(v: torch.Tensor) -> torch.Tensor:
    """[..., 16] fp32 / fp16 / int8 / uint8 -> its bytes [..., 16 * itemsize] uint8."""
    return v.contiguous().view(torch.uint8)


def _kquant_tile_scales(ggml_type: int, d: torch.Tensor, sc: torch.Tensor | None,
                        dmin: torch.Tensor | None, m: torch.Tensor | None) -> torch.Tensor:
    """The scales of every tile of 16 outputs: [out / 16, bytes] uint8 in super-block records
    (kquant_vnni.cpp's opening comment)."""
    n = d.shape[0]
    t = n // Q4_VNNI_TILE

    def tiles(v: torch.Tensor) -> torch.Tensor:  # [out, B] -> [T, B, 16]
        return v.view(t, Q4_VNNI_TILE, -1).transpose(1, 2)

    if ggml_type == 8:  # Q8_0: d [out, G] fp16 per group
        return _as_bytes(tiles(d.to(torch.float16))).reshape(t, -1)
    s = d.shape[1]
    dd = _as_bytes(tiles(d.float()))  # [T, S, 64]
    if ggml_type == 14:  # Q6_K: sc [out, S * 16] int8 -> per group (inputs 0-15, 16-31)
        scs = _as_bytes(tiles(sc.to(torch.int8)).reshape(t, s, 8, 2 * Q4_VNNI_TILE))
        return torch.cat([dd, scs.reshape(t, s, -1)], dim=2).reshape(t, -1)
    dm = _as_bytes(tiles(dmin.float()))
    scm = torch.stack([tiles(sc.to(torch.uint8)), tiles(m.to(torch.uint8))], dim=2)
    return torch.cat([dd, dm, scm.reshape(t, s, -1)], dim=2).reshape(t, -1)


def kquant_usable(part_rows: list[int], in_features: int, ggml_types: set[int]) -> bool:
    """Whether ``kquant_linear`` takes a weight of these parts: rows a multiple of 16 each,
    inputs a multiple of 256 (of 32 where every part is Q8_0, ggml type 8)."""
    return (all(n % Q4_VNNI_TILE == 0 for n in part_rows) and set(ggml_types) <= set(_KQUANT_CODES)
            and in_features % (Q4_GROUP if set(ggml_types) == {8} else 256) == 0)


def pack_kquant(parts: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF K-quant / Q8_0 blocks, unpacked (``engine.quantization.kquant.KQuantBlocks``) and
    stacked by output rows, -> ``kquant_linear``'s operands.

    Args:
        parts: per part ``(ggml_type, codes, d, sc, dmin, m)``: ggml_type 8 (Q8_0), 12 (Q4_K),
            13 (Q5_K) or 14 (Q6_K); codes [rows, in] uint8 (Q8_0: ``q + 128``); d [rows,
            in / 256] (Q8_0: [rows, in / 32]); sc, dmin, m as ``KQuantBlocks`` holds them.
            Every part's rows a multiple of 16; ``in`` a multiple of 256 (32: Q8_0 only).

    Returns:
        (codes [bytes] uint8, scales [bytes] uint8, meta [out / 16, 3] int64: per tile its
        ggml type and the byte offsets of its codes and scales).

    Raises:
        ValueError: a type or a shape the kernel cannot take.
    """
    codes, scales, meta = [], [], []
    code_off = scale_off = 0
    for ggml_type, c, d, sc, dmin, m in parts:
        n, k = c.shape
        if ggml_type not in _KQUANT_CODES:
            raise ValueError(f"kquant: ggml type {ggml_type} is not Q8_0, Q4_K, Q5_K or Q6_K")
        if n % Q4_VNNI_TILE or k % (Q4_GROUP if ggml_type == 8 else 256):
            raise ValueError(f"kquant: a part of [{n}, {k}] needs rows a multiple of "
                             f"{Q4_VNNI_TILE} and inputs of {Q4_GROUP if ggml_type == 8 else 256}")
        tc = _kquant_tile_codes(ggml_type, c)
        ts = _kquant_tile_scales(ggml_type, d, sc, dmin, m)
        for i in range(n // Q4_VNNI_TILE):
            meta.append((ggml_type, code_off + i * tc.shape[1], scale_off + i * ts.shape[1]))
        codes.append(tc.reshape(-1))
        scales.append(ts.reshape(-1))
        code_off += tc.numel()
        scale_off += ts.numel()
    return (torch.cat(codes).contiguous(), torch.cat(scales).contiguous(),
            torch.tensor(meta, dtype=torch.int64).reshape(-1, 3))


def kquant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  meta: torch.Tensor, bias: torch.Tensor | None = None,
                  act_bits: int = 16) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for GGUF K-quant and Q8_0 weights as the file stores them, through
    ``kernels/cpu/kquant_vnni.cpp`` (AVX-512 VNNI, or AVX2 with the same bits): exact integer
    dots, no weight rounded again; activations rounded per group of 32 as ``q4_linear_vnni``
    rounds them (``act_bits`` 8 or 16).

    Args:
        x: [num_tokens, in_features] fp32.
        codes, scales, meta: from ``pack_kquant``.
        bias: [out_features] fp32 or None.

    Returns:
        [num_tokens, out_features] fp32.

    Raises:
        RuntimeError: shapes, dtypes, types or offsets the kernel does not take (a clear
            message).
    """
    return torch.ops.saltserve_cpu.kquant_linear(x.contiguous(), codes, scales, meta, bias,
                                                 act_bits)
