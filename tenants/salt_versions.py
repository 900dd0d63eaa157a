"""``SaltVersions``: which salt version this server process last saw per tenant.

A tenant's salt can be rotated by this process (``POST /admin/tenants/{id}/rotate-salt``) or by
another one (``saltserve tenants rotate-salt``). Blocks cached under the old version are
unreachable either way, but they should be released once, promptly:

- the admin route rotates, calls ``note_rotated`` and evicts the tenant's blocks itself, so the
  next authentication at the new version must not evict again;
- an authentication that meets a newer version than the one last seen (a rotation done elsewhere)
  gets the old version back from ``note_seen`` and is the one caller that evicts.

Holds tenant ids and integers only (never salts). Thread-safe: one lock guards the map, and every
method is a single short critical section, so it may be called from the event loop or from
worker threads. Memory: one entry per tenant seen since the process started.
"""

from __future__ import annotations

import threading

__all__ = ["SaltVersions"]


class SaltVersions:
    """The last salt version seen per tenant, in this process (starts empty)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}  # tenant id -> last salt version seen

    def __repr__(self) -> str:
        with self._lock:
            return f"SaltVersions(tenants={len(self._seen)})"

    def note_seen(self, tenant_id: str, version: int) -> int | None:
        """Records that a request authenticated at ``version``.

        Args:
            tenant_id: the tenant.
            version: the salt version the request carries (>= 1).

        Returns:
            The previously seen version when ``version`` is newer than it: the caller must evict
            the tenant's cached blocks (exactly one caller per change gets it). None on the
            first sighting since start (nothing of this tenant can be cached yet) and when
            ``version`` is not newer (an older version, from a request that read the tenant
            before a rotation, is ignored and never moves the record back).
        """
        with self._lock:
            last = self._seen.get(tenant_id)
            if last is not None and version <= last:
                return None
            self._seen[tenant_id] = version
            return last

    def note_rotated(self, tenant_id: str, version: int) -> None:
        """Records a rotation to ``version`` that this process evicts for itself (admin API), so
        the next ``note_seen`` at that version reports nothing. Never moves the record back."""
        with self._lock:
            if version > self._seen.get(tenant_id, 0):
                self._seen[tenant_id] = version

    def last_seen(self, tenant_id: str) -> int | None:
        """The last version seen or rotated to for ``tenant_id``, or None if never."""
        with self._lock:
            return self._seen.get(tenant_id)
