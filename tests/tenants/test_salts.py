"""tenants/salts.py: effective salt derivation, client cache_salt validation, ``SealedSalt``."""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import pickle

import pytest

from tenants.salts import SealedSalt, effective_salt, new_salt, validate_client_cache_salt


def test_new_salt_is_32_random_bytes() -> None:
    a, b = new_salt(), new_salt()
    assert len(a) == 32 and len(b) == 32
    assert a != b


def test_effective_salt_layout_vector() -> None:
    """Pins the documented byte layout (module docstring of tenants.salts)."""
    tenant_salt = bytes(range(32))
    expected_none = hmac.new(
        tenant_salt, b"saltserve/effective-salt/v1" + b"\x00\x00\x00\x07" + b"\x00", hashlib.sha256
    ).digest()
    expected_client = hmac.new(
        tenant_salt,
        b"saltserve/effective-salt/v1"
        + b"\x00\x00\x00\x07"
        + b"\x01"
        + b"\x00\x00\x00\x04"
        + "ü-1".encode(),
        hashlib.sha256,
    ).digest()
    assert effective_salt(tenant_salt, 7, None) == expected_none
    assert effective_salt(tenant_salt, 7, "ü-1") == expected_client
    assert effective_salt(tenant_salt, 7, None).hex() == (
        "37414221e5a067415eadc7eeb90e5967a3b59f13b1124841f627e2c989079ca4"
    )


def test_effective_salt_is_deterministic_and_32_bytes() -> None:
    salt = new_salt()
    assert effective_salt(salt, 1, "user-1") == effective_salt(salt, 1, "user-1")
    assert len(effective_salt(salt, 1, "user-1")) == 32
    assert len(effective_salt(salt, 1, None)) == 32


def test_effective_salt_differs_per_tenant_with_same_client_salt() -> None:
    tenant_a, tenant_b = new_salt(), new_salt()
    assert effective_salt(tenant_a, 1, "shared") != effective_salt(tenant_b, 1, "shared")
    assert effective_salt(tenant_a, 1, None) != effective_salt(tenant_b, 1, None)


def test_effective_salt_differs_with_and_without_client_salt() -> None:
    salt = new_salt()
    values = {
        effective_salt(salt, 1, None),
        effective_salt(salt, 1, "a"),
        effective_salt(salt, 1, "b"),
        effective_salt(salt, 2, None),
        effective_salt(salt, 2, "a"),
    }
    assert len(values) == 5


def test_validate_client_cache_salt() -> None:
    assert validate_client_cache_salt("x") == "x"
    assert validate_client_cache_salt("y" * 128) == "y" * 128
    for bad in ["", "z" * 129, "\ud800"]:
        with pytest.raises(ValueError):
            validate_client_cache_salt(bad)
    with pytest.raises(TypeError):
        validate_client_cache_salt(123)  # type: ignore[arg-type]


def test_effective_salt_rejects_bad_inputs() -> None:
    salt = new_salt()
    with pytest.raises(ValueError):
        effective_salt(salt, 1, "")
    with pytest.raises(ValueError):
        effective_salt(salt, 1, "q" * 129)
    with pytest.raises(ValueError):
        effective_salt(b"", 1, None)
    with pytest.raises(ValueError):
        effective_salt(salt, -1, None)
    with pytest.raises(ValueError):
        effective_salt(salt, 2**32, None)


def test_sealed_salt_derives_but_never_reveals() -> None:
    raw = bytes(range(32))
    sealed = SealedSalt(raw)
    assert sealed.derive(7) == effective_salt(raw, 7, None)
    assert sealed.derive(7, "ü-1") == effective_salt(raw, 7, "ü-1")
    assert sealed.derive(7).hex() == (
        "37414221e5a067415eadc7eeb90e5967a3b59f13b1124841f627e2c989079ca4"
    )
    text = repr(sealed) + str(sealed) + repr([sealed]) + f"{sealed!r}"
    assert "<redacted>" in text and raw.hex() not in text and repr(raw) not in text
    assert not any(isinstance(getattr(sealed, n, None), bytes) for n in dir(sealed)
                   if not n.startswith("_SealedSalt__"))  # no public or plain-private bytes
    with pytest.raises(TypeError):
        pickle.dumps(sealed)
    assert copy.copy(sealed) is sealed and copy.deepcopy(sealed) is sealed
    assert sealed != SealedSalt(raw)  # no comparison by value
    with pytest.raises(ValueError):
        sealed.derive(7, "")
    for bad in (b"", "not bytes"):
        with pytest.raises(ValueError):
            SealedSalt(bad)  # type: ignore[arg-type]


def test_sealed_salt_leak_check() -> None:
    raw = new_salt()
    sealed = SealedSalt(raw)
    for form in (raw.hex(), raw.hex().upper(), base64.b64encode(raw).decode(),
                 base64.urlsafe_b64encode(raw).decode(), repr(raw)):
        assert sealed.occurs_in(f"x{form}y")
    assert sealed.occurs_in(b"x" + raw + b"y") and sealed.occurs_in(raw.hex().encode())
    assert not sealed.occurs_in("nothing here") and not sealed.occurs_in(new_salt().hex())


def test_effective_salt_takes_both_ends_of_the_version_range() -> None:
    """Versions are 4 bytes big-endian: 0 and 2**32 - 1 are valid and distinct from their
    neighbours (just outside the range is refused above)."""
    salt = new_salt()
    ends = [effective_salt(salt, v, None) for v in (0, 1, 2**32 - 2, 2**32 - 1)]
    assert len(set(ends)) == 4 and all(len(e) == 32 for e in ends)
    assert effective_salt(salt, 2**32 - 1, "u") != effective_salt(salt, 0, "u")
