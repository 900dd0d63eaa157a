"""``KernelPolicy``: which kernel runs each forward, decided once at start from the config and this
CPU, and passed to the model and every ``LinearMethod`` (no module globals to flip).

The thresholds below come from the benchmarks in docs/benchmarks.md ("Weight formats",
"CPU linear kernels"; ``benchmarks/bench_cpu_linear.py`` and ``bench_quantization.py`` print
them on any machine); each constant keeps its one-line reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels import cpu_linear

# torch's weight-only CPU kernels are fast with bf16 inputs only: quantized layers run in bf16.
KERNEL_DTYPE = torch.bfloat16
# Rows from which a quantized layer with an fp32 dense copy runs it: torch's int4 kernel costs
# what MKL's fp32 GEMM does at 32 rows, and what our fp32 kernel does at 2-4 rows.
DENSE_FROM_TOKENS = 32
DENSE_FROM_TOKENS_OWN_KERNEL = 4
# With native bf16 the dense copy is bf16 (torch's bf16 GEMM, 3.5-4.5x its fp32 one from 32
# rows); torch's 4-bit kernels still tie it at 24 decode rows.
DENSE_FROM_TOKENS_NATIVE_BF16 = 24
# torch's int8 kernel ties its bf16 copy at 8-12 rows and loses from 16 (native bf16 only).
DENSE_FROM_TOKENS_INT8_NATIVE_BF16 = 12
# Below this many rows a 4-bit layer with fp32 activations runs our Q4 kernel (faster than
# torch's AVX2 int4 kernel at 1 row; with native bf16 torch's is faster from 1 row).
Q4_OWN_KERNEL_BELOW_TOKENS = 2
Q4_OWN_KERNEL_BELOW_TOKENS_NATIVE_BF16 = 0


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16; AMX CPUs have it too)."""
    return "avx512_bf16" in cpu_linear.cpu_flags()


@dataclass(frozen=True)
class KernelPolicy:
    """The kernel choices of one engine (vLLM keeps the like in its platform and config
    objects). Build it with ``detect()``; tests and benchmarks ask for another choice with
    ``detect(int8_dot=False)`` or ``dataclasses.replace``.

    Attributes:
        cpu_kernels: our C++ CPU kernels are built and loaded here (``kernels.cpu.build``).
        native_bf16: the CPU multiplies bf16 natively (a quantized layer's dense copy is then
            bf16, else fp32).
        int8_dot: 4-bit and int8 layers with fp32 activations run our int8-dot kernels
            (``kernels/cpu/q4_vnni.cpp``: AVX-512 VNNI, AVX2 elsewhere) at every row count,
            keeping no dense copy; False: torch's int4/int8 kernels, the dense copy and our Q4
            kernel.
        onednn_large_m: fp32 dense forwards above ``cpu_linear.MAX_ROWS`` rows run oneDNN's
            GEMM (about 2x MKL's sgemm path on AMD CPUs); False: ``F.linear``.
        fused_decode: a step of decodes only, fp32 on CPU, runs each layer as one fused C++
            call (``kernels/cpu/decode_layer.cpp``) where the model's spec allows it.
        fused_decode_whole: ... and every layer of the step in one call (``decode_layers``);
            False: one call a layer (the same bits).
        dense_from_tokens: rows from which a quantized layer runs its dense copy.
        int8_dense_from_tokens: the same for an int8 layer with a bf16 copy.
        q4_own_below: rows below which a 4-bit layer runs our Q4 kernel.
    """

    cpu_kernels: bool
    native_bf16: bool
    int8_dot: bool
    onednn_large_m: bool
    fused_decode: bool
    fused_decode_whole: bool
    dense_from_tokens: int
    int8_dense_from_tokens: int
    q4_own_below: int

    @classmethod
    def detect(cls, **choices: bool | int) -> KernelPolicy:
        """This CPU's policy: our kernels loaded or not (this call does not build them:
        ``ModelRunner.load`` does, before it), native bf16 from the CPU's flags, thresholds
        from the constants above; ``choices`` override any field.

        Raises:
            TypeError: an unknown field in ``choices``.
        """
        loaded = cpu_linear.loaded()
        bf16 = native_bf16()
        dense_from = (DENSE_FROM_TOKENS_NATIVE_BF16 if bf16
                      else DENSE_FROM_TOKENS_OWN_KERNEL if loaded else DENSE_FROM_TOKENS)
        policy = cls(cpu_kernels=loaded, native_bf16=bf16, int8_dot=True, onednn_large_m=True,
                     fused_decode=True, fused_decode_whole=True, dense_from_tokens=dense_from,
                     int8_dense_from_tokens=min(dense_from, DENSE_FROM_TOKENS_INT8_NATIVE_BF16),
                     q4_own_below=(Q4_OWN_KERNEL_BELOW_TOKENS_NATIVE_BF16 if bf16
                                   else Q4_OWN_KERNEL_BELOW_TOKENS))
        return dataclasses.replace(policy, **choices)

    @property
    def dense_copy_dtype(self) -> torch.dtype:
        """A quantized layer's dense copy under fp32 activations: bf16 with native bf16 (its
        GEMM is 3.5-4.5x fp32's from 32 rows), else fp32 (the exact dequantization)."""
        return KERNEL_DTYPE if self.native_bf16 else torch.float32

    def q4_vnni(self, out_features: int, in_features: int, group_size: int) -> bool:
        """Whether a 4-bit layer of this shape with fp32 activations runs our int8-dot kernel
        (groups of 32 only)."""
        return (self.cpu_kernels and self.int8_dot and group_size == cpu_linear.Q4_GROUP
                and cpu_linear.q4_vnni_usable(out_features, in_features))

    def q8_vnni(self, out_features: int, in_features: int) -> bool:
        """Whether an int8 layer of this shape with fp32 activations runs our int8-dot
        kernel."""
        return (self.cpu_kernels and self.int8_dot
                and cpu_linear.q4_vnni_usable(out_features, in_features))

    def kquant(self, part_rows: list[int], in_features: int, ggml_types: set[int]) -> bool:
        """Whether a GGUF K-quant / Q8_0 weight (``engine.quantization.kquant.KQuantWeight``:
        its parts' rows and ggml types) runs our exact kernel (``kernels/cpu/kquant_vnni.cpp``)
        with fp32 activations."""
        return (self.cpu_kernels and self.int8_dot
                and cpu_linear.kquant_usable(part_rows, in_features, ggml_types))

    def int8_dot_serves(self, quantization: str | None, dtype: torch.dtype) -> bool:
        """Whether quantized layers with ``dtype`` activations on CPU run our int8-dot kernels
        (the only path ``--quantized-activation-bits`` applies to)."""
        return (quantization is not None and dtype == torch.float32 and self.int8_dot
                and self.cpu_kernels)

    def dense_copy_note(self, quantization: str | None, dtype: torch.dtype,
                        act_bits: int) -> str:
        """For the start-up log: which dense copy the quantized layers hold and from how many
        rows it runs ("" without one), or the int8-dot kernels' rounding where they run."""
        if quantization is None or dtype != torch.float32:
            return ""
        if self.int8_dot_serves(quantization, dtype):
            return (f"no dense copy: 4-bit and int8 layers through our int8-dot kernels "
                    f"({cpu_linear.int8_dot_isa()}, {act_bits}-bit activations) at every row "
                    f"count")
        if self.dense_copy_dtype != KERNEL_DTYPE:
            return f"fp32 dense copy from {self.dense_from_tokens} rows"
        return (f"bf16 dense copy from {self.dense_from_tokens} rows "
                f"(int8 layers from {self.int8_dense_from_tokens})")
