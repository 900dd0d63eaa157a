"""Cache evictions that every replica applies: a Redis pub/sub broadcast, with a fallback.

Replicas share PostgreSQL (tenants, keys, salts, usage, audit) but each holds its own KV cache.
When an operator rotates a tenant's salt, resets a tenant's cache, resets every cache or turns a
tenant's caching off on one replica, that replica evicts its own blocks, commits the new
generation (salt version, cache epoch; ``app.services.cache_generations``) and publishes an
event on ``<namespace>:cache-events``; every other replica evicts the same blocks on receipt
(milliseconds). Nothing else needs a message: disable and enable, limits, key and token revocation are read from the database
on every request.

Pub/sub delivers at most once, so a replica that was disconnected misses events. The fallback
is the generation check on each request (``app.auth``): a tenant's next request on a replica
that missed the event meets a newer salt version or cache epoch and evicts then. A missed
message therefore costs memory until the tenant's next request, never isolation (blocks of an
older salt can never be hit again).

Events are JSON: ``{"origin": instance id, "replica": replica id, "tenant_id": id or null (every
tenant), "reason"}``; no salts, no keys. An event is only a hint: the receiver re-reads the
tenant's salt version and cache epoch from the database and evicts only if they are newer than
what it has seen, so a forged or replayed event (anyone who can publish on the channel) cannot
flush a cache or pin a tenant's generation. Publishing never holds up an admin action: it runs
in the background with a 2 s bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    """How this replica finds the others.

    Attributes:
        redis_url: ``redis://host:port/db``; None: a single replica (nothing is shared).
        namespace: prefix of every Redis key and channel (several deployments, or test runs,
            can share one Redis).
        replica_id: this replica's name, in its events and log lines.
    """

    redis_url: str | None = field(default=None, repr=False)  # may hold a password
    namespace: str = "saltserve"
    replica_id: str = "local"

    @property
    def channel(self) -> str:
        return f"{self.namespace}:cache-events"


TENANT_ID = re.compile(r"[0-9a-f]{32}")


def event_json(origin: str, replica_id: str, tenant_id: str | None, reason: str) -> str:
    """One event's JSON (the one place events are built)."""
    return json.dumps({"origin": origin, "replica": replica_id, "tenant_id": tenant_id,
                       "reason": reason})


def publish_now(config: ClusterConfig, tenant_id: str | None, reason: str) -> int:
    """Publishes one event from outside a server (the CLI), synchronously. Returns how many
    replicas received it (0 without Redis, or when Redis is unreachable or the ``redis``
    package is missing: they catch up on the tenant's next request)."""
    if config.redis_url is None:
        return 0
    try:
        import redis
    except ImportError:
        logger.warning("the redis package is missing (pip install 'saltserve[redis]'); "
                       "replicas catch up on the tenant's next request")
        return 0
    try:
        client = redis.Redis.from_url(config.redis_url, socket_timeout=2,
                                      socket_connect_timeout=2)
        return int(client.publish(config.channel, event_json(
            uuid.uuid4().hex, config.replica_id, tenant_id, reason)))
    except redis.RedisError as e:
        logger.warning("could not tell the replicas (%s); they catch up on the tenant's next "
                       "request", type(e).__name__)
        return 0


def _redis_asyncio() -> Any:
    """``redis.asyncio``, or a RuntimeError saying how to install it."""
    try:
        import redis.asyncio as aioredis
    except ImportError:
        raise RuntimeError("SALTSERVE_REDIS_URL needs the redis package: "
                           "pip install 'saltserve[redis]'") from None
    return aioredis


