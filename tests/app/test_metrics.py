"""``GET /metrics`` on a real app (fake model, real engine, 20 KV blocks): exact deltas.

Counters are read back from the exposition text with prometheus_client's parser. Scenarios that
depend on the pool's state start with a global prefix-cache reset, which leaves every block free
and unhashed, so block-level outcomes (evictions, resident blocks) are exact.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

TOKEN = "scrape-token-for-tests"
NUM_BLOCKS = 20
P = "saltserve:"


@pytest.fixture(scope="module")
def env(app_env_builder, tmp_path_factory) -> Iterator:
    with app_env_builder(tmp_path_factory.mktemp("metrics"), metrics_token=TOKEN,
                         max_model_len=256, num_gpu_blocks_override=NUM_BLOCKS) as e:
        yield e


class Scrape:
    """One parsed scrape: ``get(name, **labels)`` is the sample's value (0 when absent)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[tuple[str, frozenset], float] = {}
        for f in self.families.values():
            for s in f.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def get(self, name: str, **labels: str) -> float:
        return self.samples.get((P + name, frozenset(labels.items())), 0.0)

    def total(self, name: str, **labels: str) -> float:
        """Sum over every series of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == P + name and want <= ls)


def scrape(env) -> Scrape:
    r = env.client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return Scrape(r.text)


def complete(env, key: str, prompt: list[int], **kw) -> dict:
    body = {"model": env.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **kw}
    r = env.client.post("/v1/completions", json=body, headers=env.headers(key))
    assert r.status_code == 200, r.text
    return r.json()


def on_engine(env, fn):
    """Runs ``fn(LLMEngine)`` on the engine thread and returns its result."""
    return env.client.portal.call(env.engine._call, fn)


def reset(env) -> None:
    on_engine(env, lambda e: e.reset_prefix_cache())


def prompt_of(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 13 * i) % 40000 + 500 for i in range(n)]


# -- auth -----------------------------------------------------------------------------------------
def test_metrics_needs_the_scrape_token(env):
    c = env.client
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = c.get("/metrics", headers=headers)
        assert r.status_code == 401, headers
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["code"]) == ("authentication_error", "invalid_metrics_token")
        assert r.headers["www-authenticate"] == "Bearer"
    # Valid tenant credentials are not enough: the admin role (or the scrape token) is.
    for token in (env.key_a, env.issue("tenant", env.tenant_a)):
        r = c.get("/metrics", headers=env.headers(token))
        assert r.status_code == 403
        assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("permission_error",
                                                                          "admin_required")
    assert c.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert c.get("/metrics", headers=env.headers(env.admin_token)).status_code == 200


def test_metrics_without_a_configured_token_are_denied_to_everyone(env):
    state = env.parts
    state.metrics_token = None
    try:
        for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}):
            r = env.client.get("/metrics", headers=headers)
            assert r.status_code == 403
            assert r.json()["error"]["code"] == "metrics_disabled"
            assert r.json()["error"]["type"] == "permission_error"
        assert env.client.get("/metrics", headers=env.headers(env.key_a)).status_code == 403
        # An admin JWT still scrapes when no scrape token is configured.
        assert env.client.get("/metrics", headers=env.headers(env.admin_token)).status_code == 200
    finally:
        state.metrics_token = TOKEN


# -- exposition -----------------------------------------------------------------------------------
def test_every_metric_is_declared_with_the_right_type_and_labels(env):
    complete(env, env.key_a, prompt_of(1, 20))
    s = scrape(env)
    counters = ["prefix_cache_queries", "prefix_cache_hits", "prefix_cache_recomputed_tokens",
                "prefix_cache_evictions", "num_preemptions", "requests", "request_success",
                "prompt_tokens", "usage_cached_tokens", "generation_tokens"]
    gauges = ["prefix_cache_resident_blocks", "kv_cache_usage_perc", "num_blocks_total",
              "num_blocks_free", "num_blocks_used", "num_blocks_cached", "num_requests_running",
              "num_requests_waiting"]
    histograms = ["time_to_first_token_seconds", "e2e_request_latency_seconds",
                  "inter_token_latency_seconds"]
    for name in counters:
        fam = s.families[P + name]
        assert fam.type == "counter", name
        if name != "prefix_cache_evictions":       # no series before the first eviction
            assert any(x.name == P + name + "_total" for x in fam.samples), name
        assert all(x.name.endswith(("_total", "_created")) for x in fam.samples), name
    for name in gauges:
        assert s.families[P + name].type == "gauge", name
    for name in histograms:
        fam = s.families[P + name]
        assert fam.type == "histogram", name
    buckets = {float(ls["le"]) for (n, fs), _ in s.samples.items()
               for ls in [dict(fs)] if n == P + "time_to_first_token_seconds_bucket"}
    assert {0.001, 0.01, 0.1, 1.0, 10.0, 60.0} <= buckets
    assert s.get("num_blocks_total", model_name=env.model) == NUM_BLOCKS
    # Opaque tenant labels only: ids, never names; no salt-looking or key material anywhere.
    tenants = {dict(ls).get("tenant") for (_, ls) in s.samples} - {None}
    assert tenants <= {env.tenant_a, env.tenant_b, ""}
    assert env.tenant_a in tenants
    assert "tenant-a" not in s.text and env.key_a not in s.text


# -- exact deltas ---------------------------------------------------------------------------------
def test_cold_warm_pairs_for_two_tenants(env):
    reset(env)
    m = env.model
    prompt = prompt_of(2, 40)                          # 2 reusable blocks (last-token rule)
    before = scrape(env)
    got = []
    for key in (env.key_a, env.key_a, env.key_b, env.key_b):
        r = complete(env, key, prompt, max_tokens=3, ignore_eos=True)
        got.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert got == [0, 32, 0, 32]
    after = scrape(env)

    def d(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    for t in (env.tenant_a, env.tenant_b):
        lab = {"model_name": m, "tenant": t}
        assert d("prefix_cache_queries_total", **lab) == 80
        assert d("prefix_cache_hits_total", **lab) == 32
        assert d("prefix_cache_recomputed_tokens_total", **lab) == 0
        # 40 prompt + 3 output tokens, 42 with KV: 2 full blocks each, nothing else resident.
        assert after.get("prefix_cache_resident_blocks", **lab) == 2
        assert d("prompt_tokens_total", **lab) == 80
        assert d("usage_cached_tokens_total", **lab) == 32
        assert d("generation_tokens_total", **lab) == 6
        assert d("requests_total", **lab, status="ok") == 2
        assert d("request_success_total", **lab, finished_reason="length") == 2
        assert d("time_to_first_token_seconds_count", **lab) == 2
        assert d("e2e_request_latency_seconds_count", **lab) == 2
        assert d("inter_token_latency_seconds_count", **lab) == 4    # 2 gaps per request
        assert d("time_to_first_token_seconds_sum", **lab) > 0
        assert after.get("time_to_first_token_seconds_bucket", **lab, le="+Inf") \
            == after.get("time_to_first_token_seconds_count", **lab)
    assert after.total("prefix_cache_evictions_total", reason="capacity") \
        == before.total("prefix_cache_evictions_total", reason="capacity")
    assert after.get("num_blocks_cached", model_name=m) == 4
    assert_idle_and_consistent(env, after)


def test_streaming_call_observes_ttft_and_itl(env):
    lab = {"model_name": env.model, "tenant": env.tenant_b}
    before = scrape(env)
    body = {"model": env.model, "prompt": prompt_of(3, 24), "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True}
    r = env.client.post("/v1/completions", json=body, headers=env.headers(env.key_b))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    after = scrape(env)
    assert after.get("time_to_first_token_seconds_count", **lab) \
        - before.get("time_to_first_token_seconds_count", **lab) == 1
    assert after.get("inter_token_latency_seconds_count", **lab) \
        - before.get("inter_token_latency_seconds_count", **lab) == 4
    assert after.get("generation_tokens_total", **lab) \
        - before.get("generation_tokens_total", **lab) == 5


def test_rejected_call_counts_as_error_only(env):
    lab = {"model_name": env.model, "tenant": env.tenant_a}
    before = scrape(env)
    body = {"model": "no-such-model", "prompt": prompt_of(4, 10)}
    r = env.client.post("/v1/completions", json=body, headers=env.headers(env.key_a))
    assert r.status_code == 404
    after = scrape(env)
    assert after.get("requests_total", **lab, status="error") \
        - before.get("requests_total", **lab, status="error") == 1
    for name in ("prompt_tokens_total", "prefix_cache_queries_total",
                 "time_to_first_token_seconds_count"):
        assert after.get(name, **lab) == before.get(name, **lab), name


def test_capacity_eviction_names_owner_and_evicting_tenant(env):
    reset(env)
    m, a, b = env.model, env.tenant_a, env.tenant_b
    pa, pb = prompt_of(5, 200), prompt_of(6, 200)      # 13 blocks each, 12 of them full
    before = scrape(env)
    complete(env, env.key_a, pa)
    # B's 13 blocks: the 8 unhashed free ones, then A's 5 least recently used (its tail blocks).
    complete(env, env.key_b, pb)
    mid = scrape(env)
    ev = "prefix_cache_evictions_total"
    assert mid.get(ev, model_name=m, tenant=a, reason="capacity", evicted_by=b) \
        - before.get(ev, model_name=m, tenant=a, reason="capacity", evicted_by=b) == 5
    assert mid.get("prefix_cache_resident_blocks", model_name=m, tenant=a) == 7
    assert mid.get("prefix_cache_resident_blocks", model_name=m, tenant=b) == 12
    # A again: hits its 7 surviving head blocks; its 6 new blocks evict 5 of B's blocks.
    r = complete(env, env.key_a, pa)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 112
    after = scrape(env)
    assert after.get(ev, model_name=m, tenant=b, reason="capacity", evicted_by=a) \
        - mid.get(ev, model_name=m, tenant=b, reason="capacity", evicted_by=a) == 5
    assert after.get("prefix_cache_hits_total", model_name=m, tenant=a) \
        - mid.get("prefix_cache_hits_total", model_name=m, tenant=a) == 112
    assert after.get("prefix_cache_resident_blocks", model_name=m, tenant=a) == 12
    assert after.get("prefix_cache_resident_blocks", model_name=m, tenant=b) == 7
    assert_idle_and_consistent(env, after)


def test_salt_rotation_and_reset_evictions_by_reason(env):
    reset(env)
    m, a, b = env.model, env.tenant_a, env.tenant_b
    prompt = prompt_of(7, 48)                          # 3 full blocks with KV
    complete(env, env.key_a, prompt)
    complete(env, env.key_b, prompt)
    before = scrape(env)
    assert on_engine(env, lambda e: e.evict_tenant_cache(a, "salt_rotation")) == 3
    mid = scrape(env)
    ev = "prefix_cache_evictions_total"
    assert mid.get(ev, model_name=m, tenant=a, reason="salt_rotation", evicted_by="") \
        - before.get(ev, model_name=m, tenant=a, reason="salt_rotation", evicted_by="") == 3
    assert mid.get("prefix_cache_resident_blocks", model_name=m, tenant=a) == 0
    assert mid.get("prefix_cache_resident_blocks", model_name=m, tenant=b) == 3
    assert on_engine(env, lambda e: e.evict_tenant_cache(a, "reset")) == 0
    assert on_engine(env, lambda e: e.reset_prefix_cache()) == 3
    after = scrape(env)
    assert after.get(ev, model_name=m, tenant=b, reason="reset", evicted_by="") \
        - mid.get(ev, model_name=m, tenant=b, reason="reset", evicted_by="") == 3
    assert after.total(ev, tenant=a, reason="reset") == mid.total(ev, tenant=a, reason="reset")
    r = complete(env, env.key_a, prompt)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    with pytest.raises(ValueError, match="reason"):
        on_engine(env, lambda e: e.evict_tenant_cache(a, "capacity"))


# -- the seed article's hit-rate estimate ---------------------------------------------------------
def test_hit_rate_estimate_from_usage_log_matches_counters(env):
    """(prefix length - prefill tokens) / prefix length over the request log (usage records)
    equals rate(hits) / rate(queries) from /metrics, per tenant."""
    reset(env)
    m = env.model
    system = {env.tenant_a: prompt_of(8, 96), env.tenant_b: prompt_of(9, 112)}
    keys = {env.tenant_a: env.key_a, env.tenant_b: env.key_b}
    before = scrape(env)
    ids: dict[str, set[str]] = {t: set() for t in system}
    for i in range(8):
        t = (env.tenant_a, env.tenant_b)[i % 2]
        r = complete(env, keys[t], system[t] + prompt_of(100 + i, 3 + 2 * i))
        ids[t].add(r["id"])
    after = scrape(env)
    for t in system:
        rows = wait_for_usage(env, t, ids[t])
        prefix_len = sum(u.prompt_tokens for u in rows)
        prefill = sum(u.prompt_tokens - u.cached_tokens for u in rows)
        estimate = (prefix_len - prefill) / prefix_len
        queries = after.get("prefix_cache_queries_total", model_name=m, tenant=t) \
            - before.get("prefix_cache_queries_total", model_name=m, tenant=t)
        hits = after.get("prefix_cache_hits_total", model_name=m, tenant=t) \
            - before.get("prefix_cache_hits_total", model_name=m, tenant=t)
        assert queries == prefix_len
        assert hits / queries == pytest.approx(estimate, abs=1e-12)
        assert estimate > 0.6
    assert_idle_and_consistent(env, after)


def test_preemption_with_unique_prompts_counts_recompute_not_hits(env):
    from concurrent.futures import ThreadPoolExecutor

    reset(env)
    m, a = env.model, env.tenant_a
    # Three concurrent requests of 80 unique tokens (5 blocks each: all three are admitted)
    # growing to 160 tokens need 3 x 10 = 30 blocks of the pool's 20.
    prompts = [prompt_of(100 + i, 80) for i in range(3)]
    before = scrape(env)
    env.fake.step_delay_s = 0.005  # the three requests overlap
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: complete(env, env.key_a, p, max_tokens=80,
                                                ignore_eos=True), prompts))
    env.fake.step_delay_s = 0.0
    after = scrape(env)

    def d(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    lab = {"model_name": m, "tenant": a}
    assert [o["usage"]["completion_tokens"] for o in outs] == [80, 80, 80]
    assert [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs] == [0, 0, 0]
    assert d("num_preemptions_total", model_name=m) >= 1
    assert d("prefix_cache_queries_total", **lab) == 240   # once per request, not per admission
    assert d("prefix_cache_hits_total", **lab) == 0         # hit rate stays 0
    assert d("prefix_cache_recomputed_tokens_total", **lab) > 0
    assert d("requests_total", **lab, status="ok") == 3
    assert_idle_and_consistent(env, after)


def wait_for_usage(env, tenant: str, ids: set[str]) -> list:
    deadline = time.time() + 10
    while True:  # usage is written off the request path
        rows = [u for u in env.repo.usage.list_usage(tenant) if u.request_id in ids]
        if len(rows) == len(ids) or time.time() > deadline:
            assert len(rows) == len(ids)
            return rows
        time.sleep(0.05)


# -- invariants -----------------------------------------------------------------------------------
def assert_idle_and_consistent(env, s: Scrape) -> None:
    """Idle engine: 0 used blocks; per-tenant sums equal the engine's global counters."""
    m = env.model
    snap = on_engine(env, lambda e: e.stats_snapshot())
    snap.check_integrity()
    assert s.get("num_blocks_used", model_name=m) == 0
    assert s.get("kv_cache_usage_perc", model_name=m) == 0
    assert s.get("num_blocks_free", model_name=m) == NUM_BLOCKS
    assert s.get("num_requests_running", model_name=m) == 0
    assert s.get("num_requests_waiting", model_name=m) == 0
    assert s.total("prefix_cache_resident_blocks") == s.get("num_blocks_cached", model_name=m)
    assert s.total("prefix_cache_queries_total") == snap.prefix_cache_queries
    assert s.total("prefix_cache_hits_total") == snap.prefix_cache_hits
    assert s.total("prefix_cache_recomputed_tokens_total") \
        == snap.prefix_cache_recomputed_tokens
    for reason, n in snap.evictions.items():
        assert s.total("prefix_cache_evictions_total", reason=reason) == n
    assert s.get("num_preemptions_total", model_name=m) == snap.num_preemptions


