"""Linear layers with dense or weight-only quantized weights (``--quantization``, vLLM's flag).

A ``LinearMethod`` maps activations ``x`` [num_tokens, in_features] to [num_tokens,
out_features] in ``x``'s dtype; the model calls it and never looks inside. Three kinds:

- ``DenseLinear``: ``F.linear`` on a float weight (fp32, bf16 or fp16; any device); on CPU in
  fp32, batches of up to ``kernels.cpu_linear.MAX_ROWS`` rows run our own kernel instead.
- ``Int8Linear`` (``--quantization int8``): per-output-channel symmetric int8 weights, with
  torch's CPU weight-only kernel ``aten::_weight_int8pack_mm`` (the kernel gpt-fast uses).
- ``Int4Linear`` (``--quantization gguf``): 4-bit codes in groups of 32 along the input, each
  group with a scale and a minimum (``w = code * scale + minimum``: GGUF's Q4_1 exactly, and Q4_0
  with ``minimum = -8 * scale``), with torch's CPU kernel ``aten::_weight_int4pack_mm_for_cpu``,
  which computes ``w = (code - 8) * scale + zero``; so ``zero = minimum + 8 * scale``.

Both quantized kernels are fast only with bf16 inputs (with fp32 inputs they run 5-10x slower
than fp32 dense), so they run in bf16 whatever the model's dtype: with fp32
activations (the CPU default) each call converts its input to bf16 and its output back, which
costs little and keeps the residual stream, attention and KV cache in fp32. Forwards of many
rows (prefill chunks, or many decodes in one step: ``dense_from_tokens()``) are compute-bound,
and there dense GEMM beats the kernels, so with fp32 activations a quantized layer also holds
a dense copy of the weight for them (for ``gguf`` the dequantization of its 4-bit blocks, for
``int8`` the unquantized weight): in fp32 (exact; from 32 rows, or 4 once our CPU kernel is
loaded), or, on CPUs with native bf16, in bf16 from 24 rows, where torch's bf16 GEMM runs
3.5-4.5x its fp32 one (``DENSE_FROM_TOKENS_NATIVE_BF16``). Decode steps of fewer sequences
read only the quantized weights. The kernels exist on CPU
only; a GPU weight-only kernel (Triton) would be one more ``LinearMethod`` with the same call.
The quantized matmuls are torch's, except one-row 4-bit forwards on CPUs without native bf16,
which run our Q4 kernel (``Q4_OWN_KERNEL_BELOW_TOKENS``), and every fp32-activation 4-bit or
int8 forward wherever our CPU kernels load, which runs our int8-dot kernels and keeps no dense
copy (``VNNI_KERNELS``: AVX-512 VNNI where the CPU has it, else AVX2; torch has no int4 kernel
for many rows that beats dense GEMM, ours does); the small-batch fp32 one is ours
(``kernels/cpu_linear.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import QUANTIZATIONS
from kernels import cpu_linear

# The projection kinds of kernels/cpu/decode_layer.cpp (one table: kernels/cpu/kinds.py).
from kernels.cpu.kinds import (
    SPEC_DENSE,
    SPEC_INT4,
    SPEC_INT8,
    SPEC_LINEAR,
    SPEC_LINEAR_BF16,
    SPEC_LINEAR_ONEDNN,
    SPEC_Q4,
    SPEC_Q4_VNNI,
    SPEC_Q8_VNNI,
)

INT4_GROUP_SIZE = 32  # GGUF's block of 32 weights
KERNEL_DTYPE = torch.bfloat16  # torch's weight-only CPU kernels are fast with bf16 inputs only
# From this many rows (tokens) on, a quantized layer with an fp32 copy runs fp32 instead: on
# AVX2 torch's int4 kernel costs about what MKL's fp32 GEMM does at 32 rows (and more above),
# and what our fp32 kernel (kernels/cpu_linear.py) does at 2-4 rows
# (benchmarks/bench_cpu_linear.py).
DENSE_FROM_TOKENS = 32
DENSE_FROM_TOKENS_OWN_KERNEL = 4
# With native bf16 (AVX512-BF16, and AMX) the dense copy is held in bf16 and runs torch's bf16
# GEMM (oneDNN), several times faster than fp32 GEMM from 32 rows. In the engine a step streams
# every weight from memory (4x the bytes in bf16), so torch's 4-bit kernels still win at 16
# decode rows and tie at 24: the bf16 copy runs from 24 rows, and pays off mostly in prefill
# (docs/benchmarks.md).
DENSE_FROM_TOKENS_NATIVE_BF16 = 24
# torch's int8 kernel (``Int8Linear``: the GGUF's Q8_0 LM head under gguf, every layer under
# int8) loses to its bf16 copy from fewer rows: at the bundled model's shapes the head and the
# layers tie with it at 8-12 rows and lose from 16 (docs/benchmarks.md). So on such CPUs an
# int8 layer runs its bf16 copy from 12 rows.
DENSE_FROM_TOKENS_INT8_NATIVE_BF16 = 12
# Below this many rows a 4-bit layer with fp32 activations runs our Q4 kernel
# (kernels/cpu/q4_linear.cpp) when it is loaded. Against torch's AVX2 int4 kernel (with its bf16
# conversions) ours is faster at 1 row, a tie at 2-3 and slower from 4, where our fp32 kernel on
# the dense copy takes over anyway. With native bf16 (AVX512-BF16) torch's int4 kernel is faster
# from 1 row, so there ours is off. benchmarks/bench_cpu_linear.py prints both.
Q4_OWN_KERNEL_BELOW_TOKENS = 2
Q4_OWN_KERNEL_BELOW_TOKENS_NATIVE_BF16 = 0
# On CPUs with AVX-512 VNNI, 4-bit and int8 layers with fp32 activations run our int8-dot kernels
# (kernels/cpu/q4_vnni.cpp) at every row count and keep no dense copy: at the bundled model's
# shapes they beat the bf16 copy, the fp32 copy and torch's int4/int8 kernels from 1 row to 512
# (docs/benchmarks.md); 16-bit activations cost about 1.1x 8-bit at 1 row and 1.6-1.75x from 16.
# On AVX2 CPUs (no VNNI) the same kernels run with vpmaddubsw + vpmaddwd, same bits, and match or
# beat the fp32 dense copy at every row count. The tied LM head keeps no fp32 copy, though one
# would be faster from 16 rows on AVX2: 113 MB beside the 28 MB of codes.
# On CPUs with AMX-INT8 (Sapphire Rapids and later Xeons) the same kernels run their integer dots
# on AMX tiles from 16 rows (4-bit: whole 8-row blocks) and 6 (int8), with the same bits
# (``cpu_linear.int8_amx``; SALTSERVE_AMX=0 turns it off): 1.2-1.7x the VNNI path from 16 rows
# (docs/benchmarks.md).
# False: the paths above (torch's kernels, the dense copy, our Q4 kernel).
VNNI_KERNELS = True
# The VNNI kernels' activation rounding per group of 32 (``cpu_linear.q4_linear_vnni``), by
# layer (``act_bits``, from ``--quantized-activation-bits``, engine.config.ACTIVATION_BITS):
# 16 (int8 and a 1/256 residual: about 2.5e-5 relative error per output against bf16's
# 3.5e-3) or 8 (llama.cpp's Q8_1 rounding as in its Q4_1 x Q8_1 dot product, 6e-3; half the
# multiply-adds). 16 is the default: it keeps gguf's perplexity close to fp32's, where 8 moves
# it measurably (benchmarks/bench_quantization.py; docs/benchmarks.md).
DEFAULT_ACT_BITS = 16


def q4_vnni(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether a 4-bit layer of this shape with fp32 activations runs our int8-dot kernel
    (``VNNI_KERNELS`` and ``kernels.cpu_linear.q4_vnni_usable``; groups of 32 only)."""
    return (VNNI_KERNELS and group_size == cpu_linear.Q4_GROUP
            and cpu_linear.q4_vnni_usable(out_features, in_features))


