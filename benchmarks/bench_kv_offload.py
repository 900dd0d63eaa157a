"""A working set larger than the pool, with and without the disk offload tier, in one run.

The bundled model in process (fp32, the default 1 GiB pool: 1,456 blocks of 16 tokens), 24
distinct system prompts of about 1,500 tokens (36k tokens in all), three rounds; each round sends
one request per prompt with a new question (8 output tokens, greedy), two in flight. Printed per
round and setting: the hit rate (cached prompt tokens / prompt tokens), the round's wall time
and the median time to first token; then the tier's blocks written and loaded, its load time
per block and AES-GCM's sealing speed on this CPU.

Usage: ``python benchmarks/bench_kv_offload.py [--prompts 24] [--rounds 3]``. Numbers in
docs/benchmarks.md with the CPU they were measured on.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.kv_offload import BlockCipher
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.weights import ensure_default_model


def _system_prompt(tokenizer, i: int, tokens: int) -> list[int]:
    words = " ".join(f"clause{i}-{j} of the policy applies to account holders" for j in
                     range(tokens // 8))
    return tokenizer.encode(f"System policy {i}: {words}")[:tokens]


def _round(engine: LLMEngine, prompts: list[list[int]], question: list[int], tag: str,
           in_flight: int) -> tuple[float, float, float]:
    """(hit rate, wall seconds, median TTFT seconds) of one round."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    pending = [EngineRequest(f"{tag}-{i}", tuple(p + question), params, tenant_id="t",
                             cache_salt=b"s" * 32) for i, p in enumerate(prompts)]
    start, arrival, first, hits, total = time.perf_counter(), {}, {}, 0, 0
    running = 0
    while pending or running:
        while pending and running < in_flight:
            req = pending.pop(0)
            arrival[req.request_id] = time.perf_counter()
            engine.add_request(req)
            running += 1
        for out in engine.step():
            if out.request_id not in first and out.new_token_ids:
                first[out.request_id] = time.perf_counter() - arrival[out.request_id]
            if out.finished:
                running -= 1
                hits += out.num_cached_tokens
                total += out.num_prompt_tokens
    return hits / total, time.perf_counter() - start, statistics.median(first.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=2)
    parser.add_argument("--data-dir", type=Path, default=Path(".saltserve"))
    args = parser.parse_args()
    model = ensure_default_model(args.data_dir)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; bundled "
          f"model fp32, default pool; {args.prompts} prompts x {args.tokens} tokens, "
          f"{args.rounds} rounds, {args.in_flight} in flight")
    print("| setting | round | hit rate | wall s | TTFT p50 s |")
    print("| --- | --- | --- | --- | --- |")
    for setting in ("pool only", "disk tier"):
        with tempfile.TemporaryDirectory(prefix="kv-offload-") as tier:
            cfg = EngineConfig(model=str(model), max_model_len=2048,
                               kv_offload_size=(8 << 30) if setting == "disk tier" else 0,
                               kv_offload_dir=tier if setting == "disk tier" else None)
            engine = LLMEngine(cfg)
            prompts = [_system_prompt(engine.tokenizer, i, args.tokens)
                       for i in range(args.prompts)]
            for r in range(args.rounds):
                question = engine.tokenizer.encode(f" Question {r}: what applies?")
                rate, wall, ttft = _round(engine, prompts, question, f"r{r}", args.in_flight)
                print(f"| {setting} | {r + 1} | {rate:.2f} | {wall:.1f} | {ttft:.2f} |",
                      flush=True)
            if engine.offloader is not None:
                engine.offloader.flush()
                s = engine.offloader.stats
                per = s.load_seconds / s.loaded * 1e3 if s.loaded else 0.0
                print(f"\ntier: {s.written} blocks written ({s.written_bytes / 2**20:.0f} MiB), "
                      f"{s.write_dropped} dropped, {s.loaded} loaded ({per:.2f} ms a block, "
                      f"read + open + copy), {s.load_failed} failed\n")
                engine.offloader.close()
    cipher = BlockCipher(b"bench", engine.cache_info.bytes_per_block)
    data = os.urandom(cipher.block_bytes)
    t0, n = time.perf_counter(), 200
    for _ in range(n):
        blob = cipher.seal(b"k" * 32, 0, b"h" * 32, data)
    seal = n * len(data) / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    for _ in range(n):
        cipher.open(b"k" * 32, 0, b"h" * 32, blob)
    opened = n * len(data) / (time.perf_counter() - t0) / 1e9
    print(f"AES-256-GCM on this CPU: seal {seal:.2f} GB/s, open {opened:.2f} GB/s "
          f"({cipher.block_bytes / 1024:.0f} KiB blocks)")


if __name__ == "__main__":
    main()
