"""Authentication and roles as injected dependencies (deny by default).

One path, ``authenticate``: ``Authorization: Bearer <token>`` where the token is either

- a tenant API key (``ss-<key id>-<secret>``, recognised by its prefix) -> role ``tenant``, or
- a JWT (``tenants.tokens.JWTVerifier``: platform-issued or external IdP) -> role from its role
  claim (``tenant`` | ``admin``), tenant from its tenant claim (required for ``tenant``, optional
  for ``admin``). A JWT naming an unknown tenant is refused (401); one naming a disabled tenant
  gets 403 on tenant routes (an admin JWT stays an admin on ``/admin``).

Dependencies:

- ``CurrentTenant`` (OpenAI routes): API key or tenant JWT. An admin JWT is accepted here only
  when it names a tenant (it then acts as that tenant, e.g. for support); an admin JWT without a
  tenant gets 403.
- ``AdminPrincipal`` (``/admin``): admin JWT only; tenant credentials get 403. Refusals are
  recorded without letting anyone flood the audit log (``AdminRefusals``): an unauthenticated
  one is counted in ``saltserve:admin_auth_refusals_total`` and a rate-limited log line, never
  an audit row; a forbidden one (valid credentials, not an admin) is aggregated into one
  ``auth.admin_forbidden`` audit row per actor and minute, with a count and the first path
  (truncated, percent-escaped). Never the token.
- ``MetricsScraper`` (``/metrics``): the scrape token or an admin JWT; tenants get 403.

``CurrentTenant`` also notices a salt rotation or cache reset done by another process (another
replica whose broadcast did not arrive, ``saltserve tenants rotate-salt``): the first request
that authenticates with a newer salt version or cache epoch than the server last saw for that
tenant evicts the tenant's cached blocks (reason ``salt_rotation`` or ``reset``) once, before it
is served. Tokens, keys and salts are never logged.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from app.admin_refusals import AdminRefusals
from app.deps import get_parts
from app.errors import APIError
from tenants.api_keys import looks_like_api_key
from tenants.authenticator import Authenticator
from tenants.errors import InvalidToken, TenantDisabled, TenantNotFound
from tenants.records import AuthContext
from tenants.revocations import TokenRevocations
from tenants.tokens import JWTVerifier
from tenants.usage import current_tenant_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Principal:
    """Who is calling.

    ``subject`` is the audit actor: the JWT ``sub``, or ``key:<key id>`` for an API key.
    ``tenant`` is the resolved tenant context (None for an admin JWT that names no tenant).
    """

    subject: str
    role: Literal["tenant", "admin"]
    via: Literal["api_key", "jwt"]
    tenant: AuthContext | None
    tenant_disabled: bool = False  # an admin JWT naming a disabled tenant (still an admin)
    jti: str | None = None  # a JWT's id (revocable by it)
    expires_at: int | None = None  # a JWT's ``exp``, unix seconds

    def __repr__(self) -> str:
        return (f"Principal(subject={self.subject!r}, role={self.role!r}, via={self.via!r}, "
                f"tenant={self.tenant.tenant_id if self.tenant else None!r})")


def _missing() -> APIError:
    return APIError(401, "missing credentials: send 'Authorization: Bearer <API key or JWT>'",
                    None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def bearer_token(request: Request) -> str | None:
    """The bearer token of ``request``, or None when the header is absent, not Bearer, or sent
    more than once (which credential counts would be ambiguous, and a load balancer hashing
    one of them could be steered)."""
    values = request.headers.getlist("authorization")
    if len(values) != 1:
        return None
    scheme, _, token = values[0].partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _api_key_principal(authenticator: Authenticator, token: str) -> Principal:
    ctx = authenticator.authenticate_api_key(token)
    return Principal(f"key:{ctx.key_id}", "tenant", "api_key", ctx)


def _jwt_principal(authenticator: Authenticator, verifier: JWTVerifier | None,
                   revocations: TokenRevocations, token: str) -> Principal:
    if verifier is None:
        raise InvalidToken("bad_jwt")
    claims = verifier.verify(token)
    if claims.jti is not None and revocations.is_revoked(claims.jti):
        raise InvalidToken("revoked")
    ctx, disabled = None, False
    if claims.tenant_id is not None:
        try:
            ctx = authenticator.context_for_tenant(claims.tenant_id)
        except TenantNotFound:
            raise InvalidToken("unknown_tenant") from None
        except TenantDisabled:
            if claims.role != "admin":
                raise
            disabled = True  # the admin may still manage it (e.g. enable it again)
    return Principal(claims.subject, claims.role, "jwt", ctx, disabled, claims.jti,
                     claims.expires_at)


async def authenticate(request: Request) -> Principal:
    """Resolves the bearer token (API key or JWT) to a ``Principal``; cached per request.

    Raises:
        APIError 401: no bearer token.
        InvalidToken (-> 401): bad key or JWT, or a JWT for an unknown tenant.
        TenantDisabled (-> 403): the tenant is disabled.
    """
    cached = getattr(request.state, "principal", None)
    if cached is not None:
        return cached
    token = bearer_token(request)
    if token is None:
        raise _missing()
    principal = await principal_for_token(request, token)
    request.state.principal = principal
    return principal


async def principal_for_token(request: Request, token: str) -> Principal:
    """Resolves an API key or a JWT (``authenticate``'s rules) to a ``Principal``.

    Raises:
        InvalidToken (-> 401): bad key or JWT, or a JWT for an unknown tenant.
        TenantDisabled (-> 403): the tenant is disabled.
    """
    parts = get_parts(request)
    if looks_like_api_key(token):
        return await run_in_threadpool(_api_key_principal, parts.repo.authenticator, token)
    # JWTs on their own few threads: a slow JWKS fetch never holds up API-key requests.
    return await asyncio.get_running_loop().run_in_executor(
        parts.jwt_executor, _jwt_principal, parts.repo.authenticator, parts.jwt_verifier,
        parts.repo.revocations, token)


async def current_tenant(request: Request) -> AuthContext:
    """The calling tenant: an API key, a tenant JWT, or an admin JWT that names a tenant.

    Raises:
        APIError 401 / InvalidToken: missing or invalid credentials.
        APIError 403: an admin JWT that names no tenant.
        TenantDisabled (-> 403): the tenant is disabled.
    """
    principal = await authenticate(request)
    if principal.tenant_disabled:
        raise TenantDisabled("the tenant named by this admin token is disabled")
    if principal.tenant is None:
        raise APIError(403, "this route needs a tenant: use an API key or a JWT with a tenant "
                       "claim", None, "tenant_required")
    current_tenant_id.set(principal.tenant.tenant_id)  # for log lines (app.logs)
    # A salt rotation or reset this process has not applied yet: drop the old blocks first.
    await get_parts(request).generations.on_request(principal.tenant)
    return principal.tenant


CurrentTenant = Annotated[AuthContext, Depends(current_tenant)]


def _refusals(request: Request) -> AdminRefusals:
    return get_parts(request).admin_refusals


async def admin_principal(request: Request) -> Principal:
    """An admin JWT (one naming a disabled tenant included). Refusals are recorded by
    ``AdminRefusals`` and re-raised.

    Raises:
        APIError 401 / InvalidToken: missing or invalid credentials.
        APIError 403: valid tenant credentials (``admin_required``).
        TenantDisabled (-> 403): tenant credentials of a disabled tenant.
    """
    try:
        principal = await authenticate(request)
    except InvalidToken as e:
        _refusals(request).anonymous(e.reason)
        raise
    except APIError as e:
        _refusals(request).anonymous(e.code or "missing")
        raise
    except TenantDisabled:
        _refusals(request).anonymous("tenant_disabled")
        raise
    if principal.role != "admin":
        await record_forbidden(request, principal.subject)
        raise APIError(403, "this route needs an admin token", None, "admin_required")
    return principal


async def record_forbidden(request: Request, subject: str) -> None:
    """Counts an admin-only request refused to valid non-admin credentials
    (``AdminRefusals.forbidden``), flushing every pending row when too many are pending."""
    refusals = _refusals(request)
    if refusals.forbidden(subject, request.method, request.url.path):
        # In a fresh context: the rows are not this request's (no request ids on them).
        await run_in_threadpool(contextvars.Context().run, refusals.flush,
                                get_parts(request).repo.usage.audit, True)


AdminPrincipal = Annotated[Principal, Depends(admin_principal)]


async def metrics_scraper(request: Request) -> None:
    """Admits a Prometheus scrape: the configured scrape token or an admin JWT.

    The scrape token comes from ``SALTSERVE_METRICS_TOKEN`` (``build_parts(metrics_token=...)``)
    and is compared in constant time. Deny by default.

    Raises:
        APIError 403: tenant credentials (``admin_required``), or no scrape token is configured
            and the caller is not an admin (``metrics_disabled``).
        APIError 401: missing or wrong token (``invalid_metrics_token``).
    """
    expected = get_parts(request).metrics_token
    token = bearer_token(request)
    if token is not None and expected and hmac.compare_digest(token.encode(), expected.encode()):
        return
    principal = None
    if token is not None:
        try:
            principal = await authenticate(request)
        except Exception:  # noqa: BLE001 - invalid, disabled tenant, ...: not an admin
            principal = None
    if principal is not None and principal.role == "admin":
        return
    if principal is not None:
        raise APIError(403, "metrics need the scrape token or an admin token", None,
                       "admin_required")
    if not expected:
        raise APIError(403, "metrics are disabled: set SALTSERVE_METRICS_TOKEN to enable "
                       "scraping, or use an admin token", None, "metrics_disabled")
    raise APIError(401, "invalid or missing metrics token: send 'Authorization: Bearer "
                   "<scrape token>'", None, "invalid_metrics_token",
                   {"WWW-Authenticate": "Bearer"})


MetricsScraper = Annotated[None, Depends(metrics_scraper)]
