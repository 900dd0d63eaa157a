"""tenants/repository.py on SQLite and PostgreSQL: tenants, keys, auth, salts, usage, audit."""

from __future__ import annotations

import base64
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from sqlalchemy import Engine, select, text

from tenants.crypto import SaltCipher
from tenants.db import make_session_factory
from tenants.errors import (
    ApiKeyNotFound,
    DuplicateTenant,
    InvalidToken,
    SaltDecryptionError,
    TenantDisabled,
    TenantNotFound,
)
from tenants.models import ApiKey, TenantSalt
from tenants.records import ApiKeyInfo, AuditEntry, TenantInfo, from_row, row_values
from tenants.repository import AuthContext, TenantRepository, UsageRecord
from tenants.salts import effective_salt


def _secret(token: str) -> str:
    return token.split("-", 2)[2]


def _row_text(engine: Engine, table: str) -> str:
    """Every value of every row of ``table``, as text, for "does X appear anywhere" checks."""
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT * FROM {table}")).all()
    return " ".join(
        (bytes(v).hex() if isinstance(v, (bytes, memoryview)) else str(v))
        for row in rows
        for v in row
    )


def test_create_tenant_and_lookup(repo: TenantRepository) -> None:
    t = repo.tenants.create("acme")
    assert len(t.id) == 32 and int(t.id, 16) >= 0
    assert t.name == "acme" and not t.disabled and t.enable_prefix_caching
    assert t.current_salt_version == 1
    assert t.created_at.tzinfo == UTC
    assert repo.tenants.get(t.id) == t
    assert repo.tenants.get_by_name("acme") == t
    assert repo.tenants.list_all() == [t]
    with pytest.raises(TenantNotFound):
        repo.tenants.get("0" * 32)
    with pytest.raises(TenantNotFound):
        repo.tenants.get_by_name("nobody")


def test_duplicate_and_invalid_tenant_names(repo: TenantRepository) -> None:
    repo.tenants.create("acme")
    with pytest.raises(DuplicateTenant):
        repo.tenants.create("acme")
    with pytest.raises(ValueError):
        repo.tenants.create("   ")
    with pytest.raises(ValueError):
        repo.tenants.create("n" * 256)
    assert len(repo.tenants.list_all()) == 1


@pytest.mark.parametrize("bad", ["bad\nname", "tab\there", "nul\x00", "bell\x07",
                                 "esc\x1b[31m", "0123456789abcdef0123456789ABCDEF",
                                 "deadbeefdeadbeefdeadbeefdeadbeef"])
def test_names_are_printable_and_never_look_like_ids(repo: TenantRepository, bad) -> None:
    with pytest.raises(ValueError, match="tenant name must not"):
        repo.tenants.create(bad)
    assert repo.tenants.list_all() == []


def test_names_are_unique_ignoring_case_and_lookups_ignore_case(repo: TenantRepository) -> None:
    acme = repo.tenants.create("  Café Ω  ")  # printable Unicode is fine; outer spaces go
    assert acme.name == "Café Ω"
    for clash in ("café ω", "CAFÉ Ω"):
        with pytest.raises(DuplicateTenant):
            repo.tenants.create(clash)
    assert repo.tenants.get_by_name("CAFÉ ω") == acme
    assert repo.tenants.resolve("café ω") == acme == repo.tenants.resolve(acme.id)
    # 31 hex characters is a name, not an id.
    assert repo.tenants.create("0123456789abcdef0123456789abcde").name.startswith("0123")


def test_resolve_takes_ids_first_and_refuses_an_ambiguous_legacy_name(
        repo: TenantRepository, engine: Engine) -> None:
    victim = repo.tenants.create("victim")
    other = repo.tenants.create("impostor")
    # A name stored before names could look like ids: the victim's id as the impostor's name.
    with engine.begin() as conn:
        conn.execute(text("UPDATE tenants SET name = :n, name_key = :n WHERE id = :i"),
                     {"n": victim.id, "i": other.id})
    with pytest.raises(ValueError, match="one tenant's id and another tenant's name"):
        repo.tenants.resolve(victim.id)
    assert repo.tenants.resolve(other.id).id == other.id
    assert repo.tenants.resolve("victim").id == victim.id


