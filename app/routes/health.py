"""``GET /health`` and ``GET /version``: the only public routes (no auth, no tenant data)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.errors import EngineDeadError
from engine.protocol import EngineClient

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine loop runs; 503 once it has died, or while the server drains before
    it stops (SIGTERM with ``--drain-seconds``: a load balancer stops sending new requests
    while the running ones finish)."""
    engine: EngineClient = request.app.state.engine
    if getattr(request.app.state, "draining", False):
        return JSONResponse({"status": "draining"}, status_code=503)
    try:
        await engine.check_health()
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
