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
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.bench import PROFILES
from app.bench.baselines import HFGenerate, run_hf, summarise
from app.bench.validate import Endpoint, Sample, random_text


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
    """Reads a server's ``/metrics`` (saltserve's names, or vLLM's, which match them): counters
    before and after a run, and ``kv_cache_usage_perc`` sampled in the background while it
    runs. vLLM counts no evictions: 0."""

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
        names = {"prefix_cache_queries": "queries", "prefix_cache_hits": "hits",
                 "prefix_cache_evictions": "evictions", "kv_cache_usage_perc": "kv_usage"}
        for family in text_string_to_metric_families(r.text):
            prefix, _, name = family.name.partition(":")
            key = names.get(name) if prefix in ("saltserve", "vllm") else None
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


@dataclass
class Measured:
    """One run's raw figures: its samples, wall time (seconds), the cache counters' change over
    it (``queries``, ``hits``, ``evictions``; None without a probe) and KV usage samples."""

    samples: list[Sample]
    wall_s: float
    counters: dict[str, float] | None = None
    kv_usage: list[float] = field(default_factory=list)


def measure(endpoint: Endpoint, prompts: list[str], concurrency: int, max_tokens: int,
            probe: MetricsProbe | None = None, ignore_eos: bool = False) -> Measured:
    """Sends ``prompts`` at ``concurrency``. ``ignore_eos``: every request generates all
    ``max_tokens``."""
    before = probe.read() if probe else None
    if probe:
        probe.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples: list[Sample] = list(pool.map(
            lambda p: endpoint.complete(p, max_tokens, ignore_eos=ignore_eos), prompts))
    wall = time.perf_counter() - start
    if probe:
        probe.stop()
    after = probe.read() if probe else None
    counters = ({k: after[k] - before[k] for k in ("queries", "hits", "evictions")}
                if before is not None and after is not None else None)
    return Measured(samples, wall, counters, list(probe.samples) if probe else [])


def pooled(runs: list[Measured], block_size: int | None = None) -> dict[str, Any]:
    """The report's figures (see the module docstring) over one or more runs of the same
    workload: samples pooled, wall times summed, cache counters summed; ``block_size`` (the
    server's, tokens) adds the block-level hit rate."""
    samples = [s for m in runs for s in m.samples]
    out = summarise(samples, sum(m.wall_s for m in runs), block_size)
    if all(m.counters is not None for m in runs):
        queried = sum(m.counters["queries"] for m in runs)  # type: ignore[index]
        hits = sum(m.counters["hits"] for m in runs)  # type: ignore[index]
        evicted = sum(m.counters["evictions"] for m in runs)  # type: ignore[index]
        kv = [x for m in runs for x in m.kv_usage]
        out["metrics"] = {
            "hit_rate": hits / queried if queried else None,
            "evicted_blocks_per_request": evicted / len(samples),
            "kv_usage_mean": statistics.fmean(kv) if kv else None,
            "kv_usage_peak": max(kv) if kv else None,
            # The server counts tokens of every tenant: agreement within 2 points when this run
            # is the only traffic (a tenant with caching off is not looked up at all).
            "hit_rate_agrees": abs(hits / queried - out["hit_rate"]) <= 0.02 if queried
            else out["cached_tokens"] == 0,
        }
    return out


def run_profile(endpoint: Endpoint, prompts: list[str], concurrency: int,
                max_tokens: int, probe: MetricsProbe | None = None,
                ignore_eos: bool = False) -> dict[str, Any]:
    """Sends ``prompts`` at ``concurrency``; the run's figures (see the module docstring).
    ``ignore_eos``: every request generates all ``max_tokens``."""
    return pooled([measure(endpoint, prompts, concurrency, max_tokens, probe, ignore_eos)])


