"""Linear layers with dense or weight-only quantized weights (``--quantization``, vLLM's flag).

One interface, one file per method (vLLM's ``QuantizationConfig`` / ``LinearMethod`` pattern):

- ``base.py``: ``QuantizationMethod`` (a ``--quantization`` value: how a checkpoint's
  projection becomes a ``LinearMethod``), ``LinearMethod`` (``x`` [num_tokens, in] ->
  [num_tokens, out] in ``x``'s dtype), ``DecodeSpec`` (what a forward runs, as the fused CPU
  decode layer takes it) and ``QuantizedLinear`` (a weight-only kernel plus an optional dense
  copy for many-row forwards);
- ``unquantized.py``: no quantization (``DenseLinear``);
- ``int8.py``: ``--quantization int8``, per-channel int8 (``Int8Linear``);
- ``gguf.py``: ``--quantization gguf``, a GGUF's 4-bit blocks kept (``Int4Linear``), its other
  tensors per-channel int8;
- ``policy.py``: ``KernelPolicy``, the kernel choices of one engine (our int8-dot kernels,
  oneDNN for large GEMMs, the fused decode, the dense-copy thresholds), built once at start
  and passed to every method and layer.

Adding a method is one file with a ``QuantizationMethod`` subclass and one line in
``_METHODS`` (and its name in ``engine.config.QUANTIZATIONS``).
"""

from __future__ import annotations

import torch

from engine.config import QUANTIZATIONS
from engine.quantization.base import (
    DEFAULT_ACT_BITS,
    DecodeSpec,
    LinearMethod,
    QuantizationMethod,
    QuantizedLinear,
)
from engine.quantization.gguf import (
    INT4_GROUP_SIZE,
    GGUFMethod,
    GroupedInt4,
    GroupedQ4,
    GroupedQ4Vnni,
    Int4Linear,
)
from engine.quantization.int8 import Int8Linear, Int8Method
from engine.quantization.kquant import KQuantBlocks, KQuantLinear, KQuantWeight
from engine.quantization.policy import (
    DENSE_FROM_TOKENS,
    DENSE_FROM_TOKENS_INT8_NATIVE_BF16,
    DENSE_FROM_TOKENS_NATIVE_BF16,
    DENSE_FROM_TOKENS_OWN_KERNEL,
    KERNEL_DTYPE,
    Q4_OWN_KERNEL_BELOW_TOKENS,
    Q4_OWN_KERNEL_BELOW_TOKENS_NATIVE_BF16,
    KernelPolicy,
    native_bf16,
)
from engine.quantization.unquantized import DenseLinear, Unquantized
from kernels.cpu.kinds import (
    SPEC_DENSE,
    SPEC_INT4,
    SPEC_INT8,
    SPEC_KQUANT,
    SPEC_LINEAR,
    SPEC_LINEAR_BF16,
    SPEC_LINEAR_ONEDNN,
    SPEC_Q4,
    SPEC_Q4_VNNI,
    SPEC_Q8_VNNI,
)

_METHODS: dict[str | None, type[QuantizationMethod]] = {
    None: Unquantized, "int8": Int8Method, "gguf": GGUFMethod}


def get_quantization_method(quantization: str | None, policy: KernelPolicy | None = None,
                            act_bits: int = DEFAULT_ACT_BITS) -> QuantizationMethod:
    """The ``QuantizationMethod`` of a ``--quantization`` value under ``policy`` (default:
    this CPU's, ``KernelPolicy.detect()``).

    Raises:
        ValueError: a name outside ``QUANTIZATIONS``.
    """
    if quantization not in _METHODS:
        raise ValueError(f"--quantization {quantization!r} is not supported; supported: "
                         f"{', '.join(QUANTIZATIONS)}")
    return _METHODS[quantization](policy if policy is not None else KernelPolicy.detect(),
                                  act_bits)


def make_linear(weight: torch.Tensor | GroupedInt4, bias: torch.Tensor | None,
                quantization: str | None, dtype: torch.dtype, device: torch.device,
                act_bits: int = DEFAULT_ACT_BITS, policy: KernelPolicy | None = None
                ) -> LinearMethod:
    """One projection's ``LinearMethod``: ``get_quantization_method(quantization, policy,
    act_bits).create_linear(weight, bias, dtype, device)``."""
    return get_quantization_method(quantization, policy, act_bits).create_linear(
        weight, bias, dtype, device)


def check_quantization(quantization: str | None, device: torch.device) -> None:
    """Raises ValueError unless the kernels of ``quantization`` (one of ``QUANTIZATIONS``) run
    on ``device``: CPU only."""
    if quantization is None:  # (EngineConfig has checked the name)
        return
    if device.type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on CPU only (torch's weight-only "
                         f"CPU kernels); on {device.type} serve bfloat16 without it")


__all__ = [
    "DEFAULT_ACT_BITS",
    "DENSE_FROM_TOKENS",
    "DENSE_FROM_TOKENS_INT8_NATIVE_BF16",
    "DENSE_FROM_TOKENS_NATIVE_BF16",
    "DENSE_FROM_TOKENS_OWN_KERNEL",
    "INT4_GROUP_SIZE",
    "KERNEL_DTYPE",
    "Q4_OWN_KERNEL_BELOW_TOKENS",
    "Q4_OWN_KERNEL_BELOW_TOKENS_NATIVE_BF16",
    "QUANTIZATIONS",
    "SPEC_DENSE",
    "SPEC_INT4",
    "SPEC_INT8",
    "SPEC_KQUANT",
    "SPEC_LINEAR",
    "SPEC_LINEAR_BF16",
    "SPEC_LINEAR_ONEDNN",
    "SPEC_Q4",
    "SPEC_Q4_VNNI",
    "SPEC_Q8_VNNI",
    "DecodeSpec",
    "DenseLinear",
    "GGUFMethod",
    "GroupedInt4",
    "GroupedQ4",
    "GroupedQ4Vnni",
    "Int4Linear",
    "Int8Linear",
    "Int8Method",
    "KQuantBlocks",
    "KQuantLinear",
    "KQuantWeight",
    "KernelPolicy",
    "LinearMethod",
    "QuantizationMethod",
    "QuantizedLinear",
    "Unquantized",
    "check_quantization",
    "get_quantization_method",
    "make_linear",
    "native_bf16",
]
