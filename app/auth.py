"""Authentication as injected dependencies: ``Authorization: Bearer <api key>`` -> tenant, and
``Authorization: Bearer <scrape token>`` for ``/metrics``."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from app.errors import APIError
from tenants.repository import AuthContext


async def current_tenant(request: Request) -> AuthContext:
    """Resolves the bearer API key to its tenant and current salt.

    Raises:
        APIError 401: missing or malformed Authorization header.
        tenants.errors.InvalidToken / TenantDisabled: mapped to 401 / 403 in ``app.errors``.
    """
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", None,
                       "invalid_api_key", {"WWW-Authenticate": "Bearer"})
    repo = request.app.state.repo
    return await run_in_threadpool(repo.authenticate_api_key, token.strip())


CurrentTenant = Annotated[AuthContext, Depends(current_tenant)]


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


async def metrics_scraper(request: Request) -> None:
    """Admits a Prometheus scrape that presents the configured scrape token.

    The token comes from ``SALTSERVE_METRICS_TOKEN`` (``create_app(metrics_token=...)``); the
    admin role (a later issue) will be accepted here too. Deny by default: with no token
    configured nobody may scrape.

    Raises:
        APIError 403: no scrape token is configured.
        APIError 401: missing or wrong token (constant-time comparison).
    """
    expected: str | None = request.app.state.metrics_token
    if not expected:
        raise APIError(403, "metrics are disabled: set SALTSERVE_METRICS_TOKEN to enable "
                       "scraping", None, "metrics_disabled")
    token = _bearer(request)
    if token is None or not hmac.compare_digest(token.encode(), expected.encode()):
        raise APIError(401, "invalid or missing metrics token: send 'Authorization: Bearer "
                       "<scrape token>'", None, "invalid_metrics_token",
                       {"WWW-Authenticate": "Bearer"})


MetricsScraper = Annotated[None, Depends(metrics_scraper)]
