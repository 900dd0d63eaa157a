"""GGUF K-quant and Q8_0 projections: our exact kernel (``kernels/cpu/kquant_vnni.cpp``) against
what the same weights ran as before it (Q4_K: our 4-bit VNNI kernel with fp16-rounded scales;
Q5_K, Q6_K, Q8_0: per-channel int8 through our int8 VNNI kernel, a second rounding), in one run.

For each type, a projection of Llama-3.1-8B's shapes (``--shape``: gate/up 28,672 x 4,096, or
q/k/v, o or down) with random valid blocks; per row count (a decode step of 1, 4 and 16
sequences, a prefill chunk of 128 rows) the median time of ``--repeats`` calls, the ratio
new / old (below 1: faster), and both layouts' bytes. 16-bit activations (the default), fp32.

Usage: ``python benchmarks/bench_kquant.py [--types Q4_K,Q5_K,Q6_K,Q8_0] [--shape gate_up]``.
Numbers in docs/benchmarks.md, with the CPU they were measured on.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from engine.quantization import KernelPolicy
from engine.quantization.gguf import Int4Linear, q4_k_as_grouped
from engine.quantization.int8 import Int8Linear
from engine.quantization.kquant import KQuantBlocks, KQuantLinear, KQuantWeight
from kernels import cpu_linear

SHAPES = {"gate_up": (28672, 4096), "qkv": (6144, 4096), "o": (4096, 4096),
          "down": (4096, 14336)}


def random_blocks(type_name: str, n: int, k: int, seed: int) -> KQuantBlocks:
    g = torch.Generator().manual_seed(seed)

    def fp16(*shape):
        return (torch.rand(*shape, generator=g) * 1e-3 + 1e-5).half().float()

    def ints(lo, hi, *shape, dtype=torch.uint8):
        return torch.randint(lo, hi, shape, generator=g, dtype=dtype)

    if type_name == "Q8_0":
        return KQuantBlocks("Q8_0", ints(0, 256, n, k), fp16(n, k // 32))
    if type_name == "Q6_K":
        return KQuantBlocks("Q6_K", ints(0, 64, n, k), fp16(n, k // 256),
                            ints(-128, 128, n, k // 16, dtype=torch.int8))
    top = 16 if type_name == "Q4_K" else 32
    return KQuantBlocks(type_name, ints(0, top, n, k), fp16(n, k // 256),
                        ints(0, 64, n, k // 32), fp16(n, k // 256), ints(0, 64, n, k // 32))


def timed(layer, x: torch.Tensor, repeats: int) -> float:
    for _ in range(3):
        layer(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0")
    parser.add_argument("--shape", default="gate_up", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,4,16,128")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if not cpu_linear.load():
        raise SystemExit(f"our CPU kernels are not built here: {cpu_linear.unavailable_reason()}")
    policy = KernelPolicy.detect()
    n, k = SHAPES[args.shape]
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"ISA {cpu_linear.int8_dot_isa()}; {args.shape} [{n}, {k}], fp32 activations, "
          f"16-bit rounding")
    print("| type | rows | exact kernel ms | before ms | new / old | exact MiB | before MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for t in args.types.split(","):
        w = KQuantWeight((random_blocks(t, n, k, 0),))
        new = KQuantLinear.from_weight(w, None)
        grouped = q4_k_as_grouped(w)
        old = (Int4Linear.from_grouped(grouped, None, torch.float32, True, policy)
               if grouped is not None
               else Int8Linear.quantize(w.dequantize(), None, torch.float32, True, policy))
        del grouped
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            a, b = timed(new, x, args.repeats), timed(old, x, args.repeats)
            print(f"| {t} | {m} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f} | "
                  f"{new.weight_bytes / 2**20:.0f} | {old.weight_bytes / 2**20:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
