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


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` would run the kernel for these operands (``load()`` must be True)."""
    return (loaded() and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and weight.is_contiguous() and not x.requires_grad)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           onednn: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the kernel where ``usable``; above ``MAX_ROWS`` fp32
    rows on CPU through oneDNN's GEMM (``onednn``, once the kernels are loaded: with
    ``SALTSERVE_CPU_KERNELS=0`` every call is ``F.linear``); else ``F.linear``.

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
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
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
