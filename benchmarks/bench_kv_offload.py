"""A working set larger than the pool, with and without offload tiers, in one run.

The bundled model in process (fp32, the default 1 GiB pool: 1,456 blocks of 16 tokens), 24
distinct system prompts of about 1,500 tokens (36k tokens in all), three rounds; each round sends
one request per prompt with a new question (8 output tokens, greedy), two in flight. Settings:
the pool alone, the disk tier (write-through, the default: a block goes to disk as soon as
its step is done), and the disk tier with the shared Redis tier (always write-through). Printed per round and setting: the hit rate (cached prompt
tokens / prompt tokens), the round's wall time and the median time to first token, and for
round 1 (every prompt new: unique-prompt throughput) its wall time over the pool-only one's.
Then each tier's blocks written and loaded and the load time per block; a restart on the disk
tier (the first request on a prefix cached before it: cached tokens and TTFT over cold); and
AES-GCM's speed on this CPU beside the load time of one prompt's blocks.

``--unique-passes N`` measures what the tiers cost on unique prompts alone, where they can
only add work: the settings' engines (those above, and the disk tier with ``write_back``) are
built once, and each pass sends every setting ``--unique-prompts`` new prompts (the order
alternating, A B C D then D C B A, so a 2-vCPU VM's drift hits all of them), then one
stream decoding 160 tokens alone per setting and pass; printed: each setting's median wall
time and median inter-token latency over the pool-only one's.

Usage: ``python benchmarks/bench_kv_offload.py [--prompts 24] [--rounds 3] [--redis-url
redis://127.0.0.1:6379/0]`` (``--redis-url ''``: no Redis setting). Numbers in
docs/benchmarks.md with the CPU they were measured on.
"""

from __future__ import annotations

import argparse
import itertools
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


