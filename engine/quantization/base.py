"""The interface every quantization method implements (vLLM's ``QuantizationConfig`` +
``LinearMethodBase``): a ``QuantizationMethod`` turns a checkpoint's (fused) projection into a
``LinearMethod``, which maps activations ``x`` [num_tokens, in_features] to [num_tokens,
out_features] in ``x``'s dtype; the model calls it and never looks inside. ``DecodeSpec`` is
what a ``LinearMethod`` runs for a row count, as the fused CPU decode layer takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.quantization.policy import KERNEL_DTYPE, KernelPolicy
from kernels import cpu_linear
from kernels.cpu.kinds import (
    SPEC_DENSE,
    SPEC_LINEAR,
    SPEC_LINEAR_BF16,
    SPEC_LINEAR_ONEDNN,
)

# The VNNI kernels' activation rounding per group of 32 (``--quantized-activation-bits``): 16
# (int8 and a 1/256 residual, 2.5e-5 relative error against bf16's 3.5e-3) or 8 (llama.cpp's
# Q8_1 rounding, half the multiply-adds). 16 keeps gguf's perplexity close to fp32's.
DEFAULT_ACT_BITS = 16


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


class QuantizationMethod:
    """One ``--quantization`` value (vLLM's ``QuantizationConfig``): how each projection of a
    checkpoint becomes a ``LinearMethod``, under the engine's ``KernelPolicy``.

    Attributes:
        name: the flag's value (None: no quantization).
        policy: the engine's kernel choices.
        act_bits: our int8-dot kernels' activation rounding (16 or 8,
            ``--quantized-activation-bits``); it changes nothing where those do not run.
    """

    name: str | None = None

    def __init__(self, policy: KernelPolicy, act_bits: int = DEFAULT_ACT_BITS) -> None:
        self.policy, self.act_bits = policy, act_bits

    def create_linear(self, weight: Any, bias: torch.Tensor | None, dtype: torch.dtype,
                      device: torch.device) -> LinearMethod:
        """The ``LinearMethod`` for one (fused) projection, for activations in ``dtype``.
        ``weight``: a float tensor [out, in], or a method's own packed type (a GGUF's
        ``GroupedInt4``)."""
        raise NotImplementedError


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


def dense_spec(weight: torch.Tensor, bias: torch.Tensor | None, num_tokens: int,
               policy: KernelPolicy) -> DecodeSpec:
    """``cpu_linear.linear``'s choice for ``num_tokens`` fp32 rows (kernels loaded)."""
    if 0 < num_tokens <= cpu_linear.MAX_ROWS:
        kind = SPEC_DENSE
    else:
        kind = (SPEC_LINEAR_ONEDNN if cpu_linear.large_m_onednn(weight, policy.onednn_large_m)
                else SPEC_LINEAR)
    return DecodeSpec(kind, (weight,), bias)


def fp32_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                             and t.is_contiguous()) for t in tensors)


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class QuantizedLinear(LinearMethod):
    """A torch weight-only kernel (``_kernel``, bf16 in and out) behind one call for any
    activation dtype, and an optional ``dense`` copy of the weight for forwards of
    ``policy.dense_from_tokens`` rows or more (prefill chunks, or many decodes in one step),
    where dense GEMM is faster on CPU: fp32, or bf16 on CPUs with native bf16
    (``KernelPolicy.dense_copy_dtype``; its product then runs in bf16 like the kernels').
    ``bias`` [out] is in the activation dtype; ``policy`` the engine's kernel choices."""

    bias: torch.Tensor | None
    dense: torch.Tensor | None
    policy: KernelPolicy

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_from(self) -> int:
        """Rows from which this layer runs its dense copy (``policy.dense_from_tokens``)."""
        return self.policy.dense_from_tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_from():
            if self.dense.dtype == torch.float32:
                return cpu_linear.linear(x, self.dense, self.bias,
                                         onednn=self.policy.onednn_large_m)
            y = F.linear(x.to(self.dense.dtype), self.dense).to(x.dtype)  # the bf16 copy
        else:
            y = self._kernel(x) if x.dtype == KERNEL_DTYPE else \
                self._kernel(x.to(KERNEL_DTYPE)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _kernel_spec(self) -> DecodeSpec | None:
        return None

    def decode_spec(self, num_tokens: int) -> DecodeSpec | None:
        if not fp32_cpu(self.bias):
            return None
        if self.dense is not None and num_tokens >= self.dense_from():
            if self.dense.dtype == KERNEL_DTYPE and self.dense.device.type == "cpu":
                return DecodeSpec(SPEC_LINEAR_BF16, (self.dense,), self.bias)
            return dense_spec(self.dense, self.bias, num_tokens, self.policy) if fp32_cpu(
                self.dense) else None
        return self._kernel_spec()


