"""First-start and every-start set-up: data dir, model conversion, database, demo tenant."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, InterfaceError, OperationalError

from app.settings import Settings
from tenants.crypto import SaltCipher, load_or_create_master_key
from tenants.db import make_engine, make_session_factory, run_migrations
from tenants.repository import TenantRepository
from tenants.tokens import JWTVerifier, load_or_create_platform_key

logger = logging.getLogger(__name__)

DEMO_TENANT = "demo"
DEMO_KEY_FILE = "demo-api-key"


@dataclass(frozen=True)
class Bootstrapped:
    repo: TenantRepository
    model_dir: Path
    demo_key: str | None        # plaintext, only on the start that created it
    demo_key_file: Path | None


def prepare_data_dir(data_dir: Path) -> Path:
    data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir, 0o700)
    return data_dir


def check_sqlite_files(url: str) -> None:
    """For a SQLite database file: the file and its ``-wal``/``-shm`` companions (when they
    exist) and its directory must be writable (SQLite maps ``-shm`` into memory: an unwritable
    one would kill the server with SIGBUS), and they are made private (0600). No-op for
    other databases.

    Raises:
        ValueError: one line naming the file that is not writable.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return
    db = Path(parsed.database)
    if not os.access(db.parent, os.W_OK):
        raise ValueError(f"the database directory {db.parent} is not writable by this user")
    for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        if not path.exists():
            continue
        if not os.access(path, os.W_OK) or not path.stat().st_mode & 0o222:
            raise ValueError(f"the database file {path} is not writable (mode "
                             f"{path.stat().st_mode & 0o777:o}); saltserve needs to write it")
        if path.stat().st_mode & 0o077:
            try:
                os.chmod(path, 0o600)  # usage, audit and key hashes: not for other local users
            except OSError as e:
                raise ValueError(f"the database file {path} is readable by other users and "
                                 f"cannot be made private ({e.strerror}); run chmod 600 {path} "
                                 "as its owner") from None


def open_repository(settings: Settings) -> TenantRepository:
    """Checks the database files (``check_sqlite_files``), migrates the database (idempotent)
    and returns the repository.

    Raises:
        ValueError: an unwritable SQLite file, a secret file others may read, or a database
            that cannot be reached or used (one line, password hidden; no traceback).
    """
    prepare_data_dir(settings.data_dir)
    url = settings.resolved_database_url()
    check_sqlite_files(url)
    try:
        db = make_engine(url)
        run_migrations(db)
    except (ArgumentError, OperationalError, InterfaceError, ModuleNotFoundError) as e:
        where = make_url(url).render_as_string(hide_password=True) if not isinstance(
            e, ArgumentError) else "the configured URL"
        cause = str(getattr(e, "orig", None) or e).strip().splitlines()[0][:300]
        if isinstance(e, ModuleNotFoundError):  # e.g. PostgreSQL without the driver
            cause = f"its driver {e.name} is not installed (pip install 'saltserve[postgres]')"
        raise ValueError(f"cannot use the database at {where}: {cause}") from None
    check_sqlite_files(url)  # the files the first start just created
    key = load_or_create_master_key(settings.data_dir, settings.master_key)
    return TenantRepository(make_session_factory(db), SaltCipher(key))


def make_jwt_verifier(settings: Settings) -> JWTVerifier:
    """The server's JWT verifier: the platform key (generated once into the data dir, 0600)
    plus the optional external IdP key source from ``SALTSERVE_JWT_*``.

    Raises:
        ValueError: a bad ``SALTSERVE_JWT_*`` setting or key file.
    """
    prepare_data_dir(settings.data_dir)
    platform = load_or_create_platform_key(settings.data_dir)
    return JWTVerifier(settings.jwt_config(), platform.public_key())


def write_secret_file(path: Path, text: str) -> None:
    """Writes ``text`` to a new file created with mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)


def bootstrap(settings: Settings) -> Bootstrapped:
    """Prepares everything ``serve`` needs; cheap on every start after the first.

    Raises:
        ValueError: ``--model`` is not a Hugging Face folder (no ``config.json``); checked
            before anything is created.
    """
    from engine.weights import ensure_default_model

    if settings.model and not (Path(settings.model) / "config.json").is_file():
        raise ValueError(f"--model {settings.model}: not a Hugging Face model folder (no "
                         "config.json there); leave --model out for the bundled SmolLM2")
    repo = open_repository(settings)
    model_dir = Path(settings.model) if settings.model else ensure_default_model(settings.data_dir)
    demo_key = None
    key_file = settings.data_dir / DEMO_KEY_FILE
    if settings.create_demo_tenant and not repo.tenants.list_all():
        tenant = repo.tenants.create(DEMO_TENANT, actor="bootstrap")
        demo_key, _info = repo.keys.create(tenant.id, name="demo", actor="bootstrap")
        write_secret_file(key_file, demo_key)
    return Bootstrapped(repo, model_dir, demo_key, key_file if key_file.exists() else None)
