"""The operator console (``/console``) over the real app: sessions, CSRF, headers, every page and
action, and hostile callers. The browser walk-through is in ``test_console_browser.py``."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.console.sessions import COOKIE, ConsoleSessions
from app.routes.console import AUDIT_ACTIONS, CSP
from tenants.tokens import token_jti

STATIC = Path(__file__).resolve().parents[2] / "app" / "console" / "static"
CHAT = {"max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": "console test " * 40}]}


@pytest.fixture(scope="module")
def env(app_env_builder, tmp_path_factory) -> Iterator:
    with app_env_builder(tmp_path_factory.mktemp("console"), max_model_len=512,
                         num_gpu_blocks_override=64) as e:
        yield e


class Console:
    """The env's client as a console user: logs in, posts forms with the CSRF token."""

    def __init__(self, env) -> None:
        self.env, self.client = env, env.client
        self.csrf = ""

    def login(self, token: str | None = None):
        self.client.cookies.clear()
        page = self.client.get("/console/login")
        login_csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        r = self.client.post("/console/login", data={"token": token or self.env.admin_token,
                                                     "csrf_token": login_csrf},
                             follow_redirects=False)
        if r.status_code == 303:
            self.csrf = self.csrf_of(self.get("/console/overview").text)
        return r

    @staticmethod
    def csrf_of(html: str) -> str:
        return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)

    def get(self, path: str, **kw):
        return self.client.get(path, follow_redirects=False, **kw)

    def post(self, path: str, data: dict | None = None, csrf: bool = True, **kw):
        data = dict(data or {})
        if csrf:
            data["csrf_token"] = self.csrf
        return self.client.post(path, data=data, follow_redirects=False, **kw)

    def follow(self, r):
        """The page a 303 leads to (its one-time messages included)."""
        assert r.status_code == 303, (r.status_code, r.text[:500])
        return self.get(r.headers["location"])


@pytest.fixture
def console(env) -> Iterator[Console]:
    c = Console(env)
    yield c
    env.client.cookies.clear()


def audit_actions(env, actor: str | None = None) -> list[str]:
    rows = env.repo.usage.list_audit(limit=1000)
    return [r.action for r in rows if actor is None or r.actor == actor]


def chart_specs(html: str) -> list[dict]:
    """The chart specs of a page's canvases."""
    return [json.loads(m.group(1)) for m in re.finditer(r"<canvas [^>]*data-chart='([^']*)'",
                                                        html)]


# -- assets and headers -----------------------------------------------------------------------
def test_the_csp_allows_nothing_inline_and_nothing_foreign():
    directives = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
    assert directives["default-src"] == "'none'" and directives["script-src"] == "'self'"
    assert directives["style-src"] == "'self'" and directives["frame-ancestors"] == "'none'"
    assert "unsafe" not in CSP and "*" not in CSP and "http" not in CSP


def test_vendored_assets_match_their_pins_and_keep_their_licences(env):
    manifest = json.loads((STATIC / "vendor" / "VENDOR.json").read_text())
    assert set(manifest["files"]) == {"htmx.min.js", "chart.umd.min.js"}
    for name, pin in manifest["files"].items():
        body = (STATIC / "vendor" / name).read_bytes()
        assert hashlib.sha256(body).hexdigest() == pin["sha256"], name
        assert pin["version"] in body[:400].decode("latin-1") or name == "htmx.min.js"
        licence = (STATIC / "vendor" / pin["license_file"]).read_text()
        assert ("MIT License" in licence) if pin["license"] == "MIT" else ("Zero-Clause BSD"
                                                                           in licence)
        served = env.client.get(f"/console/static/vendor/{name}")
        assert served.status_code == 200 and served.content == body
        assert served.headers["x-content-type-options"] == "nosniff"
    # Only files under static/ are served (the rest is the console's 404, or its login).
    for path in ("/console/static/../sessions.py", "/console/static/%2e%2e/sessions.py",
                 "/console/static/..%2fsessions.py", "/console/static/nothing.js"):
        r = env.client.get(path, follow_redirects=False)
        assert r.status_code in (303, 404) and "ConsoleSessions" not in r.text, path


