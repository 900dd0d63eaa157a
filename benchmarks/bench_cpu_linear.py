"""Our CPU linear kernel (``kernels/cpu/linear.cpp``) against torch's, at the bundled model's
shapes and decode-sized batches. Ratios measured in one run.

For each projection shape of SmolLM2-135M (fused q/k/v, o, fused gate/up, down, LM head) and
M = 1..64 activation rows (M = running sequences in a decode step):
- fp32: ``F.linear`` (MKL sgemm) vs ``kernels.cpu_linear.linear``: microseconds per call and the
  speed-up;
- the weight-only quantized kernels torch has (``--quantization int8``: ``_weight_int8pack_mm``;
  ``gguf``: ``_weight_int4pack_mm_for_cpu``), bf16 in and out, for the crossover: up to which M
  reading 1-4 bytes per weight beats our fp32 kernel reading 4 bytes.
- our Q4 kernel (``kernels/cpu/q4_linear.cpp``, fp32 in and out, int8 activation groups), the
  one ``--quantization gguf`` runs below ``KernelPolicy.q4_own_below``
  rows: its time and its speed-up over torch's int4 kernel (with the fp32 <-> bf16 conversions a
  fp32 model pays). ``ATEN_CPU_CAPABILITY=avx2`` shows torch's kernels as on an AVX2-only CPU.
- the bf16 dense copy a quantized layer holds on CPUs with native bf16 (``F.linear`` in bf16,
  with the conversions a fp32 model pays), which runs from
  ``engine.quantization.DENSE_FROM_TOKENS_NATIVE_BF16`` rows there: its time and its speed-up
  over the int4 kernel (both with conversions) and over fp32 ``F.linear``.
Also the effective read bandwidth of our kernels at M=1 (weight bytes / time).

Usage: ``python benchmarks/bench_cpu_linear.py [--rows 1,2,4,8,16,32,64]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.quantization import GroupedInt4, Int4Linear, Int8Linear
from kernels import cpu_linear

# (name, out_features, in_features) of SmolLM2-135M's projections (hidden 576, 9 heads of 64,
# 3 KV heads, intermediate 1536, vocabulary 49,152).
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576)]


def per_call_us(fn, budget_s: float = 0.25) -> float:
    """Median of 5 batches of calls, each ~budget_s / 5 long, in microseconds per call."""
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-6)
    n = max(1, int(budget_s / 5 / one))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
    return sorted(times)[2] * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if not cpu_linear.load():
        raise SystemExit(f"kernel unavailable: {cpu_linear.unavailable_reason()}")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}; kernel used up to "
          f"{cpu_linear.MAX_ROWS} rows")
    print(f"{'shape':>8} {'M':>3} {'F.linear us':>12} {'ours us':>9} {'speed-up':>9} "
          f"{'int8 us':>8} {'int4 us':>8} {'our q4 us':>10} {'vs int4':>8} {'bf16 us':>8} "
          f"{'vs int4':>8} {'vs fp32':>8}")
    for name, n, k in SHAPES:
        w = torch.randn(n, k) / k ** 0.5
        wb = w.bfloat16()
        q8 = Int8Linear.quantize(w, None, torch.bfloat16)
        g = GroupedInt4(torch.randint(0, 16, (n, k), dtype=torch.uint8),
                        torch.rand(n, k // 32) / 100, -torch.rand(n, k // 32) / 100)
        q4 = Int4Linear.from_grouped(g, None, torch.bfloat16)
        codes = cpu_linear.pack_q4(g.codes)
        scale16, minimum16 = g.scale.half(), g.minimum.half()  # as Int4Linear keeps them
        for m in rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            ref = per_call_us(lambda x=x, w=w: F.linear(x, w))
            if m <= cpu_linear.MAX_ROWS:
                ours = per_call_us(
                    lambda x=x, w=w: torch.ops.saltserve_cpu.linear_small_m(x, w, None))
                ratio = f"{ref / ours:8.2f}x"
                ours_s = f"{ours:9.1f}"
            else:
                ours_s, ratio = f"{'-':>9}", f"{'-':>9}"
            i8 = per_call_us(lambda q8=q8, xb=xb: q8._kernel(xb))
            i4 = per_call_us(lambda q4=q4, xb=xb: q4._kernel(xb))
            i4_fp32 = per_call_us(lambda q4=q4, x=x: q4._kernel(x.bfloat16()).float())
            oq4 = per_call_us(lambda x=x, c=codes, s=scale16, mn=minimum16:
                              cpu_linear.q4_linear(x, c, s, mn))
            bf16 = per_call_us(lambda x=x, wb=wb: F.linear(x.bfloat16(), wb).float())
            print(f"{name:>8} {m:3d} {ref:12.1f} {ours_s} {ratio} {i8:8.1f} {i4:8.1f} "
                  f"{oq4:10.1f} {i4_fp32 / oq4:7.2f}x {bf16:8.1f} {i4_fp32 / bf16:7.2f}x "
                  f"{ref / bf16:7.2f}x")
            if m == 1:
                gbs = n * k * 4 / (float(ours_s) * 1e-6) / 1e9
                q4_gbs = (codes.numel() + 4 * g.scale.numel()) / (oq4 * 1e-6) / 1e9
                print(f"{'':>8}     ours reads the fp32 weight at {gbs:.1f} GB/s, "
                      f"our q4 its 4-bit weight at {q4_gbs:.1f} GB/s")


if __name__ == "__main__":
    main()