def test_a_tenant_rotated_100_times_still_serves(repo: TenantRepository) -> None:
    t = repo.tenants.create("rotated")
    token, _ = repo.keys.create(t.id)
    salts = {repo.authenticator.authenticate_api_key(token).effective_salt(None)}
    for version in range(2, 102):
        assert repo.tenants.rotate_salt(t.id) == version
        ctx = repo.authenticator.authenticate_api_key(token)
        assert ctx.salt_version == version
        salts.add(ctx.effective_salt(None))
    assert len(salts) == 101  # every version its own salt
    assert repo.tenants.get(t.id).current_salt_version == 101


def test_create_key_and_authenticate(repo: TenantRepository) -> None:
    acme = repo.tenants.create("acme")
    other = repo.tenants.create("other")
    token, info = repo.keys.create(acme.id, name="ci")
    repo.keys.create(other.id)
    assert token.startswith(f"ss-{info.id}-")
    assert info.tenant_id == acme.id and info.name == "ci"
    assert info.display_prefix == f"ss-{info.id}" and info.last4 == token[-4:]
    assert info.revoked_at is None and info.expires_at is None

    ctx = repo.authenticator.authenticate_api_key(token)
    assert isinstance(ctx, AuthContext)
    assert ctx.tenant_id == acme.id and ctx.tenant_name == "acme"
    assert ctx.key_id == info.id and ctx.salt_version == 1
    assert len(ctx.effective_salt()) == 32 and ctx.enable_prefix_caching
    assert not hasattr(ctx, "tenant_salt")  # the salt is sealed, never an attribute
    assert repo.keys.list_for_tenant(acme.id) == [info]
    with pytest.raises(TenantNotFound):
        repo.keys.create("0" * 32)
    with pytest.raises(TenantNotFound):
        repo.keys.list_for_tenant("0" * 32)


def test_auth_context_repr_hides_salt(repo: TenantRepository, known_salts: list[bytes]) -> None:
    t = repo.tenants.create("acme")
    token, _ = repo.keys.create(t.id)
    ctx = repo.authenticator.authenticate_api_key(token)
    (salt,) = known_salts
    text_repr = repr(ctx) + str(ctx) + repr(vars(ctx))
    assert "<redacted>" in text_repr
    assert salt.hex() not in text_repr and repr(salt) not in text_repr
    assert not ctx.salt_occurs_in(text_repr)
    assert ctx.salt_occurs_in(f"oops {salt.hex()} leaked")  # the leak check does detect it


def test_bad_tokens_raise_invalid_token(repo: TenantRepository) -> None:
    t = repo.tenants.create("acme")
    token, info = repo.keys.create(t.id)
    secret = _secret(token)
    wrong_secret = f"ss-{info.id}-" + ("A" if secret[0] != "A" else "B") + secret[1:]
    unknown_id = f"ss-{'0' * 12 if info.id != '0' * 12 else '1' * 12}-{secret}"
    cases = {
        wrong_secret: "bad_secret",
        unknown_id: "unknown_key",
        "ss-nothex-abc": "malformed",
        "": "malformed",
        "Bearer " + token: "malformed",
        token + "x" * 300: "malformed",
    }
    for bad, reason in cases.items():
        with pytest.raises(InvalidToken) as exc_info:
            repo.authenticator.authenticate_api_key(bad)
        assert exc_info.value.reason == reason
        assert secret not in str(exc_info.value)


