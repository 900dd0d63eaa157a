"""``saltserve bench tenants``: N tenants share one pool, each with its own system prompt, while
one more tenant floods unique prompts. The measure for the fair-share work (``docs/admin.md``):
per-tenant hit rate and TTFT under the flood, and the blocks the flooder's requests evicted from
each of the others.

It creates its tenants through the admin API (an admin JWT), named
``bench-<run nonce>-<run id>-...`` (the nonce picks the prompts, so ``--run-nonce`` replays them;
the run id is new each invocation, so a replay on the same server does not collide with the
earlier run's tenants), and disables them afterwards. Evictions come from ``saltserve:prefix_cache_evictions_total``
(its ``evicted_by`` label: the tenant whose allocation took the block), read with the same
admin JWT.
"""

from __future__ import annotations

import random
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.bench.validate import Endpoint, Sample, percentile, random_text


def _evictions(url: str, admin: dict[str, str]) -> dict[tuple[str, str], float]:
    """(victim tenant id, evicting tenant id) -> evicted blocks, from ``/metrics``."""
    r = httpx.get(url + "/metrics", headers=admin, timeout=10)
    r.raise_for_status()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(r.text):
        if family.name != "saltserve:prefix_cache_evictions":
            continue
        for s in family.samples:
            if s.name.endswith("_total"):
                key = (s.labels.get("tenant", ""), s.labels.get("evicted_by", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


def run_tenants(url: str, admin_token: str, tenants: int = 4, requests: int = 8,
                flood_requests: int = 32, flood_concurrency: int = 4, max_tokens: int = 8,
                seed: int = 0, nonce: str | None = None, model: str | None = None,
                progress: Any = None) -> dict[str, Any]:
    """Runs the flood; the report. ``progress()`` is called after each completion (warm-ups,
    the tenants' requests and the flood's). Raises httpx.HTTPError / RuntimeError on a refused
    call."""
    progress_lock = threading.Lock()  # the tenants' threads and the flood's report in turn

    def done(sample: Sample) -> Sample:
        if progress is not None:
            with progress_lock:
                progress()
        return sample

    nonce = nonce or f"{random.SystemRandom().getrandbits(32):08x}"
    run_id = f"{random.SystemRandom().getrandbits(24):06x}"  # tenant names, never prompts
    admin = {"Authorization": f"Bearer {admin_token}"}
    url = url.rstrip("/")
    created: list[dict[str, Any]] = []
    try:
        prefix = f"bench-{nonce}-{run_id}-"
        for name in [f"{prefix}t{i}" for i in range(tenants)] + [f"{prefix}flood"]:
            t = httpx.post(url + "/admin/tenants", headers=admin, json={"name": name})
            t.raise_for_status()
            k = httpx.post(url + f"/admin/tenants/{t.json()['id']}/keys", headers=admin,
                           json={})
            k.raise_for_status()
            created.append({"name": name, "id": t.json()["id"], "key": k.json()["key"]})
        victims, flooder = created[:-1], created[-1]
        rng = random.Random(seed)
        systems = [f"Run {nonce}. System of tenant {i}: {random_text(rng, 900)}"
                   for i in range(tenants)]
        endpoints = [Endpoint(url, v["key"], model) for v in victims]
        for ep, system in zip(endpoints, systems, strict=True):  # each tenant's cache, warm
            done(ep.complete(system + "\nQuestion: warm-up?", max_tokens))
        before = _evictions(url, admin)
        flood_ep = Endpoint(url, flooder["key"], endpoints[0].model)
        flood_prompts = [f"Run {nonce}. Flood {j}: {random_text(rng, 700)}"
                         for j in range(flood_requests)]
        results: dict[str, list[Sample]] = {v["name"]: [] for v in victims}

        def victim(i: int) -> None:
            for r in range(requests):
                results[victims[i]["name"]].append(done(endpoints[i].complete(
                    f"{systems[i]}\nQuestion {r}: {random_text(random.Random(r), 6)}?",
                    max_tokens)))

        threads = [threading.Thread(target=victim, args=(i,)) for i in range(tenants)]
        for t in threads:
            t.start()
        with ThreadPoolExecutor(flood_concurrency) as pool:
            flood = list(pool.map(lambda p: done(flood_ep.complete(p, max_tokens)),
                                  flood_prompts))
        for t in threads:
            t.join()
        after = _evictions(url, admin)
    finally:
        for t in created:  # the run's tenants stop working; their rows stay for the audit
            httpx.patch(url + f"/admin/tenants/{t['id']}", headers=admin,
                        json={"disabled": True})

    def delta(victim_id: str, by: str | None) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items()
                   if k[0] == victim_id and (by is None or k[1] == by))

    per_tenant = {}
    for v in victims:
        samples = results[v["name"]]
        ttfts = [s.ttft_s for s in samples]
        prompt = sum(s.prompt_tokens for s in samples)
        per_tenant[v["name"]] = {
            "hit_rate": sum(s.cached_tokens for s in samples) / prompt if prompt else 0.0,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": percentile(ttfts, 0.95),
            "evicted_blocks": delta(v["id"], None),
            "evicted_by_flooder": delta(v["id"], flooder["id"])}
    flood_ttfts = [s.ttft_s for s in flood]
    return {"test": "tenants", "url": url, "seed": seed, "nonce": nonce, "run_id": run_id,
            "tenants": tenants,
            "requests": requests, "flood_requests": flood_requests,
            "flood_concurrency": flood_concurrency, "per_tenant": per_tenant,
            "flooder": {"ttft_p50_s": statistics.median(flood_ttfts),
                        "evicted_blocks_own": delta(flooder["id"], flooder["id"])}}


def format_tenants(report: dict[str, Any]) -> str:
    lines = [(f"{report['tenants']} tenants x {report['requests']} requests beside a flooder "
             f"({report['flood_requests']} unique prompts at concurrency "
             f"{report['flood_concurrency']})"),
             (f"{'tenant':28} {'hit rate':>8} {'TTFT p50':>9} {'p95':>7} {'evicted':>8} "
             f"{'by flood':>8}")]
    for name, t in report["per_tenant"].items():
        lines.append(f"{name:28} {100 * t['hit_rate']:7.1f}% {t['ttft_p50_s']:8.3f}s "
                     f"{t['ttft_p95_s']:6.2f}s {t['evicted_blocks']:8.0f} "
                     f"{t['evicted_by_flooder']:8.0f}")
    f = report["flooder"]
    lines.append(f"flooder: TTFT p50 {f['ttft_p50_s']:.3f}s, its own blocks evicted "
                 f"{f['evicted_blocks_own']:.0f}")
    return "\n".join(lines)
