"""``saltserve bench profiles``: the seed's four workload profiles, each with prefix caching on
and off, against a running server.

Profiles (``shared/seeds/001``): a shared system prompt (at least 1,500 tokens) with varying
questions; a repeated RAG document (one of three ~1,000-token documents) with a question; a
stable few-shot block (~800 tokens) with a new query; and mostly unique prompts (~600 tokens of
their own). Every prompt opens with the run's nonce, so nothing is cached from an earlier run.

"On" and "off" are two tenants of the same server: one with prefix caching, one without
(``saltserve tenants create bench-off --no-prefix-caching``), so both runs share the process,
the pool and the hardware. Each run sends ``requests`` streamed completions at
``concurrency``, and reports TTFT p50 / p95 / p99, inter-token latency, requests/s, prefill
tokens/s (prompt tokens not served from the cache, per second of wall time) and the effective
hit rate from the responses' ``cached_tokens``; with ``/metrics`` access, also the cache's own
figures over the run: hit rate (hit / queried tokens), evicted blocks per request and KV block
utilisation (mean and peak of ``kv_cache_usage_perc``, sampled every 0.25 s), and whether the
two hit rates agree.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.bench.validate import Endpoint, Sample, percentile, random_text

PROFILES = ("shared_system", "rag_document", "few_shot", "unique")


def profile_prompts(profile: str, n: int, seed: int, nonce: str) -> list[str]:
    """``n`` prompts of ``profile`` (seeded; ``nonce`` opens each one)."""
    rng = random.Random(f"{seed}:{profile}")
    head = f"Run {nonce}."

    def question(i: int) -> str:
        return f"\nQuestion {i}: {random_text(rng, 8)}?"

    if profile == "shared_system":
        system = f"{head} System: you answer for the port authority. {random_text(rng, 1450)}"
        return [system + question(i) for i in range(n)]
    if profile == "rag_document":
        docs = [f"{head} Document {d}: {random_text(rng, 780)}" for d in range(3)]
        return [docs[i % 3] + question(i) for i in range(n)]
    if profile == "few_shot":
        shots = f"{head} Examples: " + " ".join(
            f"Q: {random_text(rng, 12)}? A: {random_text(rng, 20)}." for _ in range(20))
        return [shots + question(i) for i in range(n)]
    if profile == "unique":
        return [f"{head} Request {i}: {random_text(rng, 470)}" + question(i) for i in range(n)]
    raise ValueError(f"profile must be one of {', '.join(PROFILES)}")


class MetricsProbe:
    """Reads the server's ``/metrics`` (saltserve's names): counters before and after a run,
    and ``kv_cache_usage_perc`` sampled in the background while it runs."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict[str, float] | None:
        try:
            r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        out = {"queries": 0.0, "hits": 0.0, "evictions": 0.0, "kv_usage": 0.0}
        names = {"saltserve:prefix_cache_queries": "queries",
                 "saltserve:prefix_cache_hits": "hits",
                 "saltserve:prefix_cache_evictions": "evictions",
                 "saltserve:kv_cache_usage_perc": "kv_usage"}
        for family in text_string_to_metric_families(r.text):
            key = names.get(family.name)
            if key is None:
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                out[key] += sample.value
        return out

    def start(self) -> None:
        self.samples, self._stop = [], threading.Event()

        def poll() -> None:
            while not self._stop.wait(0.25):
                snap = self.read()
                if snap is not None:
                    self.samples.append(snap["kv_usage"])

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