def test_revoked_key_is_refused(repo: TenantRepository) -> None:
    t = repo.tenants.create("acme")
    token, info = repo.keys.create(t.id)
    repo.authenticator.authenticate_api_key(token)
    revoked = repo.keys.revoke(info.id)
    assert revoked.revoked_at is not None
    assert repo.keys.revoke(info.id).revoked_at == revoked.revoked_at  # idempotent
    with pytest.raises(InvalidToken) as exc_info:
        repo.authenticator.authenticate_api_key(token)
    assert exc_info.value.reason == "revoked"
    with pytest.raises(ApiKeyNotFound):
        repo.keys.revoke("f" * 12)


def test_expired_key_is_refused(repo: TenantRepository) -> None:
    t = repo.tenants.create("acme")
    expires = datetime.now(UTC) + timedelta(hours=1)
    token, info = repo.keys.create(t.id, expires_at=expires)
    assert info.expires_at == expires
    repo.authenticator.authenticate_api_key(token)  # not yet expired
    with pytest.raises(InvalidToken) as exc_info:
        repo.authenticator.authenticate_api_key(token, now=expires + timedelta(seconds=1))
    assert exc_info.value.reason == "expired"
    # A key dead on arrival is refused at creation, not handed out.
    with pytest.raises(ValueError, match="expires_at must be in the future"):
        repo.keys.create(t.id, expires_at=datetime.now(UTC) - timedelta(seconds=1))
    assert len(repo.keys.list_for_tenant(t.id)) == 1
    with pytest.raises(ValueError):
        repo.keys.create(t.id, expires_at=datetime(2030, 1, 1))  # naive


def test_disabled_tenant_is_refused(repo: TenantRepository) -> None:
    t = repo.tenants.create("acme")
    token, _ = repo.keys.create(t.id)
    assert repo.tenants.update(t.id, disabled=True).disabled
    with pytest.raises(TenantDisabled):
        repo.authenticator.authenticate_api_key(token)
    with pytest.raises(TenantDisabled):
        repo.authenticator.context_for_tenant(t.id)
    repo.tenants.update(t.id, disabled=False)
    assert repo.authenticator.authenticate_api_key(token).tenant_id == t.id
    with pytest.raises(TenantNotFound):
        repo.tenants.update("0" * 32, disabled=True)


def test_prefix_caching_flag(repo: TenantRepository) -> None:
    t = repo.tenants.create("acme", enable_prefix_caching=False)
    token, _ = repo.keys.create(t.id)
    assert not repo.authenticator.authenticate_api_key(token).enable_prefix_caching
    repo.tenants.update(t.id, enable_prefix_caching=True)
    assert repo.authenticator.authenticate_api_key(token).enable_prefix_caching


def test_db_holds_only_the_hash(repo: TenantRepository, engine: Engine) -> None:
    t = repo.tenants.create("acme")
    token, info = repo.keys.create(t.id)
    secret = _secret(token)
    stored = _row_text(engine, "api_keys")
    assert info.id in stored
    assert secret not in stored and token not in stored
    assert secret[:-4] not in stored  # only last4 of the secret is kept
    with make_session_factory(engine)() as session:
        row = session.get(ApiKey, info.id)
        assert row is not None and len(row.key_hash) == 64


def test_stored_salt_is_encrypted_and_bound(
    repo: TenantRepository, engine: Engine, cipher: SaltCipher, known_salts: list[bytes]
) -> None:
    a = repo.tenants.create("a")
    b = repo.tenants.create("b")
    token, _ = repo.keys.create(a.id)
    salt = known_salts[0]  # tenant a's version 1
    ctx = repo.authenticator.authenticate_api_key(token)
    assert ctx.effective_salt() == effective_salt(salt, 1, None)
    with make_session_factory(engine)() as session:
        blob_a = session.scalars(
            select(TenantSalt.encrypted_salt).where(TenantSalt.tenant_id == a.id)
        ).one()
    assert salt not in blob_a
    assert cipher.decrypt(a.id, 1, blob_a) == salt
    with pytest.raises(SaltDecryptionError):
        cipher.decrypt(b.id, 1, blob_a)
    with pytest.raises(SaltDecryptionError):
        cipher.decrypt(a.id, 2, blob_a)


