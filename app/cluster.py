"""Cache evictions that every replica applies: a Redis pub/sub broadcast, with a fallback.

Replicas share PostgreSQL (tenants, keys, salts, usage, audit) but each holds its own KV cache.
When an operator rotates a tenant's salt, resets a tenant's cache, resets every cache or turns a
tenant's caching off on one replica, that replica evicts its own blocks, commits the new
generation (salt version, cache epoch; ``tenants.cache_generations``) and publishes an event on
``<namespace>:cache-events``; every other replica evicts the same blocks on receipt (milliseconds). Nothing else
needs a message: disable and enable, limits, key and token revocation are read from the database
on every request.

Pub/sub delivers at most once, so a replica that was disconnected misses events. The fallback
is the generation check on each request (``app.auth``): a tenant's next request on a replica
that missed the event meets a newer salt version or cache epoch and evicts then. A missed
message therefore costs memory until the tenant's next request, never isolation (blocks of an
older salt can never be hit again).

Events are JSON: ``{"origin": replica id, "tenant_id": id or null (every tenant), "salt_version",
"cache_epoch", "reason"}``; no salts, no keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
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

    redis_url: str | None = None
    namespace: str = "saltserve"
    replica_id: str = "local"

    @property
    def channel(self) -> str:
        return f"{self.namespace}:cache-events"


def publish_now(config: ClusterConfig, tenant_id: str | None, salt_version: int | None,
                cache_epoch: int | None, reason: str) -> int:
    """Publishes one event from outside a server (the CLI), synchronously. Returns how many
    replicas received it (0 without Redis, or when Redis is unreachable: they catch up on the
    tenant's next request)."""
    if config.redis_url is None:
        return 0
    import redis

    event = {"origin": config.replica_id, "tenant_id": tenant_id, "salt_version": salt_version,
             "cache_epoch": cache_epoch, "reason": reason}
    try:
        client = redis.Redis.from_url(config.redis_url, socket_timeout=2,
                                      socket_connect_timeout=2)
        return int(client.publish(config.channel, json.dumps(event)))
    except redis.RedisError as e:
        logger.warning("could not tell the replicas (%s); they catch up on the tenant's next "
                       "request", type(e).__name__)
        return 0


class ClusterEvents:
    """This replica's end of the broadcast.

    Args:
        config: where Redis is, the namespace and this replica's id (its own events are not
            applied twice).
        apply: called with each other replica's event, on the event loop.
        reconnect_s: wait between attempts while Redis is unreachable.
    """

    def __init__(self, config: ClusterConfig,
                 apply: Callable[[dict[str, Any]], Awaitable[None]],
                 reconnect_s: float = 1.0) -> None:
        self.config = config
        self.redis_url, self.replica_id = config.redis_url, config.replica_id
        self._apply, self._reconnect_s = apply, reconnect_s
        self._redis: Any = None
        self._listener: asyncio.Task | None = None
        self.subscribed = asyncio.Event()  # set while the listener is subscribed (tests wait)

    def __repr__(self) -> str:
        return f"ClusterEvents(replica_id={self.replica_id!r}, redis={self.redis_url is not None})"

    async def start(self) -> None:
        """Connects and starts listening (in the background; retried while Redis is down)."""
        if self.redis_url is None:
            return
        try:
            import redis.asyncio as aioredis
        except ImportError:
            raise RuntimeError("SALTSERVE_REDIS_URL needs the redis package: "
                               "pip install 'saltserve[redis]'") from None
        self._redis = aioredis.from_url(self.redis_url, socket_connect_timeout=2)
        self._listener = asyncio.create_task(self._listen(), name="cluster-events")

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    async def publish(self, tenant_id: str | None, salt_version: int | None,
                      cache_epoch: int | None, reason: str) -> None:
        """Tells the other replicas about an eviction this one has done. Never raises: a lost
        message is caught by the generation check on the tenant's next request."""
        if self._redis is None:
            return
        event = {"origin": self.replica_id, "tenant_id": tenant_id,
                 "salt_version": salt_version, "cache_epoch": cache_epoch, "reason": reason}
        try:
            await self._redis.publish(self.config.channel, json.dumps(event))
        except Exception as e:  # noqa: BLE001 - the per-request check is the fallback
            logger.error("could not publish a cache event (%s); other replicas will catch up "
                         "on the tenant's next request", type(e).__name__)

    async def _listen(self) -> None:
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.config.channel)
                    self.subscribed.set()
                    logger.info("listening for cache events on redis channel %s",
                                self.config.channel)
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
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
            if not isinstance(event, dict) or event.get("origin") == self.replica_id:
                return
            await self._apply(event)
        except Exception as e:  # noqa: BLE001 - one bad event never stops the listener
            logger.error("could not apply a cache event: %s", type(e).__name__)
