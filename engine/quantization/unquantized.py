"""No quantization: each projection is its float weight (``DenseLinear``), on CPU in fp32 through
our small-batch kernel up to ``kernels.cpu_linear.MAX_ROWS`` rows and oneDNN's GEMM above
(``KernelPolicy.onednn_large_m``), elsewhere ``F.linear``."""

from __future__ import annotations

from typing import Any

import torch

from engine.quantization.base import (
    DecodeSpec,
    LinearMethod,
    QuantizationMethod,
    dense_spec,
    fp32_cpu,
    nbytes,
)
from engine.quantization.policy import KernelPolicy
from kernels import cpu_linear


class DenseLinear(LinearMethod):
    """``F.linear(x, weight, bias)``; ``weight`` [out, in] float, ``bias`` [out] or None.
    ``policy``: the engine's kernel choices (default: this CPU's, ``KernelPolicy.detect``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 policy: KernelPolicy | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]
        self.policy = policy if policy is not None else KernelPolicy.detect()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, self.weight, self.bias, onednn=self.policy.onednn_large_m)

    def decode_spec(self, num_tokens: int) -> DecodeSpec | None:
        if not fp32_cpu(self.weight, self.bias):
            return None
        return dense_spec(self.weight, self.bias, num_tokens, self.policy)

    @property
    def weight_bytes(self) -> int:
        return nbytes(self.weight, self.bias)


class Unquantized(QuantizationMethod):
    """No ``--quantization``: the weights in the model's dtype (a GGUF's 4-bit blocks, where a
    caller passes them, dequantized)."""

    name = None

    def create_linear(self, weight: Any, bias: torch.Tensor | None, dtype: torch.dtype,
                      device: torch.device) -> LinearMethod:
        if hasattr(weight, "dequantize"):
            weight = weight.dequantize()
        return DenseLinear(weight.to(device=device, dtype=dtype),
                           None if bias is None else bias.to(device=device, dtype=dtype),
                           self.policy)
