"""``saltserve token issue``, ``tenants rotate-salt / disable / enable``, ``keys rotate-master``."""

from __future__ import annotations

import getpass
import json
import re

import pytest
from click.testing import CliRunner

from app.bootstrap import open_repository
from app.cli.main import main
from app.cli.options import cli_actor
from app.settings import Settings
from tenants.crypto import MASTER_KEY_FILENAME
from tenants.errors import InvalidToken, TenantDisabled
from tenants.tokens import (
    JWTConfig,
    JWTVerifier,
    TokenClaims,
    load_or_create_platform_key,
    token_jti,
)

ENV = {"SALTSERVE_MASTER_KEY": "", "SALTSERVE_JWT_ISSUER": "saltserve",
       "SALTSERVE_JWT_AUDIENCE": "saltserve"}


@pytest.fixture
def cli(tmp_path):
    runner = CliRunner(env=ENV)
    dd = ["--data-dir", str(tmp_path)]

    def run(*args: str, ok: bool = True):
        r = runner.invoke(main, [*args, *dd])
        if ok:
            assert r.exit_code == 0, r.output
        return r

    r = run("tenants", "create", "acme")
    run.tenant_id = re.search(r"id=([0-9a-f]{32})", r.output).group(1)  # type: ignore[attr-defined]
    return run


def test_token_issue(cli, tmp_path):
    verifier = JWTVerifier(JWTConfig(), load_or_create_platform_key(tmp_path).public_key())
    token = cli("token", "issue", "--role", "admin", "--ttl", "60").stdout.strip()
    assert verifier.verify(token) == TokenClaims("admin", "admin", None)
    token = cli("token", "issue", "--tenant", "acme", "--ttl", "60").stdout.strip()
    assert verifier.verify(token) == TokenClaims(f"tenant:{cli.tenant_id}", "tenant",
                                                 cli.tenant_id)
    token = cli("token", "issue", "--tenant", cli.tenant_id, "--role", "admin",
                "--subject", "alice").stdout.strip()
    assert verifier.verify(token) == TokenClaims("alice", "admin", cli.tenant_id)
    assert (tmp_path / "jwt-signing-key.pem").stat().st_mode & 0o777 == 0o600
    r = cli("token", "issue", "--role", "tenant", ok=False)
    assert r.exit_code == 2 and "--tenant" in r.output
    r = cli("token", "issue", "--tenant", "nobody", ok=False)
    assert r.exit_code == 1 and "no tenant" in r.output
    r = cli("token", "issue", "--role", "admin", "--ttl", "0", ok=False)
    assert r.exit_code == 2
    # Each issued token is audited (role, subject, lifetime; never the token).
    issued = [a for a in open_repository(Settings(data_dir=tmp_path)).usage.list_audit()
              if a.action == "token.issue"]
    assert [re.sub(r" jti=[0-9a-f]{32}$", "", a.detail) for a in issued][::-1] == [
        "role=admin sub='admin' ttl_s=60", f"role=tenant sub='tenant:{cli.tenant_id}' ttl_s=60",
        "role=admin sub='alice' ttl_s=3600"]
    assert issued[0].detail.endswith(f"jti={token_jti(token)}")
    assert all(a.actor == cli_actor() and token not in (a.detail or "") for a in issued)
    assert [a.tenant_id for a in issued][::-1] == [None, cli.tenant_id, cli.tenant_id]
    # Another data dir's key does not verify this one's tokens.
    other = JWTVerifier(JWTConfig(), load_or_create_platform_key(tmp_path / "x").public_key())
    with pytest.raises(InvalidToken):
        other.verify(token)


def test_rotate_salt_disable_enable(cli, tmp_path):
    repo = open_repository(Settings(data_dir=tmp_path))
    key, _ = repo.keys.create(cli.tenant_id)
    old = repo.authenticator.authenticate_api_key(key)
    r = cli("tenants", "rotate-salt", "acme")
    assert "salt_version=2" in r.output
    new = open_repository(Settings(data_dir=tmp_path)).authenticator.authenticate_api_key(key)
    assert new.salt_version == 2 and new.effective_salt() != old.effective_salt()
    assert not old.salt_occurs_in(r.output) and not new.salt_occurs_in(r.output)
    audit = repo.usage.list_audit(cli.tenant_id)
    assert audit[0].action == "tenant.rotate_salt" and audit[0].actor == cli_actor()
    assert cli_actor() == f"cli:{getpass.getuser()}"
    assert audit[0].detail == "salt_version=2"
    assert "disabled" in cli("tenants", "disable", "acme").output
    with pytest.raises(TenantDisabled):
        repo.authenticator.authenticate_api_key(key)
    assert "active" in cli("tenants", "enable", cli.tenant_id).output
    assert repo.authenticator.authenticate_api_key(key).salt_version == 2
    assert cli("tenants", "rotate-salt", "nobody", ok=False).exit_code == 1


