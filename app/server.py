"""The FastAPI application over the server's parts (``app.parts``), and its middleware."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import error_response, install_error_handlers
from app.parts import ServerParts
from app.routes import admin, console, health, metrics, openai, reports
from tenants.usage import current_client_request_id, current_request_id, current_tenant_id

logger = logging.getLogger(__name__)

_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._-]{1,64}")


class RequestIdMiddleware:
    """Gives every HTTP request a server-generated id (uuid4 hex), echoed in the
    ``x-request-id`` response header and stamped on every audit row written while serving the
    request (``tenants.usage.current_request_id``). A client's own ``X-Request-ID``, when it is a
    short safe token, is kept apart (``current_client_request_id``, the audit column
    ``client_request_id``): a client can never choose the id the server records as its own.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        request_id = uuid.uuid4().hex
        token = current_request_id.set(request_id)
        tenant_token = current_tenant_id.set(None)  # set by app.auth once authenticated
        client_token = current_client_request_id.set(
            given if _REQUEST_ID_OK.fullmatch(given) else None)

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_tenant_id.reset(tenant_token)
            current_client_request_id.reset(client_token)
            current_request_id.reset(token)


class BodySizeLimit:
    """Rejects request bodies over ``max_bytes`` with 413 before they are read into memory."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(scope, receive, send)
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI's body reader re-raises HTTPException as is (any other error
                    # would become a 400), and app.errors renders it in the OpenAI shape.
                    raise StarletteHTTPException(413, f"request body exceeds {self.max_bytes} "
                                                      "bytes")
            return message

        await self.app(scope, limited_receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = error_response(413, f"request body exceeds {self.max_bytes} bytes", None,
                              "request_too_large")
        await resp(scope, receive, send)


def create_app(parts: ServerParts) -> FastAPI:
    """The FastAPI app over ``parts`` (``app.parts.build_parts``): routes, console, error
    handlers and middleware. The parts start with the app's lifespan and stop with it
    (``ServerParts.start`` / ``close``); routes reach them through ``app.deps``.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await parts.start()
        try:
            yield
        finally:
            await parts.close()

    # Deny by default: no public /docs, /redoc or /openapi.json (only GET /health is public);
    # admins read the schema at GET /openapi.json (app.routes.admin); tests use app.openapi().
    # redirect_slashes=False: Starlette's slash redirect is absolute, built from the client's
    # Host header (an open redirect); a path with a stray slash is a plain 404 instead.
    app = FastAPI(title="saltserve", version="0.1.0", lifespan=lifespan, openapi_url=None,
                  docs_url=None, redoc_url=None, redirect_slashes=False)
    app.state.parts = parts  # read only through app.deps.get_parts
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(openai.tokenizer_router)
    app.include_router(metrics.router)
    app.include_router(admin.router)
    app.include_router(reports.admin_router)
    app.include_router(reports.tenant_router)
    app.include_router(admin.schema_router)
    console.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=parts.max_request_body_bytes)
    app.add_middleware(RequestIdMiddleware)  # outermost: ids also cover 413s
    return app