def _decode_itl(engine: LLMEngine, prompt: list[int], tag: str,
                max_tokens: int = 160) -> float:
    """Median inter-token latency (s) of one stream decoding ``max_tokens`` tokens alone (its
    output blocks are written to the tiers as they fill)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest(tag, tuple(prompt), params, tenant_id="t",
                                     cache_salt=b"s" * 32))
    times = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                times.append(time.perf_counter())
    return statistics.median(b - a for a, b in itertools.pairwise(times[1:]))  # after TTFT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=2)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--data-dir", type=Path, default=Path(".saltserve"))
    parser.add_argument("--unique-passes", type=int, default=0)
    parser.add_argument("--unique-prompts", type=int, default=8)
    args = parser.parse_args()
    if args.unique_passes:
        _unique(args, ensure_default_model(args.data_dir))
        return
    model = ensure_default_model(args.data_dir)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; bundled "
          f"model fp32, default pool; {args.prompts} prompts x {args.tokens} tokens, "
          f"{args.rounds} rounds, {args.in_flight} in flight")
    print("| setting | round | hit rate | wall s | TTFT p50 s | round 1 / pool only |")
    print("| --- | --- | --- | --- | --- | --- |")
    settings = ["pool only", "disk tier"] + (["disk + redis tiers"] if args.redis_url else [])
    cold_wall: dict[str, float] = {}
    notes: list[str] = []
    namespace = f"bench-{os.getpid()}"
    for setting in settings:
        with tempfile.TemporaryDirectory(prefix="kv-offload-") as tier:
            def engine_for(setting: str = setting, tier: str = tier) -> LLMEngine:
                redis = setting == "disk + redis tiers"
                return LLMEngine(EngineConfig(
                    model=str(model), max_model_len=2048,
                    kv_offload_size=0 if setting == "pool only" else 8 << 30,
                    kv_offload_dir=None if setting == "pool only" else tier,
                    kv_offload_redis_url=args.redis_url if redis else None,
                    kv_offload_redis_namespace=namespace))

            engine = engine_for()
            prompts = [_system_prompt(engine.tokenizer, i, args.tokens)
                       for i in range(args.prompts)]
            for r in range(args.rounds):
                question = engine.tokenizer.encode(f" Question {r}: what applies?")
                rate, wall, ttft = _round(engine, prompts, question, f"r{r}", args.in_flight)
                if r == 0:
                    cold_wall[setting] = wall
                ratio = f"{wall / cold_wall['pool only']:.2f}" if r == 0 else ""
                print(f"| {setting} | {r + 1} | {rate:.2f} | {wall:.1f} | {ttft:.2f} | {ratio} |",
                      flush=True)
            if engine.offloader is None:
                continue
            off = engine.offloader
            off.flush()
            for name, t in off.stats.tiers.items():
                notes.append(f"{setting}, {name}: {t.written} blocks written "
                             f"({t.written_bytes / 2**20:.0f} MiB), {t.write_failed} failed, "
                             f"{t.loaded} loaded, {t.load_failed} failed to open")
            s = off.stats
            per = s.load_seconds / s.loaded * 1e3 if s.loaded else 0.0
            notes.append(f"{setting}: {s.write_dropped} writes dropped (queue full); "
                         f"{s.load_jobs} loads, {per:.2f} ms a block (read + open + copy, on "
                         f"the loader thread)")
            if setting == "disk tier":  # a restart: the pool's blocks saved, found again
                off.save_pool(engine.block_pool.cached_block_hash_to_block.values())
                off.close()
                again = engine_for()
                question = again.tokenizer.encode(" After the restart: what applies?")
                cold_q = again.tokenizer.encode(" A new prompt: what applies?")
                _, _, warm_ttft = _round(again, prompts[:3], question, "restart", 1)
                fresh = [_system_prompt(again.tokenizer, 1000 + i, args.tokens)
                         for i in range(3)]
                _, _, cold_ttft = _round(again, fresh, cold_q, "fresh", 1)
                hit, _, _ = _round(again, prompts[3:6], question, "restart-hit", 1)
                notes.append(f"restart: hit rate {hit:.2f} on prefixes cached before it; "
                             f"TTFT p50 {warm_ttft:.2f} s vs {cold_ttft:.2f} s cold "
                             f"({warm_ttft / cold_ttft:.2f}x)")
                again.offloader.close()
            else:
                for t in off.tiers:
                    if t.name == "redis":
                        t.delete_all()
                off.close()
    print()
    for note in notes:
        print(f"- {note}")
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
    blocks = args.tokens // 16
    print(f"- AES-256-GCM on this CPU: seal {seal:.2f} GB/s, open {opened:.2f} GB/s "
          f"({cipher.block_bytes / 1024:.0f} KiB blocks): opening one {args.tokens}-token "
          f"prefix ({blocks} blocks) takes {blocks * cipher.block_bytes / opened / 1e6:.1f} ms")


def _unique(args: argparse.Namespace, model: Path) -> None:
    """Unique prompts only, the settings alternating (module docstring)."""
    namespace = f"bench-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="kv-offload-") as tier_a, \
            tempfile.TemporaryDirectory(prefix="kv-offload-") as tier_b, \
            tempfile.TemporaryDirectory(prefix="kv-offload-") as tier_c:
        settings = {
            "pool only": {"kv_offload_size": 0},
            "disk tier": {"kv_offload_size": 8 << 30, "kv_offload_dir": tier_a},
            "disk tier, write_back": {"kv_offload_size": 8 << 30, "kv_offload_dir": tier_c,
                                      "kv_offload_write_policy": "write_back"},
            "disk + redis tiers": {"kv_offload_size": 8 << 30, "kv_offload_dir": tier_b,
                                   "kv_offload_redis_url": args.redis_url,
                                   "kv_offload_redis_namespace": namespace}}
        if not args.redis_url:
            del settings["disk + redis tiers"]
        engines = {name: LLMEngine(EngineConfig(model=str(model), max_model_len=2048, **kw))
                   for name, kw in settings.items()}
        walls: dict[str, list[float]] = {name: [] for name in engines}
        order = list(engines)
        tok = engines["pool only"].tokenizer
        question = tok.encode(" Question: what applies?")
        for p in range(args.unique_passes):
            for name in order if p % 2 == 0 else order[::-1]:
                prompts = [_system_prompt(tok, 10_000 * (p + 1) + 100 * order.index(name) + i,
                                          args.tokens) for i in range(args.unique_prompts)]
                _, wall, _ = _round(engines[name], prompts, question, f"u{p}", args.in_flight)
                if engines[name].offloader is not None:
                    engines[name].offloader.flush()  # its writes land within its own pass
                walls[name].append(wall)
        itl: dict[str, list[float]] = {name: [] for name in engines}
        for p in range(args.unique_passes):  # single-stream decode, the same alternation
            for name in order if p % 2 == 0 else order[::-1]:
                prompt = _system_prompt(tok, 90_000 + 100 * p + order.index(name), 200)
                itl[name].append(_decode_itl(engines[name], prompt, f"d{p}"))
        print(f"# unique prompts: {args.unique_passes} passes x {args.unique_prompts} prompts x "
              f"{args.tokens} tokens, {args.in_flight} in flight, settings alternating")
        base = statistics.median(walls["pool only"])
        base_itl = statistics.median(itl["pool only"])
        for name, w in walls.items():
            print(f"- {name}: wall {statistics.median(w):.1f} s (median; passes "
                  f"{', '.join(f'{x:.1f}' for x in w)}), {statistics.median(w) / base:.3f}x "
                  f"pool only; one stream decoding 160 tokens: inter-token latency "
                  f"{statistics.median(itl[name]) * 1e3:.1f} ms (median of passes), "
                  f"{statistics.median(itl[name]) / base_itl:.3f}x pool only")
        for engine in engines.values():
            if engine.offloader is not None:
                for t in engine.offloader.tiers:
                    if t.name == "redis":
                        t.delete_all()
                engine.offloader.close()


if __name__ == "__main__":
    main()