def test_copied_salt_row_fails_to_decrypt(
    repo: TenantRepository, engine: Engine, cipher: SaltCipher
) -> None:
    """An attacker with DB write access copying tenant A's salt into tenant B gets an error."""
    a = repo.tenants.create("a")
    b = repo.tenants.create("b")
    token_b, _ = repo.keys.create(b.id)
    factory = make_session_factory(engine)
    with factory.begin() as session:
        blob_a = session.get(TenantSalt, (a.id, 1)).encrypted_salt  # type: ignore[union-attr]
        session.get(TenantSalt, (b.id, 1)).encrypted_salt = blob_a  # type: ignore[union-attr]
    fresh = TenantRepository(factory, cipher)  # empty salt cache
    with pytest.raises(SaltDecryptionError):
        fresh.authenticator.authenticate_api_key(token_b)


def test_salt_is_stable_across_repository_instances(
    repo: TenantRepository, engine: Engine, cipher: SaltCipher
) -> None:
    t = repo.tenants.create("acme")
    token, _ = repo.keys.create(t.id)
    ctx1 = repo.authenticator.authenticate_api_key(token)
    fresh = TenantRepository(make_session_factory(engine), cipher)
    ctx2 = fresh.authenticator.authenticate_api_key(token)
    assert ctx2.effective_salt(None) == ctx1.effective_salt(None)  # same salt, same version
    assert ctx2.effective_salt("u") == ctx1.effective_salt("u")
    ctx = fresh.authenticator.context_for_tenant(t.id)
    assert ctx.effective_salt("u") == ctx1.effective_salt("u")
    wrong_key = TenantRepository(make_session_factory(engine), SaltCipher(b"\x00" * 32))
    with pytest.raises(SaltDecryptionError):
        wrong_key.authenticator.authenticate_api_key(token)


def test_rotate_salt(repo: TenantRepository, engine: Engine, cipher: SaltCipher) -> None:
    t = repo.tenants.create("acme")
    token, _ = repo.keys.create(t.id)
    before = repo.authenticator.authenticate_api_key(token)
    assert repo.tenants.rotate_salt(t.id) == 2
    after = repo.authenticator.authenticate_api_key(token)  # the same key keeps working
    assert after.salt_version == 2 and repo.tenants.get(t.id).current_salt_version == 2
    assert after.effective_salt(None) != before.effective_salt(None)
    assert after.effective_salt("u") != before.effective_salt("u")
    # other processes (fresh cache) see the new version too
    fresh = TenantRepository(make_session_factory(engine), cipher)
    ctx = fresh.authenticator.authenticate_api_key(token)
    assert ctx.effective_salt("u") == after.effective_salt("u")
    assert repo.tenants.rotate_salt(t.id) == 3
    with pytest.raises(TenantNotFound):
        repo.tenants.rotate_salt("0" * 32)


def test_effective_salt_differs_between_tenants(
    repo: TenantRepository, known_salts: list[bytes]
) -> None:
    a = repo.tenants.create("a")
    b = repo.tenants.create("b")
    ctx_a = repo.authenticator.authenticate_api_key(repo.keys.create(a.id)[0])
    ctx_b = repo.authenticator.authenticate_api_key(repo.keys.create(b.id)[0])
    assert ctx_a.salt_version == ctx_b.salt_version == 1
    assert ctx_a.effective_salt("same") != ctx_b.effective_salt("same")
    assert ctx_a.effective_salt(None) != ctx_b.effective_salt(None)
    assert ctx_a.effective_salt("same") == effective_salt(known_salts[0], 1, "same")
    assert ctx_b.effective_salt(None) == effective_salt(known_salts[1], 1, None)
    with pytest.raises(ValueError):
        ctx_a.effective_salt("")


