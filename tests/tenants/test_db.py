"""tenants/db.py and migrations/: schema creation, idempotence, engine settings."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Engine, inspect, select, text
from sqlalchemy.exc import StatementError

from tenants.db import (
    MIGRATIONS_DIR,
    make_alembic_config,
    make_engine,
    make_session_factory,
    normalize_database_url,
    run_migrations,
)
from tenants.models import Base, Tenant

EXPECTED_TABLES = {"tenants", "api_keys", "tenant_salts", "usage_records", "audit_log"}


def _tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def test_migrations_create_all_tables(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        assert not (_tables(engine) & EXPECTED_TABLES)
        run_migrations(engine)
        assert EXPECTED_TABLES | {"alembic_version"} <= _tables(engine)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0011"
    finally:
        engine.dispose()


def test_migrations_match_models(engine: Engine) -> None:
    """The hand-written migration creates exactly the columns the ORM models declare."""
    insp = inspect(engine)
    for table in Base.metadata.sorted_tables:
        db_columns = {c["name"]: c for c in insp.get_columns(table.name)}
        assert set(db_columns) == set(table.columns.keys()), table.name
        for column in table.columns:
            assert db_columns[column.name]["nullable"] == column.nullable, (
                table.name,
                column.name,
            )
        pk = insp.get_pk_constraint(table.name)["constrained_columns"]
        assert set(pk) == {c.name for c in table.primary_key.columns}, table.name


def test_migrations_are_idempotent(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        run_migrations(engine)
        factory = make_session_factory(engine)
        with factory.begin() as session:
            session.add(Tenant(name="kept", name_key="kept", current_salt_version=1))
        run_migrations(engine)  # same engine
        run_migrations(database_url)  # from a URL, with its own engine
        assert _tables(engine) >= EXPECTED_TABLES
        with factory() as session:
            assert session.scalars(select(Tenant.name)).all() == ["kept"]
    finally:
        engine.dispose()


def test_alembic_config_points_at_repo_migrations() -> None:
    cfg = make_alembic_config("postgresql://u:p%40ss@h/db")
    assert Path(cfg.get_main_option("script_location") or "") == MIGRATIONS_DIR
    assert (MIGRATIONS_DIR / "env.py").is_file()
    assert (MIGRATIONS_DIR / "versions" / "0001_initial.py").is_file()
    # '%' in passwords survives configparser interpolation
    assert cfg.get_main_option("sqlalchemy.url") == "postgresql+psycopg://u:p%40ss@h/db"


def test_postgres_urls_use_psycopg_3() -> None:
    assert normalize_database_url("postgresql://h/db").drivername == "postgresql+psycopg"
    assert normalize_database_url("postgres://h/db").drivername == "postgresql+psycopg"
    assert normalize_database_url("postgresql+psycopg2://h/db").drivername == (
        "postgresql+psycopg2"  # an explicit driver is kept
    )
    assert normalize_database_url("sqlite:///x.db").drivername == "sqlite"


def test_sqlite_engine_settings(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'sub' / 'x.db'}")  # parent dir is created
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
    finally:
        engine.dispose()


def test_sqlite_in_memory_is_shared_across_sessions() -> None:
    engine = make_engine("sqlite://")
    try:
        run_migrations(engine)
        assert _tables(engine) >= EXPECTED_TABLES
    finally:
        engine.dispose()


def test_datetimes_round_trip_as_aware_utc(engine: Engine) -> None:
    factory = make_session_factory(engine)
    plus2 = timezone(timedelta(hours=2))
    created = datetime(2025, 1, 2, 3, 4, 5, 123456, tzinfo=plus2)
    with factory.begin() as session:
        session.add(Tenant(id="a" * 32, name="tz", name_key="tz", current_salt_version=1,
                           created_at=created))
    with factory() as session:
        row = session.get(Tenant, "a" * 32)
        assert row is not None
        assert row.created_at == created
        assert row.created_at.tzinfo == UTC
        assert row.disabled is False and row.enable_prefix_caching is True


def test_naive_datetimes_are_rejected(engine: Engine) -> None:
    factory = make_session_factory(engine)
    naive = datetime(2025, 1, 1)
    with pytest.raises(StatementError, match="naive datetime"), factory.begin() as session:
        session.add(Tenant(name="naive", name_key="naive", current_salt_version=1,
                           created_at=naive))


def test_no_pending_autogenerate_diffs(engine: Engine) -> None:
    """``alembic check``: the models and the hand-written migrations agree (types included)."""
    cfg = make_alembic_config(engine.url)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.check(cfg)  # raises AutogenerateDiffsDetected on any difference


def _upgrade_to(engine: Engine, revision: str) -> None:
    cfg = make_alembic_config(engine.url)
    with engine.begin() as connection:
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)


def _stored_time(database_url: str, at: datetime) -> datetime:
    """``at`` as a raw INSERT stores it: aware on PostgreSQL, naive UTC on SQLite (as the
    models' UTC type writes it)."""
    return at if database_url.startswith("postgresql") else at.replace(tzinfo=None)


def _add_0002_tenant(engine: Engine, tenant_id: str, name: str) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, created_at, disabled, "
                          "current_salt_version, enable_prefix_caching, weight) VALUES "
                          "(:i, :n, :c, false, 1, true, 1)"),
                     {"i": tenant_id, "n": name, "c": datetime.now(UTC)})


