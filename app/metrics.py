"""Prometheus metrics: engine counters read at scrape time + request-level metrics per API call.

Two sources, one per-app ``CollectorRegistry`` (never the process-global default registry, so
several apps can live in one process, e.g. in tests):

- ``EngineCollector``: a custom collector over an ``engine.stats.EngineStatsSnapshot`` taken on the
  engine thread at scrape time (prefix-cache queries/hits/evictions per tenant, KV blocks,
  preemptions, queue lengths). The engine is the only source of truth for these; nothing is
  copied into prometheus_client objects between scrapes.
- Regular ``Counter`` / ``Histogram`` objects updated by ``ServerMetrics.observe_request`` once per
  API call (when its usage is recorded) and ``ServerMetrics.observe_output`` once per streamed
  token (inter-token latency).

Names follow vLLM's with the ``saltserve:`` prefix; every series carries ``model_name`` and, where
per tenant, an opaque ``tenant`` label (the tenant id; never a salt or a tenant name; ``""`` for
requests without a tenant). ``docs/metrics.md`` lists every metric.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from engine.request import EngineRequest, RequestOutput
from engine.stats import LOAD_SECONDS_BUCKETS, EngineStatsSnapshot
from tenants.repository import UsageRecord

PREFIX = "saltserve:"

# Seconds. Resolve a warm prefix hit on a GPU (~1 ms) and a cold 8k-token prefill on CPU (tens
# of seconds) in one histogram.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0)
E2E_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


def tenant_label(tenant_id: str | None) -> str:
    """The ``tenant`` label value: the opaque tenant id, ``""`` when there is none."""
    return tenant_id or ""


class _Choice(Protocol):
    finish_reason: str | None


class RecordedCall(Protocol):
    """What ``observe_request`` reads from an API call (``app.services.completions.CompletionCall``)."""

    status: str | None
    choices: Sequence[_Choice]

    def usage_record(self) -> UsageRecord: ...


class EngineCollector(Collector):
    """Exports an ``EngineStatsSnapshot``; ``ServerMetrics.render`` sets it before each scrape.

    Args:
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: EngineStatsSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        m = self.model_name
        tl = ["model_name", "tenant"]

        def counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, labels=labels)

        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, labels=labels)

        queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache, "
                          "counted once per request at first admission.", tl)
        hits = counter("prefix_cache_hits", "Of the queried tokens, tokens served from the "
                       "prefix cache.", tl)
        recomputed = counter("prefix_cache_recomputed_tokens", "Tokens recomputed after "
                             "preemption (never counted as hits).", tl)
        resident = gauge("prefix_cache_resident_blocks", "The tenant's KV blocks that are in "
                         "the prefix cache now (free or in use).", tl)
        share = gauge("prefix_cache_share_blocks", "The tenant's guaranteed share of the KV "
                      "block pool now (by weight among tenants with cached blocks, clamped to "
                      "its min/max_cache_blocks).", tl)
        over_share = counter("prefix_cache_over_share_evictions", "The tenant's cached blocks "
                             "evicted because it was over its cache share (part of the "
                             "capacity evictions).", tl)
        tier_hits = counter("prefix_cache_tier_hits", "Of the hit tokens, tokens loaded from "
                            "the offload tiers (the rest hit the pool).", tl)
        by_source = counter("prompt_tokens_by_source", "Prompt tokens at first admission by "
                            "where their KV came from: computed, pool_hit, tier_hit.",
                            [*tl, "source"])
        tier_bytes = gauge("kv_offload_tenant_bytes", "The tenant's bytes in each offload tier "
                           "now (a shared tier: written by every replica).", [*tl, "tier"])
        tier_share = gauge("kv_offload_tenant_share_bytes", "The bytes the tenant's fair share "
                           "of each offload tier guarantees now (by weight among the tenants "
                           "holding blobs there, within its cache bounds): its occupancy "
                           "against its quota.", [*tl, "tier"])
        for tenant, t in s.tenants.items():
            labels = [m, tenant_label(tenant)]
            tier_hits.add_metric(labels, t.prefix_cache_tier_hits)
            for source, n in (("computed", t.prefix_cache_queries - t.prefix_cache_hits),
                              ("pool_hit", t.prefix_cache_hits - t.prefix_cache_tier_hits),
                              ("tier_hit", t.prefix_cache_tier_hits)):
                by_source.add_metric([*labels, source], n)
            for tier, n in t.offload_bytes.items():
                tier_bytes.add_metric([*labels, tier], n)
            for tier, n in t.offload_share_bytes.items():
                tier_share.add_metric([*labels, tier], n)
            queries.add_metric(labels, t.prefix_cache_queries)
            hits.add_metric(labels, t.prefix_cache_hits)
            recomputed.add_metric(labels, t.prefix_cache_recomputed_tokens)
            resident.add_metric(labels, t.resident_blocks)
            share.add_metric(labels, t.cache_share_blocks)
            over_share.add_metric(labels, t.over_share_evictions)
        evictions = counter(
            "prefix_cache_evictions", "The tenant's cached KV blocks evicted, by reason "
            "(capacity | salt_rotation | reset | fault); evicted_by is the tenant whose allocation "
            "caused a capacity eviction, empty for other reasons.",
            ["model_name", "tenant", "reason", "evicted_by"])
        for row in s.eviction_counts:
            evictions.add_metric([m, tenant_label(row.tenant), row.reason,
                                  tenant_label(row.evicted_by)], row.num_blocks)
        yield from (queries, hits, recomputed, resident, share, over_share, evictions)
        if s.offload is not None:
            yield from (tier_hits, by_source, tier_bytes, tier_share)
            yield from self._offload(s.offload, m)

        ml = ["model_name"]
        for name, doc, value in (
                ("num_blocks_total", "KV blocks in the pool.", s.num_blocks_total),
                ("num_blocks_free", "KV blocks not pinned by any request (cached ones included).",
                 s.num_blocks_free),
                ("num_blocks_used", "KV blocks pinned by running requests.", s.num_blocks_used),
                ("num_blocks_cached", "KV blocks in the prefix cache (free or in use).",
                 s.num_blocks_cached),
                ("kv_cache_usage_perc", "Fraction of KV blocks in use, 0..1 (vLLM semantics).",
                 s.kv_cache_usage),
                ("num_requests_running", "Requests being scheduled (prefill or decode).",
                 s.num_requests_running),
                ("num_requests_waiting", "Requests waiting for admission (preempted included).",
                 s.num_requests_waiting)):
            g = gauge(name, doc, ml)
            g.add_metric([m], value)
            yield g
        preemptions = counter("num_preemptions", "Requests preempted (recomputed later).", ml)
        preemptions.add_metric([m], s.num_preemptions)
        yield preemptions
        share = counter("num_share_preemptions", "Of those, requests preempted so that a tenant "
                        "within its weighted share of the KV pool was admitted.", ml)
        share.add_metric([m], s.num_share_preemptions)
        yield share


    @staticmethod
    def _offload(o, m: str) -> Iterator[Metric]:
        """The offload tiers' totals (engine.kv_offload), per tier where they are a tier's."""
        tl = ["model_name", "tier"]
        for kind, name, doc, attr in (
                ("gauge", "kv_offload_up", ("1 while the tier is reachable (a remote tier that "
                 "failed is off for a while; serving goes on without it)."), "up"),
                ("gauge", "kv_offload_capacity_bytes", "The tier's byte budget.",
                 "capacity_bytes"),
                ("gauge", "kv_offload_used_bytes", "Bytes of sealed blocks in the tier now.",
                 "used_bytes"),
                ("gauge", "kv_offload_unclaimed_bytes", ("Of them, bytes of tenants this process "
                 "has not served since it started (blobs found at start, or another replica's "
                 "tenants in a shared tier)."), "unclaimed_bytes"),
                ("counter", "kv_offload_written_blocks", "Blocks written to the tier.",
                 "written_blocks"),
                ("counter", "kv_offload_written_bytes", "Bytes written to the tier.",
                 "written_bytes"),
                ("counter", "kv_offload_write_failures", ("Writes the tier refused or failed "
                 "(full disk, unreachable Redis)."), "write_failed"),
                ("counter", "kv_offload_loaded_blocks", "Blocks loaded from the tier.",
                 "loaded_blocks"),
                ("counter", "kv_offload_loaded_bytes", "Plaintext bytes loaded from the tier.",
                 "loaded_bytes"),
                ("counter", "kv_offload_load_failures", ("Blobs tampered, truncated or of "
                 "another generation (a miss; deleted, never loaded)."), "load_failed")):
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                PREFIX + name, doc, labels=tl)
            for t in o.tiers:
                family.add_metric([m, t.name], float(getattr(t, attr)))
            yield family
        evicted = CounterMetricFamily(
            PREFIX + "kv_offload_evicted_blobs", "Blobs that left the tier, by reason: "
            "capacity (evicted to stay in the fair byte budget), reset (a tenant's reset, salt "
            "rotation or disable, or the global reset), invalid (failed authentication when "
            "loaded: deleted).", labels=[*tl, "reason"])
        for t in o.tiers:
            for reason, n in (("capacity", t.evicted_blobs), ("reset", t.dropped_blobs),
                              ("invalid", t.load_failed)):
                evicted.add_metric([m, t.name, reason], n)
        yield evicted
        ml = ["model_name"]
        for kind, name, doc, value in (
                ("counter", "kv_offload_write_dropped_blocks", ("Evicted blocks not written "
                 "because the writer's queue was full."), o.write_dropped),
                ("counter", "kv_offload_load_misses", ("Loads that stopped on a block no tier "
                 "gave (the request computes the rest)."), o.load_missing),
                ("gauge", "kv_offload_loads_in_flight", ("Requests waiting for their prefix to "
                 "load from a tier."), o.loads_in_flight)):
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                PREFIX + name, doc, labels=ml)
            family.add_metric([m], value)
            yield family
        hist = HistogramMetricFamily(PREFIX + "kv_offload_load_seconds", "Time to load one "
                                     "request's blocks from the tiers (read, open, copy; on the "
                                     "loader thread).", labels=ml)
        cumulative, buckets = 0, []
        for bound, n in zip((*LOAD_SECONDS_BUCKETS, float("inf")), o.load_seconds_buckets,
                            strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        hist.add_metric([m], buckets, o.load_seconds)
        yield hist


class ServerMetrics:
    """The app's metrics: one per app, with its own registry.

    Args:
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.engine_collector = EngineCollector(model_name)
        self.registry.register(self.engine_collector)
        # vLLM's cache_config_info: the KV cache's shape, as labels of a constant 1 (what a
        # benchmark report needs to be reproducible: `saltserve bench validate`).
        self.cache_config = Gauge(PREFIX + "cache_config_info", "KV cache configuration "
                                  "(labels); the value is always 1.",
                                  ["model_name", "block_size", "num_gpu_blocks", "device",
                                   "enable_prefix_caching", "cache_dtype"],
                                  registry=self.registry)
        tl = ["model_name", "tenant"]
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "API calls by outcome (ok | error | aborted), one per usage "
            "record.", [*tl, "status"], registry=r)
        self.request_success = Counter(
            PREFIX + "request_success", "Completed choices by finish reason (stop | length).",
            [*tl, "finished_reason"], registry=r)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "usage.prompt_tokens of API calls that reached the engine.",
            tl, registry=r)
        self.usage_cached_tokens = Counter(
            PREFIX + "usage_cached_tokens", "usage.prompt_tokens_details.cached_tokens of API "
            "calls that reached the engine (billing view; cache hits per engine request are "
            "saltserve:prefix_cache_hits_total).", tl, registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "usage.completion_tokens of API calls.", tl,
            registry=r)
        self.admin_auth_refusals = Counter(
            PREFIX + "admin_auth_refusals", "Unauthenticated /admin requests refused, by reason "
            "(missing | malformed | bad_jwt | unknown_key | bad_secret | revoked | expired | "
            "unknown_tenant | tenant_disabled); never audit rows.", ["reason"], registry=r)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Seconds from the API call's arrival to its "
            "first generated token.", tl, buckets=TTFT_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Seconds from arrival to the last token of "
            "API calls that completed (status ok).", tl, buckets=E2E_BUCKETS, registry=r)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Seconds between consecutive tokens of one "
            "sequence, as streamed to the client.", tl, buckets=ITL_BUCKETS, registry=r)

    def observe_request(self, job: RecordedCall) -> None:
        """Counts one API call when its usage is recorded (every call, rejected ones included).

        Token counters and histograms only count calls that reached the engine (calls rejected
        before it have no choices, record 0 tokens, and count in
        ``requests_total{status="error"}`` only).
        """
        rec = job.usage_record()
        labels = (self.model_name, tenant_label(rec.tenant_id))
        self.requests.labels(*labels, rec.status).inc()
        if not job.choices:
            return
        self.prompt_tokens.labels(*labels).inc(rec.prompt_tokens)
        self.usage_cached_tokens.labels(*labels).inc(rec.cached_tokens)
        self.generation_tokens.labels(*labels).inc(rec.completion_tokens)
        if rec.ttft_s is not None:
            self.ttft.labels(*labels).observe(rec.ttft_s)
        if rec.status == "ok":
            self.e2e_latency.labels(*labels).observe(rec.latency_s)
            for choice in job.choices:
                if choice.finish_reason is not None:
                    self.request_success.labels(*labels, choice.finish_reason).inc()

    def observe_output(self, request: EngineRequest, output: RequestOutput,
                       seconds_since_previous_token: float | None) -> None:
        """``AsyncLLM`` output observer: one inter-token latency sample per token after the first."""
        if seconds_since_previous_token is not None:
            self.itl.labels(self.model_name, tenant_label(request.tenant_id)).observe(
                seconds_since_previous_token)

    def render(self, snapshot: EngineStatsSnapshot | None, accept: str = "") -> tuple[bytes, str]:
        """Exposition of everything, engine metrics from ``snapshot`` (omitted when None).

        Args:
            snapshot: taken on the engine thread just before.
            accept: the scrape's Accept header (OpenMetrics when asked for, else text 0.0.4).

        Returns:
            (body, content type).
        """
        encoder, content_type = choose_encoder(accept)
        # No await between setting the snapshot and encoding: concurrent scrapes cannot interleave.
        self.engine_collector.snapshot = snapshot
        return encoder(self.registry), content_type