def q8_vnni(out_features: int, in_features: int) -> bool:
    """Whether an int8 layer of this shape with fp32 activations runs our int8-dot kernel
    (``VNNI_KERNELS`` and ``kernels.cpu_linear.q4_vnni_usable``)."""
    return VNNI_KERNELS and cpu_linear.q4_vnni_usable(out_features, in_features)


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16; AMX CPUs have it too)."""
    return "avx512_bf16" in cpu_linear.cpu_flags()


def int8_dense_from_tokens() -> int:
    """Rows from which an int8 layer with a bf16 copy runs it (``Int8Linear.dense_from``)."""
    return min(dense_from_tokens(), DENSE_FROM_TOKENS_INT8_NATIVE_BF16)


def dense_copy_dtype() -> torch.dtype:
    """The dtype of a quantized layer's dense copy under fp32 activations: ``KERNEL_DTYPE``
    (bf16) on CPUs with native bf16, where torch's bf16 GEMM is 3.5-4.5x its fp32 one from 32
    rows (see ``DENSE_FROM_TOKENS_NATIVE_BF16``), else fp32 (the exact dequantization)."""
    return KERNEL_DTYPE if native_bf16() else torch.float32


def q4_own_kernel_below_tokens() -> int:
    """Rows below which ``Int4Linear`` runs our Q4 kernel (see the constants above)."""
    if native_bf16():
        return Q4_OWN_KERNEL_BELOW_TOKENS_NATIVE_BF16
    return Q4_OWN_KERNEL_BELOW_TOKENS


def dense_from_tokens() -> int:
    """Rows from which a quantized layer runs its dense copy: ``DENSE_FROM_TOKENS_NATIVE_BF16``
    (a bf16 copy) on CPUs with native bf16; elsewhere ``DENSE_FROM_TOKENS_OWN_KERNEL`` once our
    CPU kernel is loaded, else ``DENSE_FROM_TOKENS`` (see the constants above)."""
    if native_bf16():
        return DENSE_FROM_TOKENS_NATIVE_BF16
    if not cpu_linear.loaded():
        return DENSE_FROM_TOKENS
    return DENSE_FROM_TOKENS_OWN_KERNEL


class LinearMethod:
    """``x`` [num_tokens, in_features] -> [num_tokens, out_features], ``x``'s dtype."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward reads for the weights (codes, scales, bias)."""
        raise NotImplementedError

    def decode_spec(self, num_tokens: int) -> DecodeSpec | None:
        """What ``__call__`` runs for ``num_tokens`` rows of fp32 CPU activations, as the fused
        decode layer (``kernels/cpu/decode_layer.cpp``) takes it; None where it cannot."""
        return None


