"""Usage-report benchmark: 1,000,000 usage rows over 30 days and 100 tenants, then a 30-day
daily report for one tenant and for all tenants (target: each under 1 s), on SQLite and on
PostgreSQL, plus a 2-day hourly report of one tenant (read from the raw rows).

The rows are bulk-loaded and ``usage_daily`` is built with migration 0008's backfill statement
(what upgrading an existing database does). The live write path is measured too: 10,000 rows
stored the way the usage journal stores them (500-row batches, each row and its rollup upsert
in one transaction), every row with its own end user.

Usage: ``python benchmarks/bench_usage_reports.py [--rows 1000000] [--postgres-url URL]``
(PostgreSQL: a scratch database ``saltserve_bench`` is created and dropped on that server).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import create_engine, insert, text

from tenants.db import make_engine, make_session_factory, run_migrations
from tenants.models import Tenant, UsageRecordRow
from tenants.usage import UsageStore
from tenants.usage_reports import UsageReportQuery

END = datetime(2026, 11, 30, tzinfo=UTC)
DAYS = 30


def _backfill_sql(dialect: str) -> str:
    path = Path(__file__).resolve().parents[1] / "migrations" / "versions" / "0008_usage_daily.py"
    spec = importlib.util.spec_from_file_location("m0008", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.backfill_sql(dialect)


def load(url: str, rows: int, tenants: int) -> tuple[UsageStore, list[str]]:
    engine = make_engine(url)
    run_migrations(engine)
    rng = random.Random(0)
    ids = [f"{i:032x}" for i in range(1, tenants + 1)]
    with engine.begin() as conn:
        conn.execute(insert(Tenant), [{"id": t, "name": f"tenant-{i}", "name_key": f"tenant-{i}",
                                       "created_at": END - timedelta(days=60),
                                       "current_salt_version": 1}
                                      for i, t in enumerate(ids)])
    span = DAYS * 86400
    t0 = time.perf_counter()
    chunk = 50_000
    for start in range(0, rows, chunk):
        batch = [{"request_id": f"r{i}", "tenant_id": ids[rng.randrange(tenants)],
                  "key_id": f"k{rng.randrange(3):011d}", "model": "SmolLM2-135M-Instruct",
                  "endpoint": "chat.completions",
                  "status": "ok" if rng.random() > 0.02 else "error",
                  "prompt_tokens": rng.randrange(20, 2000), "cached_tokens": rng.randrange(0, 20),
                  "completion_tokens": rng.randrange(1, 300), "ttft_s": rng.expovariate(5.0),
                  "latency_s": 1.0,
                  "created_at": END - timedelta(seconds=rng.randrange(span))}
                 for i in range(start, min(rows, start + chunk))]
        with engine.begin() as conn:
            conn.execute(insert(UsageRecordRow), batch)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM usage_daily"))
        conn.execute(text(_backfill_sql(engine.dialect.name)))
        if engine.dialect.name == "postgresql":
            conn.execute(text("ANALYZE"))
    print(f"  loaded {rows:,} rows and built usage_daily in {time.perf_counter() - t0:.1f} s")
    return UsageStore(make_session_factory(engine)), ids


def timed(store: UsageStore, query: UsageReportQuery) -> tuple[float, int]:
    best = float("inf")
    n = 0
    for _ in range(3):
        t0 = time.perf_counter()
        n = len(store.report(query))
        best = min(best, time.perf_counter() - t0)
    return best, n


def write_path(store: UsageStore, ids: list[str]) -> None:
    from tenants.records import UsageRecord

    n, batch = 10_000, 500
    recs = [UsageRecord(request_id=f"live-{i}", tenant_id=ids[i % len(ids)], key_id=None,
                        model="SmolLM2-135M-Instruct", endpoint="chat.completions", status="ok",
                        prompt_tokens=100, cached_tokens=10, completion_tokens=20, ttft_s=0.1,
                        latency_s=0.5, created_at=END - timedelta(seconds=i),
                        end_user=f"user-{i}") for i in range(n)]
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        store.record_usage_batch(recs[i:i + batch])
    seconds = time.perf_counter() - t0
    print(f"  write path: {n:,} rows in {batch}-row batches  {seconds:6.2f} s "
          f"({n / seconds:,.0f} rows/s)")


def run(label: str, url: str, rows: int) -> None:
    print(f"{label}:")
    store, ids = load(url, rows, 100)
    write_path(store, ids)
    since = END - timedelta(days=DAYS)
    for name, q in (
            ("30-day daily, one tenant", UsageReportQuery(since, END, "1d", ("tenant",), ids[7])),
            ("30-day daily, all tenants", UsageReportQuery(since, END, "1d", ("tenant",))),
            ("30-day daily, all, by key", UsageReportQuery(since, END, "1d", ("tenant", "key"))),
            ("2-day hourly, one tenant (raw rows)",
             UsageReportQuery(END - timedelta(days=2), END, "1h", ("tenant",), ids[7]))):
        seconds, n = timed(store, q)
        print(f"  {name:38s} {seconds * 1000:8.1f} ms  ({n} rows)  "
              f"{'OK' if seconds < 1 else 'OVER'} (target < 1 s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--postgres-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run("SQLite", f"sqlite:///{tmp}/bench.db", args.rows)
    admin = create_engine(args.postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS saltserve_bench"))
        conn.execute(text("CREATE DATABASE saltserve_bench"))
    try:
        url = args.postgres_url.rsplit("/", 1)[0] + "/saltserve_bench"
        run("PostgreSQL", url, args.rows)
    finally:
        with admin.connect() as conn:
            conn.execute(text("DROP DATABASE IF EXISTS saltserve_bench WITH (FORCE)"))
        admin.dispose()


if __name__ == "__main__":
    main()