def test_every_console_page_has_a_strict_csp_and_no_inline_code(env, console):
    console.client.cookies.clear()
    login_page = console.get("/console/login")
    assert console.login().status_code == 303
    tenant = env.tenant_a
    pages = ["/console/overview", "/console/overview/live",
             "/console/tenants", f"/console/tenants/{tenant}",
             f"/console/tenants/{tenant}/rotate-salt", f"/console/tenants/{tenant}/cache/reset",
             "/console/cache/reset", "/console/usage", "/console/audit"]
    errors = [console.get("/console/tenants/nobody"), console.get("/console/no-such-page"),
              console.post("/console/tenants", {"name": "x"}, csrf=False)]
    assert [r.status_code for r in errors] == [404, 404, 403]
    for path, r in [("/console/login", login_page), *((p, console.get(p)) for p in pages),
                    *(("error page", r) for r in errors)]:
        assert r.status_code in (200, 403, 404), (path, r.status_code)
        h = r.headers
        assert h["content-security-policy"] == CSP, path
        assert h["cache-control"] == "no-store" and h["x-frame-options"] == "DENY"
        assert h["referrer-policy"] == "same-origin"
        html = r.text
        # No inline script, no inline style, no inline event handlers: the CSP would refuse them.
        for script in re.findall(r"<script\b[^>]*>", html):
            assert 'src="/console/static/' in script
        assert not re.search(r"\sstyle=|<style\b|\son[a-z]+=|hx-headers|hx-on", html), path
        # Every control has a label (accessible name).
        for m in re.finditer(r"<(input|select|textarea)\b([^>]*)>", html):
            attrs = m.group(2)
            if 'type="hidden"' in attrs:
                continue
            control_id = re.search(r'id="([^"]+)"', attrs)
            assert control_id and f'for="{control_id.group(1)}"' in html, (path, m.group(0))
        for m in re.finditer(r"<button\b([^>]*)>(.*?)</button>", html, re.DOTALL):
            assert m.group(2).strip() or "aria-label" in m.group(1), (path, m.group(0))


# -- login, sessions and logout ---------------------------------------------------------------
def test_login_opens_a_short_httponly_strict_session_and_is_audited(env, console):
    r = console.login()
    assert r.status_code == 303 and r.headers["location"] == "/console/overview"
    cookie = next(c for c in r.headers.get_list("set-cookie") if c.startswith(COOKIE + "="))
    attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
    assert {"httponly", "path"} <= attrs and "samesite=strict" in cookie.lower()
    assert "Path=/console" in cookie and "max-age" not in attrs  # a browser-session cookie
    session_id = cookie.split(";")[0].split("=", 1)[1]
    assert env.admin_token not in cookie and len(session_id) >= 40
    overview = console.get("/console/overview")
    assert overview.status_code == 200 and "test-admin" in overview.text
    assert "console.login" in audit_actions(env, "test-admin")
    # The session id is the only credential: a bearer header without it is not one.
    console.client.cookies.clear()
    r = console.get("/console/overview", headers=env.headers(env.admin_token))
    assert r.status_code == 303 and r.headers["location"] == "/console/login"


def test_the_cookies_are_secure_over_https(env, console):
    console.client.cookies.clear()
    page = console.client.get("https://testserver/console/login")
    login_cookie = page.headers["set-cookie"]
    assert login_cookie.startswith("saltserve_console_login=") and "Secure" in login_cookie
    r = console.client.post("https://testserver/console/login",
                            data={"token": env.admin_token,
                                  "csrf_token": Console.csrf_of(page.text)},
                            follow_redirects=False)
    assert r.status_code == 303
    session_cookie = next(c for c in r.headers.get_list("set-cookie")
                          if c.startswith(COOKIE + "="))
    assert "Secure" in session_cookie and "HttpOnly" in session_cookie
    plain = console.login()  # over http (no TLS, no SALTSERVE_CONSOLE_SECURE_COOKIE): not
    assert "Secure" not in plain.headers["set-cookie"]  # Secure, or the browser would drop it


