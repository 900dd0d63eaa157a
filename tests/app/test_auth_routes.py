"""Deny by default: every route of the real app, every method, against every bad credential.

Routes are enumerated from ``app.routes`` (path parameters filled with dummies), so a route added
later without an auth dependency fails here. Only ``GET /health`` and ``GET /version`` are
public, and the console's login form (``/console/login``; its static assets are a mount, not a
route). The console (``/console``) takes its session cookie only: without one, whatever bearer
header is sent, a page redirects to the login form and a mutation is a 401.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Iterator

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from jwks_server import serve_jwks

from tenants.tokens import key_id

SCRAPE = "scrape-token-for-auth-tests"
PUBLIC = {("GET", "/health"), ("HEAD", "/health"), ("GET", "/version"), ("HEAD", "/version"),
          ("GET", "/console/login"), ("POST", "/console/login")}


@pytest.fixture(scope="module")
def env(app_env_builder, tmp_path_factory) -> Iterator:
    with app_env_builder(tmp_path_factory.mktemp("auth"), metrics_token=SCRAPE,
                         max_model_len=256, num_gpu_blocks_override=32) as e:
        yield e


def all_routes(app) -> list[tuple[str, str]]:
    """(method, concrete path) for every route and method, path params filled with dummies."""
    out = []
    for route in app.routes:
        # FastAPI >= 0.16x keeps included routers as lazy ``_IncludedRouter`` entries.
        contexts = (route.effective_route_contexts() if hasattr(route, "effective_route_contexts")
                    else [route])
        for ctx in contexts:
            original = getattr(ctx, "original_route", ctx)
            methods = getattr(original, "methods", None)
            if not methods:
                continue
            path = re.sub(r"\{[^}]+\}", "dummy-0", ctx.path)
            out.extend((m, path) for m in sorted(methods))
    assert out, "no routes found: has FastAPI changed how app.routes looks?"
    return out


def call(env, method: str, path: str, headers: dict[str, str]):
    kw = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
    return env.client.request(method, path, headers=headers, follow_redirects=False, **kw)


def assert_refused(r, method: str, path: str) -> None:
    """Refused for lack of credentials: the OpenAI-shaped 401 on the API; on the console, a
    page redirects to the login form and anything else is a 401."""
    where = (method, path, r.status_code, r.text[:300])
    if path.startswith("/console"):
        if method in ("GET", "HEAD"):
            assert r.status_code == 303 and r.headers["location"] == "/console/login", where
        else:
            assert r.status_code == 401 and r.headers["hx-redirect"] == "/console/login", where
        return
    assert r.status_code == 401, where
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "authentication_error"


def b64(obj: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


def admin_claims(**over) -> dict:
    now = int(time.time())
    return {"iss": "saltserve", "aud": "saltserve", "sub": "mallory", "iat": now,
            "exp": now + 600, "role": "admin", **over}


def bad_credentials(env) -> dict[str, dict[str, str]]:
    from tenants.tokens import load_or_create_platform_key

    platform = load_or_create_platform_key(env.data_dir)
    kid = key_id(platform.public_key())
    now = int(time.time())
    other = ed25519.Ed25519PrivateKey.generate()
    revoked, info = env.repo.keys.create(env.tenant_a, name="to-revoke")
    env.repo.keys.revoke(info.id)

    def bearer(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    return {
        "no token": {},
        "empty bearer": {"Authorization": "Bearer "},
        "basic scheme": {"Authorization": "Basic dXNlcjpwYXNz"},
        "malformed": bearer("garbage"),
        "malformed key": bearer("ss-zzzz-not-a-key"),
        "malformed jwt": bearer("a.b.c"),
        "expired jwt": bearer(jwt.encode(admin_claims(iat=now - 7200, exp=now - 3600), platform,
                                         algorithm="EdDSA", headers={"kid": kid})),
        "wrong audience": bearer(jwt.encode(admin_claims(aud="other-service"), platform,
                                            algorithm="EdDSA", headers={"kid": kid})),
        "alg none": bearer(f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64(admin_claims())}."),
        "wrong key": bearer(jwt.encode(admin_claims(), other, algorithm="EdDSA",
                                       headers={"kid": kid})),
        "revoked key": bearer(revoked),
        "unknown tenant jwt": bearer(env.issue("tenant", "0" * 32)),
    }


def test_enumeration_covers_every_router(env):
    routes = all_routes(env.client.app)
    paths = {p for _, p in routes}
    for must in ("/v1/chat/completions", "/v1/completions", "/v1/models",
                 "/v1/models/dummy-0", "/tokenize", "/detokenize", "/version", "/metrics",
                 "/admin/tenants", "/admin/tenants/dummy-0/rotate-salt", "/admin/cache/reset",
                 "/admin/audit", "/admin/usage", "/health", "/console/overview",
                 "/console/tenants/dummy-0/rotate-salt", "/console/audit"):
        assert must in paths, must
    assert "/docs" not in paths and "/redoc" not in paths  # no public schema UIs


def test_only_health_and_version_are_public(env):
    assert env.client.get("/health").status_code == 200
    assert env.client.get("/version").json()["version"] == "0.1.0"
    for method, path in all_routes(env.client.app):
        if (method, path) in PUBLIC:
            continue
        assert_refused(call(env, method, path, {}), method, path)


def test_every_route_rejects_every_bad_credential(env):
    creds = bad_credentials(env)
    secrets = [h["Authorization"].split(" ", 1)[1] for h in creds.values()
               if h.get("Authorization", "").startswith("Bearer ") and len(h["Authorization"]) > 12]
    checked = 0
    for method, path in all_routes(env.client.app):
        if (method, path) in PUBLIC:
            continue
        for name, headers in creds.items():
            r = call(env, method, path, headers)
            assert_refused(r, method, path)
            assert "Traceback" not in r.text
            assert not any(s in r.text for s in secrets), (name, path)  # never echoed
            checked += 1
    assert checked >= 15 * len(creds)


def test_tenant_credentials_get_403_on_admin_routes_and_metrics(env):
    tenant_tokens = {"api key": env.key_a, "tenant jwt": env.issue("tenant", env.tenant_a),
                     "tenant jwt b": env.issue("tenant", env.tenant_b, subject="bob")}
    n = 0
    for method, path in all_routes(env.client.app):
        if not (path.startswith("/admin") or path in ("/metrics", "/openapi.json")):
            continue
        for name, token in tenant_tokens.items():
            r = call(env, method, path, env.headers(token))
            assert r.status_code == 403, (name, method, path, r.status_code, r.text)
            assert r.json()["error"]["type"] == "permission_error"
            assert r.json()["error"]["code"] == "admin_required"
            n += 1
    assert n >= 3 * 12


def test_admin_token_reaches_admin_routes_and_metrics(env):
    h = env.headers(env.admin_token)
    assert env.client.get("/admin/tenants", headers=h).status_code == 200
    assert env.client.get("/metrics", headers=h).status_code == 200
    assert env.client.get("/openapi.json", headers=h).json()["info"]["title"] == "saltserve"
    assert env.client.get("/metrics", headers=env.headers(SCRAPE)).status_code == 200
    # The scrape token is not an admin token.
    assert env.client.get("/admin/tenants", headers=env.headers(SCRAPE)).status_code == 401


def test_two_authorization_headers_are_no_credential(env):
    """Which one would count is ambiguous (and a load balancer may hash the other)."""
    for second in (env.key_a, env.key_b, "garbage"):
        r = env.client.get("/v1/models", headers=[("Authorization", f"Bearer {env.key_a}"),
                                                  ("Authorization", f"Bearer {second}")])
        assert r.status_code == 401, second
    assert env.client.get("/v1/models", headers=env.headers(env.key_a)).status_code == 200


def test_tenant_routes_accept_api_keys_and_tenant_jwts(env):
    for token in (env.key_a, env.issue("tenant", env.tenant_a)):
        r = env.client.get("/v1/models", headers=env.headers(token))
        assert r.status_code == 200, r.text
    # An admin JWT acts as a tenant only when it names one.
    r = env.client.get("/v1/models", headers=env.headers(env.admin_token))
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_required"
    named = env.issue("admin", env.tenant_a, subject="support")
    assert env.client.get("/v1/models", headers=env.headers(named)).status_code == 200
    body = {"model": env.model, "prompt": [500, 501, 502], "max_tokens": 1, "temperature": 0}
    r = env.client.post("/v1/completions", json=body,
                        headers=env.headers(env.issue("tenant", env.tenant_b)))
    assert r.status_code == 200, r.text


def test_disabled_tenant_is_refused_for_keys_and_jwts(env):
    token = env.issue("tenant", env.tenant_b)
    named_admin = env.issue("admin", env.tenant_b, subject="support")
    env.repo.tenants.update(env.tenant_b, disabled=True)
    try:
        for t in (env.key_b, token, named_admin):
            r = env.client.get("/v1/models", headers=env.headers(t))
            assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_disabled"
        # ... but an admin token naming it is still an admin (it can enable the tenant again).
        r = env.client.get(f"/admin/tenants/{env.tenant_b}", headers=env.headers(named_admin))
        assert r.status_code == 200 and r.json()["disabled"] is True
    finally:
        env.repo.tenants.update(env.tenant_b, disabled=False)
    assert env.client.get("/v1/models", headers=env.headers(token)).status_code == 200


def test_refused_admin_calls_never_flood_the_audit_log(env):
    """Unauthenticated refusals: counted, never audit rows. Forbidden ones (a tenant key): one
    aggregated row per actor and minute with the count; never a token in either."""
    refusals = env.parts.admin_refusals
    refusals._now = lambda: 1_800_000_000.0  # one fixed minute
    refusals.flush(env.repo.usage.audit, everything=True)
    before = [a.id for a in env.repo.usage.list_audit(limit=1000)]
    expired = jwt.encode(admin_claims(exp=int(time.time()) - 3600, iat=int(time.time()) - 7200),
                         ed25519.Ed25519PrivateKey.generate(), algorithm="EdDSA")
    for headers in ({}, env.headers(expired), env.headers("x")):
        assert env.client.get("/admin/audit", headers=headers).status_code == 401
    for _ in range(5):
        assert env.client.get("/admin/audit", headers=env.headers(env.key_a)).status_code == 403
    assert [a.id for a in env.repo.usage.list_audit(limit=1000)] == before  # nothing written yet
    refusals._now = lambda: 1_800_000_060.0  # the minute has closed
    assert refusals.flush(env.repo.usage.audit) == 1
    rows = [a for a in env.repo.usage.list_audit(limit=1000) if a.id not in before]
    assert len(rows) == 1 and rows[0].action == "auth.admin_forbidden"
    assert rows[0].actor.startswith("key:") and rows[0].tenant_id is None
    assert rows[0].detail == ("reason=not_admin count=5 minute=2027-01-15T08:00Z "
                              "first=GET /admin/audit")
    assert expired not in rows[0].detail and env.key_a not in rows[0].detail


def test_unauthenticated_refusals_log_at_most_one_line_per_interval(caplog):
    from app.admin_refusals import AdminRefusals

    now = [1000.0]
    counted: list[str] = []
    refusals = AdminRefusals(counted.append, log_interval_s=10.0, now=lambda: now[0])
    with caplog.at_level("WARNING", logger="app.admin_refusals"):
        for i in range(500):
            now[0] = 1000.0 + i * 0.01                      # 500 refusals in 5 s
            refusals.anonymous("bad_jwt" if i % 2 else "malformed")
        now[0] = 1011.0
        refusals.anonymous("expired")
    lines = [r.getMessage() for r in caplog.records if r.name == "app.admin_refusals"]
    assert lines == ["refused 1 unauthenticated /admin request(s) (latest reason: malformed)",
                     "refused 500 unauthenticated /admin request(s) (latest reason: expired)"]
    assert len(counted) == 501 and counted[-1] == "expired"
    assert refusals.flush(lambda *a: None, everything=True) == 0  # none are audit rows


def test_a_revoked_platform_token_is_refused_on_its_next_request(env):
    from tenants.tokens import token_jti

    token = env.issue("tenant", env.tenant_a)
    assert env.client.get("/v1/models", headers=env.headers(token)).status_code == 200
    r = env.client.post("/admin/tokens/revoke", headers=env.headers(env.admin_token),
                        json={"jti": token_jti(token)})
    assert r.status_code == 200 and r.json()["jti"] == token_jti(token)
    r = env.client.get("/v1/models", headers=env.headers(token))
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # Revoked elsewhere (the CLI, another replica): seen on the next request too.
    other = env.issue("admin", None, subject="ops")
    assert env.client.get("/admin/tenants", headers=env.headers(other)).status_code == 200
    env.repo.revocations.revoke(token_jti(other), actor="cli:ops")
    assert env.client.get("/admin/tenants", headers=env.headers(other)).status_code == 401
    for bad in ({"jti": ""}, {"jti": 5}, {"jti": "x" * 65}, {}):
        r = env.client.post("/admin/tokens/revoke", headers=env.headers(env.admin_token),
                            json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "jti", bad
    assert env.client.get("/v1/models", headers=env.headers(env.key_a)).status_code == 200


def test_a_slow_identity_provider_never_slows_api_key_requests(env, request):
    """A flood of JWTs whose kid makes the verifier fetch a slow JWKS (the worst case: no
    refetch cooldown) keeps the JWT threads busy; API-key requests do not wait for them. The
    shared worker-thread pool is cut to 6 so that the flood (10) would exhaust it, were JWTs
    verified there."""
    from concurrent.futures import ThreadPoolExecutor

    import anyio.to_thread

    from tenants.tokens import JWTConfig, JWTVerifier

    def slow_empty_key_set() -> tuple[int, bytes]:
        time.sleep(0.3)
        return 200, json.dumps({"keys": []}).encode()

    url, _ = serve_jwks(request, slow_empty_key_set)
    state = env.parts
    saved = state.jwt_verifier
    state.jwt_verifier = JWTVerifier(JWTConfig(jwks_url=url, jwks_refetch_cooldown_s=0),
                                     saved._platform)
    request.addfinalizer(lambda: setattr(state, "jwt_verifier", saved))
    def set_shared_threads(n: int) -> None:
        anyio.to_thread.current_default_thread_limiter().total_tokens = n

    env.client.portal.call(set_shared_threads, 6)
    request.addfinalizer(lambda: env.client.portal.call(set_shared_threads, 40))
    key = ed25519.Ed25519PrivateKey.generate()
    junk = [jwt.encode(admin_claims(), key, algorithm="EdDSA", headers={"kid": f"junk-{i}"})
            for i in range(10)]
    with ThreadPoolExecutor(10) as pool:
        flood = [pool.submit(env.client.get, "/admin/tenants", headers=env.headers(t))
                 for t in junk]
        time.sleep(0.3)  # the JWT threads are now waiting on the JWKS
        latencies = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert env.client.get("/v1/models", headers=env.headers(env.key_a)).status_code == 200
            latencies.append(time.perf_counter() - t0)
        assert all(f.result().status_code == 401 for f in flood)
    assert max(latencies) < 0.5, latencies
