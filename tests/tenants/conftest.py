"""Fixtures for tenants/ tests: a migrated database on SQLite and (when reachable) PostgreSQL.

PostgreSQL runs use ``SALTSERVE_TEST_POSTGRES_URL`` (default
``postgresql+psycopg2://postgres@127.0.0.1:5432/test``) and are skipped cleanly if it cannot be
reached. Each PostgreSQL test gets its own throw-away schema (via ``search_path``), so concurrent
test runs against the same database do not interfere; all tables and ``alembic_version`` are
dropped before and after the test, and then the schema itself.
"""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from tenants.crypto import SaltCipher
from tenants.db import make_engine, make_session_factory, run_migrations
from tenants.models import Base
from tenants.repository import TenantRepository

POSTGRES_URL = os.environ.get(
    "SALTSERVE_TEST_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)


@functools.cache
def _postgres_unreachable_reason() -> str | None:
    engine = make_engine(POSTGRES_URL)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except (SQLAlchemyError, ImportError, OSError) as exc:  # driver or network: not available
        return f"PostgreSQL not reachable at {make_url(POSTGRES_URL).render_as_string()}: " + (
            type(exc).__name__
        )
    finally:
        engine.dispose()
    return None


def _drop_all(engine: Engine) -> None:
    Base.metadata.drop_all(engine)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS alembic_version"))


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database URL with an empty database (nothing migrated yet)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tenants.db'}"
        return
    reason = _postgres_unreachable_reason()
    if reason is not None:
        pytest.skip(reason)
    schema = f"t_{secrets.token_hex(6)}"
    admin = make_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    scoped = make_engine(url)
    try:
        _drop_all(scoped)
        yield url.render_as_string(hide_password=False)
    finally:
        _drop_all(scoped)
        scoped.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """A migrated engine."""
    eng = make_engine(database_url)
    run_migrations(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def master_key() -> bytes:
    return secrets.token_bytes(32)


@pytest.fixture
def cipher(master_key: bytes) -> SaltCipher:
    return SaltCipher(master_key)


@pytest.fixture
def repo(engine: Engine, cipher: SaltCipher) -> TenantRepository:
    return TenantRepository(make_session_factory(engine), cipher)
