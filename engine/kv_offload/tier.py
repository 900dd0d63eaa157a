"""What a store behind the block pool provides (``DiskStore``, ``RedisStore``; an object store
or LMCache would be one more class with these methods).

A tier stores opaque sealed blobs (``engine.kv_offload.cipher``) under a block's chained hash,
for an owner (the tenant id; disk and Redis store a keyed tag of it, ``owner_tag``), under a byte budget it shares fairly between
owners. It never sees plaintext KV, salts or tenant names it does not need; every method is
safe to call from any thread, and no method raises on a store failure: a read that fails is a
miss (None), a write that fails returns False, and the tier says whether it is ``up``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


def owner_tag(key: bytes, owner: str) -> str:
    """The opaque tag a tier stores for ``owner`` (a tenant id, "" for none): a keyed BLAKE2b
    digest, 24 hex characters. With the deployment's secret ``key`` (derived from the master
    key), the store's operator sees which blobs belong together, never whose they are, even
    for a tenant id it could guess."""
    return hashlib.blake2b(owner.encode(), key=key[:64], digest_size=12).hexdigest()


def fair_shares(capacity_bytes: int, owners, shares: dict) -> dict[str, int]:
    """Each of ``owners``' guaranteed bytes now: ``capacity_bytes`` split by weight among
    them, clamped to the owner's floor and cap (``shares``: owner -> (weight, floor fraction
    or None, cap fraction or None); absent: (1, None, None)). The pool's
    ``prefix_cache_share_blocks``, in bytes."""
    default = (1, None, None)
    total = sum(shares.get(o, default)[0] for o in owners)
    out = {}
    for o in owners:
        weight, low, high = shares.get(o, default)
        share = capacity_bytes * weight / total
        if low is not None:
            share = max(share, low * capacity_bytes)
        if high is not None:
            share = min(share, high * capacity_bytes)
        out[o] = int(share)
    return out


class ThrottledWarning:
    """Logs a warning at most once every ``every_s`` seconds (a failing tier would otherwise
    log once a block); the rest are dropped (their counters say how many)."""

    def __init__(self, logger: logging.Logger, prefix: str, every_s: float = 60.0) -> None:
        self._logger, self._prefix, self._every_s = logger, prefix, every_s
        self._last = -every_s

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last >= self._every_s:
            self._last = now
            self._logger.warning(self._prefix + message, *args)


@dataclass(frozen=True)
class TierUsage:
    """A tier's occupancy now (bytes and blobs are gauges; ``evicted`` counts blobs evicted to
    stay in the budget since start; ``owner_bytes`` maps owner -> bytes held and
    ``owner_share_bytes`` owner -> bytes its fair share guarantees now, for the owners holding
    blobs)."""

    capacity_bytes: int
    used_bytes: int
    blobs: int
    evicted: int
    owner_bytes: dict[str, int]
    up: bool = True
    owner_share_bytes: dict[str, int] = field(default_factory=dict)


class OffloadTier(Protocol):
    """One store behind the pool (see the module docstring)."""

    name: str  # "disk", "redis": the ``tier`` label of its metrics
    local: bool  # True: ``__contains__`` is exact; False: it knows only what this process saw
    write_through: bool  # True: written as soon as a step computes a block, not at eviction

    def __contains__(self, key: bytes) -> bool:
        """Whether the tier holds ``key``, from a local index (no I/O; the engine thread calls
        it while it plans a step). A remote tier may answer False for a blob another replica
        wrote: ``query`` asks the store."""
        ...

    def query(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each of ``keys`` (one round trip at most)."""
        ...

    def put(self, key: bytes, blob: bytes, owner: str) -> bool:
        """Stores ``blob`` under ``key`` for ``owner``, evicting by the fair budget; True when
        stored (or already there)."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The blob under ``key`` (now the most recently used), or None."""
        ...

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """A hint that ``get`` follows for ``keys``, in order: start the reads (a no-op where
        a read does not wait on a device)."""
        ...

    def delete(self, key: bytes) -> None: ...

    def set_share(self, owner: str, weight: int, min_fraction: float | None = None,
                  max_fraction: float | None = None) -> None:
        """The owner's weight, floor and cap (fractions of the budget) in the fair rule."""
        ...

    def delete_owner(self, owner: str) -> int:
        """Deletes every blob of ``owner``; returns how many."""
        ...

    def delete_all(self) -> int:
        """Deletes every blob; returns how many."""
        ...

    # Local tiers only: an owner's blobs leave the index at once, their storage later.
    def forget_owner(self, owner: str | None) -> list: ...

    def drop_blobs(self, blobs: list) -> None: ...

    def usage(self) -> TierUsage: ...
