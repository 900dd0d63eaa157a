"""The projection kinds of the fused decode layer: which kernel runs a projection and which
operands it takes (``engine.quantization``'s ``DecodeSpec.kind``, ``kernels/cpu/decode_layer.cpp``).

``Kind`` mirrors ``enum Kind`` in ``kernels/cpu/kinds.h`` name for name and value for value
(``tests/kernels/test_kernel_kinds.py`` checks it); ``SPEC_*`` are the same values as plain
ints, the names ``engine.quantization`` exports. A new kind is added to both files.
"""

from __future__ import annotations

from enum import IntEnum


class Kind(IntEnum):
    """One projection's kernel and operands (kinds.h lists what each takes)."""

    DENSE = 0  # (w) fp32: our linear_small_m (up to kernels.cpu_linear.MAX_ROWS rows)
    INT4 = 1  # (packed, scales_and_zeros): torch's _weight_int4pack_mm_for_cpu in bf16
    Q4 = 2  # (codes, scale, minimum): our q4_linear
    INT8 = 3  # (qweight, scales): torch's _weight_int8pack_mm in bf16
    LINEAR = 4  # (w) fp32: F.linear (more rows)
    LINEAR_BF16 = 5  # (w) bf16: F.linear in bf16 (a quantized layer's dense copy)
    LINEAR_ONEDNN = 6  # (w) fp32: oneDNN's GEMM above MAX_ROWS rows
    Q4_VNNI = 7  # (codes, scale_min): our q4_linear_vnni
    Q8_VNNI = 8  # (codes, scale): our q8_linear_vnni
    KQUANT = 9  # (codes, scales, meta): our kquant_linear (GGUF K-quants and Q8_0)


SPEC_DENSE = Kind.DENSE.value
SPEC_INT4 = Kind.INT4.value
SPEC_Q4 = Kind.Q4.value
SPEC_INT8 = Kind.INT8.value
SPEC_LINEAR = Kind.LINEAR.value
SPEC_LINEAR_BF16 = Kind.LINEAR_BF16.value
SPEC_LINEAR_ONEDNN = Kind.LINEAR_ONEDNN.value
SPEC_Q4_VNNI = Kind.Q4_VNNI.value
SPEC_Q8_VNNI = Kind.Q8_VNNI.value
SPEC_KQUANT = Kind.KQUANT.value