def test_sessions_cannot_be_fixed_and_a_new_login_replaces_the_old(env, console):
    console.client.cookies.clear()
    console.client.cookies.set(COOKIE, "chosen-by-an-attacker", path="/console")
    r = console.get("/console/overview")
    assert r.status_code == 303
    assert f'{COOKIE}=""' in r.headers["set-cookie"]  # the stale cookie is cleared
    console.client.cookies.set(COOKIE, "chosen-by-an-attacker", path="/console")
    assert console.login().status_code == 303
    first = console.client.cookies.get(COOKIE)
    assert first != "chosen-by-an-attacker"
    # Logging in again from a login form loaded earlier (another tab) ends the first session.
    console.client.cookies.clear()
    form = console.get("/console/login")
    console.client.cookies.set(COOKIE, first, path="/console")
    r = console.client.post("/console/login", data={"token": env.admin_token,
                                                    "csrf_token": Console.csrf_of(form.text)},
                            follow_redirects=False)
    assert r.status_code == 303
    second = r.cookies.get(COOKIE)
    assert second and second != first
    console.client.cookies.clear()
    console.client.cookies.set(COOKIE, first, path="/console")
    assert console.get("/console/overview").status_code == 303  # the first one ended
    # Dependencies add no query parameters a caller could play with.
    assert console.login().status_code == 303
    assert console.get("/console/tenants?touch=false").status_code == 200
    assert console.get("/console/login?logged_out=yes").status_code == 303  # logged in


def test_tenant_credentials_and_bad_tokens_are_refused_at_login(env, console):
    before = len(env.repo.usage.list_audit(limit=10_000))
    cases = {"api key": (env.key_a, 403, "API key"),
             "tenant jwt": (env.issue("tenant", env.tenant_a), 403, "tenant token"),
             "garbage": ("a.b.c", 401, "Invalid"),
             "too long": ("x" * 20_000, 400, "too long"),
             "expired": (env.issue("admin", ttl_s=10, now=int(time.time()) - 60), 401,
                         "Invalid")}
    revoked = env.issue("admin", subject="ex-admin")
    env.client.post("/admin/tokens/revoke", headers=env.headers(env.admin_token),
                    json={"jti": token_jti(revoked)})
    cases["revoked"] = (revoked, 401, "Invalid")
    for name, (token, status, text) in cases.items():
        r = console.login(token)
        assert r.status_code == status, (name, r.status_code)
        assert text in r.text, name
        assert COOKIE + "=" not in r.headers.get("set-cookie", ""), name
        assert token not in r.text  # never echoed
        assert console.get("/console/overview").status_code == 303, name
    # Refused logins never write an audit row each (no flooding): only the revocation above.
    rows = env.repo.usage.list_audit(limit=10_000)
    assert [r.action for r in rows[: len(rows) - before]] == ["token.revoke"]


def test_login_needs_its_own_csrf_token(env, console):
    console.client.cookies.clear()
    console.client.get("/console/login")
    r = console.client.post("/console/login", data={"token": env.admin_token,
                                                      "csrf_token": "forged"},
                            follow_redirects=False)
    assert r.status_code == 403 and COOKIE + "=" not in r.headers.get("set-cookie", "")
    # Another site posting a stolen-looking form: refused on origin, even with the token.
    page = console.client.get("/console/login")
    r = console.client.post("/console/login", headers={"Origin": "http://evil.example"},
                            data={"token": env.admin_token,
                                  "csrf_token": Console.csrf_of(page.text)},
                            follow_redirects=False)
    assert r.status_code == 403


def test_logout_ends_the_session_and_needs_csrf(env, console):
    assert console.login().status_code == 303
    session_id = console.client.cookies.get(COOKIE)
    assert console.post("/console/logout", csrf=False).status_code == 403
    assert console.get("/console/overview").status_code == 200  # still logged in
    r = console.post("/console/logout")
    assert r.status_code == 303 and r.headers["location"] == "/console/login?logged_out=1"
    assert "You are logged out" in console.follow(r).text
    assert "console.logout" in audit_actions(env, "test-admin")
    # Replaying the old cookie does not bring the session back.
    console.client.cookies.set(COOKIE, session_id, path="/console")
    assert console.get("/console/overview").status_code == 303


def test_revoking_the_admin_token_ends_its_console_sessions(env, console):
    token = env.issue("admin", subject="soon-revoked")
    assert console.login(token).status_code == 303
    assert console.get("/console/tenants").status_code == 200
    env.repo.revocations.revoke(token_jti(token))
    r = console.post("/console/tenants", {"name": "after-revocation"})
    assert r.status_code == 401 and r.headers["hx-redirect"] == "/console/login"
    assert "after-revocation" not in {t.name for t in env.repo.tenants.list_all()}
    assert console.get("/console/tenants").status_code == 303
    assert console.login(token).status_code == 401


