"""Fixtures for tenants/ tests: a migrated database on SQLite and (when reachable) PostgreSQL.

PostgreSQL runs use ``SALTSERVE_TEST_POSTGRES_URL`` (default
``postgresql+psycopg://postgres@127.0.0.1:5432/test``) and are skipped cleanly if it cannot be
reached. Each PostgreSQL test gets its own throw-away schema (via ``search_path``), so concurrent
test runs against the same database do not interfere; all tables and ``alembic_version`` are
dropped before and after the test, and then the schema itself.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from tenants.crypto import SaltCipher
from tenants.db import make_engine, make_session_factory, run_migrations
from tenants.repository import TenantRepository
from tenants.salts import new_salt


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


@pytest.fixture
def known_salts(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every tenant salt generated during the test, in order (creation, then rotations).

    Salts never leave ``tenants`` (``AuthContext`` holds them sealed), so tests that must know
    one (leak checks, ciphertext checks) record them as ``TenantStore`` generates them.
    """
    made: list[bytes] = []

    def recording_new_salt() -> bytes:
        made.append(new_salt())
        return made[-1]

    monkeypatch.setattr("tenants.tenant_store.new_salt", recording_new_salt)
    return made
