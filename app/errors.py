"""The one place where errors become HTTP responses in the OpenAI error shape.

``{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}``; never a
stack trace.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from tenants.errors import (
    ApiKeyNotFound,
    DuplicateTenant,
    InvalidToken,
    TenantDisabled,
    TenantNotFound,
)

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error with an HTTP status, raised by handlers and dependencies."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def _validation_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or ("body" if loc and loc[0] == "body" else None)


# Domain errors with a fixed response: exception type -> (status, message, param, code, headers).
# Their own messages may name internals, so the client gets these fixed texts instead.
_FIXED: dict[type[Exception], tuple[int, str, str | None, str, dict[str, str] | None]] = {
    InvalidToken: (401, "invalid or missing credentials (API key or JWT)", None,
                   "invalid_api_key", {"WWW-Authenticate": "Bearer"}),
    TenantDisabled: (403, "this tenant is disabled", None, "tenant_disabled", None),
    TenantNotFound: (404, "tenant not found", None, "tenant_not_found", None),
    ApiKeyNotFound: (404, "API key not found", None, "api_key_not_found", None),
    DuplicateTenant: (409, "a tenant with this name already exists", "name", "tenant_exists",
                      None),
    EngineDeadError: (503, "the inference engine is not available", None, "engine_unavailable",
                      None),
    # A locked, read-only or unreachable database: admin writes (and lookups) fail with a
    # retryable 503, never a 500 or a dropped connection; usage rows wait in the journal.
    OperationalError: (503, "the database is unavailable; try again", None,
                       "database_unavailable", {"Retry-After": "1"}),
}


def client_error(exc: Exception) -> tuple[int, str] | None:
    """(status, message) that a client may see for a known error (``APIError``, the ``_FIXED``
    table, an engine ``InvalidRequestError``); None for anything else (a 500)."""
    if isinstance(exc, APIError):
        return exc.status, exc.message
    if isinstance(exc, InvalidRequestError):
        return 400, exc.message
    for exc_type, (status, message, *_) in _FIXED.items():
        if isinstance(exc, exc_type):
            return status, message
    return None


def _fixed_handler(status: int, message: str, param: str | None, code: str,
                   headers: dict[str, str] | None):
    async def handler(_: Request, exc: Exception) -> JSONResponse:
        return error_response(status, message, param, code, headers)

    return handler


def install_error_handlers(app: FastAPI) -> None:
    """Registers the handlers: ``APIError`` as raised, request validation as 400 with ``param``,
    Starlette HTTP errors, the ``_FIXED`` table, engine ``InvalidRequestError`` as 400, and any
    other exception as a logged 500 without details."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(500, exc.message, None, "request_failed")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON", "body", "invalid_json")
        loc = tuple(first.get("loc", ()))
        msg = first.get("msg", "invalid request")
        param = _validation_param(loc)
        code = "invalid_value"
        if first.get("type") == "extra_forbidden":  # never ignored silently (docs/api.md)
            msg = "unsupported field: this server does not implement it (see docs/api.md)"
            code = "unsupported_parameter"
        elif first.get("type") == "unsupported_parameter":
            msg = f"unsupported: {msg}"
            code = "unsupported_parameter"
        return error_response(400, f"{param}: {msg}" if param else msg, param, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(exc.status_code, str(exc.detail), None, code,
                              getattr(exc, "headers", None))

    for exc_type, fixed in _FIXED.items():
        app.add_exception_handler(exc_type, _fixed_handler(*fixed))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled %s in request", type(exc).__name__, exc_info=exc)
        return error_response(500, "internal server error", None, "internal_error")
