"""Authentication as injected dependencies: ``Authorization: Bearer <api key>`` -> tenant."""

from __future__ import annotations

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