def test_rotate_master_key(cli, tmp_path):
    repo = open_repository(Settings(data_dir=tmp_path))
    key, _ = repo.keys.create(cli.tenant_id)
    cli("tenants", "rotate-salt", "acme")
    before = open_repository(Settings(data_dir=tmp_path)).authenticator.authenticate_api_key(key)
    path = tmp_path / MASTER_KEY_FILENAME
    old_key = path.read_text()
    r = cli("keys", "rotate-master")
    assert "re-encrypted 2 salts" in r.output and old_key.strip() not in r.output
    backup = tmp_path / (MASTER_KEY_FILENAME + ".bak")
    assert backup.read_text() == old_key and backup.stat().st_mode & 0o777 == 0o600
    assert path.read_text() != old_key and path.stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / (MASTER_KEY_FILENAME + ".new")).exists()
    fresh = open_repository(Settings(data_dir=tmp_path))       # decrypts with the new key
    after = fresh.authenticator.authenticate_api_key(key)                    # same salt, same version
    assert after.salt_version == 2 and after.effective_salt("u") == before.effective_salt("u")
    assert fresh.authenticator.context_for_tenant(cli.tenant_id).salt_version == 2
    assert fresh.usage.list_audit()[0].action == "master_key.rotate"


def test_rotate_master_key_from_env_prints_the_new_key_once(tmp_path):
    from tenants.crypto import decode_master_key, generate_master_key

    env_key = generate_master_key()
    runner = CliRunner(env={**ENV, "SALTSERVE_MASTER_KEY": env_key})
    dd = ["--data-dir", str(tmp_path)]
    assert runner.invoke(main, ["tenants", "create", "acme", *dd]).exit_code == 0
    r = runner.invoke(main, ["keys", "rotate-master", *dd])
    assert r.exit_code == 0, r.output
    new_key = r.stdout.strip()
    assert decode_master_key(new_key) and new_key != env_key
    assert not (tmp_path / MASTER_KEY_FILENAME).exists()
    repo = open_repository(Settings(data_dir=tmp_path, master_key=new_key))
    assert repo.authenticator.context_for_tenant(repo.tenants.get_by_name("acme").id).salt_version == 1


def test_jwt_settings_from_the_environment(tmp_path, monkeypatch):
    from app.bootstrap import make_jwt_verifier

    monkeypatch.setenv("SALTSERVE_JWT_ALGORITHMS", '["EdDSA"]')
    monkeypatch.setenv("SALTSERVE_JWT_AUDIENCE", "inference")
    monkeypatch.setenv("SALTSERVE_JWT_LEEWAY_S", "30")
    monkeypatch.setenv("SALTSERVE_JWT_TENANT_CLAIM", "org")
    cfg = Settings(data_dir=tmp_path).jwt_config()
    assert (cfg.algorithms, cfg.audience, cfg.leeway_s, cfg.tenant_claim, cfg.role_claim) == (
        ("EdDSA",), "inference", 30.0, "org", "role")
    verifier = make_jwt_verifier(Settings(data_dir=tmp_path))
    assert (tmp_path / "jwt-signing-key.pem").stat().st_mode & 0o777 == 0o600
    runner = CliRunner(env={**ENV, "SALTSERVE_JWT_AUDIENCE": "inference",
                            "SALTSERVE_JWT_TENANT_CLAIM": "org"})
    r = runner.invoke(main, ["token", "issue", "--role", "admin", "--data-dir", str(tmp_path)])
    assert verifier.verify(r.stdout.strip()).role == "admin"
    for bad in (["none"], ["HS256"], []):
        with pytest.raises(ValueError):
            Settings(data_dir=tmp_path, jwt_algorithms=bad).jwt_config()


def test_keys_create_resolves_ids_first_and_refuses_dead_or_ambiguous(cli, tmp_path):
    repo = open_repository(Settings(data_dir=tmp_path))
    impostor = repo.tenants.create("impostor")
    r = cli("keys", "create", "--tenant", cli.tenant_id)
    assert repo.authenticator.authenticate_api_key(r.stdout.strip()).tenant_id == cli.tenant_id
    r = cli("keys", "create", "--tenant", "acme", "--expires-in-days", "-1", ok=False)
    assert r.exit_code == 1 and "expires_at must be in the future" in r.output
    # A legacy name equal to another tenant's id: refused as ambiguous, not acted upon.
    from sqlalchemy import text
    with repo.tenants._session_factory.begin() as session:
        session.execute(text("UPDATE tenants SET name = :n, name_key = :n WHERE id = :i"),
                        {"n": cli.tenant_id, "i": impostor.id})
    r = cli("keys", "create", "--tenant", cli.tenant_id, ok=False)
    assert r.exit_code == 1 and "another tenant's name" in r.output
    assert len(repo.keys.list_for_tenant(impostor.id)) == 0
    assert len(repo.keys.list_for_tenant(cli.tenant_id)) == 1


