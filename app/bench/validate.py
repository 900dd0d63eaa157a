"""``saltserve bench validate``: the cold / warm / negative-control test of prefix caching.

The test the seed article prescribes before a rollout (``shared/seeds/001``), against any
OpenAI-compatible server: a prompt with a long shared prefix (``prefix_tokens``, at least 1,000)
and a short unique suffix, temperature 0, one request at a time.

Each round draws a prefix no server has seen (a nonce from the seed and the run's nonce opens
it; ``run_nonce`` is random unless given, and recorded, so a prompt set can be replayed) and
sends:

1. **cold**: the prefix + suffix A: nothing cached, full prefill;
2. **warm**: the same prefix + suffix B: the prefix comes from the cache;
3. **negative control**: the prefix with one token changed early (in its first 16-token block)
   + suffix C: nothing may match, so its TTFT must fall back to the cold one. If it does not,
   the warm speed-up came from something else (warm-up, another cache).

Before round 0 a short prompt and one as long as the test's (on a prefix of its own) pay the
server's first-request and first-long-prefill costs, which would otherwise inflate round 0's
cold TTFT alone and make the negative control look fast against it.

TTFT is measured by the client (request sent to first streamed token, seconds); ``cached_tokens``
comes from each response's usage. Gates (seed defaults, configurable): warm TTFT at least 30%
below cold (medians), effective hit rate (warm ``cached_tokens`` / prompt tokens) at least 0.6,
the negative control misses (``cached_tokens`` 0 and TTFT at least ``neg_min_ratio`` of cold),
and no p99 regression (warm p99 not above cold p99).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Common English words: prompts tokenise to about 1.3 tokens per word with most tokenizers.
WORDS = ("harbor", "cargo", "vessel", "crane", "berth", "manifest", "customs", "pallet", "freight", "container", "route", "schedule", "tide", "pilot", "anchor", "dock", "warehouse", "invoice", "ledger", "shipment", "carrier", "port", "inspection", "permit", "weight", "volume", "draft", "hull", "deck", "bridge", "engine", "fuel", "ballast", "signal", "beacon", "channel", "lock", "canal", "barge", "tug", "ferry", "terminal", "gate", "yard", "truck", "rail", "depot")
PROBE = "The quick brown fox jumps over the lazy dog near the harbor at 12:30."


@dataclass(frozen=True)
class Gates:
    """Pass / fail thresholds (the seed's defaults)."""

    min_warm_drop: float = 0.30  # warm TTFT at least this much below cold (median)
    min_hit_rate: float = 0.60  # warm cached_tokens / prompt tokens (median)
    neg_min_ratio: float = 0.70  # negative-control TTFT at least this share of cold (median)
    max_p99_ratio: float = 1.0  # warm TTFT p99 at most this multiple of cold p99 ("no regression")
    require_cold: bool = True  # the cold requests must get cached_tokens 0 (a fresh prefix)


@dataclass
class Sample:
    """One streamed completion: TTFT and total time (seconds) and its usage."""

    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class Endpoint:
    """An OpenAI-compatible server: ``url`` (without ``/v1``), an API key, a model."""

    url: str
    api_key: str
    model: str | None = None
    timeout_s: float = 300.0
    metrics_token: str | None = None
    client: httpx.Client = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.client = httpx.Client(timeout=self.timeout_s, headers={
            "Authorization": f"Bearer {self.api_key}"})
        if self.model is None:
            r = self.client.get(self.url + "/v1/models")
            r.raise_for_status()
            try:
                self.model = r.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise RuntimeError(f"{self.url}/v1/models lists no model") from None

    def tokenize(self, text: str) -> list[int] | None:
        """Token ids from the server's ``/tokenize`` (vLLM's extension); None without one."""
        try:
            r = self.client.post(self.url + "/tokenize", json={"model": self.model,
                                                               "prompt": text})
        except httpx.HTTPError:
            return None
        return r.json().get("tokens") if r.status_code == 200 else None

    def complete(self, prompt: str, max_tokens: int, ignore_eos: bool = False) -> Sample:
        """One streamed completion at temperature 0 (usage from the last chunk);
        ``ignore_eos`` (vLLM's extension) makes it generate all ``max_tokens``. A kept-alive
        connection the server closed before answering (llama.cpp's server closes idle ones
        after 5 s) is retried once on a new one."""
        try:
            return self._complete(prompt, max_tokens, ignore_eos)
        except httpx.RemoteProtocolError:
            return self._complete(prompt, max_tokens, ignore_eos)

    def _complete(self, prompt: str, max_tokens: int, ignore_eos: bool) -> Sample:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            body["ignore_eos"] = True
        start = time.perf_counter()
        first = None
        usage: dict[str, Any] = {}
        timings: dict[str, Any] = {}
        with self.client.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{self.url} answered {r.status_code}: {r.text[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("timings"):  # llama.cpp's server: its prompt-cache reuse
                    timings = chunk["timings"]
        total = time.perf_counter() - start
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") or timings.get("cache_n") or 0
        return Sample(first if first is not None else total, total,
                      int(usage.get("prompt_tokens", 0)), int(cached),
                      int(usage.get("completion_tokens", 0)))

    def cache_config(self) -> dict[str, str]:
        """Block size, pool size and device from ``saltserve:cache_config_info`` (or vLLM's
        ``vllm:cache_config_info``) on ``/metrics``; empty without access."""
        headers = {"Authorization": f"Bearer {self.metrics_token}"} if self.metrics_token else {}
        try:
            r = httpx.get(self.url + "/metrics", headers=headers, timeout=10)
        except httpx.HTTPError:
            return {}
        if r.status_code != 200:
            return {}
        for family in text_string_to_metric_families(r.text):
            if family.name in ("saltserve:cache_config_info", "vllm:cache_config_info"):
                for sample in family.samples:
                    return dict(sample.labels)
        return {}


def random_text(rng: random.Random, words: int) -> str:
    """``words`` seeded words of ``WORDS``, space-separated."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make_prefix(rng: random.Random, run_nonce: str, words: int) -> list[str]:
    """A prefix no server has seen: ``Reference <run nonce>-<seeded nonce>:`` + ``words``
    seeded words."""
    nonce = f"{run_nonce}-{rng.getrandbits(32):08x}"
    return [f"Reference {nonce}:"] + [rng.choice(WORDS) for _ in range(words)]


def words_for(endpoint: Endpoint, tokens: int, seed: int, run_nonce: str) -> int:
    """How many words make a prefix of about ``tokens`` tokens: counted by the server's
    ``/tokenize`` when it has one, else ~1.3 tokens per word."""
    words = max(1, int(tokens / 1.3))
    counted = endpoint.tokenize(" ".join(make_prefix(random.Random(seed), run_nonce, words)))
    if counted:
        words = max(1, int(words * tokens / len(counted)) + 1)
    return words


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run_validate(endpoint: Endpoint, prefix_tokens: int = 1000, rounds: int = 5,
                 seed: int = 0, max_tokens: int = 8, gates: Gates = Gates(),
                 progress: Any = None, run_nonce: str | None = None) -> dict[str, Any]:
    """Runs the test; returns the report (JSON-serialisable) with ``passed`` and per-gate
    results.

    Raises:
        ValueError: ``prefix_tokens`` under 1,000 or ``rounds`` under 1.
        RuntimeError: the server refused a request.
    """
    if prefix_tokens < 1000:
        raise ValueError("the seed's test needs a prefix of at least 1,000 tokens")
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    rng = random.Random(seed)
    run_nonce = run_nonce or f"{random.SystemRandom().getrandbits(32):08x}"
    probe = endpoint.tokenize(PROBE)
    words = words_for(endpoint, prefix_tokens, seed, run_nonce)
    # The server's own first-request costs, and those of its first long prefill (allocator
    # growth, kernel dispatch at that size): a prompt as long as the test's, on a prefix of its
    # own (its first block differs), so round 0's cold request is no slower than a miss.
    endpoint.complete("Warm-up: say hello.", 2)
    warm_up = make_prefix(random.Random(f"{seed}-warm-up"), f"{run_nonce}-warm-up", words)
    endpoint.complete("Warm-up " + " ".join(warm_up), 2)
    cold, warm, neg = [], [], []
    first_diff = None
    for r in range(rounds):
        prefix = make_prefix(rng, run_nonce, words)
        changed = ["Citation" + prefix[0].removeprefix("Reference"), *prefix[1:]]  # token 0
        text, neg_text = " ".join(prefix), " ".join(changed)
        cold.append(endpoint.complete(f"{text}\nQuestion {r}A: which berth?", max_tokens))
        warm.append(endpoint.complete(f"{text}\nQuestion {r}B: which crane?", max_tokens))
        neg.append(endpoint.complete(f"{neg_text}\nQuestion {r}C: which gate?", max_tokens))
        if first_diff is None:
            a, b = endpoint.tokenize(text), endpoint.tokenize(neg_text)
            if a and b:
                first_diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False))
                                   if x != y), None)
        if progress is not None:
            progress(r + 1, rounds)

    def ttft(samples: list[Sample]) -> dict[str, float]:
        values = [s.ttft_s for s in samples]
        return {"p50_s": statistics.median(values), "p99_s": percentile(values, 0.99),
                "min_s": min(values), "max_s": max(values)}

    cold_t, warm_t, neg_t = ttft(cold), ttft(warm), ttft(neg)
    warm_drop = 1 - warm_t["p50_s"] / cold_t["p50_s"]
    hit_rate = statistics.median(s.cached_tokens / s.prompt_tokens for s in warm
                                 if s.prompt_tokens)
    neg_ratio = neg_t["p50_s"] / cold_t["p50_s"]
    cached = [s.cached_tokens for s in cold + warm + neg if s.cached_tokens]
    config = endpoint.cache_config()
    results = {
        "cold_is_cold": {"value": [s.cached_tokens for s in cold],
                         "gate": ("cached_tokens 0 (else the prompts were cached before: use a "
                                  "new run nonce)") if gates.require_cold else "off",
                         "passed": all(s.cached_tokens == 0 for s in cold)
                         or not gates.require_cold},
        "warm_drop": {"value": warm_drop, "gate": f">= {gates.min_warm_drop}",
                      "percent": 100 * warm_drop, "passed": warm_drop >= gates.min_warm_drop},
        "hit_rate": {"value": hit_rate, "gate": f">= {gates.min_hit_rate}",
                     "passed": hit_rate >= gates.min_hit_rate},
        "negative_control": {
            "value": {"ttft_ratio_to_cold": neg_ratio,
                      "cached_tokens": [s.cached_tokens for s in neg]},
            "gate": f"cached_tokens 0 and TTFT >= {gates.neg_min_ratio} x cold",
            "passed": all(s.cached_tokens == 0 for s in neg)
            and neg_ratio >= gates.neg_min_ratio},
        "p99": {"value": {"cold_s": cold_t["p99_s"], "warm_s": warm_t["p99_s"]},
                "gate": f"warm p99 <= {gates.max_p99_ratio:g} x cold p99",
                "passed": warm_t["p99_s"] <= gates.max_p99_ratio * cold_t["p99_s"]},
    }
    return {
        "test": "validate", "url": endpoint.url, "model": endpoint.model, "seed": seed,
        "run_nonce": run_nonce,
        "rounds": rounds, "max_tokens": max_tokens,
        "tokenizer_hash": hashlib.sha256(json.dumps(probe).encode()).hexdigest()[:16]
        if probe else None,
        "prompt_tokens": {"cold": cold[0].prompt_tokens, "warm": warm[0].prompt_tokens,
                          "negative": neg[0].prompt_tokens},
        "negative_control_first_changed_token": first_diff,
        "block_size": int(config["block_size"]) if "block_size" in config else None,
        # Without /metrics: every cached_tokens is a multiple of the block size, so this is
        # the block size or a multiple of it.
        "cached_tokens_gcd": math.gcd(*cached) if cached else None,
        "num_gpu_blocks": int(config["num_gpu_blocks"]) if "num_gpu_blocks" in config else None,
        "device": config.get("device"),
        "ttft": {"cold": cold_t, "warm": warm_t, "negative": neg_t},
        "cached_tokens": {"cold": [s.cached_tokens for s in cold],
                          "warm": [s.cached_tokens for s in warm],
                          "negative": [s.cached_tokens for s in neg]},
        "samples": {"cold": [asdict(s) for s in cold], "warm": [asdict(s) for s in warm],
                    "negative": [asdict(s) for s in neg]},
        "gates": results, "passed": all(g["passed"] for g in results.values()),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a few human lines (the JSON has everything)."""
    t = report["ttft"]
    lines = [
        (f"model {report['model']} at {report['url']}  tokenizer {report['tokenizer_hash']}  "
        f"device {report['device'] or '?'}  block size {report['block_size'] or '?'}  "
        f"pool {report['num_gpu_blocks'] or '?'} blocks"),
        (f"prompt tokens: cold {report['prompt_tokens']['cold']}, warm "
        f"{report['prompt_tokens']['warm']}, negative {report['prompt_tokens']['negative']}"
        f" (first changed token: {report['negative_control_first_changed_token']})"),
        f"{'':10} {'TTFT p50':>9} {'p99':>8}  cached_tokens",
    ]
    drop = report["gates"]["warm_drop"]["value"]
    for name in ("cold", "warm", "negative"):
        lines.append(f"{name:10} {t[name]['p50_s']:8.3f}s {t[name]['p99_s']:7.3f}s  "
                     f"{report['cached_tokens'][name]}")
    lines.append(f"warm TTFT {100 * drop:.1f}% below cold (p50)")
    for name, g in report["gates"].items():
        value = g["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else json.dumps(value, default=str)
        lines.append(f"{'PASS' if g['passed'] else 'FAIL'}  {name}: {shown}  (gate {g['gate']})")
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)