@dataclass(frozen=True)
class DecodeSpec:
    """One projection as ``kernels/cpu/decode_layer.cpp`` runs it (the same kernel, operands
    and order as ``LinearMethod.__call__`` for that many fp32 rows).

    Attributes:
        kind: ``SPEC_DENSE`` (weight [out, in] fp32, our kernel: up to
            ``kernels.cpu_linear.MAX_ROWS`` rows), ``SPEC_LINEAR`` (the same, ``F.linear``:
            more rows), ``SPEC_LINEAR_ONEDNN`` (the same, oneDNN's GEMM: more rows where
            ``cpu_linear.large_m_onednn``), ``SPEC_INT4`` (torch's packed codes, scales_and_zeros; in bf16),
            ``SPEC_Q4`` (our codes, scale, minimum), ``SPEC_Q4_VNNI`` (our VNNI kernel's
            codes, scale_min), ``SPEC_Q8_VNNI`` (its int8 codes, fp32 scale),
            ``SPEC_INT8`` (qweight, scales; bf16)
            or ``SPEC_LINEAR_BF16`` (weight [out, in] bf16: ``F.linear`` in bf16).
        tensors: the kind's operands.
        bias: [out] fp32 or None.
        group: inputs per 4-bit group (``SPEC_INT4``), the activation bits
            (``SPEC_Q4_VNNI``, ``SPEC_Q8_VNNI``), else 0.
    """

    kind: int
    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None = None
    group: int = 0


def _dense_spec(weight: torch.Tensor, bias: torch.Tensor | None, num_tokens: int
                ) -> DecodeSpec:
    """``cpu_linear.linear``'s choice for ``num_tokens`` fp32 rows (kernels loaded)."""
    if 0 < num_tokens <= cpu_linear.MAX_ROWS:
        kind = SPEC_DENSE
    else:
        kind = SPEC_LINEAR_ONEDNN if cpu_linear.large_m_onednn(weight) else SPEC_LINEAR
    return DecodeSpec(kind, (weight,), bias)


