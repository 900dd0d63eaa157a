"""app/services/cache_generations.py: one eviction per salt rotation or cache reset, whoever
notices it first."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from app.services.cache_generations import CacheGenerations, CacheGenerationService
from tenants.errors import TenantNotFound
from tenants.records import AuthContext, TenantInfo
from tenants.salts import SealedSalt


def test_first_sighting_evicts_nothing() -> None:
    g = CacheGenerations()
    assert g.last_seen("t") is None
    assert g.note_seen("t", 3, 2) is None  # nothing of "t" can be cached before we saw it
    assert g.last_seen("t") == (3, 2)
    assert g.note_seen("t", 3, 2) is None  # the same generation again: nothing to do


def test_a_newer_salt_or_epoch_evicts_exactly_once_with_its_reason() -> None:
    g = CacheGenerations()
    g.note_seen("t", 1, 0)
    assert g.note_seen("t", 2, 0) == "salt_rotation"  # rotated elsewhere: this caller evicts
    assert g.note_seen("t", 2, 0) is None  # the next request does not evict again
    assert g.note_seen("t", 2, 1) == "reset"  # reset elsewhere
    assert g.note_seen("t", 5, 3) == "salt_rotation"  # both moved: one eviction
    assert g.note_seen("t", 5, 3) is None
    assert g.last_seen("t") == (5, 3)


def test_applied_changes_suppress_the_next_eviction() -> None:
    g = CacheGenerations()
    g.note_seen("t", 1, 0)
    g.note_applied("t", 2, 0)  # the admin route evicts for itself
    assert g.note_seen("t", 2, 0) is None
    g.note_applied("t", 2, 1)
    assert g.note_seen("t", 2, 1) is None
    g.note_applied("u", 4, 7)  # a change to a tenant not seen yet
    assert g.note_seen("u", 4, 7) is None and g.last_seen("u") == (4, 7)


def test_older_generations_are_ignored_and_never_move_back() -> None:
    g = CacheGenerations()
    g.note_seen("t", 3, 3)
    assert g.note_seen("t", 2, 3) is None  # a request that read the tenant before a rotation
    assert g.note_seen("t", 3, 1) is None
    assert g.last_seen("t") == (3, 3)
    g.note_applied("t", 1, 0)
    assert g.last_seen("t") == (3, 3)
    # An older salt with a newer epoch: only the epoch moves, and it is a reset.
    assert g.note_seen("t", 2, 4) == "reset" and g.last_seen("t") == (3, 4)


def test_tenants_are_independent() -> None:
    g = CacheGenerations()
    g.note_seen("a", 1)
    g.note_seen("b", 1)
    assert g.note_seen("a", 2) == "salt_rotation"
    assert g.note_seen("b", 1) is None and g.last_seen("b") == (1, 0)
    assert repr(g) == "CacheGenerations(tenants=2)"


def test_concurrent_sightings_evict_once() -> None:
    g = CacheGenerations()
    g.note_seen("t", 1, 0)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda i: g.note_seen("t", 1 + i % 2, i % 2), range(200)))
    assert results.count("salt_rotation") == 1 and results.count(None) == 199


# -- the service: who evicts, and how often ----------------------------------------------------
class _Engine:
    """Records evictions; each drops a fixed number of blocks."""

    def __init__(self) -> None:
        self.evictions: list[tuple[str | None, str]] = []

    async def evict_tenant_cache(self, tenant_id: str, reason: str) -> int:
        self.evictions.append((tenant_id, reason))
        return 3

    async def reset_prefix_cache(self) -> int:
        self.evictions.append((None, "reset"))
        return 7


class _Broadcast:
    def __init__(self) -> None:
        self.sent: list[tuple[str | None, str]] = []

    def announce(self, tenant_id: str | None, reason: str) -> None:
        self.sent.append((tenant_id, reason))


def _tenant(tenant_id: str, salt_version: int = 1, cache_epoch: int = 0) -> TenantInfo:
    return TenantInfo(tenant_id, f"name-{tenant_id}", False, salt_version, True,
                      datetime(2026, 1, 1, tzinfo=UTC), cache_epoch=cache_epoch)


def _ctx(tenant_id: str, salt_version: int, cache_epoch: int = 0) -> AuthContext:
    return AuthContext(tenant_id, f"name-{tenant_id}", None, salt_version, True,
                       SealedSalt(bytes(32)), cache_epoch=cache_epoch)


def _service(db: dict[str, TenantInfo]) -> tuple[CacheGenerationService, _Engine, _Broadcast]:
    def get(tenant_id: str) -> TenantInfo:
        if tenant_id not in db:
            raise TenantNotFound(tenant_id)
        return db[tenant_id]

    engine, broadcast = _Engine(), _Broadcast()
    return (CacheGenerationService(engine, get, lambda: list(db.values()), broadcast), engine,
            broadcast)


def test_a_request_at_a_newer_generation_evicts_once_and_a_first_sighting_never() -> None:
    svc, engine, broadcast = _service({})
    assert asyncio.run(svc.on_request(_ctx("a", 1))) == 0  # first sight: nothing cached yet
    assert asyncio.run(svc.on_request(_ctx("a", 2))) == 3  # rotated behind our back
    assert asyncio.run(svc.on_request(_ctx("a", 2))) == 0
    assert asyncio.run(svc.on_request(_ctx("a", 2, 1))) == 3  # reset behind our back
    assert engine.evictions == [("a", "salt_rotation"), ("a", "reset")]
    assert broadcast.sent == []  # a request never broadcasts: the change was someone else's


def test_a_change_applied_here_evicts_here_broadcasts_and_is_not_evicted_again() -> None:
    svc, engine, broadcast = _service({})
    asyncio.run(svc.on_request(_ctx("a", 1)))
    assert asyncio.run(svc.applied(_tenant("a", 2), "salt_rotation")) == 3
    assert engine.evictions == [("a", "salt_rotation")]
    assert broadcast.sent == [("a", "salt_rotation")]
    assert asyncio.run(svc.on_request(_ctx("a", 2))) == 0  # the next request: already done
    assert asyncio.run(svc.applied_to_all([_tenant("a", 2, 1), _tenant("b", 1, 1)])) == 7
    assert broadcast.sent[-1] == (None, "reset")
    assert asyncio.run(svc.on_request(_ctx("a", 2, 1))) == 0
    assert asyncio.run(svc.on_request(_ctx("b", 1, 1))) == 0
    assert engine.evictions == [("a", "salt_rotation"), (None, "reset")]


def test_a_broadcast_is_a_hint_checked_against_the_database() -> None:
    db = {"a": _tenant("a", 1), "b": _tenant("b", 1)}
    svc, engine, broadcast = _service(db)
    for t in ("a", "b"):
        asyncio.run(svc.on_request(_ctx(t, 1)))
    # A forged or replayed event: nothing is newer in the database, nothing is dropped.
    assert asyncio.run(svc.on_broadcast("a")) == 0
    assert asyncio.run(svc.on_broadcast(None)) == 0
    assert asyncio.run(svc.on_broadcast("f" * 32)) == 0  # an unknown tenant
    db["a"] = _tenant("a", 2)  # another replica rotated a's salt
    assert asyncio.run(svc.on_broadcast("a")) == 3
    assert asyncio.run(svc.on_broadcast("a")) == 0  # the same event again
    db["b"] = _tenant("b", 1, 4)  # another replica reset every cache; only b had moved on
    assert asyncio.run(svc.on_broadcast(None)) == 3
    assert engine.evictions == [("a", "salt_rotation"), ("b", "reset")]
    assert asyncio.run(svc.on_request(_ctx("b", 1, 4))) == 0  # b's next request: done
    assert broadcast.sent == []  # applying another's event is never re-broadcast