def test_the_overview_refresh_does_not_keep_an_idle_session_alive(env, console):
    app = env.client.app
    now = [1000.0]
    real, app.state.parts.console_sessions = app.state.parts.console_sessions, ConsoleSessions(
        idle_s=60, max_age_s=600, now=lambda: now[0])
    try:
        assert console.login().status_code == 303
        for _ in range(2):  # the page polls every few seconds; the operator is away
            now[0] += 25
            assert console.get("/console/overview/live").status_code == 200
        now[0] += 25  # 75 s since the operator's last own request
        r = console.get("/console/overview/live", headers={"HX-Request": "true"})
        assert r.status_code == 401 and r.headers["hx-redirect"] == "/console/login"
        assert console.get("/console/overview").status_code == 303
        # The operator's own requests do keep it alive.
        assert console.login().status_code == 303
        for _ in range(3):
            now[0] += 25
            assert console.get("/console/tenants").status_code == 200
    finally:
        app.state.parts.console_sessions = real


def test_sessions_end_when_idle_after_max_age_and_at_the_jwt_exp():
    now = [1000.0]
    s = ConsoleSessions(idle_s=60, max_age_s=300, max_sessions=2, now=lambda: now[0])
    sid, session = s.create("ops", "jti-1", token_expires_at=None)
    now[0] += 59
    assert s.get(sid, touch=False) is session  # a page's own refresh: the clock runs on
    now[0] += 1
    assert s.get(sid) is None
    sid, session = s.create("ops", "jti-1", token_expires_at=None)
    now[0] += 59
    assert s.get(sid) is session  # the idle clock restarts on each request
    now[0] += 59
    assert s.get(sid) is session
    now[0] += 60
    assert s.get(sid) is None and len(s) == 0  # idle for 60 s
    sid, _ = s.create("ops", None, token_expires_at=None)
    for _ in range(5):
        now[0] += 50
        assert s.get(sid) is not None
    now[0] += 50
    assert s.get(sid) is None  # 300 s after login, however busy
    sid, _ = s.create("ops", None, token_expires_at=now[0] + 30)
    now[0] += 30
    assert s.get(sid) is None  # the JWT's own exp comes first
    # Bounded: the oldest session goes first; ids are not stored, only their digests.
    ids = [s.create(f"u{i}", None, None)[0] for i in range(3)]
    assert s.get(ids[0]) is None and s.get(ids[2]) is not None and len(s) == 2
    assert not any(i in repr(s._sessions) for i in ids)
    with pytest.raises(ValueError):
        ConsoleSessions(idle_s=600, max_age_s=60)