def run_profile(endpoint: Endpoint, prompts: list[str], concurrency: int,
                max_tokens: int, probe: MetricsProbe | None = None) -> dict[str, Any]:
    """Sends ``prompts`` at ``concurrency``; the run's figures (see the module docstring)."""
    before = probe.read() if probe else None
    if probe:
        probe.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples: list[Sample] = list(pool.map(lambda p: endpoint.complete(p, max_tokens),
                                              prompts))
    wall = time.perf_counter() - start
    if probe:
        probe.stop()
    after = probe.read() if probe else None
    ttfts = [s.ttft_s for s in samples]
    prompt = sum(s.prompt_tokens for s in samples)
    cached = sum(s.cached_tokens for s in samples)
    itl = [(s.total_s - s.ttft_s) / (s.completion_tokens - 1) for s in samples
           if s.completion_tokens > 1]
    out: dict[str, Any] = {
        "requests": len(samples), "wall_s": wall,
        "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": percentile(ttfts, 0.95),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_mean_s": statistics.fmean(itl) if itl else None,
        "requests_per_s": len(samples) / wall, "prefill_tokens_per_s": (prompt - cached) / wall,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
    }
    if before is not None and after is not None:
        queried = after["queries"] - before["queries"]
        hits = after["hits"] - before["hits"]
        out["metrics"] = {
            "hit_rate": hits / queried if queried else None,
            "evicted_blocks_per_request": (after["evictions"] - before["evictions"])
            / len(samples),
            "kv_usage_mean": statistics.fmean(probe.samples) if probe.samples else None,
            "kv_usage_peak": max(probe.samples) if probe.samples else None,
            # The server counts tokens of every tenant: agreement within 2 points when this run
            # is the only traffic (a tenant with caching off is not looked up at all).
            "hit_rate_agrees": abs(hits / queried - out["hit_rate"]) <= 0.02 if queried
            else cached == 0,
        }
    return out


def run_profiles(on: Endpoint, off: Endpoint, requests: int = 16, concurrency: int = 4,
                 max_tokens: int = 16, seed: int = 0, profiles: tuple[str, ...] = PROFILES,
                 metrics_token: str | None = None, progress: Any = None,
                 nonce: str | None = None) -> dict[str, Any]:
    """Every profile with caching on (``on``'s tenant) and off (``off``'s); the report."""
    nonce = nonce or f"{random.SystemRandom().getrandbits(32):08x}"
    probe = MetricsProbe(on.url, metrics_token) if metrics_token else None
    on.complete("Warm-up: say hello.", 2)
    results: dict[str, Any] = {}
    for name in profiles:
        prompts = profile_prompts(name, requests, seed, nonce)
        # Off first: its prompts are new to the server, and it caches nothing the on run could
        # reuse (another tenant, and caching off).
        results[name] = {"off": run_profile(off, prompts, concurrency, max_tokens, probe),
                         "on": run_profile(on, prompts, concurrency, max_tokens, probe)}
        r = results[name]
        r["throughput_on_vs_off"] = r["on"]["requests_per_s"] / r["off"]["requests_per_s"]
        r["ttft_p50_off_vs_on"] = r["off"]["ttft_p50_s"] / r["on"]["ttft_p50_s"]
        if progress is not None:
            progress(name)
    return {"test": "profiles", "url": on.url, "model": on.model, "seed": seed,
            "nonce": nonce, "requests": requests, "concurrency": concurrency,
            "max_tokens": max_tokens, "cache_config": on.cache_config(), "profiles": results}


def format_profiles(report: dict[str, Any]) -> str:
    lines = [(f"model {report['model']} at {report['url']}: {report['requests']} requests per "
             f"run, concurrency {report['concurrency']}, max_tokens {report['max_tokens']}"),
             (f"{'profile':14} {'cache':5} {'TTFT p50':>9} {'p95':>7} {'p99':>7} {'ITL ms':>7} "
             f"{'req/s':>6} {'prefill tok/s':>13} {'hit rate':>8}")]
    for name, r in report["profiles"].items():
        for mode in ("off", "on"):
            x = r[mode]
            itl = f"{1000 * x['itl_mean_s']:7.1f}" if x["itl_mean_s"] is not None else "      -"
            lines.append(f"{name:14} {mode:5} {x['ttft_p50_s']:8.3f}s {x['ttft_p95_s']:6.2f}s "
                         f"{x['ttft_p99_s']:6.2f}s {itl} {x['requests_per_s']:6.2f} "
                         f"{x['prefill_tokens_per_s']:13.0f} {100 * x['hit_rate']:7.1f}%")
        lines.append(f"{'':14} on vs off: throughput {r['throughput_on_vs_off']:.2f}x, TTFT p50 "
                     f"{r['ttft_p50_off_vs_on']:.2f}x lower")
    return "\n".join(lines)