def _fp32_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                             and t.is_contiguous()) for t in tensors)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class DenseLinear(LinearMethod):
    """``F.linear(x, weight, bias)``; ``weight`` [out, in] float, ``bias`` [out] or None."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, self.weight, self.bias)

    def decode_spec(self, num_tokens: int) -> DecodeSpec | None:
        if not _fp32_cpu(self.weight, self.bias):
            return None
        return _dense_spec(self.weight, self.bias, num_tokens)

    @property
    def weight_bytes(self) -> int:
        return _nbytes(self.weight, self.bias)


class QuantizedLinear(LinearMethod):
    """A torch weight-only kernel (``_kernel``, bf16 in and out) behind one call for any
    activation dtype, and an optional ``dense`` copy of the weight for forwards of
    ``dense_from_tokens()`` rows or more (prefill chunks, or many decodes in one step), where
    dense GEMM is faster on CPU: fp32, or bf16 on CPUs with native bf16 (``dense_copy_dtype``;
    its product then runs in bf16 like the kernels'). ``bias`` [out] is in the activation
    dtype."""

    bias: torch.Tensor | None
    dense: torch.Tensor | None

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_from(self) -> int:
        """Rows from which this layer runs its dense copy (``dense_from_tokens()``)."""
        return dense_from_tokens()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_from():
            if self.dense.dtype == torch.float32:
                return cpu_linear.linear(x, self.dense, self.bias)
            y = F.linear(x.to(self.dense.dtype), self.dense).to(x.dtype)  # the bf16 copy
        else:
            y = self._kernel(x) if x.dtype == KERNEL_DTYPE else \
                self._kernel(x.to(KERNEL_DTYPE)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _kernel_spec(self) -> DecodeSpec | None:
        return None

    def decode_spec(self, num_tokens: int) -> DecodeSpec | None:
        if not _fp32_cpu(self.bias):
            return None
        if self.dense is not None and num_tokens >= self.dense_from():
            if self.dense.dtype == KERNEL_DTYPE and self.dense.device.type == "cpu":
                return DecodeSpec(SPEC_LINEAR_BF16, (self.dense,), self.bias)
            return _dense_spec(self.dense, self.bias, num_tokens) if _fp32_cpu(
                self.dense) else None
        return self._kernel_spec()


class Int8Linear(QuantizedLinear):
    """Per-channel symmetric int8: ``w[n, k] = qweight[n, k] * scales[n]``.

    Args:
        qweight: [out, in] int8, contiguous.
        scales: [out] in ``KERNEL_DTYPE`` (bf16).
        bias: [out] in the activation dtype, or None.
        dense: [out, in] fp32 or bf16 (``dense_copy_dtype()``), or None (see
            ``QuantizedLinear``).
        vnni: (codes from ``cpu_linear.pack_q8_vnni``, scales in fp32), or None; with it every
            fp32 CPU forward runs our VNNI kernel (``VNNI_KERNELS``) and ``dense`` is None.
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, dense: torch.Tensor | None = None,
                 vnni: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.qweight, self.scales, self.bias, self.dense = qweight, scales, bias, dense
        self.out_features = qweight.shape[0]
        self.vnni = vnni
        self.act_bits = DEFAULT_ACT_BITS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return cpu_linear.q8_linear_vnni(x, *self.vnni, self.bias, self.act_bits)
        return super().__call__(x)

    def decode_spec(self, num_tokens: int) -> DecodeSpec | None:
        if self.vnni is not None and _fp32_cpu(self.bias):
            return DecodeSpec(SPEC_Q8_VNNI, self.vnni, self.bias, self.act_bits)
        return super().decode_spec(num_tokens)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 keep_dense: bool = False) -> Int8Linear:
        """Round-to-nearest from a float ``weight`` [out, in]: scale = max |w| of the row / 127
        (a zero row gets scale 1), rounded to ``KERNEL_DTYPE`` before the codes are taken;
        ``bias`` in the activation ``dtype``. ``keep_dense``: ``weight`` in ``dense_copy_dtype()``
        (fp32: not copied when it already is) serves the forwards of ``dense_from_tokens()``
        rows or more; where ``q8_vnni`` holds, the codes in our VNNI kernel's layout instead."""
        w = weight.float()
        scales = w.abs().amax(dim=1) / 127.0
        scales = torch.where(scales == 0, torch.ones_like(scales), scales).to(KERNEL_DTYPE)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if bias is None else bias.to(dtype)
        if keep_dense and q8_vnni(*q.shape):
            return cls(q.contiguous(), scales, bias, vnni=(cpu_linear.pack_q8_vnni(q),
                                                           scales.float().contiguous()))
        return cls(q.contiguous(), scales, bias,
                   w.to(dense_copy_dtype()).contiguous() if keep_dense else None)

    def dense_from(self) -> int:
        """``DENSE_FROM_TOKENS_INT8_NATIVE_BF16`` with a bf16 copy (CPUs with native bf16),
        else ``dense_from_tokens()``."""
        if self.dense is not None and self.dense.dtype == KERNEL_DTYPE:
            return int8_dense_from_tokens()
        return dense_from_tokens()

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.qweight, self.scales)

    def _kernel_spec(self) -> DecodeSpec | None:
        return DecodeSpec(SPEC_INT8, (self.qweight, self.scales), self.bias)

    @property
    def weight_bytes(self) -> int:
        if self.vnni is not None:
            return _nbytes(*self.vnni, self.bias)
        return _nbytes(self.qweight, self.scales, self.bias)