def test_last_used_is_buffered_and_flushed(repo: TenantRepository, engine: Engine) -> None:
    t = repo.tenants.create("acme")
    token, info = repo.keys.create(t.id)
    factory = make_session_factory(engine)

    def stored() -> datetime | None:
        with factory() as session:
            return session.scalar(select(ApiKey.last_used_at).where(ApiKey.id == info.id))

    t1 = datetime.now(UTC)
    repo.authenticator.authenticate_api_key(token, now=t1)
    assert stored() is None  # nothing written on the request path
    assert repo.authenticator.flush_last_used() == 1
    assert stored() == t1
    assert repo.authenticator.flush_last_used() == 0
    # never moves backwards:
    repo.authenticator.authenticate_api_key(token, now=t1 - timedelta(minutes=5))
    repo.authenticator.flush_last_used()
    assert stored() == t1
    t2 = t1 + timedelta(minutes=1)
    repo.authenticator.authenticate_api_key(token, now=t2)
    repo.authenticator.authenticate_api_key(token, now=t1 + timedelta(seconds=1))
    assert repo.authenticator.flush_last_used() == 1
    assert stored() == t2


def test_usage_record_round_trip(repo: TenantRepository) -> None:
    t = repo.tenants.create("acme")
    _, key = repo.keys.create(t.id)
    when = datetime(2025, 6, 1, 12, 0, 0, 250000, tzinfo=UTC)
    record = UsageRecord(
        request_id="chatcmpl-1",
        tenant_id=t.id,
        key_id=key.id,
        model="smollm2-135m",
        endpoint="/v1/chat/completions",
        status="ok",
        prompt_tokens=100,
        cached_tokens=64,
        completion_tokens=20,
        ttft_s=0.125,
        latency_s=1.5,
        created_at=when,
        end_user="user-7",
        tier_cached_tokens=32,
        cache_write_tokens=16,
        prompt_cache_key="team-1",
    )
    # Every field is set to a non-default value, so a field the row copies drop fails equality.
    assert all(getattr(record, f.name) != f.default for f in fields(UsageRecord))
    repo.usage.record_usage(record)
    repo.usage.record_usage(
        UsageRecord(
            request_id="cmpl-2",
            tenant_id=t.id,
            key_id=None,
            model="m",
            endpoint="/v1/completions",
            status="aborted",
        )
    )
    records = repo.usage.list_usage(tenant_id=t.id)
    assert records[0] == record
    assert records[1].status == "aborted" and records[1].ttft_s is None
    assert records[1].created_at is not None and records[1].created_at.tzinfo == UTC
    assert repo.usage.list_usage(t.id, since=when, until=when + timedelta(seconds=1)) == [record]
    assert repo.usage.list_usage(tenant_id="0" * 32) == []
    with pytest.raises(ValueError):
        repo.usage.record_usage(UsageRecord("r", t.id, None, "m", "/e", status="weird"))
    with pytest.raises(ValueError):
        repo.usage.record_usage(UsageRecord("r", t.id, None, "m", "/e", "ok", prompt_tokens=-1))


def test_from_row_copies_exactly_the_record_fields() -> None:
    """The one row-to-record copy reads the record's own fields only (a key row's hash has no
    field to land in), and a row without one of them is an error, not a silent default."""
    row = SimpleNamespace(id="k1", tenant_id="t1", display_prefix="ss-k1", last4="abcd",
                          name=None, created_at=datetime(2025, 1, 1, tzinfo=UTC),
                          expires_at=None, revoked_at=None, last_used_at=None,
                          key_hash=b"secret hash")
    info = from_row(ApiKeyInfo, row)
    assert info == ApiKeyInfo("k1", "t1", "ss-k1", "abcd", None, row.created_at, None, None)
    assert "secret" not in repr(info)
    assert from_row(ApiKeyInfo, row, name="ci").name == "ci"
    del row.last_used_at
    with pytest.raises(AttributeError):
        from_row(ApiKeyInfo, row)
    # No record has a field named like a secret column, so none can be copied out.
    secrets_ = {"key_hash", "secret", "salt", "encrypted_salt"}
    for record in (ApiKeyInfo, TenantInfo, UsageRecord, AuditEntry):
        assert secrets_.isdisjoint(f.name for f in fields(record)), record
    assert row_values(info, name="x") == {**info.__dict__, "name": "x"}


