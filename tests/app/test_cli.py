"""``saltserve tenants`` / ``keys`` commands against a real SQLite data directory."""

from __future__ import annotations

import re

from click.testing import CliRunner

from app.cli import main


def test_tenant_and_key_lifecycle(tmp_path):
    runner = CliRunner()
    dd = ["--data-dir", str(tmp_path)]
    r = runner.invoke(main, ["tenants", "create", "acme", *dd])
    assert r.exit_code == 0, r.output
    assert re.search(r"tenant acme id=[0-9a-f]{32} salt_version=1", r.output)
    r = runner.invoke(main, ["tenants", "create", "acme", *dd])
    assert r.exit_code == 1 and "already exists" in r.output

    r = runner.invoke(main, ["keys", "create", "--tenant", "acme", *dd])
    assert r.exit_code == 0, r.output
    key = r.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"ss-([0-9a-f]{12})-(\S{43,})", key)
    assert m, key
    key_id = m.group(1)

    r = runner.invoke(main, ["keys", "list", "--tenant", "acme", *dd])
    assert r.exit_code == 0
    assert f"ss-{key_id}-...{key[-4:]}" in r.output and "active" in r.output
    assert m.group(2) not in r.output  # the secret is never shown again

    assert runner.invoke(main, ["keys", "revoke", key_id, *dd]).exit_code == 0
    r = runner.invoke(main, ["keys", "list", "--tenant", "acme", *dd])
    assert "revoked" in r.output
    r = runner.invoke(main, ["keys", "create", "--tenant", "nobody", *dd])
    assert r.exit_code == 1 and "no tenant" in r.output

    r = runner.invoke(main, ["tenants", "list", *dd])
    assert "acme" in r.output
    assert (tmp_path / "master.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "saltserve.db").exists()


def test_serve_help_lists_engine_flags():
    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0
    for flag in ("--data-dir", "--database-url", "--host", "--port", "--model", "--block-size",
                 "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--enable-prefix-caching / --no-enable-prefix-caching",
                 "--prefix-caching-hash-algo", "--num-gpu-blocks-override",
                 "--kv-cache-memory-bytes", "--gpu-memory-utilization", "--attention-backend"):
        assert flag in r.output, flag
