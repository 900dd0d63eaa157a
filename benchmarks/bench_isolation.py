"""Noisy-neighbour benchmarks: can one tenant hurt another? Ratios measured in one run.

1. compute: tenant A sends one small chat request per second; tenant B floods with 8 concurrent
   1,200-token prompts (``--b-concurrency``, ``--b-max-tokens``; ``--num-gpu-blocks 300``: a pool
   the flood overfills, where B's running requests would hold every block A needs). A's p50/p95 latency and TTFT solo vs under B's flood, with the plain
   ``fcfs`` scheduling policy (first come, first served across tenants) and with ``fair`` (weighted
   fair queuing + stall-free batching between tenants). Target: A's p50 under flood <= 2x solo
   with ``fair``, no limits configured. Bundled model, engine level (no HTTP).
2. cache: A repeats requests over a ~1,000-token system prompt; B floods unique prompts that
   cycle the whole pool several times. A's hit rate solo vs under flood, with the fair cache
   share and with plain LRU eviction (no per-tenant share). Target: >= 90% of solo. Also the
   unique-prompt throughput of one tenant alone, fair share vs plain LRU (target >= 0.98x).
   Hit rates do not depend on the model's arithmetic, so this part runs the real scheduler and
   block pool over the deterministic fake executor (``tests/fake_engine.py``), at pool sizes
   where "several cycles" take seconds, not minutes.
3. eviction cost: microseconds per allocated block (each one evicting a cached block) with 1,
   10 and 1,000 tenants holding the cached blocks.

Usage: ``python benchmarks/bench_isolation.py [compute|cache|eviction ...]`` (default: all).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.weights import ensure_default_model

QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?",
             "How many legs has a spider?", "What is 2 + 2?", "Name a planet.",
             "What do bees make?", "Which ocean is largest?", "What is ice made of?",
             "Who wrote Hamlet?", "What is H2O?", "How many days in a week?"]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# -- 1. compute ----------------------------------------------------------------------------------
def run_compute_phase(engine: LLMEngine, tok, flood: bool, n_a: int, a_max_tokens: int,
                      b_prompt_tokens: int, b_concurrency: int, seed: int,
                      b_max_tokens: int = 4) -> dict:
    rng = random.Random(seed)
    engine.reset_prefix_cache()
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    b_live: set[str] = set()
    b_tokens = 0
    b_n = 0
    t0 = time.perf_counter()
    next_a, a_sent = t0, 0

    def add_b() -> None:
        nonlocal b_n
        prompt = tuple(rng.randrange(1000, 40000) for _ in range(b_prompt_tokens))
        rid = f"b{seed}-{b_n}"
        b_n += 1
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=b_max_tokens,
                                                                     ignore_eos=True),
                                         tenant_id="B", cache_salt=b"salt-B"))
        b_live.add(rid)

    if flood:
        for _ in range(b_concurrency):
            add_b()
    while len(done) < n_a:
        now = time.perf_counter()
        if a_sent < n_a and now >= next_a:
            q = QUESTIONS[(seed + a_sent) % len(QUESTIONS)]
            text = tok.apply_chat_template([{"role": "user", "content": f"{q} (#{a_sent})"}],
                                           tokenize=False, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
            rid = f"a{seed}-{a_sent}"
            engine.add_request(EngineRequest(rid, tuple(ids), SamplingParams(
                max_tokens=a_max_tokens, ignore_eos=True), tenant_id="A", cache_salt=b"salt-A"))
            arrival[rid] = now
            a_sent += 1
            next_a += 1.0
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, next_a - time.perf_counter()))
            continue
        sched = engine.scheduler
        before = {r.request_id: r.num_computed_tokens for r in sched.running}
        outputs = engine.step()
        now = time.perf_counter()
        for r in sched.running:
            if r.tenant_id == "B":
                b_tokens += r.num_computed_tokens - before.get(r.request_id, 0)
        for out in outputs:
            rid = out.request_id
            if rid in arrival:
                if rid not in first and out.new_token_ids:
                    first[rid] = now
                if out.finished:
                    done[rid] = now
            elif out.finished and rid in b_live:
                b_live.discard(rid)
                b_tokens += out.num_prompt_tokens  # its last chunk (it left ``running``)
                if flood:
                    add_b()
    wall = time.perf_counter() - t0
    for rid in list(b_live):
        engine.abort_request([rid])
    while engine.has_unfinished_requests():  # (a load of an aborted request may be in flight)
        engine.step()
    lat = [done[r] - arrival[r] for r in arrival]
    ttft = [first[r] - arrival[r] for r in arrival]
    return {"p50": statistics.median(lat), "p95": pct(lat, 0.95),
            "ttft50": statistics.median(ttft), "ttft95": pct(ttft, 0.95),
            "b_tok_s": b_tokens / wall if flood else 0.0}


def _pool_stats(engine: LLMEngine) -> tuple[int, int, int]:
    s = engine.scheduler.stats
    return s.num_preemptions, getattr(s, "num_share_preemptions", 0), s.num_recomputed_tokens


def bench_compute(args: argparse.Namespace) -> None:
    model_dir = ensure_default_model(Path(args.data_dir))
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=2048, device="cpu",
                                    dtype="float32", kv_offload_size=0,
                                    num_gpu_blocks_override=args.num_gpu_blocks))
    tok = engine.tokenizer
    kw = {"n_a": args.a_requests, "a_max_tokens": args.a_max_tokens,
          "b_prompt_tokens": 1200, "b_concurrency": args.b_concurrency,
          "b_max_tokens": args.b_max_tokens}
    # Warm-up: the first forwards pay one-off costs; also lets the step-cost model see both
    # decode-only and large steps (it would see them within the first seconds of serving).
    run_compute_phase(engine, tok, True, **{**kw, "n_a": 2}, seed=99)
    rows = {}
    for policy in ("fcfs", "fair"):
        engine.scheduler.policy = policy
        solo = run_compute_phase(engine, tok, False, **kw, seed=1)
        before = _pool_stats(engine)
        flood = run_compute_phase(engine, tok, True, **kw, seed=2)
        flood["pool"] = [b - a for a, b in zip(before, _pool_stats(engine), strict=True)]
        rows[policy] = (solo, flood)
    cap = engine.scheduler.interactive_step_tokens
    print(f"\n[1] noisy neighbour, compute: A = {args.a_requests} chat requests, 1/s, "
          f"{args.a_max_tokens} new tokens each; B = {args.b_concurrency} x 1,200-token "
          f"prompts, {args.b_max_tokens} new tokens each, closed loop; pool "
          f"{engine.block_pool.num_blocks} blocks of {engine.config.block_size} tokens")
    print(f"    measured stall-free cap: {cap} tokens per step beside another tenant's decodes")
    print(f"    {'policy':6} {'A solo p50/p95 (s)':>20} {'A flood p50/p95 (s)':>21} "
          f"{'p50 / p95 ratio':>15} {'TTFT solo/flood p50 (s)':>24} {'B tok/s':>8} "
          f"{'preempted (for a share)':>24} {'recomputed tokens':>18}")
    for policy, (solo, flood) in rows.items():
        pre, share, recomputed = flood["pool"]
        print(f"    {policy:6} {solo['p50']:9.2f} /{solo['p95']:6.2f}   "
              f"{flood['p50']:9.2f} /{flood['p95']:7.2f}   {flood['p50'] / solo['p50']:6.2f}x /"
              f"{flood['p95'] / solo['p95']:5.2f}x {solo['ttft50']:11.3f} /{flood['ttft50']:8.3f}"
              f"    {flood['b_tok_s']:8.0f} {pre:15d} ({share:d}) {recomputed:18d}")


# -- 2. cache ------------------------------------------------------------------------------------
def _plain_lru(engine: LLMEngine) -> None:
    """Plain LRU eviction, without the fair cache share: never pick an over-share owner."""
    engine.block_pool._furthest_over_share = lambda: None
    engine.block_pool._is_over_share = lambda tenant, extra=0: False


def run_cache_phase(engine: LLMEngine, flood: bool, rounds: int, b_prompt_tokens: int,
                    b_per_round: int, seed: int) -> tuple[float, int]:
    """Returns (A's hit rate over its repeats, B tokens submitted)."""
    rng = random.Random(seed)
    system = tuple(range(5000, 6000))  # A's ~1,000-token system prompt
    queried = hits = b_tokens = 0
    for i in range(rounds):
        rid = f"a{seed}-{i}"
        engine.add_request(EngineRequest(rid, system + (7000 + i, 7001 + i), SamplingParams(
            max_tokens=2, ignore_eos=True), tenant_id="A", cache_salt=b"A"))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished and i > 0:
                    queried += out.num_prompt_tokens
                    hits += out.num_cached_tokens
        if flood:
            for j in range(b_per_round):
                prompt = tuple(rng.randrange(10000, 40000) for _ in range(b_prompt_tokens))
                engine.add_request(EngineRequest(f"b{seed}-{i}-{j}", prompt, SamplingParams(
                    max_tokens=1), tenant_id="B", cache_salt=b"B"))
                b_tokens += b_prompt_tokens
            while engine.has_unfinished_requests():
                engine.step()
    return hits / queried, b_tokens


def _fake_engine(num_blocks: int) -> LLMEngine:
    sys.path.insert(0, str(REPO / "tests"))
    from fake_engine import make_fake_llm_engine
    from transformers import AutoTokenizer

    model_dir = ensure_default_model(Path(".saltserve"))
    return make_fake_llm_engine(model_dir, AutoTokenizer.from_pretrained(model_dir),
                                num_gpu_blocks_override=num_blocks, max_model_len=2048,
                                max_num_batched_tokens=2048)


def bench_cache(args: argparse.Namespace) -> None:
    num_blocks = 512  # 8,192 tokens; A's system prompt is 63 blocks
    rounds, b_prompt, b_per_round = 10, 1000, 25  # B: 25,000 tokens between A's requests: the
    # whole pool cycles about 3 times between two requests of A
    results = {}
    for name, lru in (("fair share", False), ("plain LRU", True)):
        solo_engine, flood_engine = _fake_engine(num_blocks), _fake_engine(num_blocks)
        if lru:
            _plain_lru(solo_engine)
            _plain_lru(flood_engine)
        solo, _ = run_cache_phase(solo_engine, False, rounds, b_prompt, b_per_round, 1)
        flood, b_tokens = run_cache_phase(flood_engine, True, rounds, b_prompt, b_per_round, 2)
        results[name] = (solo, flood, b_tokens)
    print(f"\n[2] noisy neighbour, cache: pool {num_blocks} blocks; A repeats a 1,000-token "
          f"system prompt {rounds} times; B floods {b_per_round} unique {b_prompt}-token "
          "prompts between A's requests")
    for name, (solo, flood, b_tokens) in results.items():
        print(f"    {name:10}: A hit rate solo {solo:.1%}, under flood {flood:.1%} "
              f"({flood / solo:.0%} of solo); B sent {b_tokens:,} tokens = "
              f"{b_tokens / (num_blocks * 16):.1f} pool cycles in all")
    # One tenant alone, unique prompts: engine steps/s with the fair cache share vs plain LRU,
    # interleaved, best of 3 (scheduler + pool overhead only: the fake model is ~free).
    times = {"fair share": [], "plain LRU": []}
    for _ in range(3):
        for name, runs in times.items():
            engine = _fake_engine(256)
            if name == "plain LRU":
                _plain_lru(engine)
            rng = random.Random(5)
            t0 = time.perf_counter()
            for i in range(300):
                prompt = tuple(rng.randrange(10000, 40000) for _ in range(200))
                engine.add_request(EngineRequest(f"u{i}", prompt, SamplingParams(max_tokens=1),
                                                 tenant_id="A", cache_salt=b"A"))
                while engine.has_unfinished_requests():
                    engine.step()
            runs.append(time.perf_counter() - t0)
    new, old = min(times["fair share"]), min(times["plain LRU"])
    print(f"    one tenant, 300 unique 200-token prompts through a 256-block pool: "
          f"{300 / new:.0f} req/s fair share vs {300 / old:.0f} req/s plain LRU "
          f"= {old / new:.3f}x")


# -- 3. eviction cost ----------------------------------------------------------------------------
def bench_eviction(args: argparse.Namespace) -> None:
    print("\n[3] eviction cost: allocate 1 block (evicting a cached one), cache it, free it")
    n = 20000
    for tenants in (1, 10, 1000):
        pool = BlockPool(4096)
        names = [f"t{i}" for i in range(tenants)]
        counter = 0
        blocks = pool.get_new_blocks(pool.num_blocks, None)
        for i, b in enumerate(blocks):
            pool.cache_full_block(b, counter.to_bytes(8, "little"), names[i % tenants])
            counter += 1
        pool.free_blocks(blocks)
        t0 = time.perf_counter()
        for i in range(n):
            owner = names[i % tenants]
            (b,) = pool.get_new_blocks(1, owner)
            pool.cache_full_block(b, counter.to_bytes(8, "little"), owner)
            counter += 1
            pool.free_blocks([b])
        per = (time.perf_counter() - t0) / n * 1e6
        pool.check_integrity()
        print(f"    {tenants:5} tenants: {per:5.2f} us per block "
              f"(over-share evictions {pool.stats.num_over_share_evictions:,} of {n:,})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("parts", nargs="*", default=["compute", "cache", "eviction"],
                   choices=["compute", "cache", "eviction"])
    p.add_argument("--data-dir", default=".saltserve")
    p.add_argument("--a-requests", type=int, default=10)
    p.add_argument("--a-max-tokens", type=int, default=16)
    p.add_argument("--b-concurrency", type=int, default=8)
    p.add_argument("--b-max-tokens", type=int, default=4)
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="compute: the pool's blocks (vLLM's --num-gpu-blocks-override); "
                        "default: the engine's default pool")
    args = p.parse_args()
    for part in args.parts:
        {"compute": bench_compute, "cache": bench_cache, "eviction": bench_eviction}[part](args)


if __name__ == "__main__":
    main()
