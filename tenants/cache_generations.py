"""``CacheGenerations``: which generation of each tenant's cache this process last saw.

A tenant's cached blocks belong to a generation: its salt version (bumped by a rotation) and its
cache epoch (bumped by a reset; ``TenantStore.bump_cache_epoch``). Either can move on in this
process (the admin API, the console) or in another one (another replica, ``saltserve tenants
rotate-salt``). Blocks of an older generation should be released once, promptly:

- the process that rotates or resets evicts for itself and calls ``note_applied``, so its next
  authentication at the new generation does not evict again; so does a replica applying the
  broadcast of another's action (``app.cluster``);
- an authentication (or a broadcast) that meets a newer generation than the one last seen gets
  the reason back from ``note_seen`` and is the one caller that evicts.

Holds tenant ids and integers only (never salts). Thread-safe: one lock guards the map, and every
method is a single short critical section, so it may be called from the event loop or from
worker threads. Memory: one entry per tenant seen since the process started.
"""

from __future__ import annotations

import threading
from typing import Literal

__all__ = ["CacheGenerations", "EvictReason"]

EvictReason = Literal["salt_rotation", "reset"]


class CacheGenerations:
    """The last (salt version, cache epoch) seen per tenant, in this process (starts empty)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, int]] = {}  # tenant id -> (salt version, cache epoch)

    def __repr__(self) -> str:
        with self._lock:
            return f"CacheGenerations(tenants={len(self._seen)})"

    def note_seen(self, tenant_id: str, salt_version: int,
                  cache_epoch: int = 0) -> EvictReason | None:
        """Records that a request (or a broadcast) carries this generation.

        Returns:
            Why the tenant's cached blocks must go when the generation is newer than the one
            last seen (``salt_rotation`` when the salt moved on, else ``reset``): exactly one
            caller per change gets it. None on the first sighting since start (nothing of this
            tenant can be cached yet) and when nothing is newer (a request that read the tenant
            before a change never moves the record back).
        """
        with self._lock:
            last = self._seen.get(tenant_id)
            if last is None:
                self._seen[tenant_id] = (salt_version, cache_epoch)
                return None
            newer_salt, newer_epoch = salt_version > last[0], cache_epoch > last[1]
            if not (newer_salt or newer_epoch):
                return None
            self._seen[tenant_id] = (max(salt_version, last[0]), max(cache_epoch, last[1]))
            return "salt_rotation" if newer_salt else "reset"

    def note_applied(self, tenant_id: str, salt_version: int, cache_epoch: int = 0) -> None:
        """Records a change to this generation that this process evicted for itself, so the
        next ``note_seen`` at it reports nothing. Never moves the record back."""
        with self._lock:
            last = self._seen.get(tenant_id, (0, 0))
            self._seen[tenant_id] = (max(salt_version, last[0]), max(cache_epoch, last[1]))

    def last_seen(self, tenant_id: str) -> tuple[int, int] | None:
        """The last (salt version, cache epoch) seen or applied for ``tenant_id``, or None."""
        with self._lock:
            return self._seen.get(tenant_id)
