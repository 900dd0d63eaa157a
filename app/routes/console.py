"""``/console``: the operator console, server-rendered (Jinja2) with htmx and Chart.js.

Log in by pasting an admin JWT: it is verified as on ``/admin`` (tenant credentials are
refused) and becomes a short server-side session (``app.console.sessions``) behind an HttpOnly,
SameSite=Strict cookie; bearer headers are ignored here. Every mutation is a POST that must
carry the session's CSRF token and come from this origin; every page is sent with a strict
Content-Security-Policy (scripts and styles only from ``/console/static``, no inline code, no
eval). The actions are ``app.services.admin.AdminService``'s, audited with the JWT ``sub``.

Pages: overview (pool and per-tenant cache charts, refreshed live), tenants, tenant detail
(keys, salt rotation, cache reset), usage (charts and CSV) and the audit log. Mutations answer
303 back to a page (post/redirect/get) with the outcome as a one-time message; the one
exception is a new API key, shown once in the response that created it.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlencode, urlsplit

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.auth import principal_for_token, record_forbidden
from app.console import views
from app.console.sessions import COOKIE, LOGIN_COOKIE, ConsoleSession, ConsoleSessions
from app.deps import get_parts
from app.errors import client_error
from app.services.admin import (
    NULLABLE_LIMITS,
    RETENTION_SETTINGS,
    AdminService,
    usage_report,
)
from tenants.api_keys import looks_like_api_key
from tenants.errors import InvalidToken, TenantDisabled, TenantNotFound
from tenants.records import TenantInfo
from tenants.tenant_store import MAX_TENANT_NAME_CHARS
from tenants.usage_reports import BUCKETS, REPORT_COLUMNS, csv_text, report_dicts

logger = logging.getLogger(__name__)

CONSOLE_DIR = Path(__file__).resolve().parent.parent / "console"
PREFIX = "/console"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
# Every action the stores and the console write, for the audit page's filter.
AUDIT_ACTIONS = ("tenant.create", "tenant.update", "tenant.rotate_salt", "api_key.create",
                 "api_key.revoke", "cache.reset", "cache.reset_all", "token.issue",
                 "token.revoke", "master_key.rotate", "auth.admin_forbidden", "console.login",
                 "console.logout")
AUDIT_PAGE_ROWS = 50
USAGE_TABLE_ROWS = 500
MAX_TOKEN_CHARS = 16_384  # a pasted JWT longer than this is refused unread

router = APIRouter(prefix=PREFIX, include_in_schema=False)
templates = Jinja2Templates(directory=CONSOLE_DIR / "templates")
templates.env.filters["tenant_label"] = views.tenant_label


class LoginRequired(Exception):
    """No live console session (none, idle, expired, logged out, or its JWT revoked)."""


class CsrfRefused(Exception):
    """A mutation without this session's CSRF token, or from another origin."""


# -- sessions, CSRF and headers ---------------------------------------------------------------
def _sessions(request: Request) -> ConsoleSessions:
    return get_parts(request).console_sessions


def _admin(request: Request) -> AdminService:
    return get_parts(request).admin


async def _live_session(request: Request, touch: bool) -> ConsoleSession:
    """The caller's live session (cookie only: a bearer header is no console credential);
    ``touch`` restarts its idle clock.

    Raises:
        LoginRequired: no live session, or the JWT it was opened with has been revoked since
            (the session ends).
    """
    sessions = _sessions(request)
    session_id = request.cookies.get(COOKIE)
    session = sessions.get(session_id, touch)
    if session is None:
        raise LoginRequired
    if session.jti is not None and await run_in_threadpool(
            get_parts(request).repo.revocations.is_revoked, session.jti):
        sessions.end(session_id)
        raise LoginRequired
    return session


async def console_session(request: Request) -> ConsoleSession:
    """The operator's live session (``_live_session``; the request counts as activity)."""
    return await _live_session(request, touch=True)


