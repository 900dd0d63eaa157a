"""``tenants.tokens``: platform key, issuing, and every way ``JWTVerifier`` must refuse a token."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from jwks_server import jwks_body, serve_jwks

from tenants.errors import InvalidToken
from tenants.tokens import (
    PLATFORM_KEY_FILENAME,
    JWTConfig,
    JWTVerifier,
    TokenClaims,
    issue_token,
    key_id,
    load_or_create_platform_key,
    token_jti,
)

CFG = JWTConfig()


def b64(obj: dict | bytes) -> str:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def claims(**over) -> dict:
    now = int(time.time())
    base = {"iss": "saltserve", "aud": "saltserve", "sub": "alice", "iat": now,
            "exp": now + 600, "role": "tenant", "tenant": "t1"}
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


@pytest.fixture
def platform(tmp_path) -> ed25519.Ed25519PrivateKey:
    return load_or_create_platform_key(tmp_path)


@pytest.fixture
def verifier(platform) -> JWTVerifier:
    return JWTVerifier(CFG, platform.public_key())


def sign(key, payload: dict, alg: str = "EdDSA", kid: str | None = "auto") -> str:
    headers = {}
    if kid == "auto":
        headers["kid"] = key_id(key.public_key())
    elif kid is not None:
        headers["kid"] = kid
    return jwt.encode(payload, key, algorithm=alg, headers=headers)


def rejected(verifier: JWTVerifier, token: str) -> None:
    with pytest.raises(InvalidToken):
        verifier.verify(token)


def test_platform_key_is_created_once_with_mode_0600(tmp_path):
    k1 = load_or_create_platform_key(tmp_path)
    k2 = load_or_create_platform_key(tmp_path)
    assert (tmp_path / PLATFORM_KEY_FILENAME).stat().st_mode & 0o777 == 0o600
    assert key_id(k1.public_key()) == key_id(k2.public_key())


def test_issued_tokens_round_trip(platform, verifier):
    t = issue_token(platform, CFG, subject="ops", role="tenant", tenant_id="t1", ttl_s=60)
    assert verifier.verify(t) == TokenClaims("ops", "tenant", "t1")
    a = issue_token(platform, CFG, subject="root", role="admin", tenant_id=None, ttl_s=60)
    assert verifier.verify(a) == TokenClaims("root", "admin", None)
    header = jwt.get_unverified_header(a)
    assert header["alg"] == "EdDSA" and header["kid"] == key_id(platform.public_key())
    with pytest.raises(ValueError):
        issue_token(platform, CFG, subject="x", role="tenant", tenant_id=None, ttl_s=60)
    with pytest.raises(ValueError):
        issue_token(platform, CFG, subject="x", role="root", tenant_id=None, ttl_s=60)  # type: ignore[arg-type]


def test_alg_none_is_refused(verifier):
    for alg in ("none", "None", "NONE"):
        rejected(verifier, f"{b64({'alg': alg, 'typ': 'JWT'})}.{b64(claims())}.")
    with pytest.raises(ValueError, match="never 'none'"):
        JWTConfig(algorithms=("none",))


def test_hs_rs_confusion_is_refused(tmp_path, platform):
    """An HS256 token keyed with the (public) PEM of a verifying key must never pass."""
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = rsa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "idp.pem").write_bytes(pem)
    v = JWTVerifier(JWTConfig(public_key_file=tmp_path / "idp.pem"), platform.public_key())
    for secret in (pem, platform.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)):
        head = b64({"alg": "HS256", "typ": "JWT"}) + "." + b64(claims())
        sig = hmac.new(secret, head.encode(), hashlib.sha256).digest()
        rejected(v, head + "." + b64(sig))
    with pytest.raises(ValueError):
        JWTConfig(algorithms=("HS256", "RS256"))
    # The real RSA token passes; the same key's token is refused once RS256 is not allowed.
    good = sign(rsa_key, claims(), "RS256", kid=None)
    assert v.verify(good).subject == "alice"
    only_ed = JWTVerifier(JWTConfig(algorithms=("EdDSA",), public_key_file=tmp_path / "idp.pem"))
    rejected(only_ed, good)
    # An EdDSA header on an RSA-only key source is refused (alg must match the key family).
    rejected(JWTVerifier(JWTConfig(public_key_file=tmp_path / "idp.pem")),
             sign(ed25519.Ed25519PrivateKey.generate(), claims(), kid=None))


def test_an_idp_token_exp_of_any_number_type_is_whole_seconds(tmp_path, platform):
    """``expires_at`` (a console session's end) is the token's exp rounded down, whether the
    identity provider wrote exp as an int, a float or a numeric string."""
    idp = ed25519.Ed25519PrivateKey.generate()
    pem = idp.public_key().public_bytes(serialization.Encoding.PEM,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "idp.pem").write_bytes(pem)
    v = JWTVerifier(JWTConfig(public_key_file=tmp_path / "idp.pem"), platform.public_key())
    now = int(time.time())
    for exp in (now + 600, now + 600.75, str(now + 600)):
        token = sign(idp, claims(exp=exp, role="admin", tenant=None), kid=None)
        assert v.verify(token).expires_at == now + 600, exp
    rejected(v, sign(idp, claims(exp="soon", role="admin", tenant=None), kid=None))


def test_expiry_and_leeway(platform):
    now = int(time.time())
    old = sign(platform, claims(iat=now - 100, exp=now - 10))
    rejected(JWTVerifier(CFG, platform.public_key()), old)
    lenient = JWTVerifier(JWTConfig(leeway_s=60), platform.public_key())
    assert lenient.verify(old).subject == "alice"
    future = sign(platform, claims(iat=now + 3600, exp=now + 7200))
    rejected(JWTVerifier(CFG, platform.public_key()), future)


@pytest.mark.parametrize("over", [
    {"aud": "someone-else"}, {"iss": "evil"}, {"exp": None}, {"iat": None}, {"iss": None},
    {"aud": None}, {"sub": None}, {"sub": ""}, {"role": None}, {"role": "root"},
    {"role": "tenant", "tenant": None}, {"tenant": ""}, {"tenant": 7},
])
def test_claims_are_required_and_checked(verifier, platform, over):
    rejected(verifier, sign(platform, claims(**over)))


def test_wrong_key_is_refused(verifier, platform):
    other = ed25519.Ed25519PrivateKey.generate()
    rejected(verifier, sign(other, claims()))                               # its own kid
    rejected(verifier, sign(other, claims(), kid=key_id(platform.public_key())))  # forged kid
    rejected(verifier, sign(other, claims(), kid=None))
    rejected(verifier, "not-a-jwt")
    rejected(verifier, "a.b.c")
    good = sign(platform, claims())
    rejected(verifier, good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB"))


def test_configurable_claim_names(platform):
    cfg = JWTConfig(tenant_claim="org", role_claim="https://saltserve/role", leeway_s=5)
    v = JWTVerifier(cfg, platform.public_key())
    t = issue_token(platform, cfg, subject="bob", role="tenant", tenant_id="t9", ttl_s=60)
    assert v.verify(t) == TokenClaims("bob", "tenant", "t9")
    rejected(v, sign(platform, claims()))          # default claim names: no role claim found


def test_jwks_with_kid_rotation(request):
    keys = {f"k{i}": rsa.generate_private_key(public_exponent=65537, key_size=2048)
            for i in (1, 2)}
    published = {"body": jwks_body({"k1": keys["k1"]})}
    url, _ = serve_jwks(request, lambda: (200, published["body"]))
    v = JWTVerifier(JWTConfig(algorithms=("RS256",), jwks_url=url, jwks_refetch_cooldown_s=0))
    t1 = sign(keys["k1"], claims(), "RS256", kid="k1")
    assert v.verify(t1).subject == "alice"
    published["body"] = jwks_body({"k2": keys["k2"]})  # the IdP rotates: an unknown kid refetches
    t2 = sign(keys["k2"], claims(sub="bob"), "RS256", kid="k2")
    assert v.verify(t2).subject == "bob"
    rejected(v, t1)                                  # k1 is gone from the set
    rejected(v, sign(keys["k1"], claims(), "RS256", kid="k2"))  # k2's kid, k1's signature
    rejected(v, sign(keys["k1"], claims(), "RS256", kid=None))


def test_junk_kids_cause_at_most_one_jwks_fetch_per_cooldown(request):
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    url, fetches = serve_jwks(request, lambda: (200, jwks_body({"k1": key})))
    v = JWTVerifier(JWTConfig(algorithms=("RS256",), jwks_url=url, jwks_refetch_cooldown_s=30))
    # Junk that fails the structure or algorithm checks never reaches the key set.
    for junk in ("x", "a.b.c", sign(key, claims(), "RS256", kid="k" * 300),
                 jwt.encode(claims(), "s" * 32, algorithm="HS256", headers={"kid": "k9"})):
        rejected(v, junk)
    assert fetches == []
    assert v.verify(sign(key, claims(), "RS256", kid="k1")).subject == "alice"
    assert len(fetches) == 1
    for i in range(50):  # 50 well-formed tokens with unknown kids: no fetch in the cooldown
        rejected(v, sign(key, claims(), "RS256", kid=f"junk-{i}"))
    assert len(fetches) == 1
    assert v.verify(sign(key, claims(sub="bob"), "RS256", kid="k1")).subject == "bob"


def test_platform_tokens_have_a_jti_and_a_maximum_lifetime(platform):
    cfg = JWTConfig(max_token_ttl_s=3600)
    v = JWTVerifier(cfg, platform.public_key())
    token = issue_token(platform, cfg, subject="ops", role="admin", tenant_id=None, ttl_s=3600)
    jti = token_jti(token)
    assert jti is not None and len(jti) == 32 and v.verify(token).jti == jti
    other = issue_token(platform, cfg, subject="ops", role="admin", tenant_id=None, ttl_s=60)
    assert token_jti(other) != jti                    # one per token
    with pytest.raises(ValueError, match="ttl_s must be 1 to 3600"):
        issue_token(platform, cfg, subject="ops", role="admin", tenant_id=None, ttl_s=3601)
    # A platform-signed token living longer than the maximum (issued under a looser
    # configuration) is refused by a verifier with the stricter one.
    loose = JWTConfig(max_token_ttl_s=7200)
    long_lived = issue_token(platform, loose, subject="ops", role="admin", tenant_id=None,
                             ttl_s=7200)
    assert JWTVerifier(loose, platform.public_key()).verify(long_lived).subject == "ops"
    rejected(v, long_lived)
    assert token_jti("not a token") is None


def test_no_key_source_refuses_everything(platform, tmp_path):
    rejected(JWTVerifier(CFG), sign(platform, claims()))
    with pytest.raises(ValueError, match="JWKS"):
        JWTVerifier(JWTConfig(jwks_url=(tmp_path / "jwks.json").as_uri()))  # http(s) only


def test_a_failing_jwks_endpoint_is_asked_at_most_once_per_cooldown(request):
    url, fetches = serve_jwks(request, lambda: (500, b""))
    v = JWTVerifier(JWTConfig(algorithms=("RS256",), jwks_url=url, jwks_refetch_cooldown_s=30))
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    for i in range(20):
        rejected(v, sign(key, claims(), "RS256", kid=f"junk-{i}"))
    assert len(fetches) == 1
