"""tenants/salt_versions.py: one eviction per salt change, whoever notices it first."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tenants.salt_versions import SaltVersions


def test_first_sighting_evicts_nothing() -> None:
    v = SaltVersions()
    assert v.last_seen("t") is None
    assert v.note_seen("t", 3) is None  # nothing of "t" can be cached before we saw it
    assert v.last_seen("t") == 3
    assert v.note_seen("t", 3) is None  # same version again: nothing to do


def test_newer_version_evicts_exactly_once() -> None:
    v = SaltVersions()
    v.note_seen("t", 1)
    assert v.note_seen("t", 2) == 1  # rotated elsewhere: this caller evicts
    assert v.note_seen("t", 2) is None  # the next request does not evict again
    assert v.note_seen("t", 5) == 2  # a jump of several versions evicts once too
    assert v.last_seen("t") == 5


def test_admin_rotation_suppresses_the_next_eviction() -> None:
    v = SaltVersions()
    v.note_seen("t", 1)
    v.note_rotated("t", 2)  # the admin route evicts for itself
    assert v.note_seen("t", 2) is None
    v.note_rotated("u", 4)  # rotation of a tenant not seen yet
    assert v.note_seen("u", 4) is None and v.last_seen("u") == 4


def test_older_version_is_ignored_and_never_moves_back() -> None:
    v = SaltVersions()
    v.note_seen("t", 3)
    assert v.note_seen("t", 2) is None  # a request that read the tenant before the rotation
    assert v.last_seen("t") == 3
    v.note_rotated("t", 1)
    assert v.last_seen("t") == 3
    assert v.note_seen("t", 4) == 3


def test_tenants_are_independent() -> None:
    v = SaltVersions()
    v.note_seen("a", 1)
    v.note_seen("b", 1)
    assert v.note_seen("a", 2) == 1
    assert v.note_seen("b", 1) is None and v.last_seen("b") == 1
    assert repr(v) == "SaltVersions(tenants=2)"


def test_concurrent_sightings_evict_once() -> None:
    v = SaltVersions()
    v.note_seen("t", 1)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda _: v.note_seen("t", 2), range(200)))
    assert results.count(1) == 1 and results.count(None) == 199