class ClusterBroadcast:
    """This replica's sending end: tells the others which tenant's cache it dropped.

    Args:
        config: where Redis is, the namespace and this replica's id.

    Attributes:
        origin: this process's id in its events (even when two processes share a replica id),
            so that its own listener skips them.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.origin = uuid.uuid4().hex
        self._redis: Any = None  # bounded by a socket timeout
        self._publishing: set[asyncio.Task] = set()

    def __repr__(self) -> str:
        return (f"ClusterBroadcast(replica_id={self.config.replica_id!r}, "
                f"redis={self.config.redis_url is not None})")

    async def start(self) -> None:
        """Connects (lazily: Redis may be down now and up later). No-op without Redis.

        Raises:
            RuntimeError: a Redis URL is set but the ``redis`` package is missing.
        """
        if self.config.redis_url is None:
            return
        self._redis = _redis_asyncio().from_url(self.config.redis_url, socket_connect_timeout=2,
                                                socket_timeout=2)

    async def close(self) -> None:
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    def announce(self, tenant_id: str | None, reason: str) -> None:
        """Tells the other replicas, in the background, that this one evicted ``tenant_id``'s
        blocks (every tenant's for None). Never raises or waits: a lost message is caught by
        the generation check on the tenant's next request."""
        if self._redis is None:
            return
        task = asyncio.get_running_loop().create_task(self._publish(tenant_id, reason))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, tenant_id: str | None, reason: str) -> None:
        try:
            await asyncio.wait_for(self._redis.publish(self.config.channel, event_json(
                self.origin, self.config.replica_id, tenant_id, reason)), 2.0)
        except Exception as e:  # noqa: BLE001 - the per-request check is the fallback
            logger.error("could not publish a cache event (%s); other replicas will catch up "
                         "on the tenant's next request", type(e).__name__)


class ClusterListener:
    """This replica's receiving end: applies the other replicas' events.

    Args:
        config: where Redis is, the namespace and this replica's id.
        origin: this process's own ``ClusterBroadcast.origin`` (its events are skipped).
        apply: called with the tenant id of each other replica's event (None: every tenant),
            on the event loop (``CacheGenerationService.on_broadcast``: it re-reads the
            generations from the database).
        reconnect_s: wait between attempts while Redis is unreachable.
    """

    def __init__(self, config: ClusterConfig, origin: str,
                 apply: Callable[[str | None], Awaitable[object]],
                 reconnect_s: float = 1.0) -> None:
        self.config, self._origin = config, origin
        self._apply, self._reconnect_s = apply, reconnect_s
        self._sub: Any = None  # no read timeout, pinged every 15 s
        self._listener: asyncio.Task | None = None
        self.subscribed = asyncio.Event()  # set while the listener is subscribed (tests wait)

    def __repr__(self) -> str:
        return (f"ClusterListener(replica_id={self.config.replica_id!r}, "
                f"redis={self.config.redis_url is not None})")

    async def start(self) -> None:
        """Starts listening in the background (retried while Redis is down). No-op without
        Redis.

        Raises:
            RuntimeError: a Redis URL is set but the ``redis`` package is missing.
        """
        url = self.config.redis_url
        if url is None:
            return
        # A half-open connection (a failover without a reset) is noticed by the pings.
        self._sub = _redis_asyncio().from_url(url, socket_connect_timeout=2,
                                              socket_keepalive=True, health_check_interval=15)
        self._listener = asyncio.create_task(self._listen(), name="cluster-events")

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.aclose()

    async def _listen(self) -> None:
        while True:
            try:
                async with self._sub.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.config.channel)
                    self.subscribed.set()
                    logger.info("listening for cache events on redis channel %s",
                                self.config.channel)
                    while True:  # wakes up every second, so the health checks run
                        message = await pubsub.get_message(timeout=1.0)
                        if message is not None and message.get("type") == "message":
                            await self._handle(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Redis down: retry; requests still check
                self.subscribed.clear()
                logger.warning("cache events: redis unavailable (%s); retrying in %.0f s",
                               type(e).__name__, self._reconnect_s)
                await asyncio.sleep(self._reconnect_s)

    async def _handle(self, data: bytes | str) -> None:
        try:
            event = json.loads(data)
            if not isinstance(event, dict) or event.get("origin") == self._origin:
                return
            tenant_id = event.get("tenant_id")
            if tenant_id is not None and not (isinstance(tenant_id, str)
                                              and TENANT_ID.fullmatch(tenant_id)):
                return  # not one of our events
            await self._apply(tenant_id)
        except Exception as e:  # noqa: BLE001 - one bad event never stops the listener
            logger.error("could not apply a cache event: %s", type(e).__name__)
