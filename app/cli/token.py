"""``saltserve token ...``: issue and revoke platform JWTs."""

from __future__ import annotations

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
def token() -> None:
    """Issue platform JWTs (signed with the data dir's Ed25519 key)."""


@token.command("issue")
@click.option("--tenant", default=None, help="Tenant name or id (required for --role tenant).")
@click.option("--role", type=click.Choice(["tenant", "admin"]), default="tenant",
              show_default=True)
@click.option("--ttl", type=click.IntRange(min=1), default=3600, show_default=True,
              help="Lifetime in seconds, at most SALTSERVE_JWT_MAX_TOKEN_TTL_S. [30 days]")
@click.option("--subject", default=None,
              help="The sub claim, recorded as the audit actor. [admin | tenant:<id>]")
@common_options
def token_issue(tenant: str | None, role: str, ttl: int, subject: str | None,
                **opts: Any) -> None:
    """Print a signed JWT (shown once, never stored)."""
    from app.bootstrap import prepare_data_dir
    from tenants.tokens import issue_token, load_or_create_platform_key, token_jti

    settings = settings_from_options(**opts)
    tenant_id = None
    if tenant is not None:
        tenant_id = tenant_id_of(open_repository(settings), tenant)
    elif role == "tenant":
        raise click.UsageError("--role tenant needs --tenant")
    try:
        config = settings.jwt_config()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if "EdDSA" not in config.algorithms:
        click.echo("warning: EdDSA is not in SALTSERVE_JWT_ALGORITHMS; servers will refuse "
                   "this token", err=True)
    key = load_or_create_platform_key(prepare_data_dir(settings.data_dir))
    subject = subject or (role if tenant_id is None else f"{role}:{tenant_id}")
    try:
        token = issue_token(key, config, subject=subject, role=role,  # type: ignore[arg-type]
                            tenant_id=tenant_id, ttl_s=ttl)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    jti = token_jti(token)
    open_repository(settings).usage.audit(
        cli_actor(), "token.issue", tenant_id,
        f"role={role} sub={subject[:64]!r} ttl_s={ttl} jti={jti}")
    click.echo(f"jti {jti} (revoke with: saltserve token revoke {jti})", err=True)
    click.echo(token)


@token.command("revoke")
@click.argument("jti")
@common_options
def token_revoke(jti: str, **opts: Any) -> None:
    """Revoke a platform JWT by its jti: refused from its next request on, on every server."""

    try:
        open_repository(settings_from_options(**opts)).revocations.revoke(jti, actor=cli_actor())
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"revoked jti {jti}")
