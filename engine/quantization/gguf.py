"""``--quantization gguf``: the model folder's GGUF weights served as they are stored where we
have a kernel for them. Q4_K, Q5_K, Q6_K and Q8_0 tensors run our exact K-quant kernel
(``KQuantLinear``, ``engine.quantization.kquant``) with fp32 activations on CPU; 4-bit tensors
(Q4_0, Q4_1, and Q4_K elsewhere: ``engine.models.gguf``) stay 4-bit (``Int4Linear``: groups of
32 inputs, ``w = code * scale + minimum``); every other tensor (F16, F32, other types, and
Q5_K / Q6_K / Q8_0 where our kernel does not run; dequantized one at a time) is quantized per
channel to int8 (``Int8Linear``). With fp32 activations on CPU our int8-dot kernels run every forward
(``KernelPolicy.int8_dot``); otherwise torch's ``aten::_weight_int4pack_mm_for_cpu``, which
computes ``w = (code - 8) * scale + zero`` (so ``zero = minimum + 8 * scale``), in bf16, our Q4
kernel at one row, and a dense copy for forwards of many rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.quantization.base import (
    DEFAULT_ACT_BITS,
    DecodeSpec,
    LinearMethod,
    QuantizationMethod,
    QuantizedLinear,
    fp32_cpu,
    nbytes,
)
from engine.quantization.int8 import Int8Linear
from engine.quantization.kquant import SUPER_BLOCK, KQuantLinear, KQuantWeight
from engine.quantization.policy import KERNEL_DTYPE, KernelPolicy
from kernels import cpu_linear
from kernels.cpu.kinds import SPEC_INT4, SPEC_Q4, SPEC_Q4_VNNI

INT4_GROUP_SIZE = 32  # GGUF's block of 32 weights (a Q4_K sub-block too)


@dataclass
class GroupedInt4:
    """4-bit weights as a GGUF Q4_1, Q4_0 or Q4_K tensor holds them, unpacked to one code per byte.

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
        scale, minimum: [out, in / 32] fp16 (a GGUF's own storage: exact for Q4_0 and Q4_1,
            rounded for Q4_K, whose ``d * sc`` can need 17 bits).
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
        packed: from ``aten::_convert_weight_to_int4pack_for_cpu`` ([out, in / 2] uint8); None
            with ``vnni`` (with ``scales_and_zeros``: only our kernel's layout is kept).
        scales_and_zeros: [in / group_size, out, 2] in ``KERNEL_DTYPE`` (bf16):
            ``w = (code - 8) * scale + zero``.
        bias: [out] in the activation dtype, or None.
        dense: [out, in] fp32 or bf16 (``KernelPolicy.dense_copy_dtype``), or None (see
            ``QuantizedLinear``).
        own: the same weights for our Q4 kernel (fp32 activations only), or None; it runs
            below ``own_below`` rows (``KernelPolicy.q4_own_below``).
        vnni: the same weights for our VNNI kernel, or None; with it every fp32 CPU forward
            runs that kernel (``KernelPolicy.int8_dot``), whatever its rows, and ``dense``/``own`` are None.
    """

    def __init__(self, packed: torch.Tensor | None, group_size: int,
                 scales_and_zeros: torch.Tensor | None,
                 out_features: int, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, own: GroupedQ4 | None = None,
                 vnni: GroupedQ4Vnni | None = None, policy: KernelPolicy | None = None) -> None:
        self.packed, self.group_size = packed, group_size
        self.scales_and_zeros, self.bias, self.dense = scales_and_zeros, bias, dense
        self.out_features = out_features
        self.own = own
        self.policy = policy if policy is not None else KernelPolicy.detect()
        self.own_below = self.policy.q4_own_below
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
        if self.vnni is not None and fp32_cpu(self.bias):
            return DecodeSpec(SPEC_Q4_VNNI, (self.vnni.codes, self.vnni.scale_min), self.bias,
                              self.act_bits)
        if self.own is not None and num_tokens < self.own_below and fp32_cpu(self.bias):
            return DecodeSpec(SPEC_Q4, (self.own.codes, self.own.scale, self.own.minimum),
                              self.bias)
        return super().decode_spec(num_tokens)

    def _kernel_spec(self) -> DecodeSpec | None:
        return DecodeSpec(SPEC_INT4, (self.packed, self.scales_and_zeros), self.bias,
                          self.group_size)

    @classmethod
    def from_grouped(cls, w: GroupedInt4, bias: torch.Tensor | None, dtype: torch.dtype,
                     keep_dense: bool = False, policy: KernelPolicy | None = None
                     ) -> Int4Linear:
        """Packs ``w`` for the CPU kernel (scales and zeros in ``KERNEL_DTYPE``, ``bias`` in the
        activation ``dtype``). ``keep_dense`` (fp32 activations): where ``policy.q4_vnni``
        holds, the weights in our VNNI kernel's layout instead, and no dense copy; else also
        keep its dequantization (exact in fp32; in bf16 on CPUs with native bf16,
        ``KernelPolicy.dense_copy_dtype``) for the forwards of ``dense_from_tokens`` rows or
        more.

        Raises:
            ValueError: a shape the kernel cannot take.
        """
        policy = policy if policy is not None else KernelPolicy.detect()
        n, k = w.shape
        if w.group_size not in (32, 64, 128, 256) or k % w.group_size:
            raise ValueError(f"int4 weights need in_features ({k}) to be a multiple of the "
                             f"group size ({w.group_size}) and a group of 32, 64, 128 or 256")
        bias = None if bias is None else bias.to(dtype)
        if keep_dense and policy.q4_vnni(n, k, w.group_size):
            # Only our kernel's layout: every forward of an fp32 model runs it, and torch's
            # packed copy would double the weights' memory.
            return cls(None, w.group_size, None, n, bias,
                       vnni=GroupedQ4Vnni(*cpu_linear.pack_q4_vnni(w.codes, w.scale, w.minimum)),
                       policy=policy)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            w.codes.to(torch.int32).contiguous(), 1)
        zero = w.minimum + 8 * w.scale
        sz = torch.stack([w.scale.t(), zero.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
        own = None
        if keep_dense and policy.cpu_kernels and w.group_size == cpu_linear.Q4_GROUP:
            own = GroupedQ4(cpu_linear.pack_q4(w.codes), w.scale.half().contiguous(),
                            w.minimum.half().contiguous())
        return cls(packed, w.group_size, sz, n, bias,
                   w.dequantize().to(policy.dense_copy_dtype) if keep_dense else None, own,
                   policy=policy)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError("this 4-bit layer holds only our int8-dot kernel's layout: it "
                               "runs fp32 CPU activations only")
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size,
                                                          self.scales_and_zeros)

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads: our kernel's weights where it runs, else torch's."""
        if self.vnni is not None:
            return nbytes(self.vnni.codes, self.vnni.scale_min, self.bias)
        if self.own is not None:
            return nbytes(self.own.codes, self.own.scale, self.own.minimum, self.bias)
        return nbytes(self.packed, self.scales_and_zeros, self.bias)


def q4_k_as_grouped(w: KQuantWeight) -> GroupedInt4 | None:
    """A Q4_K-only weight as ``GroupedInt4`` (scale ``d * sc``, minimum ``-dmin * m``: products
    of an fp16 and a 6-bit integer, exact in fp32), for the 4-bit paths; None for other types."""
    if any(p.type_name != "Q4_K" for p in w.parts):
        return None
    per = SUPER_BLOCK // INT4_GROUP_SIZE
    scale = torch.cat([p.d.repeat_interleave(per, dim=1) * p.sc.float() for p in w.parts])
    minimum = torch.cat([-(p.dmin.repeat_interleave(per, dim=1) * p.m.float())
                         for p in w.parts])
    return GroupedInt4(torch.cat([p.codes for p in w.parts]), scale, minimum, INT4_GROUP_SIZE)


class GGUFMethod(QuantizationMethod):
    """``--quantization gguf``: K-quant and Q8_0 blocks (``KQuantWeight``) through our exact
    kernel where fp32 CPU activations run it (``KernelPolicy.kquant``); 4-bit blocks
    (``GroupedInt4``, and Q4_K elsewhere) kept as ``Int4Linear``; float weights (a GGUF's other
    types, dequantized, and K-quants where our kernel does not run) quantized per channel to
    int8."""

    name = "gguf"

    def create_linear(self, weight: Any, bias: torch.Tensor | None, dtype: torch.dtype,
                      device: torch.device) -> LinearMethod:
        keep_dense = dtype == torch.float32
        if isinstance(weight, KQuantWeight):
            if keep_dense and device.type == "cpu" and self.policy.kquant(
                    [p.shape[0] for p in weight.parts], weight.shape[1], weight.ggml_types):
                return KQuantLinear.from_weight(weight, bias, self.act_bits)
            weight = q4_k_as_grouped(weight) or weight.dequantize()
        if isinstance(weight, GroupedInt4):
            layer: QuantizedLinear = Int4Linear.from_grouped(weight, bias, dtype, keep_dense,
                                                             self.policy)
        else:
            layer = Int8Linear.quantize(weight, bias, dtype, keep_dense, self.policy)
        layer.act_bits = self.act_bits
        return layer