def test_audit_rows_contain_no_salt(
    repo: TenantRepository, engine: Engine, cipher: SaltCipher, known_salts: list[bytes]
) -> None:
    t = repo.tenants.create("acme")
    token, info = repo.keys.create(t.id, actor="admin:alice")
    repo.authenticator.authenticate_api_key(token)
    repo.tenants.rotate_salt(t.id, actor="admin:alice")
    repo.authenticator.authenticate_api_key(token)
    salts = list(known_salts)
    assert len(salts) == 2
    repo.keys.revoke(info.id)
    repo.usage.audit("admin:bob", "cache.reset", tenant_id=t.id, detail="blocks=3",
                     request_id="r-1")

    entries = repo.usage.list_audit(tenant_id=t.id)
    actions = [e.action for e in reversed(entries)]
    assert actions == [
        "tenant.create",
        "api_key.create",
        "tenant.rotate_salt",
        "api_key.revoke",
        "cache.reset",
    ]
    by_action = {e.action: e for e in entries}
    assert by_action["tenant.create"].detail == "salt_version=1"
    assert by_action["tenant.rotate_salt"].detail == "salt_version=2"
    assert by_action["tenant.rotate_salt"].actor == "admin:alice"
    assert by_action["cache.reset"].request_id == "r-1"

    stored = _row_text(engine, "audit_log")
    for salt in salts:
        for encoding in (salt.hex(), base64.b64encode(salt).decode(), repr(salt)):
            assert encoding not in stored
    assert _secret(token) not in stored
    with engine.connect() as conn:
        raw = conn.execute(text("SELECT detail FROM audit_log")).scalars().all()
    assert all(salt.decode("latin-1") not in (d or "") for salt in salts for d in raw)


def test_reencrypt_salts_under_new_master_key(repo: TenantRepository, engine: Engine) -> None:
    t = repo.tenants.create("acme")
    repo.tenants.rotate_salt(t.id)
    token, _ = repo.keys.create(t.id)
    before = repo.authenticator.authenticate_api_key(token)
    new_cipher = SaltCipher(b"\x07" * 32)
    assert repo.tenants.reencrypt_salts(new_cipher) == 2
    fresh = TenantRepository(make_session_factory(engine), new_cipher)
    after = fresh.authenticator.authenticate_api_key(token)
    assert after.salt_version == before.salt_version == 2
    assert after.effective_salt("u") == before.effective_salt("u")  # the salt is unchanged


def test_concurrent_authentication(repo: TenantRepository) -> None:
    """Threads share one repository (one process serving many requests)."""
    from concurrent.futures import ThreadPoolExecutor

    tenants = [repo.tenants.create(f"t{i}") for i in range(3)]
    tokens = [repo.keys.create(t.id)[0] for t in tenants]

    def auth(i: int) -> tuple[str, bytes]:
        ctx = repo.authenticator.authenticate_api_key(tokens[i % 3])
        return ctx.tenant_id, ctx.effective_salt()

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(auth, range(60)))
    by_tenant: dict[str, set[bytes]] = {}
    for tenant_id, salt in results:
        by_tenant.setdefault(tenant_id, set()).add(salt)
    assert set(by_tenant) == {t.id for t in tenants}
    assert all(len(salts) == 1 for salts in by_tenant.values())
    assert repo.authenticator.flush_last_used() == 3
