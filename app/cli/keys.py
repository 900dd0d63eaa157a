"""``saltserve keys ...``: tenant API keys and the master key that encrypts the salts."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from app.cli.options import (
    cli_actor,
    common_options,
    open_repository,
    settings_from_options,
    tenant_id_of,
)


@click.group()
def keys() -> None:
    """Manage tenant API keys."""


@keys.command("create")
@click.option("--tenant", required=True, help="Tenant name or id.")
@click.option("--name", default=None, help="Label for the key.")
@click.option("--expires-in-days", type=int, default=None, help="Expiry. [never]")
@common_options
def keys_create(tenant: str, name: str | None, expires_in_days: int | None, **opts: Any) -> None:
    """Create an API key; the key is printed once and never stored in plain text."""

    repo = open_repository(settings_from_options(**opts))
    expires = (datetime.now(UTC) + timedelta(days=expires_in_days)) if expires_in_days else None
    try:
        key, info = repo.keys.create(tenant_id_of(repo, tenant), name, expires,
                                     actor=cli_actor())
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"key id {info.id} for tenant {tenant} (shown once):", err=True)
    click.echo(key)


@keys.command("list")
@click.option("--tenant", required=True, help="Tenant name or id.")
@common_options
def keys_list(tenant: str, **opts: Any) -> None:
    """List a tenant's keys (display prefix and last 4 characters only)."""

    repo = open_repository(settings_from_options(**opts))
    for k in repo.keys.list_for_tenant(tenant_id_of(repo, tenant)):
        state = "revoked" if k.revoked_at else "active"
        click.echo(f"{k.id}  {k.display_prefix}-...{k.last4}  {state}  name={k.name}")


@keys.command("revoke")
@click.argument("key_id")
@common_options
def keys_revoke(key_id: str, **opts: Any) -> None:
    """Revoke key KEY_ID (effective on the next request)."""
    from tenants.errors import TenantError

    try:
        open_repository(settings_from_options(**opts)).keys.revoke(key_id, actor=cli_actor())
    except TenantError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"revoked {key_id}")


@keys.command("rotate-master")
@common_options
def keys_rotate_master(**opts: Any) -> None:
    """Re-encrypt every tenant salt under a new master key (one transaction).

    With the key file (default), the new key replaces ``master.key`` and the old one is kept as
    ``master.key.bak`` (0600; delete it once backups no longer need it). With
    ``SALTSERVE_MASTER_KEY`` set, the new key is printed once: put it in the environment.
    Restart running servers afterwards.
    """
    from app.bootstrap import write_secret_file
    from tenants.crypto import (
        MASTER_KEY_FILENAME,
        SaltCipher,
        decode_master_key,
        generate_master_key,
    )

    settings = settings_from_options(**opts)
    repo = open_repository(settings)
    new_text = generate_master_key()
    new_cipher = SaltCipher(decode_master_key(new_text))
    if settings.master_key:
        n = repo.tenants.reencrypt_salts(new_cipher, actor=cli_actor())
        click.echo(f"re-encrypted {n} salts; set SALTSERVE_MASTER_KEY to the new key "
                   "(shown once) and restart servers:", err=True)
        click.echo(new_text)
        return
    path = settings.data_dir / MASTER_KEY_FILENAME
    staged, backup = path.with_name(path.name + ".new"), path.with_name(path.name + ".bak")
    write_secret_file(staged, new_text)
    try:
        n = repo.tenants.reencrypt_salts(new_cipher, actor=cli_actor())
    except BaseException:
        staged.unlink()
        raise
    os.replace(path, backup)
    os.chmod(backup, 0o600)
    os.replace(staged, path)
    click.echo(f"re-encrypted {n} salts under a new master key in {path} (old key kept in "
               f"{backup}); restart running servers")
