"""A real app (engine on the bundled model + SQLite tenants) behind Starlette's TestClient."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.server import create_app
from engine.async_engine import AsyncLLM
from tenants.crypto import SaltCipher, decode_master_key, generate_master_key
from tenants.db import make_engine, make_session_factory, run_migrations
from tenants.repository import TenantRepository


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

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}


def make_repo(tmp: Path) -> TenantRepository:
    db = make_engine(f"sqlite:///{tmp / 'app.db'}")
    run_migrations(db)
    return TenantRepository(make_session_factory(db),
                            SaltCipher(decode_master_key(generate_master_key())))


@pytest.fixture(scope="module")
def app_env(make_llm_engine, tmp_path_factory) -> Iterator[AppEnv]:
    repo = make_repo(tmp_path_factory.mktemp("app"))
    a = repo.create_tenant("tenant-a")
    b = repo.create_tenant("tenant-b")
    key_a, _ = repo.create_api_key(a.id)
    key_b, _ = repo.create_api_key(b.id)
    core = make_llm_engine(max_model_len=512, num_gpu_blocks_override=128)
    engine = AsyncLLM(core)
    app = create_app(engine, repo)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield AppEnv(client, repo, engine, core.served_model_name, key_a, key_b, a.id, b.id)
