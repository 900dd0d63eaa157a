"""``--quantization int8``: per-output-channel symmetric int8 weights (round to nearest from the
checkpoint's floats). With fp32 activations on CPU our int8-dot kernel
(``kernels/cpu/q4_vnni.cpp``, ``KernelPolicy.int8_dot``) runs every forward; otherwise torch's
weight-only kernel ``aten::_weight_int8pack_mm`` (the kernel gpt-fast uses) in bf16, with a
dense copy for forwards of many rows."""

from __future__ import annotations

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
from engine.quantization.policy import KERNEL_DTYPE, KernelPolicy
from kernels import cpu_linear
from kernels.cpu.kinds import SPEC_INT8, SPEC_Q8_VNNI

# Rows rounded at once when quantizing (bounds the fp32 temporaries of a large projection).
_ROWS_AT_ONCE = 1024


class Int8Linear(QuantizedLinear):
    """Per-channel symmetric int8: ``w[n, k] = qweight[n, k] * scales[n]``.

    Args:
        qweight: [out, in] int8, contiguous; None with ``vnni`` (only our kernel's layout is
            kept: torch's copy would double the weights' memory).
        scales: [out] in ``KERNEL_DTYPE`` (bf16).
        bias: [out] in the activation dtype, or None.
        dense: [out, in] fp32 or bf16 (``KernelPolicy.dense_copy_dtype``), or None (see
            ``QuantizedLinear``).
        vnni: (codes from ``cpu_linear.pack_q8_vnni``, scales in fp32), or None; with it every
            fp32 CPU forward runs our VNNI kernel (``KernelPolicy.int8_dot``) and ``dense`` is None.
    """

    def __init__(self, qweight: torch.Tensor | None, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, dense: torch.Tensor | None = None,
                 vnni: tuple[torch.Tensor, torch.Tensor] | None = None,
                 policy: KernelPolicy | None = None) -> None:
        self.qweight, self.scales, self.bias, self.dense = qweight, scales, bias, dense
        self.out_features = scales.shape[0]
        self.vnni = vnni
        self.act_bits = DEFAULT_ACT_BITS
        self.policy = policy if policy is not None else KernelPolicy.detect()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return cpu_linear.q8_linear_vnni(x, *self.vnni, self.bias, self.act_bits)
        return super().__call__(x)

    def decode_spec(self, num_tokens: int) -> DecodeSpec | None:
        if self.vnni is not None and fp32_cpu(self.bias):
            return DecodeSpec(SPEC_Q8_VNNI, self.vnni, self.bias, self.act_bits)
        return super().decode_spec(num_tokens)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 keep_dense: bool = False, policy: KernelPolicy | None = None) -> Int8Linear:
        """Round-to-nearest from a float ``weight`` [out, in]: scale = max |w| of the row / 127
        (a zero row gets scale 1), rounded to ``KERNEL_DTYPE`` before the codes are taken;
        ``bias`` in the activation ``dtype``. ``keep_dense``: ``weight`` in the policy's
        ``dense_copy_dtype`` (fp32: not copied when it already is) serves the forwards of
        ``dense_from_tokens`` rows or more; where ``policy.q8_vnni`` holds, the codes in our
        VNNI kernel's layout instead."""
        policy = policy if policy is not None else KernelPolicy.detect()
        w = weight.float()
        scales = w.abs().amax(dim=1) / 127.0
        scales = torch.where(scales == 0, torch.ones_like(scales), scales).to(KERNEL_DTYPE)
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        s = scales.float()[:, None]
        for i in range(0, w.shape[0], _ROWS_AT_ONCE):  # fp32 temporaries of a slice, not all
            rows = slice(i, i + _ROWS_AT_ONCE)
            q[rows] = torch.round(w[rows] / s[rows]).clamp(-127, 127).to(torch.int8)
        bias = None if bias is None else bias.to(dtype)
        if keep_dense and policy.q8_vnni(*q.shape):
            return cls(None, scales, bias, vnni=(cpu_linear.pack_q8_vnni(q),
                                                 scales.float().contiguous()), policy=policy)
        return cls(q.contiguous(), scales, bias,
                   w.to(policy.dense_copy_dtype).contiguous() if keep_dense else None,
                   policy=policy)

    def dense_from(self) -> int:
        """``policy.int8_dense_from_tokens`` with a bf16 copy (CPUs with native bf16), else
        ``policy.dense_from_tokens``."""
        if self.dense is not None and self.dense.dtype == KERNEL_DTYPE:
            return self.policy.int8_dense_from_tokens
        return self.policy.dense_from_tokens

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            raise RuntimeError("this int8 layer holds only our int8-dot kernel's layout: it "
                               "runs fp32 CPU activations only")
        return torch._weight_int8pack_mm(x, self.qweight, self.scales)

    def _kernel_spec(self) -> DecodeSpec | None:
        return DecodeSpec(SPEC_INT8, (self.qweight, self.scales), self.bias)

    @property
    def weight_bytes(self) -> int:
        if self.vnni is not None:
            return nbytes(*self.vnni, self.bias)
        return nbytes(self.qweight, self.scales, self.bias)


class Int8Method(QuantizationMethod):
    """``--quantization int8``: every projection ``Int8Linear.quantize``d from its float
    weight (a GGUF's 4-bit blocks, where a caller passes them, dequantized first)."""

    name = "int8"

    def create_linear(self, weight: Any, bias: torch.Tensor | None, dtype: torch.dtype,
                      device: torch.device) -> LinearMethod:
        if hasattr(weight, "dequantize"):
            weight = weight.dequantize()
        layer = Int8Linear.quantize(weight, bias, dtype, keep_dense=dtype == torch.float32,
                                    policy=self.policy)
        layer.act_bits = self.act_bits
        return layer