@dataclass
class GroupedInt4:
    """4-bit weights as stored in a GGUF Q4_1 (or Q4_0) tensor, unpacked to one code per byte.

    ``w[n, k] = codes[n, k] * scale[n, k // g] + minimum[n, k // g]`` with ``g`` =
    ``group_size`` consecutive inputs.

    Attributes:
        codes: [out, in] uint8 in [0, 15].
        scale, minimum: [out, in // group_size] fp32.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    group_size: int = INT4_GROUP_SIZE

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """[out, in] fp32."""
        n, k = self.codes.shape
        w = (self.codes.view(n, k // self.group_size, self.group_size).float()
             * self.scale[..., None] + self.minimum[..., None])
        return w.view(n, k)

    def rows(self, index: torch.Tensor) -> GroupedInt4:
        """The output rows ``index`` (a permutation or a slice of them), in that order."""
        return GroupedInt4(self.codes[index], self.scale[index], self.minimum[index],
                           self.group_size)

    @staticmethod
    def cat(parts: list[GroupedInt4]) -> GroupedInt4:
        """Stacks the output rows of ``parts`` (a fused q/k/v or gate/up projection)."""
        if len({p.group_size for p in parts}) != 1:
            raise ValueError("cannot fuse 4-bit weights with different group sizes")
        return GroupedInt4(torch.cat([p.codes for p in parts]),
                           torch.cat([p.scale for p in parts]),
                           torch.cat([p.minimum for p in parts]), parts[0].group_size)


@dataclass
class GroupedQ4:
    """``GroupedInt4`` in our CPU kernel's layout (``kernels.cpu_linear.q4_linear``).

    Attributes:
        codes: [out, in / 2] uint8 from ``cpu_linear.pack_q4``.
        scale, minimum: [out, in / 32] fp16 (a GGUF's own storage, so exact for its blocks).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor


@dataclass
class GroupedQ4Vnni:
    """``GroupedInt4`` in our VNNI kernel's layout (``kernels.cpu_linear.q4_linear_vnni``).

    Attributes:
        codes: [out / 16, in / 32, 256] uint8 from ``cpu_linear.pack_q4_vnni``.
        scale_min: [out / 16, in / 32, 32] fp16 (each tile's 16 scales, then 16 minimums).
    """

    codes: torch.Tensor
    scale_min: torch.Tensor


class Int4Linear(QuantizedLinear):
    """Grouped 4-bit weights through ``aten::_weight_int4pack_mm_for_cpu``.

    Args:
        packed: from ``aten::_convert_weight_to_int4pack_for_cpu`` ([out, in / 2] uint8).
        scales_and_zeros: [in / group_size, out, 2] in ``KERNEL_DTYPE`` (bf16):
            ``w = (code - 8) * scale + zero``.
        bias: [out] in the activation dtype, or None.
        dense: [out, in] fp32 or bf16 (``dense_copy_dtype()``), or None (see
            ``QuantizedLinear``).
        own: the same weights for our Q4 kernel (fp32 activations only), or None; it runs
            below ``own_below`` rows (``q4_own_kernel_below_tokens()``).
        vnni: the same weights for our VNNI kernel, or None; with it every fp32 CPU forward
            runs that kernel (``VNNI_KERNELS``), whatever its rows, and ``dense``/``own`` are None.
    """

    def __init__(self, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor,
                 out_features: int, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, own: GroupedQ4 | None = None,
                 vnni: GroupedQ4Vnni | None = None) -> None:
        self.packed, self.group_size = packed, group_size
        self.scales_and_zeros, self.bias, self.dense = scales_and_zeros, bias, dense
        self.out_features = out_features
        self.own = own
        self.own_below = q4_own_kernel_below_tokens()
        self.vnni = vnni
        self.act_bits = DEFAULT_ACT_BITS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return cpu_linear.q4_linear_vnni(x, self.vnni.codes, self.vnni.scale_min, self.bias,
                                             self.act_bits)
        if (self.own is not None and x.dtype == torch.float32
                and x.shape[0] < self.own_below):
            return cpu_linear.q4_linear(x, self.own.codes, self.own.scale, self.own.minimum,
                                        self.bias)
        return super().__call__(x)

    def decode_spec(self, num_tokens: int) -> DecodeSpec | None:
        if self.vnni is not None and _fp32_cpu(self.bias):
            return DecodeSpec(SPEC_Q4_VNNI, (self.vnni.codes, self.vnni.scale_min), self.bias,
                              self.act_bits)
        if self.own is not None and num_tokens < self.own_below and _fp32_cpu(self.bias):
            return DecodeSpec(SPEC_Q4, (self.own.codes, self.own.scale, self.own.minimum),
                              self.bias)
        return super().decode_spec(num_tokens)

    def _kernel_spec(self) -> DecodeSpec | None:
        return DecodeSpec(SPEC_INT4, (self.packed, self.scales_and_zeros), self.bias,
                          self.group_size)

    @classmethod
    def from_grouped(cls, w: GroupedInt4, bias: torch.Tensor | None, dtype: torch.dtype,
                     keep_dense: bool = False) -> Int4Linear:
        """Packs ``w`` for the CPU kernel (scales and zeros in ``KERNEL_DTYPE``, ``bias`` in the
        activation ``dtype``). ``keep_dense`` (fp32 activations): where ``q4_vnni`` holds,
        the weights in our VNNI kernel's layout instead, and no dense copy; else also keep its
        dequantization (exact in fp32; in bf16 on CPUs with native bf16,
        ``dense_copy_dtype()``) for the forwards of ``dense_from_tokens()`` rows or more.

        Raises:
            ValueError: a shape the kernel cannot take.
        """
        n, k = w.shape
        if w.group_size not in (32, 64, 128, 256) or k % w.group_size:
            raise ValueError(f"int4 weights need in_features ({k}) to be a multiple of the "
                             f"group size ({w.group_size}) and a group of 32, 64, 128 or 256")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            w.codes.to(torch.int32).contiguous(), 1)
        zero = w.minimum + 8 * w.scale
        sz = torch.stack([w.scale.t(), zero.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
        bias = None if bias is None else bias.to(dtype)
        if keep_dense and q4_vnni(n, k, w.group_size):
            return cls(packed, w.group_size, sz, n, bias,
                       vnni=GroupedQ4Vnni(*cpu_linear.pack_q4_vnni(w.codes, w.scale, w.minimum)))
        own = None
        if keep_dense and cpu_linear.loaded() and w.group_size == cpu_linear.Q4_GROUP:
            own = GroupedQ4(cpu_linear.pack_q4(w.codes), w.scale.half().contiguous(),
                            w.minimum.half().contiguous())
        return cls(packed, w.group_size, sz, n, bias,
                   w.dequantize().to(dense_copy_dtype()) if keep_dense else None, own)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size,
                                                          self.scales_and_zeros)

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads: our kernel's weights where it runs, else torch's."""
        if self.vnni is not None:
            return _nbytes(self.vnni.codes, self.vnni.scale_min, self.bias)
        if self.own is not None:
            return _nbytes(self.own.codes, self.own.scale, self.own.minimum, self.bias)
        return _nbytes(self.packed, self.scales_and_zeros, self.bias)


def int8_dot_kernels_serve(quantization: str | None, dtype: torch.dtype) -> bool:
    """Whether quantized layers with ``dtype`` activations on CPU run our int8-dot kernels (the
    only path ``act_bits`` applies to): quantization on, fp32 activations, ``VNNI_KERNELS`` and
    the kernels built here."""
    return (quantization is not None and dtype == torch.float32 and VNNI_KERNELS
            and cpu_linear.loaded())


def dense_copy_note(quantization: str | None, dtype: torch.dtype,
                    act_bits: int = DEFAULT_ACT_BITS) -> str:
    """For the start-up log: which dense copy the quantized layers hold and from how many rows
    it runs ("" without one: no quantization, or activations other than fp32), and the int8-dot
    kernels' activation rounding (``act_bits``) where those run instead."""
    if quantization is None or dtype != torch.float32:
        return ""
    if int8_dot_kernels_serve(quantization, dtype):
        return (f"no dense copy: 4-bit and int8 layers through our int8-dot kernels "
                f"({cpu_linear.int8_dot_isa()}, {act_bits}-bit activations) at every row "
                f"count")
    if dense_copy_dtype() != KERNEL_DTYPE:
        return f"fp32 dense copy from {dense_from_tokens()} rows"
    return (f"bf16 dense copy from {dense_from_tokens()} rows "
            f"(int8 layers from {int8_dense_from_tokens()})")


def check_quantization(quantization: str | None, device: torch.device) -> None:
    """Raises ValueError unless the kernels of ``quantization`` (one of ``QUANTIZATIONS``) run
    on ``device``: CPU only."""
    if quantization is None:  # (EngineConfig has checked the name)
        return
    if device.type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on CPU only (torch's weight-only "
                         f"CPU kernels); on {device.type} serve bfloat16 without it")


def make_linear(weight: torch.Tensor | GroupedInt4, bias: torch.Tensor | None,
                quantization: str | None, dtype: torch.dtype,
                device: torch.device, act_bits: int = DEFAULT_ACT_BITS) -> LinearMethod:
    """The ``LinearMethod`` for one (fused) projection, for activations in ``dtype``.

    ``weight`` is a float tensor [out, in] or, from a GGUF, ``GroupedInt4``. Without
    quantization it becomes dense in ``dtype`` on ``device``; ``int8`` quantizes a float weight
    per channel; ``gguf`` keeps 4-bit groups as they are and quantizes float weights (a GGUF's
    F16/F32/Q8_0 tensors, dequantized) per channel to int8. Quantized kernels run in bf16
    (``KERNEL_DTYPE``); with fp32 activations they also keep a dense copy for forwards of
    ``dense_from_tokens()`` rows or more, where dense GEMM is faster: in ``dense_copy_dtype()``
    (an fp32 ``weight`` is kept as it is when that is fp32, not copied: pass a tied embedding's
    own parameter). ``act_bits``: our int8-dot kernels' activation rounding (16 or 8,
    ``--quantized-activation-bits``); it changes nothing where those kernels do not run.
    """
    if isinstance(weight, GroupedInt4) and quantization != "gguf":
        weight = weight.dequantize()
    if quantization is None:
        return DenseLinear(weight.to(device=device, dtype=dtype),
                           None if bias is None else bias.to(device=device, dtype=dtype))
    keep_dense = dtype == torch.float32
    layer = Int4Linear.from_grouped(weight, bias, dtype, keep_dense) \
        if isinstance(weight, GroupedInt4) else Int8Linear.quantize(weight, bias, dtype, keep_dense)
    layer.act_bits = act_bits
    return layer


__all__ = [
    "DEFAULT_ACT_BITS",
    "DENSE_FROM_TOKENS",
    "DENSE_FROM_TOKENS_INT8_NATIVE_BF16",
    "INT4_GROUP_SIZE",
    "KERNEL_DTYPE",
    "QUANTIZATIONS",
    "DecodeSpec",
    "DenseLinear",
    "GroupedInt4",
    "Int4Linear",
    "Int8Linear",
    "LinearMethod",
    "QuantizedLinear",
    "check_quantization",
    "dense_copy_dtype",
    "dense_copy_note",
    "dense_from_tokens",
    "int8_dense_from_tokens",
    "int8_dot_kernels_serve",
    "make_linear",
    "native_bf16",
]
