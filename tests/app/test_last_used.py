"""API-key ``last_used_at`` is buffered (no DB write per request) and flushed periodically."""

from __future__ import annotations

import time

from sqlalchemy import select

from tenants.db import make_engine
from tenants.models import ApiKey


def test_last_used_at_is_flushed_in_the_background(app_env_builder, tmp_path):
    with app_env_builder(tmp_path, last_used_flush_s=0.3) as env:
        key_id = env.key_a.split("-")[1]
        db = make_engine(f"sqlite:///{tmp_path / 'app.db'}")

        def last_used():
            with db.connect() as conn:
                return conn.execute(select(ApiKey.last_used_at).where(ApiKey.id == key_id)
                                    ).scalar_one()

        assert last_used() is None
        r = env.client.get("/v1/models", headers=env.headers(env.key_a))
        assert r.status_code == 200
        deadline = time.time() + 10
        while last_used() is None and time.time() < deadline:
            time.sleep(0.1)
        assert last_used() is not None
        db.dispose()
        # Operators see it in the key listing (tenant named by name here).
        keys = env.client.get("/admin/tenants/tenant-a/keys",
                              headers=env.headers(env.admin_token)).json()["data"]
        listed = {k["id"]: k["last_used_at"] for k in keys}
        assert listed[key_id] is not None
