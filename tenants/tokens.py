"""JWT bearer tokens: platform-issued (Ed25519 key in the data dir) and external IdP (PEM / JWKS).

A token is accepted only if all of these hold:

- its header ``alg`` is in the configured allow-list (``none`` and HMAC ``HS*`` can never be
  configured: saltserve verifies asymmetric signatures only, so a public key can never be
  abused as an HMAC secret), *and* it belongs to the family of the key that verifies it
  (``EdDSA`` for Ed25519, ``RS*``/``PS*`` for RSA, ``ES*`` for EC): no algorithm confusion;
- the signature verifies with the platform key (header ``kid`` = the platform key's kid), a
  JWKS key with that ``kid`` (``PyJWKClient``: the key set is cached; an unknown kid refetches
  it at most once per ``jwks_refetch_cooldown_s``, so IdP key rotation needs no restart and a
  flood of junk kids causes at most one fetch per cooldown) or the configured public key file.
  The token's structure, algorithm and ``kid`` are checked before any fetch;
- a platform token (signed with the platform key) lives at most ``max_token_ttl_s``
  (``exp - iat``); ``issue_token`` refuses longer ones;
- ``exp``, ``iat``, ``iss``, ``aud`` and ``sub`` are present; ``iss``/``aud`` match the
  configuration; ``exp``/``iat`` are checked with the configured leeway (seconds);
- the role claim is ``tenant`` or ``admin``; a ``tenant`` token names a tenant id in the tenant
  claim. Whether that tenant exists and is enabled is checked by the caller (``app.auth``).

Platform key: ``<data_dir>/jwt-signing-key.pem`` (PKCS#8 PEM, mode 0600), generated once.
Tokens are never logged; errors say why only through ``InvalidToken.reason`` (logs only).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from tenants.crypto import require_private_file
from tenants.errors import InvalidToken

logger = logging.getLogger(__name__)

PLATFORM_KEY_FILENAME = "jwt-signing-key.pem"
ROLES = ("tenant", "admin")
Role = Literal["tenant", "admin"]

_FAMILIES: dict[type, frozenset[str]] = {
    ed25519.Ed25519PublicKey: frozenset({"EdDSA"}),
    rsa.RSAPublicKey: frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"}),
    ec.EllipticCurvePublicKey: frozenset({"ES256", "ES384", "ES512"}),
}
_SUPPORTED = frozenset().union(*_FAMILIES.values())
_REQUIRED_CLAIMS = ["exp", "iat", "iss", "aud", "sub"]


@dataclass(frozen=True)
class JWTConfig:
    """JWT verification settings (``app.settings.Settings.jwt_config`` builds one).

    Args:
        algorithms: allow-list of header ``alg`` values; asymmetric only.
        issuer: required ``iss``; platform tokens are issued with it.
        audience: required ``aud``; platform tokens are issued with it.
        leeway_s: clock skew tolerated on ``exp``/``iat``/``nbf``, seconds.
        tenant_claim: claim holding the tenant id.
        role_claim: claim holding ``tenant`` or ``admin``.
        public_key_file: PEM public key of an external identity provider, or None.
        jwks_url: JWKS endpoint of an external identity provider, or None.
        jwks_refetch_cooldown_s: least seconds between two JWKS fetches for unknown kids.
        max_token_ttl_s: longest lifetime of a platform token (seconds).
    """

    algorithms: tuple[str, ...] = ("EdDSA", "RS256")
    issuer: str = "saltserve"
    audience: str = "saltserve"
    leeway_s: float = 0.0
    tenant_claim: str = "tenant"
    role_claim: str = "role"
    public_key_file: Path | None = None
    jwks_url: str | None = None
    jwks_refetch_cooldown_s: float = 30.0
    max_token_ttl_s: int = 30 * 86400

    def __post_init__(self) -> None:
        bad = [a for a in self.algorithms if a not in _SUPPORTED]
        if bad or not self.algorithms:
            raise ValueError(
                f"unsupported JWT algorithms {bad}: allow only asymmetric ones from "
                f"{sorted(_SUPPORTED)} (never 'none' or HS*) in SALTSERVE_JWT_ALGORITHMS")
        if self.leeway_s < 0:
            raise ValueError("SALTSERVE_JWT_LEEWAY_S must be >= 0")
        if not self.tenant_claim or not self.role_claim:
            raise ValueError("SALTSERVE_JWT_TENANT_CLAIM / _ROLE_CLAIM must not be empty")
        if self.jwks_refetch_cooldown_s < 0:
            raise ValueError("SALTSERVE_JWT_JWKS_REFETCH_COOLDOWN_S must be >= 0")
        if self.max_token_ttl_s < 1:
            raise ValueError("SALTSERVE_JWT_MAX_TOKEN_TTL_S must be >= 1")


@dataclass(frozen=True)
class TokenClaims:
    """The verified identity of a JWT: ``sub``, role, (optional for admins) tenant id, and the
    ``jti`` when the token has one (every platform token does; revocable by it)."""

    subject: str
    role: Role
    tenant_id: str | None
    jti: str | None = field(default=None, compare=False)  # not part of the identity
    expires_at: int | None = field(default=None, compare=False)  # ``exp``, unix seconds


def key_id(public_key: Any) -> str:
    """A stable ``kid`` for a public key: the first 16 hex chars of sha256 of its DER SPKI."""
    der = public_key.public_bytes(serialization.Encoding.DER,
                                  serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()[:16]


def load_or_create_platform_key(data_dir: Path) -> ed25519.Ed25519PrivateKey:
    """Returns the platform's Ed25519 signing key, generating ``jwt-signing-key.pem`` (0600) once.

    Written atomically (temporary file + ``os.link``), so concurrent first starts agree on one key.

    Raises:
        ValueError: if the file exists but does not hold an Ed25519 private key, or group or
            others may access it (``tenants.crypto.require_private_file``).
    """
    path = Path(data_dir) / PLATFORM_KEY_FILENAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        pem = ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption())
        fd, tmp = tempfile.mkstemp(prefix=".jwt-key.", dir=path.parent)  # mode 0600
        try:
            os.write(fd, pem)
            os.fsync(fd)
            os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            else:
                logger.info("generated a new JWT signing key at %s", path)
        finally:
            os.unlink(tmp)
    require_private_file(path)
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ValueError(  # noqa: TRY004 - misconfiguration is a ValueError (STYLE.md)
            f"{path} must hold an Ed25519 private key (delete it to regenerate)")
    return key


def issue_token(private_key: ed25519.Ed25519PrivateKey, config: JWTConfig, *, subject: str,
                role: Role, tenant_id: str | None, ttl_s: int, now: float | None = None) -> str:
    """Signs a platform token (EdDSA, header ``kid`` = the platform key's kid).

    Args:
        private_key: from ``load_or_create_platform_key``.
        config: issuer, audience and claim names.
        subject: ``sub`` (the actor recorded in the audit log).
        role: ``tenant`` or ``admin``.
        tenant_id: required for ``tenant``; optional for ``admin``.
        ttl_s: lifetime in seconds, 1 to ``config.max_token_ttl_s``.
        now: issue time (unix seconds); default now.

    Returns:
        The token; its ``jti`` (a fresh uuid4 hex) is what ``revoke`` takes (``token_jti``).

    Raises:
        ValueError: bad role, missing tenant for a tenant token, empty subject, or ttl_s out
            of range.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    if role == "tenant" and not tenant_id:
        raise ValueError("a tenant token needs a tenant")
    if not subject:
        raise ValueError("subject must be non-empty")
    if not 1 <= ttl_s <= config.max_token_ttl_s:
        raise ValueError(f"ttl_s must be 1 to {config.max_token_ttl_s} seconds "
                         "(SALTSERVE_JWT_MAX_TOKEN_TTL_S)")
    iat = int(time.time() if now is None else now)
    claims: dict[str, Any] = {"iss": config.issuer, "aud": config.audience, "sub": subject,
                              "iat": iat, "exp": iat + int(ttl_s), "jti": uuid.uuid4().hex,
                              config.role_claim: role}
    if tenant_id:
        claims[config.tenant_claim] = tenant_id
    return jwt.encode(claims, private_key, algorithm="EdDSA",
                      headers={"kid": key_id(private_key.public_key())})


def token_jti(token: str) -> str | None:
    """The ``jti`` claim of a token, unverified (to show or revoke a token one holds)."""
    try:
        jti = jwt.decode(token, options={"verify_signature": False}).get("jti")
    except jwt.InvalidTokenError:
        return None
    return jti if isinstance(jti, str) else None


def _algorithms_for(key: Any, allowed: tuple[str, ...]) -> list[str]:
    for typ, family in _FAMILIES.items():
        if isinstance(key, typ):
            return [a for a in allowed if a in family]
    return []


class JWTVerifier:
    """Verifies bearer JWTs against the platform key and an optional external IdP key source.

    Thread-safe (``PyJWKClient`` locks its cache). ``verify`` may fetch the JWKS over the network
    on a cache miss: call it off the event loop.

    Args:
        config: allow-list, issuer, audience, leeway, claim names, IdP key source.
        platform_public_key: the platform's Ed25519 public key, or None to trust only the IdP.

    Raises:
        ValueError: ``config.public_key_file`` does not hold a supported public key.
    """

    def __init__(self, config: JWTConfig,
                 platform_public_key: ed25519.Ed25519PublicKey | None = None) -> None:
        self.config = config
        self._platform = platform_public_key
        self._platform_kid = key_id(platform_public_key) if platform_public_key else None
        self._file_key: Any = None
        if config.public_key_file is not None:
            key = serialization.load_pem_public_key(Path(config.public_key_file).read_bytes())
            if not any(isinstance(key, t) for t in _FAMILIES):
                raise ValueError(f"{config.public_key_file}: not an Ed25519, RSA or EC public key")
            self._file_key = key
        self._jwks: jwt.PyJWKClient | None = None
        self._fetch_lock = threading.Lock()
        self._last_fetch_attempt = -float("inf")
        if config.jwks_url:
            try:
                self._jwks = jwt.PyJWKClient(
                    config.jwks_url, cache_jwk_set=True, lifespan=300, timeout=5,
                    cooldown_duration=config.jwks_refetch_cooldown_s)
            except jwt.PyJWKClientError as e:
                raise ValueError(f"SALTSERVE_JWT_JWKS_URL: {e}") from None

    def __repr__(self) -> str:
        return f"JWTVerifier(issuer={self.config.issuer!r}, audience={self.config.audience!r})"

    def _may_fetch_for(self, kid: str) -> bool:
        """Whether looking ``kid`` up may reach the JWKS endpoint: always for a kid in the
        cached key set; otherwise at most once per ``jwks_refetch_cooldown_s``, counted from
        the last attempt (PyJWT's own cooldown only starts after a successful fetch, so a
        failing endpoint would be asked once per junk token)."""
        assert self._jwks is not None
        cache = self._jwks.jwk_set_cache
        cached = cache.get() if cache is not None else None
        if cached is not None and any(k.key_id == kid for k in cached.keys):
            return True
        with self._fetch_lock:
            now = time.monotonic()
            if now - self._last_fetch_attempt < self.config.jwks_refetch_cooldown_s:
                return False
            self._last_fetch_attempt = now
            return True

    def _candidates(self, token: str, kid: str | None) -> list[Any]:
        if kid is not None and kid == self._platform_kid:
            return [self._platform]
        keys: list[Any] = []
        if kid is None and self._platform is not None:
            keys.append(self._platform)
        if self._jwks is not None and kid is not None and self._may_fetch_for(kid):
            try:
                keys.append(self._jwks.get_signing_key_from_jwt(token).key)
            except jwt.PyJWKClientError:
                pass  # unknown kid even after a refresh, or the endpoint is down
            except Exception as e:  # noqa: BLE001 - a broken IdP key set is "no key", not a 500
                logger.warning("the JWKS endpoint returned an unusable key set: %s",
                               type(e).__name__)
        if self._file_key is not None:
            keys.append(self._file_key)
        return keys

    def verify(self, token: str) -> TokenClaims:
        """Verifies ``token`` and returns its identity.

        Raises:
            InvalidToken: malformed, disallowed algorithm, no key verifies it, expired, wrong
                issuer/audience, a required claim missing, bad role or a tenant token without a
                tenant (``reason`` "bad_jwt"; the client sees one generic message).
        """
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise InvalidToken("malformed") from None
        alg, kid = header.get("alg"), header.get("kid")
        if not isinstance(alg, str) or alg not in self.config.algorithms:
            raise InvalidToken("bad_jwt")
        if kid is not None and (not isinstance(kid, str) or not 0 < len(kid) <= 256):
            raise InvalidToken("bad_jwt")
        try:  # the whole structure (a JSON object payload), still before any key fetch
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.InvalidTokenError:
            raise InvalidToken("malformed") from None
        if not isinstance(unverified, dict):
            raise InvalidToken("malformed")
        claims: dict[str, Any] | None = None
        for key in self._candidates(token, kid):
            algorithms = _algorithms_for(key, self.config.algorithms)
            if alg not in algorithms:
                continue  # the header's alg does not belong to this key's family
            try:
                claims = jwt.decode(
                    token, key, algorithms=algorithms, audience=self.config.audience,
                    issuer=self.config.issuer, leeway=self.config.leeway_s,
                    options={"require": _REQUIRED_CLAIMS})
            except jwt.InvalidSignatureError:
                continue
            except jwt.InvalidTokenError:
                raise InvalidToken("bad_jwt") from None
            if key is self._platform and not (
                    isinstance(claims["exp"], int) and isinstance(claims["iat"], int)
                    and claims["exp"] - claims["iat"] <= self.config.max_token_ttl_s):
                raise InvalidToken("bad_jwt")  # a platform token longer-lived than allowed
            break
        if claims is None:
            raise InvalidToken("bad_jwt")
        role, tenant = claims.get(self.config.role_claim), claims.get(self.config.tenant_claim)
        subject = claims["sub"]
        if role not in ROLES or not isinstance(subject, str) or not subject:
            raise InvalidToken("bad_jwt")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise InvalidToken("bad_jwt")
        if role == "tenant" and tenant is None:
            raise InvalidToken("bad_jwt")
        jti = claims.get("jti")
        if jti is not None and (not isinstance(jti, str) or not 0 < len(jti) <= 64):
            raise InvalidToken("bad_jwt")
        # PyJWT has checked that ``exp`` is a number (an IdP may send 1796085553.5 or a
        # numeric string); rounding down ends a console session early, never late.
        return TokenClaims(subject=subject, role=role, tenant_id=tenant, jti=jti,
                           expires_at=int(float(claims["exp"])))
