"""Tenant API key format, generation, hashing and constant-time verification.

Format::

    ss-<key id: 12 lowercase hex>-<secret: secrets.token_urlsafe(32), 43 chars, 256 bits>

The key id is public (the row's primary key; ``display_prefix`` = ``ss-<key id>``). Only
``sha256(secret).hexdigest()`` is stored. A plain, fast hash is enough here because the secret
has 256 bits of entropy (nothing to brute-force), unlike a password.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field

KEY_PREFIX = "ss"
KEY_ID_HEX_CHARS = 12
SECRET_BYTES = 32

# token_urlsafe(32) gives 43 chars; accept up to 256 so future longer secrets still parse.
_TOKEN_RE = re.compile(r"ss-([0-9a-f]{12})-([A-Za-z0-9_-]{43,256})")

# Compared against when the key id is unknown, so that path costs the same as a wrong secret.
_DUMMY_HASH = hashlib.sha256(b"saltserve/dummy-api-key-secret").hexdigest()


@dataclass(frozen=True)
class ParsedApiKey:
    """A syntactically valid API key split into its parts."""

    key_id: str
    secret: str = field(repr=False)

    def __repr__(self) -> str:
        return f"ParsedApiKey(key_id={self.key_id!r}, secret=<redacted>)"


@dataclass(frozen=True)
class NewApiKey:
    """A freshly generated key. ``token`` is shown to the user once and never stored."""

    token: str = field(repr=False)
    key_id: str
    key_hash: str
    display_prefix: str
    last4: str

    def __repr__(self) -> str:
        return f"NewApiKey(key_id={self.key_id!r}, token=<redacted>)"


def new_key_id() -> str:
    """Returns a random key id: 12 lowercase hex chars (48 bits)."""
    return secrets.token_hex(KEY_ID_HEX_CHARS // 2)


def display_prefix(key_id: str) -> str:
    """Returns the recognisable, non-secret prefix of a key, ``ss-<key id>``."""
    return f"{KEY_PREFIX}-{key_id}"


def hash_secret(secret: str) -> str:
    """Returns the stored form of a key secret: lowercase hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def generate_api_key(key_id: str | None = None) -> NewApiKey:
    """Generates a new API key.

    Args:
        key_id: the key id to use (12 lowercase hex), or None for a random one.

    Returns:
        The token and the parts to store.

    Raises:
        ValueError: if ``key_id`` is not 12 lowercase hex chars.
    """
    key_id = new_key_id() if key_id is None else key_id
    if not re.fullmatch(r"[0-9a-f]{12}", key_id):
        raise ValueError("key id must be 12 lowercase hex chars")
    secret = secrets.token_urlsafe(SECRET_BYTES)
    return NewApiKey(
        token=f"{display_prefix(key_id)}-{secret}",
        key_id=key_id,
        key_hash=hash_secret(secret),
        display_prefix=display_prefix(key_id),
        last4=secret[-4:],
    )


def parse_api_key(token: str) -> ParsedApiKey | None:
    """Splits a token into key id and secret.

    Args:
        token: the bearer token.

    Returns:
        The parts, or None if ``token`` does not have the API key format (it may be a JWT).
    """
    if not isinstance(token, str):
        return None
    match = _TOKEN_RE.fullmatch(token)
    if match is None:
        return None
    return ParsedApiKey(key_id=match.group(1), secret=match.group(2))


def looks_like_api_key(token: str) -> bool:
    """Returns True if ``token`` starts like a saltserve API key (cheap routing vs JWT)."""
    return isinstance(token, str) and token.startswith(f"{KEY_PREFIX}-")


def verify_secret(secret: str, key_hash: str | None) -> bool:
    """Checks a secret against a stored hash in constant time.

    Args:
        secret: the secret part of the presented token.
        key_hash: the stored hex SHA-256, or None when the key id is unknown (a dummy hash is
            compared instead, so both paths take the same time; the result is then False).

    Returns:
        True only if ``key_hash`` is not None and matches.
    """
    expected = _DUMMY_HASH if key_hash is None else key_hash
    ok = hmac.compare_digest(hash_secret(secret).encode("ascii"), expected.encode("ascii"))
    return ok and key_hash is not None
