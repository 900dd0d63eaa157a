"""``saltserve bench working-set``: a working set larger than the KV pool, the workload the
offload tiers are for (docs/prefix-caching.md), against our server and any peers.

``prompts`` distinct system prompts of about ``tokens`` tokens each, sent in ``rounds`` rounds;
each round sends one request per prompt with a new question (``max_tokens`` greedy tokens),
``concurrency`` in flight. Round 1 is cold; from round 2 on a server whose cache holds the
whole working set hits every prompt, and one whose pool alone is too small (LRU) evicts each
prompt just before it comes back. Servers run one after another (never sharing the cores), each
on its own prompt set (opened by the run's nonce and the server's name, so no server finds
another's or an earlier run's prompts cached).

Per server and round: the hit rate (cached prompt tokens / prompt tokens; a llama.cpp server
reports its reuse as ``timings.cache_n``), the round's wall time and the median TTFT; and each
server's warm-round wall time over the first server's.
"""

from __future__ import annotations

import random
import secrets
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.bench.validate import WORDS, Endpoint, Sample


def system_prompt(rng: random.Random, tokens: int, opening: str) -> str:
    """About ``tokens`` tokens of instructions (1.1 tokens a word with SmolLM2's tokenizer),
    unique per ``opening``."""
    body = " ".join(rng.choice(WORDS) for _ in range(int(tokens / 1.1)))
    return f"{opening} Rules: {body}"


def _round(endpoint: Endpoint, prompts: list[str], question: str, concurrency: int,
           max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples: list[Sample] = list(pool.map(
            lambda p: endpoint.complete(f"{p}\n\n{question}\nAnswer:", max_tokens, True),
            prompts))
    wall = time.perf_counter() - start
    prompt = sum(s.prompt_tokens for s in samples)
    return {"wall_s": wall, "hit_rate": sum(s.cached_tokens for s in samples) / prompt
            if prompt else None, "ttft_p50_s": statistics.median(s.ttft_s for s in samples),
            "prompt_tokens": prompt}


def run_working_set(endpoints: dict[str, Endpoint], prompts: int, tokens: int, rounds: int,
                    concurrency: int, max_tokens: int, seed: int, nonce: str | None = None,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs the workload on each endpoint in turn (first: the baseline of the ratios).

    Returns:
        ``{"config": ..., "servers": {name: {"rounds": [{"wall_s", "hit_rate", "ttft_p50_s",
        "prompt_tokens"}, ...], "warm_wall_ratio": float | None}}}``.
    """
    nonce = nonce or secrets.token_hex(4)
    report: dict[str, Any] = {"config": {"prompts": prompts, "tokens": tokens, "rounds": rounds,
                                         "concurrency": concurrency, "max_tokens": max_tokens,
                                         "seed": seed, "nonce": nonce}, "servers": {}}
    for name, endpoint in endpoints.items():
        rng = random.Random(f"{seed}-{name}")
        texts = [system_prompt(rng, tokens, f"You are the assistant of desk {nonce}-{name}-{i}.")
                 for i in range(prompts)]
        results = []
        for r in range(rounds):
            results.append(_round(endpoint, texts, f"Question {r}: which rule applies to "
                                  f"{rng.choice(WORDS)}?", concurrency, max_tokens))
            if progress is not None:
                last = results[-1]
                progress(f"{name} round {r + 1}: hit rate {last['hit_rate']:.2f}, wall "
                         f"{last['wall_s']:.1f} s, TTFT p50 {last['ttft_p50_s']:.2f} s")
        report["servers"][name] = {"rounds": results}
    first = next(iter(report["servers"].values()))["rounds"]
    for server in report["servers"].values():
        warm = [r["wall_s"] for r in server["rounds"][1:]]
        base = [r["wall_s"] for r in first[1:]]
        server["warm_wall_ratio"] = (statistics.median(warm) / statistics.median(base)
                                     if warm and base else None)
    return report


def format_working_set(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [(f"working set: {c['prompts']} prompts x ~{c['tokens']} tokens, {c['rounds']} "
              f"rounds, {c['concurrency']} in flight, {c['max_tokens']} tokens each"),
             "| server | round | hit rate | wall s | TTFT p50 s |",
             "| --- | --- | --- | --- | --- |"]
    for name, server in report["servers"].items():
        for i, r in enumerate(server["rounds"], 1):
            rate = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
            lines.append(f"| {name} | {i} | {rate} | {r['wall_s']:.1f} | {r['ttft_p50_s']:.2f} |")
    for name, server in report["servers"].items():
        if server["warm_wall_ratio"] is not None:
            lines.append(f"{name}: warm rounds' wall time {server['warm_wall_ratio']:.2f}x the "
                         "first server's")
    return "\n".join(lines)
