"""What padding oneDNN's rows to ``kernels.cpu_linear.ONEDNN_ROW_BUCKET`` buys and costs.

oneDNN (and torch's ideep layer) caches one GEMM primitive per input shape. Prefill chunks take
every row count up to ``max_num_batched_tokens``, so without padding a server's resident memory
grows with each new count (up to 1,024 cached shapes per cache).

1. ``rss``: resident memory added by 600 distinct row counts (257-856) through
   ``cpu_linear.linear`` at the bundled model's MLP shape, unpadded (bucket 1) and padded
   (the bucket in use), each in a fresh process.
2. ``prefill``: the bundled model in process (fp32, no offload tier), 8 prompts of random
   lengths (200-1,500 tokens) per pass, 2 in flight, unpadded and padded alternating within
   each pass on the same lengths; prints the median wall of each and their ratio.

Usage: ``python benchmarks/bench_onednn_shapes.py [rss] [prefill] [--passes 7]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kernels import cpu_linear

_RSS_CHILD = """
import sys, torch
from kernels import cpu_linear
cpu_linear.load()
cpu_linear.ONEDNN_ROW_BUCKET = int(sys.argv[1])
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
w = torch.randn(1536, 576)
for m in range(40, 50):
    cpu_linear.linear(torch.randn(m, 576), w)
start = rss()
for m in range(257, 857):
    cpu_linear.linear(torch.randn(m, 576), w)
print(f"{rss() - start:.1f} {int(cpu_linear.large_m_onednn(w))}")
"""


def bench_rss() -> None:
    print("[1] resident memory added by 600 distinct row counts, [m, 576] x [576, 1536] fp32")
    for bucket in (1, cpu_linear.ONEDNN_ROW_BUCKET):
        out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(bucket)], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
        if out[1] != "1":
            print("    oneDNN is not in use on this machine (SALTSERVE_CPU_KERNELS=0?)")
            return
        print(f"    rows padded to a multiple of {bucket:3d}: +{float(out[0]):.0f} MiB")


def bench_prefill(passes: int) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_kv_offload import _round, _system_prompt

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.weights import ensure_default_model

    engine = LLMEngine(EngineConfig(model=str(ensure_default_model(REPO / ".saltserve")),
                                    max_model_len=2048, kv_offload_size=0))
    tok = engine.tokenizer
    question = tok.encode(" Question: what applies?")
    rng = random.Random(1)
    buckets = (1, cpu_linear.ONEDNN_ROW_BUCKET)
    walls: dict[int, list[float]] = {b: [] for b in buckets}
    for p in range(passes + 1):  # pass 0 warms up
        lengths = [rng.randrange(200, 1500) for _ in range(8)]
        for b in buckets if p % 2 == 0 else buckets[::-1]:
            cpu_linear.ONEDNN_ROW_BUCKET = b
            prompts = [_system_prompt(tok, 1000 * p + 10 * b + i, n)
                       for i, n in enumerate(lengths)]
            _, wall, _ = _round(engine, prompts, question, f"p{p}b{b}", 2)
            if p:
                walls[b].append(wall)
    cpu_linear.ONEDNN_ROW_BUCKET = buckets[1]
    base, padded = (statistics.median(walls[b]) for b in buckets)
    ratios = [x / y for x, y in zip(walls[buckets[1]], walls[1], strict=True)]
    print(f"[2] prefill, {passes} passes of 8 prompts (200-1,500 tokens), 2 in flight: "
          f"unpadded {base:.2f} s, padded {padded:.2f} s (medians), {padded / base:.3f}x; "
          f"per pass {min(ratios):.3f}-{max(ratios):.3f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("parts", nargs="*", help="rss, prefill (default: both)")
    p.add_argument("--passes", type=int, default=7)
    args = p.parse_args()
    if set(args.parts) - {"rss", "prefill"}:
        p.error("parts are rss and prefill")
    for part in args.parts or ["rss", "prefill"]:
        bench_rss() if part == "rss" else bench_prefill(args.passes)


if __name__ == "__main__":
    main()
