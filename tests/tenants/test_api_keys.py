"""tenants/api_keys.py: key format, parsing, hashing and verification."""

from __future__ import annotations

import hashlib
import re

import pytest

from tenants.api_keys import (
    generate_api_key,
    hash_secret,
    looks_like_api_key,
    parse_api_key,
    verify_secret,
)


def test_generated_key_format() -> None:
    new = generate_api_key()
    assert re.fullmatch(r"ss-[0-9a-f]{12}-[A-Za-z0-9_-]{43}", new.token)
    assert new.display_prefix == f"ss-{new.key_id}"
    secret = new.token.split("-", 2)[2]
    assert new.key_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert new.last4 == secret[-4:]
    assert secret not in repr(new)
    assert generate_api_key().token != new.token


def test_parse_round_trip() -> None:
    new = generate_api_key()
    parsed = parse_api_key(new.token)
    assert parsed is not None
    assert parsed.key_id == new.key_id
    assert verify_secret(parsed.secret, new.key_hash)
    assert parsed.secret not in repr(parsed)
    assert looks_like_api_key(new.token)


@pytest.mark.parametrize(
    "token",
    [
        "",
        "ss-",
        "ss-0123456789ab",
        "ss-0123456789ab-short",
        "ss-0123456789AB-" + "a" * 43,  # key id must be lowercase
        "ss-0123456789a-" + "a" * 43,
        "sk-0123456789ab-" + "a" * 43,
        "ss-0123456789ab-" + "a" * 42 + "!",
        " ss-0123456789ab-" + "a" * 43,
        "eyJhbGciOiJIUzI1NiJ9.e30.sig",
    ],
)
def test_parse_rejects_malformed(token: str) -> None:
    assert parse_api_key(token) is None


def test_verify_secret() -> None:
    new = generate_api_key()
    secret = new.token.split("-", 2)[2]
    assert verify_secret(secret, new.key_hash)
    assert not verify_secret(secret + "x", new.key_hash)
    assert not verify_secret(secret, None)  # unknown key id: dummy compare, always False
    assert hash_secret(secret) == new.key_hash


def test_generate_with_invalid_key_id() -> None:
    with pytest.raises(ValueError):
        generate_api_key("XYZ")
