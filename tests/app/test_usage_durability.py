"""Usage rows through the real server survive a database that refuses for a while: calls made
while another process holds SQLite's write lock all succeed, and exactly their rows appear once
the lock is released (``tenants.usage_journal``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tenants.db import make_engine


@pytest.fixture(scope="module")
def env(app_env_builder, tmp_path_factory) -> Iterator:
    with app_env_builder(tmp_path_factory.mktemp("durable"), max_model_len=256,
                         num_gpu_blocks_override=64) as e:
        yield e


def test_calls_while_the_database_is_locked_are_all_billed_once_it_unlocks(env):
    t = env.repo.tenants.create("durable")
    key, _ = env.repo.keys.create(t.id)
    body = {"model": env.model, "prompt": [500, 501, 502], "max_tokens": 2, "temperature": 0}
    assert env.client.post("/v1/completions", json=body, headers=env.headers(key)
                           ).status_code == 200     # warm: the key is cached, its row stored
    journal = env.parts.journal
    assert journal.wait_stored()
    locker = make_engine(f"sqlite:///{env.data_dir / 'app.db'}").raw_connection()
    locker.execute("PRAGMA busy_timeout=0")
    locker.execute("BEGIN EXCLUSIVE")               # another process holds the write lock
    ids = []
    try:
        for _ in range(8):
            r = env.client.post("/v1/completions", json=body, headers=env.headers(key))
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        time.sleep(0.5)
        assert journal.pending_segments()           # journalled on disk, not yet stored
    finally:
        locker.rollback()
        locker.close()
    assert journal.wait_stored(timeout_s=30)
    rows = [r for r in env.repo.usage.list_usage(t.id) if r.request_id in ids]
    assert sorted(r.request_id for r in rows) == sorted(ids)
    assert all((r.status, r.prompt_tokens, r.completion_tokens) == ("ok", 3, 2) for r in rows)
    assert len(env.repo.usage.list_usage(t.id)) == 9


def test_an_admin_write_while_the_database_is_locked_is_a_503_that_changes_nothing(env):
    path = f"/admin/tenants/{env.tenant_b}"
    before = env.client.get(path, headers=env.headers(env.admin_token)).json()
    locker = make_engine(f"sqlite:///{env.data_dir / 'app.db'}").raw_connection()
    locker.execute("PRAGMA busy_timeout=0")
    locker.execute("BEGIN EXCLUSIVE")
    try:  # the server's connection waits its busy timeout (5 s), then gives up
        r = env.client.patch(path, headers=env.headers(env.admin_token),
                             json={"rpm_limit": 7})
    finally:
        locker.rollback()
        locker.close()
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("service_unavailable", "database_unavailable")
    assert r.headers["retry-after"] == "1" and "Traceback" not in r.text
    assert env.client.get(path, headers=env.headers(env.admin_token)).json() == before
    # ... and the same write succeeds once the database is free again.
    r = env.client.patch(path, headers=env.headers(env.admin_token), json={"rpm_limit": 7})
    assert r.status_code == 200 and r.json()["rpm_limit"] == 7
    env.client.patch(path, headers=env.headers(env.admin_token), json={"rpm_limit": None})
