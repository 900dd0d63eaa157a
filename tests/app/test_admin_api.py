"""``/admin`` on a real app (fake model, real engine): tenants, keys, salt rotation (API and
cache resets, the per-tenant caching switch, audit rows and usage reports.

Cache scenarios start with a global reset so block counts are exact. A 40-token prompt has two
reusable blocks (last-token rule): a full hit is 32 cached tokens.
"""

from __future__ import annotations

import csv
import io
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

FULL = 32


@pytest.fixture(scope="module")
def env(app_env_builder, tmp_path_factory) -> Iterator:
    with app_env_builder(tmp_path_factory.mktemp("admin"), max_model_len=256,
                         num_gpu_blocks_override=64) as e:
        yield e


def admin(env, method: str, path: str, **kw):
    return env.client.request(method, path, headers=env.headers(env.admin_token), **kw)


def prompt_of(seed: int, n: int = 40) -> list[int]:
    return [(seed * 7919 + 13 * i) % 40000 + 500 for i in range(n)]


def complete(env, key: str, prompt: list[int], **kw) -> dict:
    body = {"model": env.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **kw}
    r = env.client.post("/v1/completions", json=body, headers=env.headers(key))
    assert r.status_code == 200, r.text
    return r.json()


def cached(env, key: str, prompt: list[int]) -> int:
    return complete(env, key, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(env, name: str, **labels: str) -> float:
    """Sum of ``saltserve:<name>`` samples whose labels include ``labels`` (admin scrape)."""
    r = admin(env, "GET", "/metrics")
    assert r.status_code == 200, r.text
    total = 0.0
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == "saltserve:" + name and set(labels.items()) <= set(s.labels.items()):
                total += s.value
    return total


def reset_all(env) -> None:
    assert admin(env, "POST", "/admin/cache/reset").status_code == 200


def leaks_salt(env, tenant_id: str, text: str) -> bool:
    """Whether ``text`` holds the tenant's current salt (hex, base64, URL-safe base64, repr).
    The salt itself never leaves ``tenants/``: the sealed salt answers the question."""
    return env.repo.authenticator.context_for_tenant(tenant_id).salt_occurs_in(text)


# -- tenants and keys -----------------------------------------------------------------------------
def test_tenant_and_key_lifecycle(env):
    r = admin(env, "POST", "/admin/tenants", json={"name": "acme"})
    assert r.status_code == 201, r.text
    t = r.json()
    assert t["name"] == "acme" and t["current_salt_version"] == 1 and not t["disabled"]
    assert "salt" not in t and "tenant_salt" not in t
    r = admin(env, "POST", "/admin/tenants", json={"name": "acme"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "tenant_exists"
    assert admin(env, "POST", "/admin/tenants", json={"name": ""}).status_code == 400
    assert admin(env, "POST", "/admin/tenants", json={"name": "x", "evil": 1}).status_code == 400
    ids = [x["id"] for x in admin(env, "GET", "/admin/tenants").json()["data"]]
    assert {env.tenant_a, env.tenant_b, t["id"]} <= set(ids)
    assert admin(env, "GET", f"/admin/tenants/{t['id']}").json()["name"] == "acme"
    r = admin(env, "GET", "/admin/tenants/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"

    r = admin(env, "POST", f"/admin/tenants/{t['id']}/keys", json={"name": "ci"})
    assert r.status_code == 201, r.text
    created = r.json()
    key = created["key"]
    assert key.startswith(f"ss-{created['id']}-") and created["last4"] == key[-4:]
    assert cached(env, key, prompt_of(1, 8)) == 0                       # the key works
    listed = admin(env, "GET", f"/admin/tenants/{t['id']}/keys").json()["data"]
    assert [k["id"] for k in listed] == [created["id"]]
    assert key not in str(listed) and "key_hash" not in listed[0]       # shown once only
    r = admin(env, "POST", f"/admin/tenants/{t['id']}/keys",
              json={"expires_at": "2030-01-01T00:00:00"})                # naive time
    assert r.status_code == 400
    r = admin(env, "POST", f"/admin/keys/{created['id']}/revoke")
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    body = {"model": env.model, "prompt": [500], "max_tokens": 1}
    r = env.client.post("/v1/completions", json=body, headers=env.headers(key))
    assert r.status_code == 401                                          # next request refused
    r = admin(env, "POST", "/admin/keys/000000000000/revoke")
    assert r.status_code == 404 and r.json()["error"]["code"] == "api_key_not_found"

    r = admin(env, "PATCH", f"/admin/tenants/{t['id']}", json={"disabled": True})
    assert r.status_code == 200 and r.json()["disabled"] is True
    key2 = admin(env, "POST", f"/admin/tenants/{t['id']}/keys", json={}).json()["key"]
    r = env.client.post("/v1/completions", json=body, headers=env.headers(key2))
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_disabled"
    admin(env, "PATCH", f"/admin/tenants/{t['id']}", json={"disabled": False})
    assert env.client.post("/v1/completions", json=body,
                           headers=env.headers(key2)).status_code == 200


# -- strict admin input ---------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"rpm_limit": 2**63}, "rpm_limit"),          # was a 500 and a dropped connection
    ({"rpm_limit": 2**31}, "rpm_limit"),          # one over what the column holds
    ({"rpm_limit": True}, "rpm_limit"),           # was taken as 1
    ({"tpm_limit": "10"}, "tpm_limit"),
    ({"max_concurrent": 1.5}, "max_concurrent"),
    ({"disabled": "yes"}, "disabled"),            # was taken as true: the tenant disabled
    ({"disabled": 1}, "disabled"),
    ({"enable_prefix_caching": "false"}, "enable_prefix_caching"),
    ({"weight": 1001}, "weight"),
    ({"weight": 2.0}, "weight"),
    ({"min_cache_blocks": -1}, "min_cache_blocks"),
    ({"max_cache_blocks": 2**31}, "max_cache_blocks"),
])
def test_admin_patch_is_strict_and_changes_nothing_when_refused(env, body, param):
    path = f"/admin/tenants/{env.tenant_b}"
    before = admin(env, "GET", path).json()
    r = admin(env, "PATCH", path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    assert admin(env, "GET", path).json() == before


def test_admin_limits_take_the_ends_of_their_range(env):
    t = admin(env, "POST", "/admin/tenants", json={"name": "bounds"}).json()
    path = f"/admin/tenants/{t['id']}"
    top = 2**31 - 1
    r = admin(env, "PATCH", path, json={"rpm_limit": top, "tpm_limit": 1, "max_concurrent": top,
                                        "weight": 1000, "min_cache_blocks": 0,
                                        "max_cache_blocks": top})
    assert r.status_code == 200, r.text
    assert {k: r.json()[k] for k in ("rpm_limit", "tpm_limit", "max_concurrent", "weight",
                                     "min_cache_blocks", "max_cache_blocks")} == {
        "rpm_limit": top, "tpm_limit": 1, "max_concurrent": top, "weight": 1000,
        "min_cache_blocks": 0, "max_cache_blocks": top}
    assert admin(env, "PATCH", path, json={"rpm_limit": None}).json()["rpm_limit"] is None


@pytest.mark.parametrize("name, status", [
    ("evil\nname", 400), ("nul\u0000", 400), ("esc\u001b[2J", 400),
    ("0123456789abcdef0123456789abcdef", 400),  # shaped like a tenant id
    ("ACME-strict", 409),                        # case variant of an existing name
    ("ß" * 200, 400),                            # 400 characters once casefolded
    (123, 400), (True, 400),
])
def test_admin_tenant_names_are_checked(env, name, status):
    admin(env, "POST", "/admin/tenants", json={"name": "acme-strict"})
    count = len(admin(env, "GET", "/admin/tenants").json()["data"])
    r = admin(env, "POST", "/admin/tenants", json={"name": name})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "name"
    assert len(admin(env, "GET", "/admin/tenants").json()["data"]) == count


def test_a_key_dead_on_arrival_is_refused(env):
    path = f"/admin/tenants/{env.tenant_b}/keys"
    before = len(admin(env, "GET", path).json()["data"])
    for expires_at in ("2020-01-01T00:00:00Z", datetime.now(UTC).isoformat()):
        r = admin(env, "POST", path, json={"expires_at": expires_at})
        assert r.status_code == 400 and r.json()["error"]["param"] == "expires_at", r.text
        assert "in the future" in r.json()["error"]["message"]
    r = admin(env, "POST", path, json={"expires_at": (datetime.now(UTC) + timedelta(days=1))
                                       .isoformat()})
    assert r.status_code == 201, r.text
    assert len(admin(env, "GET", path).json()["data"]) == before + 1


def test_no_redirect_echoes_the_host_header(env):
    for path in ("/admin/tenants/", "/v1/models/", "/health/"):
        r = env.client.get(path, headers={**env.headers(env.admin_token),
                                          "Host": "evil.example"}, follow_redirects=False)
        # /v1/models/ is "retrieve model" with an empty id: the admin token is refused there.
        assert r.status_code == (403 if path == "/v1/models/" else 404), (path, r.status_code)
        assert "location" not in r.headers
        assert "evil.example" not in r.text


# -- salt rotation --------------------------------------------------------------------------------
def test_rotate_salt_through_the_api(env):
    reset_all(env)
    p = prompt_of(2)
    assert [cached(env, env.key_a, p), cached(env, env.key_a, p)] == [0, FULL]
    assert [cached(env, env.key_b, p), cached(env, env.key_b, p)] == [0, FULL]
    old = env.repo.authenticator.context_for_tenant(env.tenant_a)
    before = old.salt_version
    r = admin(env, "POST", f"/admin/tenants/{env.tenant_a}/rotate-salt")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["salt_version"] == before + 1 and out["blocks_dropped"] >= 2
    assert set(out) == {"tenant_id", "salt_version", "blocks_dropped", "tier_bytes_dropped"}
    assert out["tier_bytes_dropped"] == {}  # the fake model has no offload tier
    assert not leaks_salt(env, env.tenant_a, r.text) and not old.salt_occurs_in(r.text)
    assert metric(env, "prefix_cache_resident_blocks", tenant=env.tenant_a) == 0
    assert cached(env, env.key_a, p) == 0                      # old blocks unreachable
    assert cached(env, env.key_a, p) == FULL                   # new version warms again
    assert cached(env, env.key_b, p) == FULL                   # other tenant untouched
    # The next auth at the new version does not evict again (the server already saw it).
    evicted = metric(env, "prefix_cache_evictions_total", tenant=env.tenant_a,
                     reason="salt_rotation")
    assert cached(env, env.key_a, p) == FULL
    assert metric(env, "prefix_cache_evictions_total", tenant=env.tenant_a,
                  reason="salt_rotation") == evicted
    assert admin(env, "POST", "/admin/tenants/nope/rotate-salt").status_code == 404


def test_rotation_out_of_band_is_noticed_on_the_next_request(env):
    """``saltserve tenants rotate-salt`` runs in another process: the server notices the new
    version when the tenant next authenticates and drops the old blocks once."""
    reset_all(env)
    p = prompt_of(3)
    assert [cached(env, env.key_b, p), cached(env, env.key_b, p)] == [0, FULL]
    assert [cached(env, env.key_a, p), cached(env, env.key_a, p)] == [0, FULL]
    evicted = metric(env, "prefix_cache_evictions_total", tenant=env.tenant_b,
                     reason="salt_rotation")
    env.repo.tenants.rotate_salt(env.tenant_b, actor="cli")            # not through the server
    assert cached(env, env.key_b, p) == 0
    after = metric(env, "prefix_cache_evictions_total", tenant=env.tenant_b,
                   reason="salt_rotation")
    assert after - evicted >= 2                                # the old blocks were released
    assert cached(env, env.key_b, p) == FULL
    assert metric(env, "prefix_cache_evictions_total", tenant=env.tenant_b,
                  reason="salt_rotation") == after             # once
    assert cached(env, env.key_a, p) == FULL


def test_request_in_flight_during_rotation_finishes_unharmed(env):
    reset_all(env)
    p = prompt_of(4)
    kw = {"max_tokens": 64, "ignore_eos": True}
    reference = complete(env, env.key_a, p, **kw)
    result: dict = {}

    def run() -> None:
        result["r"] = complete(env, env.key_a, p, **kw)

    env.fake.step_delay_s = 0.02  # 64 tokens take > 1 s: the rotation lands mid-request
    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 30
    while not env.client.portal.call(
            env.engine._call, lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline and worker.is_alive(), "request never started"
        time.sleep(0.005)
    r = admin(env, "POST", f"/admin/tenants/{env.tenant_a}/rotate-salt")
    assert r.status_code == 200
    assert worker.is_alive(), "the request finished before the rotation: nothing was tested"
    worker.join(60)
    env.fake.step_delay_s = 0.0
    got = result["r"]
    assert got["choices"][0]["text"] == reference["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == 64
    assert cached(env, env.key_a, p) == 0


# -- cache resets and the caching switch ----------------------------------------------------------
def test_tenant_and_global_cache_reset(env):
    reset_all(env)
    p = prompt_of(5)
    for key in (env.key_a, env.key_b):
        assert [cached(env, key, p), cached(env, key, p)] == [0, FULL]
    r = admin(env, "POST", f"/admin/tenants/{env.tenant_a}/cache/reset")
    assert r.status_code == 200 and r.json()["blocks_dropped"] >= 2
    assert cached(env, env.key_b, p) == FULL
    assert cached(env, env.key_a, p) == 0
    r = admin(env, "POST", "/admin/cache/reset")
    assert r.status_code == 200 and r.json()["blocks_dropped"] >= 4
    assert cached(env, env.key_b, p) == 0
    assert admin(env, "POST", "/admin/tenants/nope/cache/reset").status_code == 404


def test_per_tenant_caching_switch(env):
    reset_all(env)
    p = prompt_of(6)
    for key in (env.key_a, env.key_b):
        assert [cached(env, key, p), cached(env, key, p)] == [0, FULL]
    r = admin(env, "PATCH", f"/admin/tenants/{env.tenant_a}",
              json={"enable_prefix_caching": False})
    assert r.status_code == 200 and r.json()["enable_prefix_caching"] is False
    assert metric(env, "prefix_cache_resident_blocks", tenant=env.tenant_a) == 0
    assert [cached(env, env.key_a, p), cached(env, env.key_a, p)] == [0, 0]
    assert metric(env, "prefix_cache_resident_blocks", tenant=env.tenant_a) == 0
    assert cached(env, env.key_b, p) == FULL
    admin(env, "PATCH", f"/admin/tenants/{env.tenant_a}", json={"enable_prefix_caching": True})
    assert [cached(env, env.key_a, p), cached(env, env.key_a, p)] == [0, FULL]
    assert admin(env, "PATCH", f"/admin/tenants/{env.tenant_a}",
                 json={"disabled": "maybe"}).status_code == 400


def test_disabling_a_tenant_drops_its_cache(env):
    """Nothing of a disabled tenant's stays cached (the pool here; the offload tiers too,
    docs/prefix-caching.md): re-enabled, it starts cold; the other tenant keeps its blocks."""
    reset_all(env)
    p = prompt_of(8)
    for key in (env.key_a, env.key_b):
        assert [cached(env, key, p), cached(env, key, p)] == [0, FULL]
    r = admin(env, "PATCH", f"/admin/tenants/{env.tenant_a}", json={"disabled": True})
    assert r.status_code == 200 and r.json()["disabled"] is True
    assert metric(env, "prefix_cache_resident_blocks", tenant=env.tenant_a) == 0
    rows = admin(env, "GET", "/admin/audit", params={"tenant": env.tenant_a,
                                                     "action": "cache.reset"}).json()["data"]
    assert rows and "cause=disabled" in rows[0]["detail"]
    r = admin(env, "PATCH", f"/admin/tenants/{env.tenant_a}", json={"disabled": False})
    assert r.status_code == 200
    assert [cached(env, env.key_a, p), cached(env, env.key_b, p)] == [0, FULL]


# -- audit and usage ------------------------------------------------------------------------------
def test_audit_rows_record_versions_never_salts(env):
    t = admin(env, "POST", "/admin/tenants", json={"name": "audited"}).json()
    k = admin(env, "POST", f"/admin/tenants/{t['id']}/keys", json={}).json()
    admin(env, "POST", f"/admin/keys/{k['id']}/revoke")
    admin(env, "POST", f"/admin/tenants/{t['id']}/rotate-salt")
    admin(env, "POST", f"/admin/tenants/{t['id']}/cache/reset")
    env.client.get("/admin/audit", headers=env.headers(env.key_a))      # denied
    r = admin(env, "GET", "/admin/audit", params={"tenant": t["id"]})
    assert r.status_code == 200
    rows = r.json()["data"]
    by_action = {row["action"]: row for row in rows}
    assert by_action["tenant.create"]["detail"] == "salt_version=1"
    assert by_action["tenant.rotate_salt"]["detail"] == "salt_version=2"
    assert "salt_version=2" in by_action["cache.reset"]["detail"]
    assert by_action["api_key.create"]["detail"] == f"key_id={k['id']} salt_version=1"
    assert by_action["api_key.revoke"]["detail"] == f"key_id={k['id']} salt_version=1"
    assert {row["actor"] for row in rows} == {"test-admin"}
    env.parts.admin_refusals.flush(env.repo.usage.audit, everything=True)
    everything = admin(env, "GET", "/admin/audit", params={"limit": 1000}).text
    assert "auth.admin_forbidden" in everything
    for tid in (t["id"], env.tenant_a, env.tenant_b):
        assert not leaks_salt(env, tid, everything)
    assert k["key"] not in everything and env.key_a not in everything
    assert admin(env, "GET", "/admin/audit", params={"limit": 0}).status_code == 400


def test_usage_report_json_and_csv(env):
    complete(env, env.key_b, prompt_of(7, 20))
    assert env.parts.journal.wait_stored()  # rows are written off the path
    r = admin(env, "GET", "/admin/usage", params={"tenant": env.tenant_b})
    assert r.status_code == 200
    rows = r.json()["data"]
    assert rows and {row["tenant_id"] for row in rows} == {env.tenant_b}
    assert rows[-1]["prompt_tokens"] == 20 and rows[-1]["status"] == "ok"
    r = admin(env, "GET", "/admin/usage", params={"tenant": env.tenant_b, "format": "csv"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    parsed = list(csv.DictReader(io.StringIO(r.text)))
    assert len(parsed) == len(rows) and parsed[-1]["prompt_tokens"] == "20"
    for bucket in ("1h", "1d"):
        r = admin(env, "GET", "/admin/usage/report", params={"bucket": bucket})
        buckets = r.json()["data"]
        mine = [b for b in buckets if b["tenant_id"] == env.tenant_b]
        assert sum(b["requests"] for b in mine) == len(rows)
        assert sum(b["prompt_tokens"] for b in mine) == sum(x["prompt_tokens"] for x in rows)
        assert {b["tenant_name"] for b in mine} == {"tenant-b"}
    r = admin(env, "GET", "/admin/usage/report", params={"bucket": "1m", "format": "csv"})
    assert r.text.splitlines()[0].startswith("bucket_start,tenant_id,tenant_name,key_id")
    assert admin(env, "GET", "/admin/usage", params={"format": "xml"}).status_code == 400
    assert admin(env, "GET", "/admin/usage",
                 params={"since": "2020-01-01T00:00:00"}).status_code == 400  # naive time


def test_audit_rows_carry_the_servers_request_id_and_the_clients_apart(env):
    import re

    h = {**env.headers(env.admin_token), "X-Request-ID": "trace-123"}
    r = env.client.post("/admin/tenants", json={"name": "traced"}, headers=h)
    assert r.status_code == 201
    server_id = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", server_id)  # never the client's value
    tenant_id = r.json()["id"]
    r = admin(env, "POST", f"/admin/tenants/{tenant_id}/rotate-salt")
    generated = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated) and generated != server_id
    rows = {e.action: e for e in env.repo.usage.list_audit(tenant_id)}
    created = rows["tenant.create"]
    assert (created.request_id, created.client_request_id) == (server_id, "trace-123")
    assert (rows["tenant.rotate_salt"].request_id,
            rows["tenant.rotate_salt"].client_request_id) == (generated, None)
    # A client sending a server's id as its own is only ever recorded as client_request_id.
    h = {**env.headers(env.admin_token), "X-Request-ID": generated}
    env.client.post(f"/admin/tenants/{tenant_id}/cache/reset", headers=h)
    reset = next(e for e in env.repo.usage.list_audit(tenant_id) if e.action == "cache.reset")
    assert reset.request_id != generated and reset.client_request_id == generated
    # A header that is not a short safe token is dropped.
    r = env.client.post(f"/admin/tenants/{tenant_id}/cache/reset",
                        headers={**env.headers(env.admin_token), "X-Request-ID": "x" * 65})
    latest = env.repo.usage.list_audit(tenant_id, limit=1)[0]
    assert latest.client_request_id is None and latest.request_id == r.headers["x-request-id"]


def test_an_anonymous_flood_leaves_the_audit_log_alone(env):
    """1,100 refused anonymous calls must not push the real admin rows out of the newest 1,000."""
    admin(env, "POST", f"/admin/tenants/{env.tenant_b}/cache/reset")
    real = env.repo.usage.list_audit(limit=1)[0]
    assert real.action == "cache.reset"
    counted = metric(env, "admin_auth_refusals_total", reason="malformed")
    for _ in range(1100):
        assert env.client.get("/admin/tenants", headers=env.headers("x")).status_code == 401
    env.parts.admin_refusals.flush(env.repo.usage.audit, everything=True)
    assert env.repo.usage.list_audit(limit=1)[0] == real          # no row was written
    assert metric(env, "admin_auth_refusals_total", reason="malformed") == counted + 1100
    rows = admin(env, "GET", "/admin/audit", params={"limit": 1000}).json()["data"]
    assert rows[0]["id"] == real.id


def test_a_forbidden_paths_row_is_truncated_and_escaped(env):
    refusals = env.parts.admin_refusals
    refusals.flush(env.repo.usage.audit, everything=True)
    path = "/admin/tenants/" + "x" * 300 + "%0aFAKE%20ROW%00"
    assert env.client.get(path, headers=env.headers(env.key_b)).status_code == 403
    refusals.flush(env.repo.usage.audit, everything=True)
    row = env.repo.usage.list_audit(limit=1)[0]
    assert row.action == "auth.admin_forbidden"
    first = row.detail.split(" first=", 1)[1]
    assert first.startswith("GET /admin/tenants/xxx") and len(first) == len("GET ") + 128
    assert first.isprintable() and "\n" not in row.detail and " " not in first[4:]


def test_audit_pages_and_filters(env):
    t = admin(env, "POST", "/admin/tenants", json={"name": "paged"}).json()
    start = datetime.now(UTC)
    for _ in range(5):
        admin(env, "POST", f"/admin/tenants/{t['id']}/cache/reset")
    admin(env, "POST", f"/admin/tenants/{t['id']}/rotate-salt")
    mine = [e.id for e in env.repo.usage.list_audit(t["id"])]     # newest first
    assert len(mine) == 7
    seen, cursor = [], None
    while True:
        params = {"tenant": t["id"], "limit": 3, **({"cursor": cursor} if cursor else {})}
        page = admin(env, "GET", "/admin/audit", params=params).json()
        seen += [row["id"] for row in page["data"]]
        assert page["has_more"] == (page["next_cursor"] is not None)
        if not page["has_more"]:
            break
        cursor = page["next_cursor"]
    assert seen == mine                                       # every row once, in order
    q = {"tenant": t["id"], "action": "cache.reset"}
    resets = admin(env, "GET", "/admin/audit", params=q).json()["data"]
    assert len(resets) == 5 and {r["action"] for r in resets} == {"cache.reset"}
    q = {"actor": "test-admin", "action": "tenant.rotate_salt", "tenant": t["id"],
         "since": start.isoformat()}
    assert len(admin(env, "GET", "/admin/audit", params=q).json()["data"]) == 1
    q = {"tenant": t["id"], "until": start.isoformat()}
    only = admin(env, "GET", "/admin/audit", params=q).json()["data"]
    assert [r["action"] for r in only] == ["tenant.create"]
    assert admin(env, "GET", "/admin/audit", params={"actor": "nobody"}).json()["data"] == []
    for bad in ({"cursor": "abc"}, {"cursor": "²"}, {"cursor": "9" * 32},
                {"since": "2026-01-01T00:00:00"}, {"limit": 1001}):
        r = admin(env, "GET", "/admin/audit", params=bad)
        assert r.status_code == 400, (bad, r.text)


def test_tenants_are_accepted_by_name_or_id_everywhere_and_unknown_ones_are_404(env):
    t = admin(env, "POST", "/admin/tenants", json={"name": "Named-Co"}).json()
    key = admin(env, "POST", "/admin/tenants/named-co/keys", json={"name": "k"})
    assert key.status_code == 201 and key.json()["tenant_id"] == t["id"]  # name, any case
    complete(env, key.json()["key"], prompt_of(777))
    for path in ("/admin/tenants/Named-Co", f"/admin/tenants/{t['id']}"):
        assert admin(env, "GET", path).json()["id"] == t["id"]
    assert admin(env, "PATCH", "/admin/tenants/Named-Co", json={"weight": 3}).json()["weight"] == 3
    assert admin(env, "GET", "/admin/tenants/Named-Co/keys").json()["data"][0]["name"] == "k"
    assert admin(env, "POST", "/admin/tenants/Named-Co/rotate-salt").json()["tenant_id"] == t["id"]
    assert admin(env, "POST", "/admin/tenants/Named-Co/cache/reset").json()["tenant_id"] == t["id"]
    deadline = time.time() + 5
    while time.time() < deadline and not admin(
            env, "GET", "/admin/usage", params={"tenant": "Named-Co"}).json()["data"]:
        time.sleep(0.05)
    usage = admin(env, "GET", "/admin/usage", params={"tenant": "Named-Co"}).json()["data"]
    assert [u["tenant_id"] for u in usage] == [t["id"]]
    audit = admin(env, "GET", "/admin/audit", params={"tenant": "Named-Co"}).json()["data"]
    assert {"tenant.create", "api_key.create", "tenant.rotate_salt", "cache.reset",
            "tenant.update"} <= {
        a["action"] for a in audit}
    # An unknown tenant is a 404 everywhere, never an empty 200.
    for method, path, kw in (("GET", "/admin/tenants/nobody", {}),
                             ("GET", "/admin/tenants/nobody/keys", {}),
                             ("POST", "/admin/tenants/nobody/rotate-salt", {}),
                             ("POST", "/admin/tenants/nobody/cache/reset", {}),
                             ("PATCH", "/admin/tenants/nobody", {"json": {"weight": 2}}),
                             ("GET", "/admin/usage", {"params": {"tenant": "nobody"}}),
                             ("GET", "/admin/audit", {"params": {"tenant": "nobody"}})):
        r = admin(env, method, path, **kw)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["code"] == "tenant_not_found"


def test_usage_report_routes_and_a_tenants_own_usage(env):
    complete(env, env.key_a, prompt_of(8, 40))
    complete(env, env.key_a, prompt_of(8, 40))  # a repeat: a hit
    complete(env, env.key_b, prompt_of(9, 40))
    assert env.parts.journal.wait_stored()
    r = admin(env, "GET", "/admin/usage/report",
              params={"tenant": "tenant-a", "bucket": "1h", "group_by": "tenant,key,model"})
    assert r.status_code == 200, r.text
    rows = r.json()["data"]
    assert {row["tenant_id"] for row in rows} == {env.tenant_a}
    assert all(row["key_id"] and row["model"] == env.model for row in rows)
    assert sum(row["cached_tokens"] for row in rows) >= FULL
    assert any(row["hit_rate"] and row["hit_rate"] > 0 for row in rows)
    assert all(row["ttft_p50_s"] is not None for row in rows)
    # A tenant reads its own usage only, with its own key.
    own = env.client.get("/v1/usage", params={"bucket": "1h", "group_by": "key"},
                         headers=env.headers(env.key_b))
    assert own.status_code == 200, own.text
    assert {row["tenant_id"] for row in own.json()["data"]} == {env.tenant_b}
    assert env.client.get("/v1/usage", headers=env.headers(env.admin_token)).status_code == 403
    for params, status in (({"group_by": "colour"}, 400), ({"bucket": "2h"}, 400),
                           ({"tenant": "nobody"}, 404),
                           ({"bucket": "1m", "since": "2026-01-01T00:00:00Z"}, 400)):
        assert admin(env, "GET", "/admin/usage/report", params=params).status_code == status
    assert env.client.get("/v1/usage", params={"group_by": "tenant"},
                          headers=env.headers(env.key_a)).status_code == 400
    # Times at the edges of the calendar are 400s, not 500s (found by review).
    for params in ({"until": "0001-01-01T00:00:00Z"}, {"until": "9999-12-31T23:00:00-02:00"},
                   {"since": "0001-01-01T00:30:00+01:00", "bucket": "1h"}):
        r = env.client.get("/v1/usage", params=params, headers=env.headers(env.key_a))
        assert r.status_code == 400, (params, r.text)
    # A daily report says which whole UTC days it counted.
    r = admin(env, "GET", "/admin/usage/report",
              params={"since": "2026-11-03T10:15:00+00:00", "until": "2026-11-04T01:00:00Z"})
    assert (r.json()["since"], r.json()["until"]) == ("2026-11-03T00:00:00+00:00",
                                                      "2026-11-05T00:00:00+00:00")
    assert admin(env, "GET", "/admin/usage", params={"bucket_s": 60}).status_code == 400
    # Audit rows outlive tenants: an id that is no tenant (any more) still filters.
    gone = admin(env, "GET", "/admin/audit", params={"tenant": "f" * 32})
    assert gone.status_code == 200 and gone.json()["data"] == []


def test_cache_stats_without_prometheus(env):
    admin(env, "POST", "/admin/cache/reset")
    prompt = prompt_of(31, 40)
    assert cached(env, env.key_a, prompt) == 0
    assert cached(env, env.key_a, prompt) == FULL
    r = admin(env, "GET", "/admin/cache")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["num_blocks_total"] == 64
    assert body["num_blocks_free"] + body["num_blocks_used"] == 64
    a = next(t for t in body["tenants"] if t["tenant_id"] == env.tenant_a)
    assert a["tenant_name"] == "tenant-a" and a["resident_blocks"] >= 2
    assert a["hit_tokens"] >= FULL and 0 < a["hit_rate"] <= 1
    assert set(a["evictions"]) >= {"capacity", "salt_rotation", "reset"}
    assert env.client.get("/admin/cache", headers=env.headers(env.key_a)).status_code == 403


def test_a_tenant_flooding_its_usage_report_is_rate_limited_and_others_are_not(env):
    t = admin(env, "POST", "/admin/tenants", json={"name": "report-flooder"}).json()
    admin(env, "PATCH", f"/admin/tenants/{t['id']}", json={"rpm_limit": 3})
    key = admin(env, "POST", f"/admin/tenants/{t['id']}/keys", json={}).json()["key"]
    codes = [env.client.get("/v1/usage", params={"bucket": "1m"},
                            headers=env.headers(key)).status_code for _ in range(6)]
    assert codes[:3] == [200] * 3 and set(codes[3:]) == {429}
    r = env.client.get("/v1/usage", headers=env.headers(key))
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in r.headers
    # Another tenant's reports and calls are unaffected.
    assert env.client.get("/v1/usage", headers=env.headers(env.key_a)).status_code == 200
    complete(env, env.key_a, prompt_of(55))
