"""Engine and session construction, and Alembic migrations run from code.

Supported URLs: ``sqlite:///<path>`` (the embedded default; the parent directory is created),
``sqlite://`` (in-memory, tests only), ``postgresql+psycopg://...`` and ``postgresql://...``
(mapped to psycopg 3, the ``postgres`` extra; psycopg2 URLs work too).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

import tenants

#: The repository's Alembic environment.
MIGRATIONS_DIR: Path = Path(tenants.__file__).resolve().parent.parent / "migrations"

# Arbitrary constant: serialises concurrent `run_migrations` calls on one PostgreSQL database.
_PG_MIGRATION_LOCK_ID = 0x5A17_5E7E


def normalize_database_url(database_url: str | URL) -> URL:
    """Parses a database URL and picks the driver saltserve uses for it.

    Args:
        database_url: an SQLAlchemy URL string or object.

    Returns:
        The URL; ``postgres://`` / ``postgresql://`` become ``postgresql+psycopg://`` (psycopg
        3, the ``postgres`` extra), or ``postgresql+psycopg2://`` when only psycopg2 is
        installed.

    Raises:
        sqlalchemy.exc.ArgumentError: if the URL cannot be parsed.
    """
    url = make_url(database_url)
    if url.drivername in ("postgres", "postgresql"):
        for module, driver in (("psycopg", "postgresql+psycopg"),
                               ("psycopg2", "postgresql+psycopg2")):
            if importlib.util.find_spec(module):
                return url.set(drivername=driver)
    return url


def _on_sqlite_connect(dbapi_connection: Any, connection_record: Any) -> None:
    """Per-connection SQLite settings: FK enforcement, WAL, and waiting on locks."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=5000")  # ms
        cursor.execute("PRAGMA journal_mode=WAL")  # no-op ("memory") for in-memory databases
        cursor.execute("PRAGMA synchronous=NORMAL")  # safe with WAL; fsync at checkpoints
    finally:
        cursor.close()


def make_engine(database_url: str | URL, *, echo: bool = False) -> Engine:
    """Creates the SQLAlchemy engine for the tenants database.

    SQLite connections may be used from any thread (``check_same_thread=False``; the pool hands
    each connection to one thread at a time), enforce foreign keys and use WAL.

    Args:
        database_url: e.g. ``sqlite:////var/lib/saltserve/saltserve.db`` or
            ``postgresql+psycopg://user:pw@host/db``.
        echo: log SQL statements (never on in production: parameters include key hashes).

    Returns:
        The engine.

    Raises:
        sqlalchemy.exc.ArgumentError: if the URL cannot be parsed.
        ModuleNotFoundError: if the URL's DB driver is not installed.
    """
    url = normalize_database_url(database_url)
    if url.get_backend_name() != "sqlite":
        return create_engine(url, echo=echo, pool_pre_ping=True)

    kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False}}
    if url.database in (None, "", ":memory:"):
        kwargs["poolclass"] = StaticPool  # one shared connection, else each has its own empty DB
    else:
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, echo=echo, **kwargs)
    event.listen(engine, "connect", _on_sqlite_connect)
    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Returns a session factory bound to ``engine``.

    Objects are not expired on commit, so values read inside a transaction stay readable after it.
    """
    return sessionmaker(bind=engine, expire_on_commit=False)


def make_alembic_config(database_url: str | URL) -> Config:
    """Builds the Alembic configuration in code (no ``alembic.ini`` needed at runtime).

    Args:
        database_url: the database to migrate.

    Returns:
        A config with ``script_location`` = the repository's ``migrations/`` directory.
    """
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    rendered = normalize_database_url(database_url).render_as_string(hide_password=False)
    cfg.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))  # configparser escaping
    return cfg


def run_migrations(engine_or_url: Engine | str | URL) -> None:
    """Upgrades the database schema to the newest revision (``alembic upgrade head``).

    Idempotent: a database already at head is left unchanged. On PostgreSQL an advisory lock
    serialises concurrent callers (e.g. several workers starting at once).

    Args:
        engine_or_url: an engine from ``make_engine``, or a database URL (a temporary engine is
            created and disposed).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: if the database is unreachable or a migration fails.
        alembic.util.exc.CommandError: if the database is at a revision this code does not know.
    """
    if isinstance(engine_or_url, Engine):
        _upgrade(engine_or_url)
        return
    engine = make_engine(engine_or_url)
    try:
        _upgrade(engine)
    finally:
        engine.dispose()


def _upgrade(engine: Engine) -> None:
    cfg = make_alembic_config(engine.url)
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:lock_id)"), {"lock_id": _PG_MIGRATION_LOCK_ID}
            )
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, "head")
