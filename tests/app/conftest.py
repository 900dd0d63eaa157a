"""A real app (SQLite or PostgreSQL tenants) behind Starlette's TestClient, over the real engine
(scheduler, block pool, prefix cache, ``AsyncLLM`` thread) running either a deterministic fake
model (``tests/fake_engine.py``: default, no weights, no torch forward) or the real bundled model
(``real_model=True``: for tests of model outputs, timing and the engine's numerics)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
from fake_engine import FakeExecutor, make_fake_llm_engine
from fastapi.testclient import TestClient

from app.parts import ServerParts, build_parts
from app.server import create_app
from engine.async_engine import AsyncLLM
from tenants.crypto import SaltCipher, decode_master_key, generate_master_key
from tenants.db import make_engine, make_session_factory, run_migrations
from tenants.repository import TenantRepository
from tenants.tokens import JWTConfig, JWTVerifier, issue_token, load_or_create_platform_key


@dataclass
class AppEnv:
    client: TestClient
    repo: TenantRepository
    engine: AsyncLLM
    model: str
    key_a: str
    key_b: str
    tenant_a: str
    tenant_b: str
    # platform JWT, role admin, sub "test-admin", no tenant (kept out of failure output)
    admin_token: str = field(default="", repr=False)
    data_dir: Path | None = None   # holds the platform JWT signing key

    @property
    def parts(self) -> ServerParts:
        """The server's parts (``app.parts``) the app was built from."""
        return self.client.app.state.parts

    @property
    def fake(self) -> FakeExecutor | None:
        """The fake model (None on the real one): its ``fail``, ``steps``, ``tokens_computed``."""
        runner = self.engine.engine.runner
        return runner if isinstance(runner, FakeExecutor) else None

    def on_engine_thread(self, fn: Callable):
        """Runs ``fn(llm_engine)`` on the engine thread between steps; returns its result."""
        return self.client.portal.call(self.engine._call, fn)

    def engine_state(self) -> tuple[int, int, bool]:
        """(free blocks, total blocks, has unfinished requests), read on the engine thread after
        checking the KV cache manager's and the block pool's integrity."""
        def probe(core):
            core.kv_cache_manager.check_integrity()
            core.block_pool.check_integrity()
            pool = core.block_pool
            return pool.get_num_free_blocks(), pool.num_blocks, core.has_unfinished_requests()

        return self.on_engine_thread(probe)

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def completion_scope(self, body: bytes, spec: str = "2.3") -> dict:
        """The ASGI scope of ``POST /v1/completions`` with ``body`` and tenant A's key, for
        tests that drive the app as the server does (``app(scope, receive, send)``)."""
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec},
                "http_version": "1.1", "method": "POST", "scheme": "http",
                "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                "root_path": "",
                "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"authorization", f"Bearer {self.key_a}".encode())],
                "client": ("127.0.0.1", 1), "server": ("test", 80)}

    def usage_row(self, tenant_id: str, request_id: str, timeout_s: float = 5.0):
        """The usage row of call ``request_id`` once the journal has stored it."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            rows = [u for u in self.repo.usage.list_usage(tenant_id)
                    if u.request_id == request_id]
            if rows:
                return rows[0]
            time.sleep(0.05)
        raise AssertionError("usage row not stored")

    def issue(self, role: str = "tenant", tenant_id: str | None = None, ttl_s: int = 3600,
              subject: str = "test", **kw) -> str:
        """A platform JWT signed with this app's key (``issue_token`` keyword args in ``kw``)."""
        assert self.data_dir is not None
        key = load_or_create_platform_key(self.data_dir)
        return issue_token(key, JWTConfig(), subject=subject, role=role,  # type: ignore[arg-type]
                           tenant_id=tenant_id, ttl_s=ttl_s, **kw)


def make_repo(tmp: Path, database_url: str | None = None) -> TenantRepository:
    db = make_engine(database_url or f"sqlite:///{tmp / 'app.db'}")
    run_migrations(db)
    return TenantRepository(make_session_factory(db),
                            SaltCipher(decode_master_key(generate_master_key())))


@contextmanager
def build_app_env(make_llm_engine, model_dir: Path, tokenizer, tmp: Path,
                  metrics_token: str | None = None, database_url: str | None = None,
                  last_used_flush_s: float = 60.0, real_model: bool = False,
                  **engine_overrides) -> Iterator[AppEnv]:
    """A running app over a fresh engine and database with tenants A and B (one key each).

    Args:
        metrics_token: passed to ``build_parts`` (None: ``/metrics`` answers 403).
        database_url: tenants database (default: SQLite in ``tmp``).
        real_model: the bundled model instead of the fake one.
        engine_overrides: ``EngineConfig`` fields; default max_model_len 512 and 128 KV blocks.
    """
    repo = make_repo(tmp, database_url)
    a = repo.tenants.create("tenant-a")
    b = repo.tenants.create("tenant-b")
    key_a, _ = repo.keys.create(a.id)
    key_b, _ = repo.keys.create(b.id)
    overrides = {"max_model_len": 512, "num_gpu_blocks_override": 128, **engine_overrides}
    core = (make_llm_engine(**overrides) if real_model
            else make_fake_llm_engine(model_dir, tokenizer, **overrides))
    engine = AsyncLLM(core)
    platform_key = load_or_create_platform_key(tmp)
    verifier = JWTVerifier(JWTConfig(), platform_key.public_key())
    app = create_app(build_parts(engine, repo, metrics_token=metrics_token, jwt_verifier=verifier,
                                 last_used_flush_s=last_used_flush_s,
                                 usage_journal_dir=tmp / "usage-journal"))
    admin = issue_token(platform_key, JWTConfig(), subject="test-admin", role="admin",
                        tenant_id=None, ttl_s=3600)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield AppEnv(client, repo, engine, core.served_model_name, key_a, key_b, a.id, b.id,
                     admin, tmp)


@pytest.fixture(scope="session")
def app_env_builder(make_llm_engine, model_dir, tokenizer
                    ) -> Callable[..., AbstractContextManager[AppEnv]]:
    """``build_app_env`` bound to the bundled model's files, for test modules that need their own
    app: ``with app_env_builder(tmp, metrics_token="t", num_gpu_blocks_override=20) as env:``."""
    return partial(build_app_env, make_llm_engine, model_dir, tokenizer)


@pytest.fixture(scope="module")
def app_env(app_env_builder, tmp_path_factory) -> Iterator[AppEnv]:
    """An app over the fake model."""
    with app_env_builder(tmp_path_factory.mktemp("app")) as env:
        yield env


@pytest.fixture(scope="module")
def real_app_env(app_env_builder, tmp_path_factory) -> Iterator[AppEnv]:
    """An app over the real bundled model (end-to-end tests of model output)."""
    with app_env_builder(tmp_path_factory.mktemp("real-app"), real_model=True) as env:
        yield env
