"""Our CPU decode attention (``kernels/cpu/decode_attention.cpp``) on fp32 caches: the AVX2
tiles against the AVX-512 ones, at the bundled model's shapes. Ratios measured in one run.

SmolLM2-135M's attention (9 query heads, 3 KV heads of 64, blocks of 16 positions) for four
decode steps, each over 30 layers' own caches (as a decode step walks them, so the cache does
not stay in L2):
- 16 sequences on one 1,760-token prefix with tails of their own (the 16-concurrent workload of
  ``bench_servers.py``: shared chunks read once for 48 query rows);
- one sequence at 1,780 positions; 16 unshared sequences at 300; one at 300.

The two paths run alternately, ``--reps`` times each; the table gives the median milliseconds a
layer, the speed-up, and whether the outputs are the same bits (they must be). Where the CPU lacks
AVX-512 only the AVX2 column is printed.

Usage: ``python benchmarks/bench_decode_attention.py [--reps 15] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cpu_linear, cpu_ops

LAYERS, BLOCK, KV_HEADS, HEADS, HEAD_DIM = 30, 16, 3, 9, 64


def make_case(prefix: int, tails: list[int], shared: bool, gen: torch.Generator):
    """Decode rows of ``len(tails)`` sequences of ``prefix + tail`` positions: on one shared
    prefix (its blocks in every table) or each on its own blocks; caches for every layer."""
    tables, used = [], 0
    if shared:
        used = -(-prefix // BLOCK)
    for t in tails:
        n = -(-(t if shared else prefix + t) // BLOCK)
        tables.append((list(range(-(-prefix // BLOCK))) if shared else []) +
                      list(range(used, used + n)))
        used += n
    bt = torch.zeros(len(tails), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    caches = [(torch.randn(used, BLOCK, KV_HEADS, HEAD_DIM, generator=gen),
               torch.randn(used, BLOCK, KV_HEADS, HEAD_DIM, generator=gen))
              for _ in range(LAYERS)]
    q = torch.randn(len(tails), HEADS, HEAD_DIM, generator=gen)
    qsl = torch.arange(len(tails) + 1, dtype=torch.int32)
    lens = torch.tensor([prefix + t for t in tails], dtype=torch.int32)
    return q, caches, qsl, lens, bt


def one_step(case) -> tuple[float, torch.Tensor]:
    """Milliseconds a layer for one pass over every layer, and the last layer's output."""
    q, caches, qsl, lens, bt = case
    out = torch.empty_like(q)
    t0 = time.perf_counter()
    for kc, vc in caches:
        cpu_ops.decode_attention(out, q, kc, vc, qsl, lens, bt, HEAD_DIM ** -0.5)
    return (time.perf_counter() - t0) / len(caches) * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15, help="passes over the layers per path")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not cpu_linear.load():
        sys.exit(f"our CPU kernels are off here: {cpu_linear.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    was = cpu_ops.decode_attention_avx512()
    paths = ["avx2"] + (["avx512"] if cpu_ops.decode_attention_avx512(True) else [])
    gen = torch.Generator().manual_seed(0)
    cases = {
        "16 on a 1,760-token prefix": make_case(1760, [20 + i for i in range(16)], True, gen),
        "1 sequence at 1,780": make_case(1780, [0], False, gen),
        "16 unshared at 300": make_case(300, [0] * 16, False, gen),
        "1 sequence at 300": make_case(300, [0], False, gen),
    }
    print(f"{args.threads} threads, {LAYERS} layers' caches, ms a layer (median of {args.reps})")
    print(f"| step | {' | '.join(paths)} |" + (" AVX-512 speed-up | same bits |"
                                              if len(paths) > 1 else ""))
    print("| --- " * (len(paths) + (3 if len(paths) > 1 else 1)) + "|")
    try:
        for name, case in cases.items():
            times: dict[str, list[float]] = {p: [] for p in paths}
            outs: dict[str, torch.Tensor] = {}
            for rep in range(args.reps + 1):
                for path in paths if rep % 2 else paths[::-1]:
                    cpu_ops.decode_attention_avx512(path == "avx512")
                    ms, outs[path] = one_step(case)
                    if rep:  # the first pass warms up
                        times[path].append(ms)
            med = {p: statistics.median(times[p]) for p in paths}
            row = f"| {name} | " + " | ".join(f"{med[p]:.3f}" for p in paths) + " |"
            if len(paths) > 1:
                same = torch.equal(outs["avx2"], outs["avx512"])
                row += f" {med['avx2'] / med['avx512']:.2f}x | {'yes' if same else 'NO'} |"
            print(row, flush=True)
    finally:
        cpu_ops.decode_attention_avx512(was)


if __name__ == "__main__":
    main()
