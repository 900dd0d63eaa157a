"""The server's parts, built in one place: the composition root.

``build_parts`` wires an engine client and a tenant repository into everything the routes use
(metrics, rate limiter, usage journal, services, the cache-generation rule, the replicas'
broadcast); ``parts_from_settings`` first builds the engine client and repository from
``Settings`` (``saltserve serve``). ``app.server.create_app`` turns the parts into a FastAPI
app, and routes receive them through the typed dependencies of ``app.deps``.

Wiring runs one way: engine and repository -> metrics -> services -> generations -> admin;
the broadcast is built before the generation service that announces through it, and the
listener after it, with its ``on_broadcast`` as the callback::

    ClusterBroadcast ──▶ CacheGenerationService ◀── ClusterListener (apply)
                              ▲          ▲
                      AdminService     app.auth (each request)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool

from app.admin_refusals import AdminRefusals
from app.cluster import ClusterBroadcast, ClusterConfig, ClusterListener
from app.console.sessions import ConsoleSessions
from app.limits import RateLimiter
from app.limits_redis import RedisRateLimiter
from app.metrics import ServerMetrics
from app.services.admin import AdminService
from app.services.cache_generations import CacheGenerationService
from app.services.completions import CompletionsService
from app.services.prompts import TokenizerService
from engine.protocol import EngineClient
from tenants.repository import TenantRepository
from tenants.tokens import JWTVerifier
from tenants.usage_journal import UsageJournal

if TYPE_CHECKING:
    from app.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ServerParts:
    """Everything one server process serves with; built by ``build_parts``.

    Started and stopped with the app's lifespan (``start`` / ``close``). Fields are read
    through ``app.deps``; tests may replace a setting such as ``metrics_token`` or
    ``jwt_verifier`` on a running app.

    Attributes:
        engine: the engine client (``engine.protocol.EngineClient``).
        repo: tenants, keys, salts, usage and audit.
        metrics: request-level Prometheus metrics and the exporter of engine snapshots.
        completions: chat / completions orchestration, limits and usage.
        tokenizers: ``/tokenize`` and ``/detokenize``.
        generations: the cache-generation rule (drop a tenant's old blocks once, everywhere).
        admin: operator actions shared by the admin API and the console.
        broadcast / listener: this replica's ends of the cache-event broadcast.
        journal: the usage journal (None: rows go straight to the database).
        admin_refusals: refused ``/admin`` calls, counted and aggregated.
        jwt_verifier: verifies bearer JWTs; None refuses every JWT (API keys only).
        jwt_executor: the threads JWT verification (and a JWKS fetch) runs on.
        metrics_token: the Prometheus scrape token; None: admin JWTs only.
        console_sessions: the operator console's session store.
        started_at: unix seconds when the parts were built (``/v1/models``' ``created``).
        max_request_body_bytes: larger bodies get 413 before they are read.
        draining: set by ``app.draining`` on the first SIGTERM: ``/health`` answers 503.
    """

    engine: EngineClient
    repo: TenantRepository
    metrics: ServerMetrics
    completions: CompletionsService
    tokenizers: TokenizerService
    generations: CacheGenerationService
    admin: AdminService
    broadcast: ClusterBroadcast
    listener: ClusterListener
    journal: UsageJournal | None
    admin_refusals: AdminRefusals
    jwt_verifier: JWTVerifier | None
    jwt_executor: ThreadPoolExecutor
    metrics_token: str | None
    console_sessions: ConsoleSessions
    started_at: int
    max_request_body_bytes: int
    last_used_flush_s: float = 60.0
    on_engine_death: Callable[[], None] | None = None
    draining: bool = False
    _tasks: list[asyncio.Task] = field(default_factory=list, repr=False)

    def __repr__(self) -> str:
        return (f"ServerParts(model={self.engine.model_info().served_model_name!r}, "
                f"replica={self.broadcast.config.replica_id!r})")

    def start_draining(self) -> None:
        """From now on ``GET /health`` answers 503 (``app.draining``: the first SIGTERM), so a
        load balancer sends no new requests while the running ones finish."""
        self.draining = True

    async def start(self) -> None:
        """Starts serving: the journal first (it stores what an earlier process left), then
        the engine loop, the broadcast and its listener, the ``last_used_at`` flusher and the
        engine watchdog."""
        if self.journal is not None:
            self.journal.start()
        self.engine.start()
        await self.broadcast.start()
        await self.listener.start()
        self._tasks = [asyncio.create_task(self._flush_periodically(), name="flush-last-used"),
                       asyncio.create_task(self._watch_engine(), name="engine-watchdog")]

    async def close(self) -> None:
        """Stops serving. Each step runs on its own: a database that refuses at shutdown (the
        case the usage journal exists for) must not skip the steps after it."""
        for task in self._tasks:
            task.cancel()
        await self.listener.close()
        await self.broadcast.close()
        steps = [self.completions.preprocessor.shutdown, self.engine.shutdown]
        if self.journal is not None:
            steps.append(self.journal.close)
        steps += [self.repo.authenticator.flush_last_used,
                  lambda: self.admin_refusals.flush(self.repo.usage.audit, everything=True),
                  lambda: self.jwt_executor.shutdown(wait=False, cancel_futures=True)]
        for step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - logged; the next step still runs
                logger.error("shutdown step failed: %s", type(e).__name__)

    async def _watch_engine(self) -> None:
        while not self.engine.errored:
            await asyncio.sleep(0.25)
        logger.critical("the engine is dead (%s); /health now answers 503",
                        type(self.engine.dead_error).__name__)
        if self.on_engine_death is not None:
            self.on_engine_death()

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.last_used_flush_s)
            try:
                await run_in_threadpool(self.repo.authenticator.flush_last_used)
            except Exception as e:  # noqa: BLE001 - retried next period, never kills the app
                logger.error("flushing API-key last_used_at failed: %s", type(e).__name__)
            await run_in_threadpool(self.admin_refusals.flush, self.repo.usage.audit)


def build_parts(engine: EngineClient, repo: TenantRepository, *,
                max_request_body_bytes: int = 4 << 20,
                metrics_token: str | None = None,
                jwt_verifier: JWTVerifier | None = None,
                last_used_flush_s: float = 60.0,
                on_engine_death: Callable[[], None] | None = None,
                usage_journal_dir: Path | None = None,
                console_sessions: ConsoleSessions | None = None,
                cluster: ClusterConfig | None = None) -> ServerParts:
    """Wires the server's parts around an engine client and a tenant repository.

    Args:
        max_request_body_bytes: larger request bodies get 413 before they are read.
        metrics_token: bearer token that Prometheus presents on ``GET /metrics``
            (``SALTSERVE_METRICS_TOKEN``); None or empty disables scraping (403) except for
            admin JWTs.
        jwt_verifier: verifies bearer JWTs (platform and IdP keys); None refuses every JWT,
            so only API keys work and the admin API is closed.
        last_used_flush_s: API-key ``last_used_at`` times are buffered in memory and written
            this often (seconds) and on shutdown.
        on_engine_death: called once, on the event loop, when the engine is declared dead
            (``saltserve serve`` stops the server and exits non-zero for a supervisor).
        usage_journal_dir: where usage rows are journalled before they are written to the
            database (``tenants.usage_journal``); None writes them directly (no durability
            when the database refuses).
        console_sessions: the console's session store; None: the default lifetimes (15
            minutes idle, 1 hour at most).
        cluster: how this replica reaches the others (Redis URL, namespace, replica id);
            None: a single replica.

    Raises:
        tenants.usage_journal.JournalInUse: another process already holds this usage journal.
    """
    info = engine.model_info()
    metrics = ServerMetrics(info.served_model_name)
    metrics.cache_config.labels(
        info.served_model_name, str(info.block_size), str(info.num_blocks), info.device,
        str(info.enable_prefix_caching).lower(), info.cache_dtype).set(1)
    engine.add_output_observer(metrics.observe_output)
    refusals = metrics.admin_auth_refusals
    cluster = cluster or ClusterConfig()
    # Per-tenant rpm / tpm / concurrency limits: shared by the replicas through Redis when
    # there is one (app/limits_redis.py), else this process's own (app/limits.py).
    limiter = (RedisRateLimiter(cluster.redis_url, cluster.namespace) if cluster.redis_url
               else RateLimiter())
    journal = (UsageJournal(usage_journal_dir, repo.usage.record_usage_batch)
               if usage_journal_dir is not None else None)
    completions = CompletionsService(
        engine, journal.append if journal is not None else repo.usage.record_usage,
        metrics, limiter, usage_sink_blocks=journal is None)
    broadcast = ClusterBroadcast(cluster)
    generations = CacheGenerationService(engine, repo.tenants.get, repo.tenants.list_all,
                                         broadcast)
    return ServerParts(
        engine=engine, repo=repo, metrics=metrics, completions=completions,
        tokenizers=TokenizerService(info, completions.preprocessor),
        generations=generations,
        admin=AdminService(repo, engine, generations),
        broadcast=broadcast,
        listener=ClusterListener(cluster, broadcast.origin, generations.on_broadcast),
        journal=journal,
        admin_refusals=AdminRefusals(lambda reason: refusals.labels(reason=reason).inc()),
        jwt_verifier=jwt_verifier,
        # JWT verification (which may fetch an IdP's JWKS) runs on its own threads.
        jwt_executor=ThreadPoolExecutor(max_workers=4, thread_name_prefix="jwt"),
        metrics_token=metrics_token or None,
        console_sessions=console_sessions or ConsoleSessions(),
        started_at=int(time.time()),
        max_request_body_bytes=max_request_body_bytes,
        last_used_flush_s=last_used_flush_s,
        on_engine_death=on_engine_death)


@dataclass(frozen=True)
class BuiltServer:
    """What ``parts_from_settings`` returns: the parts, and the first start's demo key."""

    parts: ServerParts
    demo_key: str | None  # plaintext, only on the start that created it
    demo_key_file: Path | None


def journal_dir(settings: Settings) -> Path:
    """The usage journal's folder in the data dir: one per replica when replicas share a data
    dir (``--replica-id``), so that each journals its own rows."""
    return settings.replica_folder("usage-journal")


def parts_from_settings(settings: Settings, replica_id: str,
                        on_engine_death: Callable[[], None] | None = None) -> BuiltServer:
    """``saltserve serve``'s parts: prepares the data dir, database and model
    (``app.bootstrap``), builds the engine client (``AsyncLLM``, on the thread that steps it)
    and the JWT verifier, then ``build_parts``.

    Raises:
        ValueError: a bad engine flag or setting, or an unusable database or key file.
        FileNotFoundError: missing weights or GGUF.
        tenants.usage_journal.JournalInUse: another process already holds this data dir's usage
            journal.
    """
    from app.bootstrap import bootstrap, make_jwt_verifier
    from engine.async_engine import AsyncLLM

    settings.engine_config(settings.data_dir / "models")  # a bad engine flag: before any write
    boot = bootstrap(settings)
    verifier = make_jwt_verifier(settings)
    sessions = ConsoleSessions(settings.console_session_idle_s, settings.console_session_max_s,
                               secure_cookie=settings.console_secure_cookie)
    # Built and stepped on one thread: see AsyncLLM.from_config.
    client = AsyncLLM.from_config(settings.engine_config(
        boot.model_dir, kv_owner_key=boot.repo.cipher.kv_owner_key))
    parts = build_parts(
        client, boot.repo, max_request_body_bytes=settings.max_request_body_bytes,
        metrics_token=settings.metrics_token, jwt_verifier=verifier,
        on_engine_death=on_engine_death, usage_journal_dir=journal_dir(settings),
        console_sessions=sessions,
        cluster=ClusterConfig(settings.redis_url, settings.redis_namespace, replica_id))
    return BuiltServer(parts, boot.demo_key, boot.demo_key_file)