def test_docs_and_dashboard_name_only_exported_metrics(env):
    """docs/metrics.md lists every exported family; the dashboard queries only exported ones."""
    import json
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    s = scrape(env)
    exported = {n for n, f in s.families.items() if n.startswith(P) and not n.endswith("_created")}
    documented = set(re.findall(r"`(saltserve:[a-z0-9_]+)`", (docs / "metrics.md").read_text()))
    for name in exported:
        kind = s.families[name].type
        assert (name + "_total" if kind == "counter" else name) in documented, name
    dash = json.loads((docs / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {n if n in exported else re.sub(r"_(bucket|sum|count|total)$", "", n)
            for e in exprs for n in re.findall(r"saltserve:[a-z0-9_]+", e)}
    assert used and used <= exported, used - exported
    assert {"saltserve:prefix_cache_hits", "saltserve:prefix_cache_evictions",
            "saltserve:time_to_first_token_seconds", "saltserve:kv_cache_usage_perc"} <= used


def test_usage_rows_sum_to_the_token_counters_rejected_calls_included(env):
    """Billing matches the work: a call refused before the engine (400 at parsing, 400 after
    tokenising, 429 for tokens per minute) records 0 tokens, so per-tenant usage sums equal
    the Prometheus counters."""
    t = env.repo.tenants.create("billing")
    key, _ = env.repo.keys.create(t.id)
    env.repo.tenants.update(t.id, tpm_limit=100)
    body = {"model": env.model, "max_tokens": 1, "temperature": 0}

    def post(**kw):
        return env.client.post("/v1/completions", json={**body, **kw}, headers=env.headers(key))

    assert post(prompt=prompt_of(90, 120)).status_code == 429          # after tokenising
    env.repo.tenants.update(t.id, tpm_limit=None)
    assert post(prompt=prompt_of(91, 200), max_tokens=100).status_code == 400  # context length
    assert post(prompt=prompt_of(92, 10), temperature=-1).status_code == 400   # at parsing
    reset(env)
    ok = [post(prompt=prompt_of(93, n)).json() for n in (40, 40, 23)]
    assert [u["usage"]["prompt_tokens_details"]["cached_tokens"] for u in ok] == [0, 32, 16]
    deadline = time.time() + 10
    while len(rows := env.repo.usage.list_usage(t.id)) < 6 and time.time() < deadline:
        time.sleep(0.02)  # usage rows are written off the request path
    assert len(rows) == 6
    refused = [r for r in rows if r.status == "error"]
    assert len(refused) == 3
    assert all((r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (0, 0, 0)
               for r in refused)
    assert sorted(r.prompt_tokens for r in rows if r.status == "ok") == [23, 40, 40]
    s = scrape(env)
    labels = {"model_name": env.model, "tenant": t.id}
    assert s.total("requests_total", **labels) == 6
    assert s.total("requests_total", status="error", **labels) == 3
    assert s.get("prompt_tokens_total", **labels) == sum(r.prompt_tokens for r in rows) == 103
    assert s.get("usage_cached_tokens_total", **labels) == sum(r.cached_tokens for r in rows)
    assert s.get("generation_tokens_total", **labels) == sum(r.completion_tokens for r in rows)
    assert sum(r.completion_tokens for r in rows) == 3