def run_profiles(on: Endpoint, off: Endpoint, requests: int = 16, concurrency: int = 4,
                 max_tokens: int = 16, seed: int = 0, profiles: tuple[str, ...] = PROFILES,
                 progress: Any = None, nonce: str | None = None,
                 peers: dict[str, Endpoint] | None = None, hf: HFGenerate | None = None,
                 probe: MetricsProbe | None = None, rounds: int = 1) -> dict[str, Any]:
    """Every profile with caching on (``on``'s tenant) and off (``off``'s), then on each of
    ``peers`` (name -> endpoint) and through ``hf`` (``generate``, one prompt at a time); the
    report, with ours (caching on) over each of the others. ``probe`` reads our cache counters
    (a server's ``/metrics``, or an in-process engine's): without one the report has no
    ``metrics``.

    ``rounds`` > 1 interleaves: each round sends a new prompt set (its own nonce) to off and on,
    in alternating order (off first in even rounds), then to each peer; every run's figures pool
    its rounds, and ``rounds_on_vs_off`` lists each round's throughput ratio, so a drift of the
    machine during the run hits both sides alike (HF ``generate`` runs the first round's prompts once, at the end).
    Raises ValueError for ``rounds`` < 1."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    nonce = nonce or f"{random.SystemRandom().getrandbits(32):08x}"
    peers = peers or {}
    cache_config = on.cache_config()
    peer_configs = {n: p.cache_config() for n, p in peers.items()}
    ours_block = _block_size(cache_config)
    on.complete("Warm-up: say hello.", 2)
    for peer in peers.values():
        peer.complete("Warm-up: say hello.", 2)
    if hf is not None:
        hf.complete("Warm-up: say hello.", 2)
    results: dict[str, Any] = {}
    for name in profiles:
        ours: dict[str, list[Measured]] = {"off": [], "on": []}
        theirs: dict[str, list[Measured]] = {peer_name: [] for peer_name in peers}
        first_prompts: list[str] = []
        for i in range(rounds):
            prompts = profile_prompts(name, requests, seed, nonce if i == 0 else f"{nonce}-{i}")
            first_prompts = first_prompts or prompts
            # Off first in round 0: its prompts are new to the server, and it caches nothing the
            # on run could reuse (another tenant, and caching off).
            for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                ours[side].append(measure(on if side == "on" else off, prompts, concurrency,
                                          max_tokens, probe))
            for peer_name, peer in peers.items():
                theirs[peer_name].append(measure(peer, prompts, concurrency, max_tokens,
                                                 MetricsProbe(peer.url, peer.metrics_token)))
        results[name] = {"off": pooled(ours["off"], ours_block),
                         "on": pooled(ours["on"], ours_block)}
        r = results[name]
        r["peers"] = {peer_name: pooled(runs, _block_size(peer_configs[peer_name]))
                      for peer_name, runs in theirs.items()}
        if rounds > 1:
            r["rounds_on_vs_off"] = [(len(b.samples) / b.wall_s) / (len(a.samples) / a.wall_s)
                                     for a, b in zip(ours["off"], ours["on"])]
        if hf is not None:
            r["hf_generate"] = run_hf(hf, first_prompts, max_tokens)
        others = {"caching off": r["off"], **r["peers"]}
        if hf is not None:
            others["hf_generate"] = r["hf_generate"]
        r["ours_vs"] = {other: {
            "throughput": r["on"]["requests_per_s"] / x["requests_per_s"],
            "ttft_p50_lower": x["ttft_p50_s"] / r["on"]["ttft_p50_s"]}
            for other, x in others.items()}
        r["throughput_on_vs_off"] = r["ours_vs"]["caching off"]["throughput"]
        r["ttft_p50_off_vs_on"] = r["ours_vs"]["caching off"]["ttft_p50_lower"]
        if progress is not None:
            progress(name)
    return {"test": "profiles", "url": on.url, "model": on.model, "seed": seed,
            "nonce": nonce, "requests": requests, "concurrency": concurrency,
            "max_tokens": max_tokens, "rounds": rounds, "cache_config": cache_config,
            "peers": {n: {"url": p.url, "model": p.model, "cache_config": peer_configs[n]}
                      for n, p in peers.items()},
            "hf_generate": ({"model_dir": str(hf.model_dir), "device": "cpu", "dtype": "float32"}
                            if hf is not None else None),
            "profiles": results}


def _block_size(cache_config: dict[str, str]) -> int | None:
    try:
        return int(cache_config["block_size"])
    except (KeyError, ValueError):
        return None


def profile_runs(profile: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One profile's runs by label, in report order: ours off and on, each peer, generate."""
    runs = {"ours, cache off": profile["off"], "ours, cache on": profile["on"],
            **profile.get("peers", {})}
    if profile.get("hf_generate"):
        runs["hf_generate"] = profile["hf_generate"]
    return runs


