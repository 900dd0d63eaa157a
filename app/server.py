"""FastAPI application factory."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from app.auth import AdminRefusals
from app.cluster import ClusterConfig, ClusterEvents
from app.console.sessions import ConsoleSessions
from app.errors import error_response, install_error_handlers
from app.limits import RateLimiter
from app.limits_redis import RedisRateLimiter
from app.metrics import ServerMetrics
from app.routes import admin, console, health, metrics, openai, reports
from app.services.admin import AdminService
from app.services.completions import CompletionsService
from app.services.prompts import TokenizerService
from engine.protocol import EngineClient
from tenants.cache_generations import CacheGenerations
from tenants.repository import TenantRepository
from tenants.tokens import JWTVerifier
from tenants.usage import current_client_request_id, current_request_id, current_tenant_id
from tenants.usage_journal import UsageJournal

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


def create_app(engine: EngineClient, repo: TenantRepository,
               max_request_body_bytes: int = 4 << 20,
               metrics_token: str | None = None,
               jwt_verifier: JWTVerifier | None = None,
               last_used_flush_s: float = 60.0,
               on_engine_death: Callable[[], None] | None = None,
               usage_journal_dir: Path | None = None,
               console_sessions: ConsoleSessions | None = None,
               cluster: ClusterConfig | None = None) -> FastAPI:
    """Builds the app around an engine client and a tenant repository.

    The engine loop starts with the app's lifespan and stops with it. API-key ``last_used_at``
    times are buffered in memory (no DB write per request) and written every
    ``last_used_flush_s`` seconds and on shutdown.

    Args:
        metrics_token: bearer token that Prometheus presents on ``GET /metrics``
            (``SALTSERVE_METRICS_TOKEN``); None or empty disables scraping (403) except for
            admin JWTs.
        jwt_verifier: verifies bearer JWTs (platform and IdP keys); None refuses every JWT,
            so only API keys work and the admin API is closed.
        on_engine_death: called once, on the event loop, when the engine is declared dead
            (``saltserve serve`` stops the server and exits non-zero for a supervisor).
        usage_journal_dir: where usage rows are journalled before they are written to the
            database (``tenants.usage_journal``; ``saltserve serve`` uses
            ``<data_dir>/usage-journal``); None writes them directly (no durability when the
            database refuses).
        console_sessions: the operator console's session store (``app.routes.console``);
            None: one with the default lifetimes (15 minutes idle, 1 hour at most).
        cluster: how this replica reaches the others (``app.cluster``: Redis URL, namespace,
            replica id); None: a single replica.
    """

    async def watch_engine() -> None:
        while not engine.errored:
            await asyncio.sleep(0.25)
        logger.critical("the engine is dead (%s); /health now answers 503",
                        type(engine.dead_error).__name__)
        if on_engine_death is not None:
            on_engine_death()

    async def flush_periodically() -> None:
        while True:
            await asyncio.sleep(last_used_flush_s)
            try:
                await run_in_threadpool(repo.authenticator.flush_last_used)
            except Exception as e:  # noqa: BLE001 - retried next period, never kills the app
                logger.error("flushing API-key last_used_at failed: %s", type(e).__name__)
            await run_in_threadpool(app.state.admin_refusals.flush, repo.usage.audit)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if journal is not None:
            journal.start()  # first stores what an earlier process left
        engine.start()
        await events.start()
        flusher = asyncio.create_task(flush_periodically())
        watchdog = asyncio.create_task(watch_engine())
        try:
            yield
        finally:
            flusher.cancel()
            watchdog.cancel()
            await events.close()
            # Each step on its own: a database that refuses at shutdown (the case the usage
            # journal exists for) must not skip the steps after it.
            steps = [app.state.completions.preprocessor.shutdown, engine.shutdown]
            if journal is not None:
                steps.append(journal.close)
            steps += [repo.authenticator.flush_last_used,
                      lambda: app.state.admin_refusals.flush(repo.usage.audit, everything=True),
                      lambda: app.state.jwt_executor.shutdown(wait=False, cancel_futures=True)]
            for step in steps:
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - logged; the next step still runs
                    logger.error("shutdown step failed: %s", type(e).__name__)

    # Deny by default: no public /docs, /redoc or /openapi.json (only GET /health is public);
    # admins read the schema at GET /openapi.json (app.routes.admin); tests use app.openapi().
    # redirect_slashes=False: Starlette's slash redirect is absolute, built from the client's
    # Host header (an open redirect); a path with a stray slash is a plain 404 instead.
    app = FastAPI(title="saltserve", version="0.1.0", lifespan=lifespan, openapi_url=None,
                  docs_url=None, redoc_url=None, redirect_slashes=False)
    info = engine.model_info()
    app.state.engine = engine
    app.state.repo = repo
    app.state.started_at = int(time.time())
    # JWT verification (which may fetch an IdP's JWKS) runs on its own threads.
    app.state.jwt_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="jwt")
    app.state.metrics = ServerMetrics(info.served_model_name)
    app.state.metrics.cache_config.labels(
        info.served_model_name, str(info.block_size), str(info.num_blocks), info.device,
        str(info.enable_prefix_caching).lower(), info.cache_dtype).set(1)
    refusals = app.state.metrics.admin_auth_refusals
    app.state.admin_refusals = AdminRefusals(lambda reason: refusals.labels(reason=reason).inc())
    app.state.metrics_token = metrics_token or None
    app.state.jwt_verifier = jwt_verifier
    # One object: app.auth's per-request check and the admin actions' own evictions.
    app.state.cache_generations = CacheGenerations()
    app.state.admin = AdminService(repo, engine, app.state.cache_generations)
    cluster = cluster or ClusterConfig()
    events = ClusterEvents(cluster, app.state.admin.apply_event)
    app.state.admin.events = app.state.cluster_events = events
    # Per-tenant rpm / tpm / concurrency limits: shared by the replicas through Redis when
    # there is one (app/limits_redis.py), else this process's own (app/limits.py).
    limiter = (RedisRateLimiter(cluster.redis_url, cluster.namespace) if cluster.redis_url
               else RateLimiter())
    journal = (UsageJournal(usage_journal_dir, repo.usage.record_usage_batch)
               if usage_journal_dir is not None else None)
    app.state.usage_journal = journal
    app.state.completions = CompletionsService(
        engine, journal.append if journal is not None else repo.usage.record_usage,
        app.state.metrics, limiter, usage_sink_blocks=journal is None)
    app.state.tokenizer_service = TokenizerService(info, app.state.completions.preprocessor)
    engine.add_output_observer(app.state.metrics.observe_output)
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(openai.tokenizer_router)
    app.include_router(metrics.router)
    app.include_router(admin.router)
    app.include_router(reports.admin_router)
    app.include_router(reports.tenant_router)
    app.include_router(admin.schema_router)
    console.install(app, console_sessions or ConsoleSessions())
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    app.add_middleware(RequestIdMiddleware)  # outermost: ids also cover 413s
    return app
