"""The server on PostgreSQL: auth, isolation and usage records through a real app."""

from __future__ import annotations

import time

import pytest


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_completions_isolation_and_usage_on_postgresql(app_env_builder, database_url, tmp_path):
    with app_env_builder(tmp_path, database_url=database_url) as env:
        prompt = [777] + list(range(20000, 20040))  # 41 tokens -> 2 reusable blocks

        def cached(key: str) -> int:
            r = env.client.post("/v1/completions", headers=env.headers(key), json={
                "model": env.model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(env.key_a) == 0
        assert cached(env.key_b) == 0      # A's blocks are invisible to B
        assert cached(env.key_b) == 32     # B's own repeat hits
        assert cached(env.key_a) == 32
        r = env.client.get("/v1/models", headers={"Authorization": "Bearer ss-0-nope"})
        assert r.status_code == 401
        deadline = time.time() + 5
        while time.time() < deadline:
            rows = env.repo.usage.list_usage(env.tenant_a) + env.repo.usage.list_usage(env.tenant_b)
            if len(rows) == 4:
                break
            time.sleep(0.05)
        assert sorted(u.cached_tokens for u in rows) == [0, 0, 32, 32]
        assert {u.status for u in rows} == {"ok"}