def _same_origin(request: Request) -> bool:
    """False when the browser says the request came from another site (``Sec-Fetch-Site``)
    or another origin (``Origin`` whose host differs from ``Host``)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return True
    return urlsplit(origin).netloc.lower() == request.headers.get("host", "").lower()


async def console_mutation(request: Request,
                           session: Annotated[ConsoleSession, Depends(console_session)]
                           ) -> ConsoleSession:
    """A live session whose request carries its CSRF token (``X-CSRF-Token`` header, as htmx
    sends it, or the ``csrf_token`` form field) from this origin.

    Raises:
        LoginRequired: no live session. CsrfRefused: no or wrong token, or a cross-site request.
    """
    presented = request.headers.get("x-csrf-token")  # scripts; the pages send the field
    if presented is None:
        presented = (await read_form(request)).get("csrf_token")
    if not _same_origin(request) or not session.csrf_ok(
            presented if isinstance(presented, str) else None):
        raise CsrfRefused
    return session


class BadForm(Exception):
    """A form that is not valid UTF-8 text (refused, never stored with replacement
    characters)."""


async def read_form(request: Request) -> FormData:
    """The request's form (url-encoded; parsed once per request).

    Raises:
        BadForm: a value was not valid UTF-8 (the parser replaced it with U+FFFD) or a field
            is a file upload.
    """
    form = await request.form()
    for value in form.values():
        if not isinstance(value, str) or "\ufffd" in value:
            raise BadForm
    return form


async def polling_session(request: Request) -> ConsoleSession:
    """The session of a page's automatic refresh: it does not count as the operator's activity
    (an overview left open still logs out after the idle time)."""
    return await _live_session(request, touch=False)


Session = Annotated[ConsoleSession, Depends(console_session)]
Polling = Annotated[ConsoleSession, Depends(polling_session)]
Mutation = Annotated[ConsoleSession, Depends(console_mutation)]


class ConsoleHeaders:
    """Security headers on every ``/console`` response: the CSP, no sniffing, no framing, no
    referrer to other sites; pages (not the static assets) are never cached."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == PREFIX or path.startswith(PREFIX + "/")):
            return await self.app(scope, receive, send)
        static = path.startswith(PREFIX + "/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers") or []
                           if k.lower() != b"cache-control" or static]
                headers += [(b"content-security-policy", CSP.encode()),
                            (b"x-content-type-options", b"nosniff"),
                            (b"x-frame-options", b"DENY"),
                            # not no-referrer: under it a browser sends ``Origin: null`` on
                            # form posts, which the origin check refuses
                            (b"referrer-policy", b"same-origin"),
                            (b"cross-origin-opener-policy", b"same-origin")]
                if not static:
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _secure(request: Request) -> bool:
    return _sessions(request).secure_cookie or request.url.scheme == "https"


