"""tenants/cache_generations.py: one eviction per salt rotation or cache reset, whoever
notices it first."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tenants.cache_generations import CacheGenerations


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
