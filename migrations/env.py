"""Alembic environment for saltserve.

Used two ways:

- from code (``tenants.db.run_migrations``): the caller passes an open connection, inside a
  transaction, in ``config.attributes["connection"]``; logging is left to the application.
- from the command line (``alembic upgrade head`` with the repo's ``alembic.ini``): an engine is
  created from ``sqlalchemy.url`` and the ini file's logging config is applied.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection

from tenants.db import make_engine
from tenants.models import Base

config = context.config

if config.config_file_name is not None and "connection" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _configure_and_run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite needs table rebuilds
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    """Emits SQL to stdout (``alembic upgrade head --sql``) without a database connection."""
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Runs migrations on the passed-in connection, or on a new engine from the URL."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise ValueError("set sqlalchemy.url in alembic.ini or pass a connection")
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            _configure_and_run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