def _render(request: Request, template: str, status: int = 200,
            session: ConsoleSession | None = None, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(
        request, template, {"session": session, "flashes": session.take_flashes()
                            if session is not None else [], "prefix": PREFIX, **context},
        status_code=status)


def _redirect(path: str) -> RedirectResponse:
    return RedirectResponse(PREFIX + path, status_code=303)


def _tenant_path(tenant: str, rest: str = "") -> str:
    """``/tenants/<tenant><rest>``, the tenant (a path parameter: any text) escaped."""
    return f"/tenants/{quote(tenant, safe='')}{rest}"


def install(app: FastAPI) -> None:
    """Adds the console to ``app``: routes, static assets, headers and its error pages (its
    sessions are ``ServerParts.console_sessions``)."""
    # The assets first: the router ends with a catch-all 404 page for /console/*.
    app.mount(PREFIX + "/static", StaticFiles(directory=CONSOLE_DIR / "static"),
              name="console-static")
    app.include_router(router)
    app.add_middleware(ConsoleHeaders)

    @app.exception_handler(LoginRequired)
    async def _login_required(request: Request, _: LoginRequired) -> Response:
        if request.method in ("GET", "HEAD") and "hx-request" not in request.headers:
        # htmx (a boosted link or form, the overview's refresh) follows HX-Redirect to the
        # login page; a plain form post gets a page that says what happened.
            response: Response = _redirect("/login")
        else:
            response = _render(request, "message.html", 401, title="Logged out",
                               message="Your console session has ended. Log in again.")
            response.headers["HX-Redirect"] = PREFIX + "/login"
        if COOKIE in request.cookies:  # a stale session cookie: the browser drops it
            response.delete_cookie(COOKIE, path=PREFIX)
        return response

    @app.exception_handler(BadForm)
    async def _bad_form(request: Request, _: BadForm) -> Response:
        return _render(request, "message.html", 400, title="Refused",
                       message="The form was not valid UTF-8 text; nothing was changed.")

    @app.exception_handler(CsrfRefused)
    async def _csrf_refused(request: Request, _: CsrfRefused) -> Response:
        logger.warning("refused a console %s without a valid CSRF token or from another "
                       "origin", request.method)
        return _render(request, "message.html", 403, title="Refused",
                       message="This request did not come from a console page of this "
                               "server (CSRF check failed). Reload the page and try again.")


async def _attempt(session: ConsoleSession, action: Any) -> Any:
    """Awaits an admin action; a client error (404, 409, 400, 503, ...) becomes an error
    message on the next page and None. Anything else propagates (a logged 500)."""
    try:
        return await action
    except Exception as e:
        described = client_error(e)
        if described is None:
            raise
        session.flash("error", described[1])
        return None


def _fmt_time(t: datetime | None) -> str:
    return "—" if t is None else t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


templates.env.filters["utc"] = _fmt_time


# -- login and logout -------------------------------------------------------------------------
@router.get("/login")
async def login_page(request: Request, logged_out: str = "") -> Response:
    """The login form; it carries a fresh login CSRF token, also set as a cookie."""
    if _sessions(request).get(request.cookies.get(COOKIE)) is not None:
        return _redirect("/overview")
    return _login_form(request, 200, "You are logged out." if logged_out == "1" else None)


def _login_form(request: Request, status: int, notice: str | None = None,
                error: str | None = None) -> Response:
    token = secrets.token_urlsafe(32)
    response = _render(request, "login.html", status, login_csrf=token, notice=notice,
                       error=error)
    response.set_cookie(LOGIN_COOKIE, token, max_age=600, path=PREFIX + "/login",
                        httponly=True, samesite="strict", secure=_secure(request))
    return response


@router.post("/login")
async def login(request: Request) -> Response:
    """Opens a session for an admin JWT. Refuses API keys and tenant JWTs (403), bad, expired
    or revoked tokens (401), and a form without the login CSRF token (403); each refusal is
    counted as an ``/admin`` refusal is (never an audit row per attempt)."""
    form = await read_form(request)
    presented, expected = form.get("csrf_token"), request.cookies.get(LOGIN_COOKIE)
    if not (_same_origin(request) and isinstance(presented, str) and expected
            and secrets.compare_digest(presented.encode(), expected.encode())):
        raise CsrfRefused
    refusals = get_parts(request).admin_refusals
    token = form.get("token")
    token = token.strip() if isinstance(token, str) else ""
    if not token:
        return _login_form(request, 400, error="Paste an admin token.")
    if len(token) > MAX_TOKEN_CHARS:
        refusals.anonymous("malformed")
        return _login_form(request, 400, error="That is too long to be a token.")
    if looks_like_api_key(token):
        refusals.anonymous("console_api_key")
        return _login_form(request, 403, error="That is an API key, a tenant credential: the "
                           "console needs an admin token (saltserve token issue --role admin).")
    try:
        principal = await principal_for_token(request, token)
    except (InvalidToken, TenantDisabled) as e:
        refusals.anonymous(getattr(e, "reason", "tenant_disabled"))
        return _login_form(request, 401, error="Invalid, expired or revoked token.")
    if principal.role != "admin":
        await record_forbidden(request, principal.subject)
        return _login_form(request, 403, error="That is a tenant token: the console needs an "
                           "admin token.")
    sessions = _sessions(request)
    sessions.end(request.cookies.get(COOKIE))  # a login replaces the browser's old session
    session_id, session = sessions.create(principal.subject, principal.jti,
                                          principal.expires_at)
    ends = datetime.fromtimestamp(session.expires_at, UTC)
    await run_in_threadpool(get_parts(request).repo.usage.audit, principal.subject,
                            "console.login", None,
                            f"session_ends={ends.strftime('%Y-%m-%dT%H:%M:%SZ')}")
    response = _redirect("/overview")
    response.set_cookie(COOKIE, session_id, path=PREFIX, httponly=True, samesite="strict",
                        secure=_secure(request))
    response.delete_cookie(LOGIN_COOKIE, path=PREFIX + "/login")
    return response


@router.post("/logout")
async def logout(request: Request, session: Mutation) -> Response:
    """Ends the session (audited ``console.logout``) and clears the cookie."""
    _sessions(request).end(request.cookies.get(COOKIE))
    await run_in_threadpool(get_parts(request).repo.usage.audit, session.subject,
                            "console.logout", None, None)
    response = _redirect("/login?logged_out=1")
    response.delete_cookie(COOKIE, path=PREFIX)
    return response


# -- overview ---------------------------------------------------------------------------------
@router.get("")
async def console_root(_: Session) -> Response:
    return _redirect("/overview")


@router.get("/overview")
async def overview(request: Request, session: Session) -> Response:
    """Pool usage and per-tenant cache charts; the live part refreshes every few seconds."""
    stats = await _admin(request).cache_stats()
    return _render(request, "overview.html", session=session, page="overview", stats=stats,
                   charts=views.overview_charts(stats))


@router.get("/overview/live")
async def overview_live(request: Request, session: Polling) -> Response:
    """The overview's live part (an htmx fragment: numbers, table and chart data)."""
    stats = await _admin(request).cache_stats()
    return _render(request, "_overview_live.html", session=session, stats=stats,
                   charts=views.overview_charts(stats))


@router.get("/cache/reset")
async def confirm_reset_all(request: Request, session: Session) -> Response:
    stats = await _admin(request).cache_stats()
    return _render(request, "confirm.html", session=session, page="overview",
                   title="Reset every tenant's prefix cache?",
                   lines=[(f"{stats['num_blocks_cached']} cached blocks are dropped now, across "
                          "all tenants; every tenant's next requests miss until its cache "
                          "warms up again."), "Running requests are not harmed."],
                   action="/cache/reset", button="Reset all caches", cancel="/overview")


@router.post("/cache/reset")
async def reset_all(request: Request, session: Mutation) -> Response:
    done = await _attempt(session, _admin(request).reset_cache(session.subject))
    if done is not None:
        session.flash("ok", f"The prefix cache of every tenant was reset: "
                            f"{done['blocks_dropped']} cached blocks dropped.")
    return _redirect("/overview")


# -- tenants ----------------------------------------------------------------------------------
@router.get("/tenants")
async def tenants_page(request: Request, session: Session) -> Response:
    tenants = await _admin(request).list_tenants()
    return _render(request, "tenants.html", session=session, page="tenants", tenants=tenants)


@router.post("/tenants")
async def create_tenant(request: Request, session: Mutation) -> Response:
    form = await read_form(request)
    name = _text(form, "name")
    t = await _attempt(session, _admin(request).create_tenant(
        name, form.get("enable_prefix_caching") == "on", session.subject))
    if t is None:
        return _redirect("/tenants")
    session.flash("ok", f"Tenant {t.name} created (salt version 1). Issue it a key below.")
    return _redirect(f"/tenants/{t.id}")


def _text(form: FormData, name: str) -> str:
    value = form.get(name)
    return value.strip() if isinstance(value, str) else ""


def _changes(form: FormData) -> dict[str, Any]:
    """``AdminService.update_tenant`` keywords from a settings form: ``disabled`` and
    ``enable_prefix_caching`` as ``true`` / ``false``; ``weight`` and the limits as whole
    numbers (an empty limit is unlimited). Fields not in the form are left as they are.

    Raises:
        ValueError: a value that is not a whole number (or true / false).
    """
    changes: dict[str, Any] = {}
    for flag in ("disabled", "enable_prefix_caching"):
        if flag in form:
            value = _text(form, flag)
            if value not in ("true", "false"):
                raise ValueError(f"{flag} must be true or false")
            changes[flag] = value == "true"
    for name in ("weight", *NULLABLE_LIMITS):
        if name not in form:
            continue
        value = _text(form, name)
        if value == "" and name != "weight":
            changes[name] = None
        elif value.isascii() and value.isdigit() and len(value) <= 12:
            changes[name] = int(value)
        else:
            label = name.replace("_", " ")
            raise ValueError(f"{label} must be a whole number"
                             + ("" if name == "weight" else ", or empty for no limit"))
    for name in RETENTION_SETTINGS:
        if name in form:
            value = _text(form, name)
            if value not in ("in_memory", "24h"):
                raise ValueError(f"{name.replace('_', ' ')} must be in_memory or 24h")
            changes[name] = value
    return changes


@router.post("/tenants/{tenant}/update")
async def update_tenant(tenant: str, request: Request, session: Mutation) -> Response:
    """Enable / disable, caching on / off, weight and limits; back to the list or the detail
    page (``back``)."""
    form = await read_form(request)
    back = "/tenants" if form.get("back") == "list" else _tenant_path(tenant)
    try:
        changes = _changes(form)
    except ValueError as e:
        session.flash("error", str(e))
        return _redirect(back)
    t = await _attempt(session, _admin(request).update_tenant(tenant, session.subject,
                                                              **changes))
    if t is not None:
        state = "disabled" if t.disabled else "enabled"
        caching = "on" if t.enable_prefix_caching else "off"
        session.flash("ok", f"Tenant {t.name} saved: {state}, prefix caching {caching}, "
                            f"weight {t.weight}.")
        back = "/tenants" if form.get("back") == "list" else f"/tenants/{t.id}"
    return _redirect(back)


async def _tenant_or_404(request: Request, session: ConsoleSession,
                         tenant: str) -> TenantInfo | Response:
    """The tenant a path names, or an error page (404 for an unknown one)."""
    try:
        return await _admin(request).resolve_tenant(tenant)
    except Exception as e:
        described = client_error(e)
        if described is None:
            raise
        return _render(request, "message.html", described[0], session=session,
                       page="tenants", title="No such tenant"
                       if isinstance(e, TenantNotFound) else "Error", message=described[1])


def _tenant_cache(stats: dict, tenant_id: str) -> dict:
    for t in stats["tenants"]:
        if t["tenant_id"] == tenant_id:
            return t
    return {"resident_blocks": 0, "queried_tokens": 0, "hit_tokens": 0, "hit_rate": None,
            "tier_hit_tokens": 0, "tier_bytes": {}, "evictions": {}}


async def _tenant_page(request: Request, session: ConsoleSession, t: TenantInfo,
                       status: int = 200, new_key: dict | None = None) -> Response:
    admin = _admin(request)
    keys = await admin.list_keys(t.id)
    cache = _tenant_cache(await admin.cache_stats(), t.id)
    return _render(request, "tenant.html", status, session=session, page="tenants", tenant=t,
                   keys=keys, cache=cache, new_key=new_key, limit_fields=NULLABLE_LIMITS)


@router.get("/tenants/{tenant}")
async def tenant_page(tenant: str, request: Request, session: Session) -> Response:
    t = await _tenant_or_404(request, session, tenant)
    if isinstance(t, Response):
        return t
    return await _tenant_page(request, session, t)


@router.post("/tenants/{tenant}/keys")
async def create_key(tenant: str, request: Request, session: Mutation) -> Response:
    """Issues a key and shows its plaintext once, in this response (never stored, never
    shown again)."""
    form = await read_form(request)
    name = _text(form, "name") or None
    expires = _text(form, "expires_in_days")
    expires_at = None
    if expires:
        if not (expires.isascii() and expires.isdigit() and len(expires) <= 4
                and 0 < int(expires) <= 3650):
            session.flash("error", "expires in days must be a whole number from 1 to 3650, "
                                   "or empty for a key that does not expire")
            return _redirect(_tenant_path(tenant))
        expires_at = datetime.now(UTC) + timedelta(days=int(expires))
    created = await _attempt(session, _admin(request).create_key(tenant, name, expires_at,
                                                                 session.subject))
    if created is None:
        return _redirect(_tenant_path(tenant))
    token, info = created
    t = await _admin(request).resolve_tenant(info.tenant_id)
    return await _tenant_page(request, session, t, 201,
                              new_key={"key": token, "id": info.id, "name": info.name})


@router.post("/keys/{key_id}/revoke")
async def revoke_key(key_id: str, request: Request, session: Mutation) -> Response:
    info = await _attempt(session, _admin(request).revoke_key(key_id, session.subject))
    if info is None:
        return _redirect("/tenants")
    session.flash("ok", f"Key {info.display_prefix}…{info.last4} revoked: it is refused from "
                        "its next request on.")
    return _redirect(f"/tenants/{info.tenant_id}")


async def _confirm(request: Request, session: ConsoleSession, tenant: str, what: str,
                   lines: Callable[[TenantInfo, int], list[str]]) -> Response:
    """The confirm step of a tenant action (``what``: ``rotate-salt`` or ``cache/reset``): what
    it drops, from the tenant's resident blocks now, before it is done."""
    t = await _tenant_or_404(request, session, tenant)
    if isinstance(t, Response):
        return t
    blocks = _tenant_cache(await _admin(request).cache_stats(), t.id)["resident_blocks"]
    rotate = what == "rotate-salt"
    return _render(request, "confirm.html", session=session, page="tenants",
                   title=(f"Rotate the salt of {t.name}?" if rotate
                          else f"Reset the prefix cache of {t.name}?"),
                   lines=lines(t, blocks), action=f"/tenants/{t.id}/{what}",
                   button="Rotate salt" if rotate else "Reset cache",
                   cancel=f"/tenants/{t.id}")


@router.get("/tenants/{tenant}/rotate-salt")
async def confirm_rotate_salt(tenant: str, request: Request, session: Session) -> Response:
    return await _confirm(request, session, tenant, "rotate-salt", lambda t, blocks: [
        (f"The salt moves from version {t.current_salt_version} to "
        f"{t.current_salt_version + 1}."),
        (f"{blocks} cached blocks of {t.name} are dropped now; its next requests miss the "
        "prefix cache until it warms up again."),
        "API keys keep working; running requests are not harmed."])


@router.post("/tenants/{tenant}/rotate-salt")
async def rotate_salt(tenant: str, request: Request, session: Mutation) -> Response:
    done = await _attempt(session, _admin(request).rotate_salt(tenant, session.subject))
    if done is None:
        return _redirect("/tenants")
    session.flash("ok", f"Salt rotated to version {done['salt_version']}: "
                        f"{done['blocks_dropped']} cached blocks dropped.")
    return _redirect(f"/tenants/{done['tenant_id']}")


@router.get("/tenants/{tenant}/cache/reset")
async def confirm_reset_tenant(tenant: str, request: Request, session: Session) -> Response:
    return await _confirm(request, session, tenant, "cache/reset", lambda t, blocks: [
        (f"{blocks} cached blocks of {t.name} are dropped now; its next requests miss until "
        "the cache warms up again. The salt stays."),
        "Running requests are not harmed."])


@router.post("/tenants/{tenant}/cache/reset")
async def reset_tenant(tenant: str, request: Request, session: Mutation) -> Response:
    done = await _attempt(session, _admin(request).reset_tenant_cache(tenant, session.subject))
    if done is None:
        return _redirect("/tenants")
    session.flash("ok", f"Prefix cache reset: {done['blocks_dropped']} cached blocks dropped.")
    return _redirect(f"/tenants/{done['tenant_id']}")


# -- usage ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _UsageFilter:
    tenant: str  # a tenant id, or "" for all
    range: str
    bucket: str

    def query(self) -> str:
        return urlencode({"tenant": self.tenant, "range": self.range, "bucket": self.bucket})


def _usage_filter(tenant: str, range_: str, bucket: str) -> _UsageFilter:
    """The filter asked for; an unknown range or bucket falls back to the defaults."""
    range_ = range_ if range_ in views.RANGES else "24h"
    bucket = bucket if bucket in BUCKETS else views.DEFAULT_BUCKET[range_]
    return _UsageFilter(tenant, range_, bucket)


async def _usage_rows(request: Request, session: ConsoleSession, f: _UsageFilter):
    """(rows, (since, until)) of the filter's report; None after an error message."""
    admin = _admin(request)
    tenant_id = None
    if len(f.tenant) > MAX_TENANT_NAME_CHARS:
        session.flash("error", "tenant not found")
        return None
    if f.tenant:
        t = await _attempt(session, admin.resolve_tenant(f.tenant))
        if t is None:
            return None
        tenant_id = t.id
    until = datetime.now(UTC)
    return await _attempt(session, usage_report(
        get_parts(request).repo.usage, tenant_id, until - views.RANGES[f.range], until, f.bucket,
        ("tenant",)))


@router.get("/usage")
async def usage_page(request: Request, session: Session, tenant: str = "",
                     range: str = "24h", bucket: str = "") -> Response:
    """Usage charts per tenant over time, the rows as a table, and a CSV link."""
    f = _usage_filter(tenant, range, bucket)
    tenants = await _admin(request).list_tenants()
    report = await _usage_rows(request, session, f)
    rows, charts = [], []
    if report is not None:
        rows, (since, until) = report
        charts = views.usage_charts(rows, f.bucket, since, until)
    table = sorted(rows, key=lambda r: (r.bucket_start, r.tenant_name or ""), reverse=True)
    return _render(request, "usage.html", session=session, page="usage", tenants=tenants,
                   f=f, ranges=list(views.RANGES), buckets=list(BUCKETS), charts=charts,
                   rows=table[:USAGE_TABLE_ROWS], total_rows=len(table))


@router.get("/usage.csv")
async def usage_csv(request: Request, session: Session, tenant: str = "", range: str = "24h",
                    bucket: str = "") -> Response:
    """The usage page's report as CSV (``/admin/usage/report``'s columns)."""
    f = _usage_filter(tenant, range, bucket)
    report = await _usage_rows(request, session, f)
    if report is None:  # the usage page says why
        session.take_flashes()
        return _redirect("/usage?" + f.query())
    return Response(csv_text(report_dicts(report[0]), REPORT_COLUMNS), media_type="text/csv",
                    headers={"Content-Disposition":
                             f'attachment; filename="usage-{f.range}-{f.bucket}.csv"'})


# -- audit ------------------------------------------------------------------------------------
def _utc_input(value: str) -> datetime | None:
    """A ``datetime-local`` input's value, read as UTC (or in the offset it carries). Raises
    ValueError for a bad one."""
    if not value:
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError("times look like 2026-12-01T09:30 (UTC)") from None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


# The audit page's filters and their longest values (their columns' widths).
_AUDIT_FILTERS = {"tenant": MAX_TENANT_NAME_CHARS, "action": 64, "actor": 255, "since": 40,
                  "until": 40}


@router.get("/audit")
async def audit_page(request: Request, session: Session, tenant: str = "", action: str = "",
                     actor: str = "", since: str = "", until: str = "",
                     cursor: str = "") -> Response:
    """The audit log, newest first, filtered and paged (``AUDIT_PAGE_ROWS`` a page)."""
    admin = _admin(request)
    filters = {"tenant": tenant, "action": action, "actor": actor, "since": since,
               "until": until}
    page, rows, next_cursor = None, [], None
    try:
        for name, longest in _AUDIT_FILTERS.items():
            if len(filters[name]) > longest:
                raise ValueError(f"{name} is longer than any {name} ({longest} characters)")
        start, end = _utc_input(filters["since"]), _utc_input(filters["until"])
    except ValueError as e:
        session.flash("error", str(e))
    else:
        page = await _attempt(session, admin.audit_page(
            tenant=filters["tenant"] or None, action=filters["action"] or None,
            actor=filters["actor"] or None, since=start, until=end, cursor=cursor or None,
            limit=AUDIT_PAGE_ROWS))
    if page is not None:
        rows, next_cursor = page.rows, page.next_cursor
    names = {t.id: t.name for t in await admin.list_tenants()}
    query = {k: v for k, v in filters.items() if v}
    return _render(request, "audit.html", session=session, page="audit", rows=rows,
                   names=names, filters=filters, actions=AUDIT_ACTIONS,
                   tenants=sorted(names.values()), first_page=not cursor,
                   newest_url=f"{PREFIX}/audit?{urlencode(query)}",
                   older_url=(f"{PREFIX}/audit?{urlencode({**query, 'cursor': next_cursor})}"
                              if next_cursor else None))


@router.get("/{path:path}")
async def not_found(request: Request, session: Session, path: str) -> Response:
    """Any other console path (registered last): a console 404 page."""
    return _render(request, "message.html", 404, session=session, title="Not found",
                   message="The console has no such page.")