def format_profiles(report: dict[str, Any]) -> str:
    rounds = report.get("rounds", 1)
    per_run = (f"{report['requests']} requests per run" if rounds == 1 else
               f"{rounds} interleaved rounds of {report['requests']} requests per run")
    lines = [(f"model {report['model']} at {report['url']}: {per_run}, concurrency "
              f"{report['concurrency']}, max_tokens {report['max_tokens']}")]
    ours_block = report["cache_config"].get("block_size", "?")
    for name, peer in report.get("peers", {}).items():
        block = peer["cache_config"].get("block_size", "?")
        note = "" if block == ours_block else " (differs: prefixes are reused in whole blocks)"
        lines.append(f"block size: ours {ours_block}, {name} {block}{note}")
    if report.get("hf_generate"):
        lines.append("hf_generate: transformers generate, one prompt at a time, fp32, greedy")
    lines.append(f"{'profile':14} {'run':16} {'TTFT p50':>9} {'p95':>7} {'p99':>7} "
                 f"{'ITL ms':>7} {'req/s':>6} {'out tok/s':>9} {'prefill tok/s':>13} "
                 f"{'hit rate':>8} {'blk hit':>7} {'KV peak':>7} {'evict/req':>9}")

    def pct(v: float | None, width: int) -> str:
        return f"{100 * v:{width - 1}.1f}%" if v is not None else " " * (width - 1) + "-"

    for name, r in report["profiles"].items():
        for run, x in profile_runs(r).items():
            itl = f"{1000 * x['itl_mean_s']:7.1f}" if x["itl_mean_s"] is not None else "      -"
            m = x.get("metrics") or {}
            evict = m.get("evicted_blocks_per_request")
            lines.append(f"{name:14} {run:16} {x['ttft_p50_s']:8.3f}s {x['ttft_p95_s']:6.2f}s "
                         f"{x['ttft_p99_s']:6.2f}s {itl} {x['requests_per_s']:6.2f} "
                         f"{x['output_tokens_per_s']:9.1f} {x['prefill_tokens_per_s']:13.0f} "
                         f"{pct(x['hit_rate'], 8)} {pct(x.get('block_hit_rate'), 7)} "
                         f"{pct(m.get('kv_usage_peak'), 7)} "
                         f"{'-' if evict is None else format(evict, '.2f'):>9}")
            if m and not m.get("hit_rate_agrees", True):
                lines.append(f"{'':14} {run}: /metrics hit rate {pct(m.get('hit_rate'), 7)} "
                             "disagrees with cached_tokens (other traffic on the server?)")
        if r.get("rounds_on_vs_off"):
            each = ", ".join(f"{x:.2f}" for x in r["rounds_on_vs_off"])
            lines.append(f"{'':14} throughput on/off per round: {each} (median "
                         f"{statistics.median(r['rounds_on_vs_off']):.2f}x)")
        for other, v in r["ours_vs"].items():
            lower = v["ttft_p50_lower"]
            ttft = f"{lower:.2f}x lower" if lower >= 1 else f"{1 / lower:.2f}x higher"
            lines.append(f"{'':14} ours (cache on) vs {other}: throughput "
                         f"{v['throughput']:.2f}x, TTFT p50 {ttft}")
    return "\n".join(lines)