def test_token_revoke_and_maximum_lifetime(cli, tmp_path):
    r = cli("token", "issue", "--role", "admin", "--ttl", "60")
    token = r.stdout.strip()
    jti = token_jti(token)
    assert f"jti {jti}" in r.stderr and token not in r.stderr
    repo = open_repository(Settings(data_dir=tmp_path))
    assert not repo.revocations.is_revoked(jti)
    assert cli("token", "revoke", jti).output.strip() == f"revoked jti {jti}"
    assert repo.revocations.is_revoked(jti)
    cli("token", "revoke", jti)  # idempotent: one audit row
    rows = [a for a in repo.usage.list_audit() if a.action == "token.revoke"]
    assert [(a.detail, a.actor) for a in rows] == [(f"jti={jti}", cli_actor())]
    r = cli("token", "issue", "--role", "admin", "--ttl", str(30 * 86400 + 1), ok=False)
    assert r.exit_code == 2 and "ttl_s must be 1 to 2592000" in r.output
    assert cli("token", "revoke", "x" * 65, ok=False).exit_code == 2


def test_unwritable_database_and_exposed_secrets_stop_the_start(tmp_path):
    runner = CliRunner(env=ENV)
    dd = ["--data-dir", str(tmp_path)]
    assert runner.invoke(main, ["tenants", "create", "acme", *dd]).exit_code == 0
    db = tmp_path / "saltserve.db"
    # Files this CLI created are private (umask 077), the database included.
    for path in (db, tmp_path / MASTER_KEY_FILENAME):
        assert path.stat().st_mode & 0o777 == 0o600, path
    # An older database left readable by others is made private on the next start.
    db.chmod(0o644)
    assert runner.invoke(main, ["tenants", "list", *dd]).exit_code == 0
    assert db.stat().st_mode & 0o777 == 0o600
    # A read-only database file: one clear line, no traceback.
    db.chmod(0o444)
    r = runner.invoke(main, ["tenants", "list", *dd])
    assert r.exit_code == 1, r.output
    assert f"the database file {db} is not writable (mode 444)" in r.output
    assert "Traceback" not in r.output
    db.chmod(0o600)
    # A master key (or JWT signing key) readable by others stops the start with the fix.
    key = tmp_path / MASTER_KEY_FILENAME
    key.chmod(0o644)
    r = runner.invoke(main, ["tenants", "list", *dd])
    assert r.exit_code == 1 and f"run chmod 600 {key}" in r.output
    key.chmod(0o600)
    assert runner.invoke(main, ["token", "issue", "--role", "admin", *dd]).exit_code == 0
    jwt_key = tmp_path / "jwt-signing-key.pem"
    jwt_key.chmod(0o640)
    with pytest.raises(ValueError, match=f"run chmod 600 {jwt_key}"):
        load_or_create_platform_key(tmp_path)


def test_usage_report_and_set_limits(cli, tmp_path):
    from datetime import UTC, datetime, timedelta

    from tenants.records import UsageRecord

    repo = open_repository(Settings(data_dir=tmp_path, master_key=None))
    now = datetime.now(UTC)
    repo.usage.record_usage_batch([UsageRecord(
        request_id=f"r{i}", tenant_id=cli.tenant_id, key_id=None, model="m",
        endpoint="completions", status="ok", prompt_tokens=100, cached_tokens=25 * i,
        completion_tokens=5, ttft_s=0.3, created_at=now - timedelta(hours=i)) for i in range(3)])
    table = cli("usage", "report", "--tenant", "acme", "--since", "1d").output
    assert table.splitlines()[0].split()[:3] == ["bucket_start", "tenant_name", "requests"]
    assert sum(int(line.split()[3]) for line in table.splitlines()[1:]) == 3
    csv_out = cli("usage", "report", "--since", "1d", "--bucket", "1h", "--format",
                  "csv").output
    assert csv_out.splitlines()[0].startswith("bucket_start,tenant_id,tenant_name")
    assert len(csv_out.splitlines()) == 4  # one hour bucket per record
    as_json = json.loads(cli("usage", "report", "--since", "2d", "--bucket", "1h", "--format",
                             "json").output)
    assert sorted(r["cached_tokens"] for r in as_json) == [0, 25, 50]
    assert sorted(r["hit_rate"] for r in as_json) == [0.0, 0.25, 0.5]
    bad = cli("usage", "report", "--bucket", "1m", "--since", "30d", ok=False)
    assert bad.exit_code != 0 and "buckets" in bad.output
    assert cli("usage", "report", "--tenant", "nobody", ok=False).exit_code != 0
    for bad_since in ("\u00b2d", "99999999999d", "yesterday"):
        r = cli("usage", "report", "--since", bad_since, ok=False)
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output

    out = cli("tenants", "set-limits", "acme", "--rpm", "60", "--max-concurrent", "4").output
    assert "rpm=60" in out and "tpm=None" in out and "max_concurrent=4" in out
    out = cli("tenants", "set-limits", "acme", "--rpm", "none").output
    assert "rpm=None" in out and "max_concurrent=4" in out
