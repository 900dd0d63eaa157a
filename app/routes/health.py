"""``GET /health`` and ``GET /version``: the only public routes (no auth, no tenant data)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.deps import Parts
from engine.errors import EngineDeadError

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(parts: Parts) -> JSONResponse:
    """200 while the engine loop runs; 503 once it has died, or while the server drains before
    it stops (SIGTERM with ``--drain-seconds``: a load balancer stops sending new requests
    while the running ones finish)."""
    if parts.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    try:
        await parts.engine.check_health()
        ok = True
    except EngineDeadError:
        ok = False
    return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)


@router.get("/version")
async def version() -> dict:
    """The server's version (vLLM ``GET /version``); public, as in vLLM."""
    try:
        return {"version": package_version("saltserve")}
    except PackageNotFoundError:  # running from a source tree that was never installed
        return {"version": "unknown"}
