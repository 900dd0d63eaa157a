"""tenants/authenticator.py and the facade's parts: the salt cache follows rotations."""

from __future__ import annotations

from sqlalchemy import Engine

from tenants.api_key_store import ApiKeyStore
from tenants.authenticator import Authenticator
from tenants.crypto import SaltCipher
from tenants.db import make_session_factory
from tenants.repository import TenantRepository
from tenants.salts import SealedSalt, effective_salt
from tenants.tenant_store import TenantStore
from tenants.usage import UsageStore


def test_facade_exposes_one_part_per_concern(repo: TenantRepository) -> None:
    assert isinstance(repo.tenants, TenantStore)
    assert isinstance(repo.keys, ApiKeyStore)
    assert isinstance(repo.authenticator, Authenticator)
    assert isinstance(repo.usage, UsageStore)
    t = repo.tenants.create("acme")
    token, info = repo.keys.create(t.id)
    assert repo.keys.list_for_tenant(t.id) == [info]
    # The facade is the stores only: no delegating methods creep back.
    assert not [n for n in vars(TenantRepository) if not n.startswith("_")]
    assert repo.tenants.resolve("acme") == repo.tenants.resolve(t.id) == t
    ctx = repo.authenticator.authenticate_api_key(token)
    assert ctx == repo.authenticator.authenticate_api_key(token)  # equality ignores the sealed salt
    assert hash(ctx) == hash(repo.authenticator.authenticate_api_key(token))
    assert repo.authenticator.flush_last_used() == 1
    for part in (repo, repo.tenants, repo.keys, repo.authenticator, repo.usage):
        assert "cipher" not in repr(part).lower()


def test_creation_and_rotation_here_update_the_cache(
    repo: TenantRepository, known_salts: list[bytes]
) -> None:
    auth = repo.authenticator
    t = repo.tenants.create("acme")
    assert auth.cached_salt_version(t.id) == 1  # cached at creation, no decrypt needed
    token, _ = repo.keys.create(t.id)
    v1 = auth.authenticate_api_key(token)
    assert v1.effective_salt() == effective_salt(known_salts[0], 1, None)

    assert repo.tenants.rotate_salt(t.id) == 2
    assert auth.cached_salt_version(t.id) == 2  # the old salt is dropped at once
    v2 = auth.authenticate_api_key(token)
    assert v2.salt_version == 2
    assert v2.effective_salt() == effective_salt(known_salts[1], 2, None)
    assert v2.effective_salt() != v1.effective_salt()
    assert v1.effective_salt() == effective_salt(known_salts[0], 1, None)  # old contexts keep
    assert auth.context_for_tenant(t.id).effective_salt() == v2.effective_salt()


def test_rotation_by_another_process_replaces_the_cached_salt(
    repo: TenantRepository, engine: Engine, cipher: SaltCipher, known_salts: list[bytes]
) -> None:
    t = repo.tenants.create("acme")
    token, _ = repo.keys.create(t.id)
    before = repo.authenticator.authenticate_api_key(token)
    other = TenantRepository(make_session_factory(engine), cipher)  # e.g. the CLI
    assert other.authenticator.cached_salt_version(t.id) is None
    assert other.tenants.rotate_salt(t.id) == 2
    assert repo.authenticator.cached_salt_version(t.id) == 1  # this process cannot know yet
    after = repo.authenticator.authenticate_api_key(token)  # ...until the database says version 2
    assert after.salt_version == 2 and repo.authenticator.cached_salt_version(t.id) == 2
    assert after.effective_salt() == effective_salt(known_salts[1], 2, None)
    assert after.effective_salt() != before.effective_salt()


def test_an_older_version_never_replaces_a_newer_cached_one(repo: TenantRepository) -> None:
    t = repo.tenants.create("acme")
    repo.tenants.rotate_salt(t.id)
    auth = repo.authenticator
    auth.salt_created(t.id, 1, SealedSalt(b"\x01" * 32))  # a late report of an old version
    assert auth.cached_salt_version(t.id) == 2


def test_master_key_rotation_reaches_the_authenticator(
    repo: TenantRepository, engine: Engine, known_salts: list[bytes]
) -> None:
    t = repo.tenants.create("acme")
    token, _ = repo.keys.create(t.id)
    repo.authenticator.authenticate_api_key(token)
    new_cipher = SaltCipher(b"\x09" * 32)
    assert repo.tenants.reencrypt_salts(new_cipher) == 1
    other = TenantRepository(make_session_factory(engine), new_cipher)
    assert other.tenants.rotate_salt(t.id) == 2  # stored under the new master key only
    ctx = repo.authenticator.authenticate_api_key(token)  # cache miss: must decrypt with the new key
    assert ctx.salt_version == 2
    assert ctx.effective_salt() == effective_salt(known_salts[1], 2, None)
