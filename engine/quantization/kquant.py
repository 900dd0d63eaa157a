"""GGUF K-quant and Q8_0 weights kept exactly as the file stores them (``--quantization gguf``).

llama.cpp's K-quants are two-level (ggml ``ggml-common.h``): a super-block of 256 inputs has
fp16 scales ``d`` (and ``dmin``), each sub-block of 32 inputs (Q6_K: 16) a small integer scale
``sc`` (and minimum ``m``)::

    Q4_K, Q5_K:  w = (d * sc) * q - dmin * m      q in [0, 15] / [0, 31], sc, m in [0, 63]
    Q6_K:        w = (d * sc) * (q - 32)          q in [0, 63], sc int8
    Q8_0:        w = d * (u - 128)                u = q + 128, d per block of 32

``KQuantBlocks`` holds one tensor's blocks unpacked to one code per byte with its integer and
fp32 scales; ``KQuantWeight`` stacks several (a fused q/k/v or gate/up projection whose parts
may differ in type, as in a Q4_K_M file). ``KQuantLinear`` serves them through
``kernels/cpu/kquant_vnni.cpp`` (fp32 activations, AVX-512 VNNI or AVX2): no weight is rounded
again, and the layout costs 1.00-1.06x the file's bytes. Elsewhere (bf16 activations, our
kernels off) a Q4_K-only weight becomes ``GroupedInt4`` (exact) and any other is dequantized and
quantized per channel to int8, the path every float weight takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quantization.base import DEFAULT_ACT_BITS, DecodeSpec, LinearMethod, nbytes
from kernels import cpu_linear
from kernels.cpu.kinds import SPEC_KQUANT

SUPER_BLOCK = 256  # inputs per K-quant super-block (ggml's QK_K)

# ggml's type ids (ggml.h), which the kernel's meta tensor names each tile by.
GGML_TYPE = {"Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


@dataclass
class KQuantBlocks:
    """One GGUF tensor of type ``type_name`` (``GGML_TYPE``), unpacked but not rounded.

    Attributes:
        type_name: "Q4_K", "Q5_K", "Q6_K" or "Q8_0".
        codes: [out, in] uint8, unsigned: Q4_K, Q5_K, Q6_K the file's q; Q8_0 ``q + 128``.
        d: [out, in / 256] fp32 (Q8_0: [out, in / 32]), the file's fp16 values.
        sc: Q4_K, Q5_K [out, in / 32] uint8; Q6_K [out, in / 16] int8; Q8_0 None.
        dmin: Q4_K, Q5_K [out, in / 256] fp32; else None.
        m: Q4_K, Q5_K [out, in / 32] uint8; else None.
    """

    type_name: str
    codes: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """[out, in] fp32, with the operations (and bits) of ``gguf.quants.dequantize``."""
        n, k = self.codes.shape
        if self.type_name == "Q8_0":
            return ((self.codes.to(torch.int16) - 128).float().view(n, -1, 32)
                    * self.d[..., None]).view(n, k)
        sub = 16 if self.type_name == "Q6_K" else 32
        per = SUPER_BLOCK // sub
        scale = (self.d.repeat_interleave(per, dim=1) * self.sc.float())[..., None]
        if self.type_name == "Q6_K":
            q = (self.codes.to(torch.int16) - 32).float().view(n, -1, sub)
            return (scale * q).view(n, k)
        q = self.codes.float().view(n, -1, sub)
        dm = (self.dmin.repeat_interleave(per, dim=1) * self.m.float())[..., None]
        return (scale * q - dm).view(n, k)

    def rows(self, index: torch.Tensor) -> KQuantBlocks:
        """The output rows ``index`` (a permutation or a slice of them), in that order."""
        pick = (lambda t: None if t is None else t[index])
        return KQuantBlocks(self.type_name, self.codes[index], self.d[index], pick(self.sc),
                            pick(self.dmin), pick(self.m))


@dataclass
class KQuantWeight:
    """Output rows stacked from one or more ``KQuantBlocks`` (a fused projection's parts).

    Attributes:
        parts: the blocks in output order; each part's rows a multiple of 16 for the kernel.
    """

    parts: tuple[KQuantBlocks, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(p.type_name for p in self.parts)

    @property
    def ggml_types(self) -> set[int]:
        return {GGML_TYPE[p.type_name] for p in self.parts}

    def dequantize(self) -> torch.Tensor:
        """[out, in] fp32 (each part as ``KQuantBlocks.dequantize``)."""
        return torch.cat([p.dequantize() for p in self.parts])

    def rows(self, index: torch.Tensor) -> KQuantWeight:
        """The output rows ``index`` of a one-part weight (llama.cpp's q/k permutation undone).

        Raises:
            ValueError: a weight of several parts.
        """
        if len(self.parts) != 1:
            raise ValueError("rows() of a stacked K-quant weight")
        return KQuantWeight((self.parts[0].rows(index),))

    @staticmethod
    def cat(parts: list[KQuantWeight]) -> KQuantWeight:
        """Stacks the output rows of ``parts`` (same inputs, any types).

        Raises:
            ValueError: parts with different input sizes.
        """
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError("cannot fuse K-quant weights with different input sizes")
        return KQuantWeight(tuple(b for p in parts for b in p.parts))


class KQuantLinear(LinearMethod):
    """``x @ w.T (+ bias)`` for a ``KQuantWeight`` through our kernel, its weights only in the
    kernel's layout: fp32 CPU activations only (``KernelPolicy.kquant`` decides where it runs).

    Args:
        packed: (codes, scales, meta) from ``cpu_linear.pack_kquant``.
        out_features: rows of ``w``.
        bias: [out] fp32, or None.
        act_bits: the activations' rounding, 16 or 8 (``--quantized-activation-bits``).
    """

    def __init__(self, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 out_features: int, bias: torch.Tensor | None = None,
                 act_bits: int = DEFAULT_ACT_BITS) -> None:
        self.packed, self.out_features, self.bias = packed, out_features, bias
        self.act_bits = act_bits

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise RuntimeError("a K-quant layer in our kernel's layout runs fp32 CPU "
                               "activations only")
        return cpu_linear.kquant_linear(x, *self.packed, self.bias, self.act_bits)

    def decode_spec(self, num_tokens: int) -> DecodeSpec | None:
        return DecodeSpec(SPEC_KQUANT, self.packed, self.bias, self.act_bits)

    @classmethod
    def from_weight(cls, w: KQuantWeight, bias: torch.Tensor | None,
                    act_bits: int = DEFAULT_ACT_BITS) -> KQuantLinear:
        """Packs ``w`` (``cpu_linear.kquant_usable``) for the kernel; ``bias`` in fp32."""
        packed = cpu_linear.pack_kquant([(GGML_TYPE[p.type_name], p.codes, p.d, p.sc, p.dmin,
                                          p.m) for p in w.parts])
        return cls(packed, w.shape[0], None if bias is None else bias.float().contiguous(),
                   act_bits)

    @property
    def weight_bytes(self) -> int:
        return nbytes(*self.packed, self.bias)