def test_migration_0003_backfills_name_keys_and_keeps_every_child_row(database_url: str
                                                                        ) -> None:
    engine = make_engine(database_url)
    try:
        _upgrade_to(engine, "0002")
        _add_0002_tenant(engine, "a" * 32, "Café Ω")
        _add_0002_tenant(engine, "b" * 32, "acme")
        now = datetime.now(UTC)
        with engine.begin() as conn:  # a salt, a key and a usage row hang off tenant a
            conn.execute(text("INSERT INTO tenant_salts (tenant_id, version, encrypted_salt, "
                              "created_at) VALUES (:t, 1, :s, :c)"),
                         {"t": "a" * 32, "s": b"x" * 60, "c": now})
            conn.execute(text("INSERT INTO api_keys (id, tenant_id, key_hash, display_prefix, "
                              "last4, created_at) VALUES ('k00000000001', :t, :h, 'ss-k', "
                              "'abcd', :c)"), {"t": "a" * 32, "h": "0" * 64, "c": now})
            conn.execute(text("INSERT INTO usage_records (request_id, tenant_id, model, "
                              "endpoint, status, prompt_tokens, cached_tokens, "
                              "completion_tokens, created_at) VALUES ('r1', :t, 'm', "
                              "'completions', 'ok', 1, 0, 1, :c)"), {"t": "a" * 32, "c": now})
        run_migrations(engine)
        with engine.connect() as conn:
            keys = dict(conn.execute(text("SELECT name, name_key FROM tenants")).all())
            counts = [conn.execute(text(f"SELECT count(*) FROM {t}")).scalar()
                      for t in ("tenant_salts", "api_keys", "usage_records")]
        assert keys == {"Café Ω": "café ω", "acme": "acme"}
        assert counts == [1, 1, 1]  # a table rebuild with foreign keys on would cascade
    finally:
        engine.dispose()