# -- CSRF on every mutation -------------------------------------------------------------------
def test_mutations_without_the_csrf_token_or_from_another_origin_change_nothing(env, console):
    assert console.login().status_code == 303
    tenants_before = env.repo.tenants.list_all()
    salt = env.repo.tenants.get(env.tenant_a).current_salt_version
    key = env.repo.keys.list_for_tenant(env.tenant_a)[0]
    other = Console(env)  # another operator's session: its token is not this one's
    attempts = [("/console/tenants", {"name": "csrf-victim"}),
                (f"/console/keys/{key.id}/revoke", {}),
                ("/console/logout", {}),
                (f"/console/tenants/{env.tenant_a}/rotate-salt", {}),
                (f"/console/tenants/{env.tenant_a}/update", {"disabled": "true"}),
                (f"/console/tenants/{env.tenant_a}/keys", {"name": "stolen"}),
                (f"/console/tenants/{env.tenant_a}/cache/reset", {}),
                ("/console/cache/reset", {})]
    for path, data in attempts:
        assert console.post(path, data, csrf=False).status_code == 403, path
        assert console.post(path, {**data, "csrf_token": "wrong"}, csrf=False
                            ).status_code == 403, path
        for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                        {"Origin": "null"}, {"Sec-Fetch-Site": "same-site"},
                        {"Origin": "http://testserver.evil.example"}):
            r = console.post(path, data, headers=headers)
            assert r.status_code == 403, (path, headers)
            assert "CSRF" in r.text
    assert env.repo.tenants.list_all() == tenants_before
    assert env.repo.tenants.get(env.tenant_a).current_salt_version == salt
    assert len(env.repo.keys.list_for_tenant(env.tenant_a)) == 1
    assert env.repo.keys.list_for_tenant(env.tenant_a)[0].revoked_at is None
    assert console.get("/console/overview").status_code == 200  # not logged out
    session_id = console.client.cookies.get(COOKIE)
    other.login(env.issue("admin", subject="other-admin"))
    stolen = other.csrf
    console.client.cookies.clear()
    console.client.cookies.set(COOKIE, session_id, path="/console")
    assert console.post("/console/tenants", {"name": "x", "csrf_token": stolen}, csrf=False
                        ).status_code == 403
    # The token as htmx sends it (a header) works, and so does this origin.
    r = console.post("/console/tenants", {"name": "via-header"}, csrf=False,
                     headers={"X-CSRF-Token": console.csrf, "Origin": "http://testserver",
                              "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 303 and env.repo.tenants.resolve("via-header")


# -- pages and actions ------------------------------------------------------------------------
def test_tenant_lifecycle_through_the_console(env, console):
    assert console.login().status_code == 303
    page = console.follow(console.post("/console/tenants", {"name": "acme",
                                                            "enable_prefix_caching": "on"}))
    acme = env.repo.tenants.resolve("acme")
    assert acme.enable_prefix_caching and f"Tenant {acme.id}" not in page.text
    assert "Tenant acme created" in page.text and acme.id in page.text
    # A taken name: an error message, nothing created.
    page = console.follow(console.post("/console/tenants", {"name": "ACME"}))
    assert "already exists" in page.text and len(env.repo.tenants.list_all()) >= 3
    # Limits and weight; a bad value changes nothing and says why.
    page = console.follow(console.post(f"/console/tenants/{acme.id}/update",
                                       {"weight": "3", "rpm_limit": "120", "tpm_limit": "",
                                        "max_concurrent": "4"}))
    t = env.repo.tenants.get(acme.id)
    assert (t.weight, t.rpm_limit, t.tpm_limit, t.max_concurrent) == (3, 120, None, 4)
    assert "Tenant acme saved" in page.text
    for bad in ({"rpm_limit": "-1"}, {"weight": ""}, {"weight": "1e3"}, {"disabled": "maybe"},
                {"weight": "5000"}, {"min_cache_blocks": "9", "max_cache_blocks": "2"}):
        page = console.follow(console.post(f"/console/tenants/{acme.id}/update", bad))
        assert "flash-error" in page.text, bad
        assert env.repo.tenants.get(acme.id) == t, bad
    # Disable and enable from the list; caching off and on.
    r = console.post(f"/console/tenants/{acme.id}/update", {"disabled": "true", "back": "list"})
    assert r.headers["location"] == "/console/tenants"
    assert env.repo.tenants.get(acme.id).disabled
    console.post(f"/console/tenants/{acme.id}/update", {"disabled": "false"})
    console.post(f"/console/tenants/{acme.id}/update", {"enable_prefix_caching": "false"})
    assert not env.repo.tenants.get(acme.id).enable_prefix_caching
    console.post(f"/console/tenants/{acme.id}/update", {"enable_prefix_caching": "true"})
    t = env.repo.tenants.get(acme.id)
    assert not t.disabled and t.enable_prefix_caching
    # By name too; an unknown tenant is a 404 page, never an empty one.
    assert console.get("/console/tenants/acme").status_code == 200
    missing = console.get("/console/tenants/nobody")
    assert missing.status_code == 404 and "No such tenant" in missing.text
    page = console.follow(console.post("/console/tenants/nobody/rotate-salt"))
    assert "tenant not found" in page.text
    actions = audit_actions(env, "test-admin")
    assert actions.count("tenant.update") >= 5 and "tenant.create" in actions


def test_a_new_key_is_shown_once_and_works_and_revoking_it_stops_it(env, console):
    assert console.login().status_code == 303
    r = console.post(f"/console/tenants/{env.tenant_b}/keys", {"name": "ci",
                                                               "expires_in_days": "30"})
    assert r.status_code == 201
    key = re.search(r'id="new-key-value" readonly value="([^"]+)"', r.text).group(1)
    assert key.startswith("ss-") and "shown this once" in r.text
    info = next(k for k in env.repo.keys.list_for_tenant(env.tenant_b) if k.name == "ci")
    assert info.expires_at is not None
    ok = env.client.post("/v1/chat/completions", headers=env.headers(key),
                         json={**CHAT, "model": env.model})
    assert ok.status_code == 200
    page = console.get(f"/console/tenants/{env.tenant_b}")
    assert key not in page.text and info.last4 in page.text  # never shown again
    keys_before = len(env.repo.keys.list_for_tenant(env.tenant_b))
    for form, message in (({"expires_in_days": "-3"}, "expires in days"),
                          ({"expires_in_days": "1" * 5000}, "expires in days"),
                          ({"name": "k" * 1000}, "key name must be at most 255"),
                          ({"name": "nul\x00byte"}, "printable")):
        bad = console.follow(console.post(f"/console/tenants/{env.tenant_b}/keys", form))
        assert message in bad.text, form
    assert len(env.repo.keys.list_for_tenant(env.tenant_b)) == keys_before
    page = console.follow(console.post(f"/console/keys/{info.id}/revoke"))
    assert "revoked" in page.text
    refused = env.client.post("/v1/chat/completions", headers=env.headers(key),
                              json={**CHAT, "model": env.model})
    assert refused.status_code == 401
    page = console.follow(console.post("/console/keys/nokey/revoke"))
    assert "API key not found" in page.text


def test_rotation_and_reset_confirm_what_they_drop_then_do_it(env, console):
    assert console.login().status_code == 303
    h = env.headers(env.key_a)
    body = {**CHAT, "model": env.model,
            "messages": [{"role": "user", "content": "rotate me " * 60}]}
    env.client.post("/v1/chat/completions", headers=h, json=body)
    again = env.client.post("/v1/chat/completions", headers=h, json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    confirm = console.get(f"/console/tenants/{env.tenant_a}/rotate-salt")
    blocks = int(re.search(r"(\d+) cached blocks of tenant-a are dropped", confirm.text)
                 .group(1))
    assert blocks > 0
    version = env.repo.tenants.get(env.tenant_a).current_salt_version
    assert f"from version {version} to {version + 1}" in confirm.text  # shown, not done
    page = console.follow(console.post(f"/console/tenants/{env.tenant_a}/rotate-salt"))
    assert f"Salt rotated to version {version + 1}: {blocks} cached blocks dropped" in page.text
    miss = env.client.post("/v1/chat/completions", headers=h, json=body).json()
    assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    hit = env.client.post("/v1/chat/completions", headers=h, json=body).json()
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # warms up again
    confirm = console.get(f"/console/tenants/{env.tenant_a}/cache/reset")
    blocks = int(re.search(r"(\d+) cached blocks of tenant-a are dropped", confirm.text)
                 .group(1))
    assert blocks > 0
    page = console.follow(console.post(f"/console/tenants/{env.tenant_a}/cache/reset"))
    assert f"Prefix cache reset: {blocks} cached blocks dropped" in page.text
    miss = env.client.post("/v1/chat/completions", headers=h, json=body).json()
    assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Tenant B's cache was untouched by A's rotation and reset ... and B's repeat hits.
    b_body = {**body, "messages": [{"role": "user", "content": "tenant b " * 60}]}
    env.client.post("/v1/chat/completions", headers=env.headers(env.key_b), json=b_body)
    console.follow(console.post(f"/console/tenants/{env.tenant_a}/cache/reset"))
    b = env.client.post("/v1/chat/completions", headers=env.headers(env.key_b), json=b_body)
    assert b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    page = console.follow(console.post("/console/cache/reset"))
    assert "The prefix cache of every tenant was reset" in page.text
    actions = audit_actions(env, "test-admin")
    assert {"tenant.rotate_salt", "cache.reset", "cache.reset_all"} <= set(actions)


def test_overview_and_usage_show_the_numbers_and_charts(env, console):
    assert console.login().status_code == 303
    h = env.headers(env.key_b)
    body = {**CHAT, "model": env.model,
            "messages": [{"role": "user", "content": "usage page " * 60}]}
    for _ in range(2):
        assert env.client.post("/v1/chat/completions", headers=h, json=body).status_code == 200
    assert env.parts.journal.wait_stored()
    overview = console.get("/console/overview").text
    charts = {c["id"]: c for c in chart_specs(overview)}
    assert set(charts) == {"chart-pool", "chart-resident", "chart-hit-rate", "chart-evictions"}
    pool = charts["chart-pool"]["datasets"][0]["data"]
    assert sum(pool[:2]) == 64  # free + in use = the pool
    hit_rate = charts["chart-hit-rate"]
    b_rate = hit_rate["datasets"][0]["data"][hit_rate["labels"].index("tenant-b")]
    assert 0 < b_rate <= 100
    live = console.get("/console/overview/live")
    assert "<html" not in live.text and "tenant-b" in live.text  # a fragment
    usage = console.get("/console/usage?tenant=tenant-b&range=1h").text
    charts = {c["id"]: c for c in chart_specs(usage)}
    assert len(charts["chart-requests"]["labels"]) in (60, 61)  # every minute of the hour
    requests = charts["chart-requests"]["datasets"]
    assert [d["label"] for d in requests] == ["tenant-b"]
    assert sum(requests[0]["data"]) >= 2
    cached = sum(charts["chart-cached"]["datasets"][0]["data"])
    assert cached > 0
    csv = console.get("/console/usage.csv?tenant=tenant-b&range=1h&bucket=1m")
    assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
    lines = csv.text.strip().splitlines()
    assert lines[0].startswith("bucket_start,tenant_id,tenant_name")
    assert sum(int(x.split(",")[6]) for x in lines[1:]) == sum(requests[0]["data"])
    # A bad filter is a message, not an error page; unknown tenants are named.
    bad = console.get("/console/usage?tenant=nobody")
    assert bad.status_code == 200 and "tenant not found" in bad.text
    odd = console.get("/console/usage?range=forever&bucket=1y").text
    assert "<option selected>24h</option>" in odd and "<option selected>1h</option>" in odd
    csv_bad = console.follow(console.get("/console/usage.csv?tenant=nobody"))
    assert csv_bad.text.count("tenant not found") == 1


def test_the_audit_filter_lists_every_action_the_code_writes():
    """``AUDIT_ACTIONS`` is a hand-kept list: every action string passed to an audit call in
    app/ and tenants/ must be in it (a new action without a filter entry fails here)."""
    call = re.compile(r'(?:add_audit\(\s*[^,()]+,\s*[^,()]+,|\baudit\(\s*[^,()]+(?:\([^)]*\))?,'
                      r'|\.audit,\s*[^,()]+,)\s*"([a-z_]+\.[a-z_]+)"')
    root = STATIC.parents[2]
    written = {m.group(1) for d in ("app", "tenants") for p in (root / d).rglob("*.py")
               for m in call.finditer(p.read_text())}
    assert {"cache.reset", "console.login", "api_key.create", "auth.admin_forbidden"} <= written
    assert written <= set(AUDIT_ACTIONS), written - set(AUDIT_ACTIONS)


def test_audit_page_filters_and_pages(env, console):
    assert console.login().status_code == 303
    for i in range(3):
        console.post("/console/tenants", {"name": f"audit-{i}"})
    page = console.get("/console/audit?action=tenant.create&actor=test-admin").text
    rows = re.findall(r'<th scope="row">([a-z_.]+)</th>', page)
    assert rows and set(rows) == {"tenant.create"}
    page = console.get("/console/audit?tenant=audit-1").text
    assert re.findall(r'<th scope="row">([a-z_.]+)</th>', page) == ["tenant.create"]
    # Pagination: 50 a page, then "Older entries" with a cursor.
    for i in range(55):
        env.repo.usage.audit("bulk", "tenant.update", env.tenant_b, f"n={i}")
    first = console.get("/console/audit?actor=bulk").text
    assert first.count('<th scope="row">tenant.update</th>') == 50
    older = re.search(r'href="([^"]+)" rel="next"', first).group(1).replace("&amp;", "&")
    assert "cursor=" in older and "actor=bulk" in older
    second = console.get(older).text
    assert second.count('<th scope="row">tenant.update</th>') == 5
    assert 'rel="next"' not in second and "Newest" in second
    bad = console.get("/console/audit?since=yesterday")
    assert bad.status_code == 200 and "times look like" in bad.text
    bad = console.get("/console/audit?cursor=abc")
    assert "cursor must be a next_cursor value" in bad.text
    long_name = "L" * 64
    console.post("/console/tenants", {"name": long_name})
    too_long = console.get("/console/audit?tenant=" + long_name * 5).text
    assert "tenant is longer than any tenant" in too_long
    assert 'scope="row">tenant.create' not in too_long  # no other tenant's rows instead
    # A time with an offset means that instant (not the same wall-clock time in UTC).
    from datetime import UTC, datetime, timedelta, timezone

    plus5 = timezone(timedelta(hours=5))
    since = (datetime.now(UTC) - timedelta(minutes=5)).astimezone(plus5)
    page = console.get("/console/audit", params={"actor": "bulk",
                                                 "since": since.isoformat(timespec="minutes")})
    assert page.text.count('<th scope="row">tenant.update</th>') == 50


# -- hostile input ----------------------------------------------------------------------------
def test_hostile_names_are_escaped_and_huge_forms_refused(env, console):
    assert console.login().status_code == 303
    evil = '<script>alert(1)</script>"><img src=x onerror=alert(2)>\'</canvas>'
    console.post("/console/tenants", {"name": evil, "enable_prefix_caching": "on"})
    tenant = env.repo.tenants.resolve(evil)
    key, _ = env.repo.keys.create(tenant.id)
    r = env.client.post("/v1/chat/completions", headers=env.headers(key),
                        json={**CHAT, "model": env.model})
    assert r.status_code == 200, r.text
    assert env.parts.journal.wait_stored()
    for path in ("/console/tenants", f"/console/tenants/{tenant.id}", "/console/audit",
                 "/console/overview", f"/console/usage?tenant={tenant.id}&range=1h"):
        html = console.get(path).text
        assert "<script>alert" not in html and "<img src=x" not in html, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html, path
        # The name in the charts' single-quoted attributes comes back whole, as data.
        labels = [label for spec in chart_specs(html) for label in
                  spec["labels"] + [d["label"] for d in spec["datasets"]]]
        if path.startswith(("/console/overview", "/console/usage")):
            assert any(evil in label for label in labels), path
    r = console.client.post("/console/tenants", content=f"name=%FF%FE&csrf_token={console.csrf}",
                            headers={"Content-Type": "application/x-www-form-urlencoded"},
                            follow_redirects=False)
    assert r.status_code == 400 and "not valid UTF-8" in r.text
    assert not [t for t in env.repo.tenants.list_all() if "\ufffd" in t.name]
    r = console.post("/console/tenants", {"name": "x" * (5 << 20)})
    assert r.status_code == 413
    # Another tenant's traffic is served meanwhile, unharmed.
    ok = env.client.post("/v1/chat/completions", headers=env.headers(env.key_b),
                         json={**CHAT, "model": env.model})
    assert ok.status_code == 200
    free, total, busy = env.engine_state()
    assert not busy and free == total  # no leaked block


def test_the_overview_lists_each_offload_tier(env, console, monkeypatch):
    """With offload tiers (the fake model has none: its stats get one here), the overview
    shows each tier's occupancy and traffic, and a tier that is down says so."""
    from app.services.admin import AdminService

    real = AdminService.cache_stats

    async def with_tiers(self):
        stats = await real(self)
        tier = {"name": "disk", "up": True, "capacity_bytes": 256 << 20,
                "used_bytes": 3 << 20, "blobs": 4, "unclaimed_bytes": 0, "evicted_blobs": 2,
                "written_blocks": 6, "written_bytes": 6 << 20, "write_failed": 0,
                "loaded_blocks": 5, "loaded_bytes": 5 << 20, "load_failed": 1}
        return {**stats, "tiers": [tier, {**tier, "name": "redis", "up": False}]}

    monkeypatch.setattr(AdminService, "cache_stats", with_tiers)
    assert console.login().status_code == 303
    live = console.get("/console/overview/live").text
    table = live[live.index('id="offload-tiers"'):live.index("</table>", live.index(
        'id="offload-tiers"'))]
    assert "disk</th>" in table and "3.0 MiB" in table and "256 MiB" in table
    assert "redis (unreachable)</th>" in table