def test_migration_0003_stops_on_names_equal_ignoring_case(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        _upgrade_to(engine, "0002")
        _add_0002_tenant(engine, "a" * 32, "Acme")
        _add_0002_tenant(engine, "b" * 32, "ACME")
        with pytest.raises(RuntimeError, match="differ only in case; rename one"):
            run_migrations(engine)
        with engine.connect() as conn:  # nothing half-done: still at 0002, both rows intact
            assert conn.execute(text("SELECT version_num FROM alembic_version")
                                ).scalar() == "0002"
            assert conn.execute(text("SELECT count(*) FROM tenants")).scalar() == 2
    finally:
        engine.dispose()


def test_downgrade_to_0002_and_back_keeps_every_row(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        run_migrations(engine)
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO tenants (id, name, name_key, created_at, disabled, "
                              "current_salt_version, enable_prefix_caching, weight) VALUES "
                              "(:i, 'Acme', 'acme', :c, false, 1, true, 1)"),
                         {"i": "a" * 32, "c": datetime.now(UTC)})
            conn.execute(text("INSERT INTO tenant_salts (tenant_id, version, encrypted_salt, "
                              "created_at) VALUES (:t, 1, :s, :c)"),
                         {"t": "a" * 32, "s": b"x" * 60, "c": datetime.now(UTC)})
        cfg = make_alembic_config(engine.url)
        with engine.begin() as connection:
            cfg.attributes["connection"] = connection
            command.downgrade(cfg, "0002")
        run_migrations(engine)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name_key FROM tenants")).scalar() == "acme"
            assert conn.execute(text("SELECT count(*) FROM tenant_salts")).scalar() == 1
    finally:
        engine.dispose()


def test_migration_0008_sums_existing_usage_into_usage_daily(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        _upgrade_to(engine, "0007")
        _add_0002_tenant(engine, "a" * 32, "acme")
        day1 = datetime(2026, 11, 3, 23, 59, tzinfo=UTC)
        with engine.begin() as conn:
            for i, (at, status, ttft) in enumerate([(day1, "ok", 0.04), (day1, "error", None),
                                                    (day1 + timedelta(minutes=2), "ok", 40.0)]):
                conn.execute(text(
                    "INSERT INTO usage_records (request_id, tenant_id, key_id, model, endpoint, "
                    "status, prompt_tokens, cached_tokens, completion_tokens, ttft_s, "
                    "created_at) VALUES (:r, :t, NULL, 'm', 'completions', :s, 10, 4, 2, :f, "
                    ":c)"), {"r": f"r{i}", "t": "a" * 32, "s": status, "f": ttft,
                              "c": _stored_time(database_url, at)})
        run_migrations(engine)
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT day, key_id, requests, errors, prompt_tokens, cached_tokens, "
                "ttft_bin_1, ttft_bin_10 FROM usage_daily ORDER BY day")).all()
        assert [tuple(r) for r in rows] == [("2026-11-03", "", 2, 1, 20, 8, 1, 0),
                                            ("2026-11-04", "", 1, 0, 10, 4, 0, 1)]
    finally:
        engine.dispose()


def test_migration_0011_fills_the_tier_split_of_days_already_summed(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        _upgrade_to(engine, "0010")
        _add_0002_tenant(engine, "a" * 32, "acme")
        day1 = datetime(2026, 11, 3, 23, 59, tzinfo=UTC)
        with engine.begin() as conn:
            for i, (at, key, tier, writes) in enumerate([
                    (day1, None, 16, 32), (day1, None, 0, 16), (day1, "k1", 48, 0),
                    (day1 + timedelta(minutes=2), None, 64, 0)]):
                conn.execute(text(
                    "INSERT INTO usage_records (request_id, tenant_id, key_id, model, endpoint, "
                    "status, prompt_tokens, cached_tokens, completion_tokens, "
                    "tier_cached_tokens, cache_write_tokens, created_at) VALUES (:r, :t, :k, "
                    "'m', 'completions', 'ok', 100, 64, 2, :tier, :w, :c)"),
                    {"r": f"r{i}", "t": "a" * 32, "k": key, "tier": tier, "w": writes,
                     "c": _stored_time(database_url, at)})
                conn.execute(text(
                    "INSERT INTO usage_daily (day, tenant_id, key_id, model, requests, errors, "
                    "prompt_tokens, cached_tokens, completion_tokens, ttft_bin_0, ttft_bin_1, "
                    "ttft_bin_2, ttft_bin_3, ttft_bin_4, ttft_bin_5, ttft_bin_6, ttft_bin_7, "
                    "ttft_bin_8, ttft_bin_9, ttft_bin_10) VALUES (:d, :t, :k, 'm', 1, 0, 100, "
                    "64, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0) ON CONFLICT (day, tenant_id, "
                    "key_id, model) DO UPDATE SET requests = usage_daily.requests + 1"),
                    {"d": (at.strftime("%Y-%m-%d")), "t": "a" * 32, "k": key or ""})
        run_migrations(engine)
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT day, key_id, requests, tier_cached_tokens, cache_write_tokens "
                "FROM usage_daily ORDER BY day, key_id")).all()
        assert [tuple(r) for r in rows] == [("2026-11-03", "", 2, 16, 48),
                                            ("2026-11-03", "k1", 1, 48, 0),
                                            ("2026-11-04", "", 1, 64, 0)]
    finally:
        engine.dispose()
