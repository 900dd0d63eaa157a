"""``saltserve tenants ...``: create, list, enable / disable tenants, rotate salts, set
capacity shares and rate limits."""

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
def tenants() -> None:
    """Manage tenants."""


@tenants.command("create")
@click.argument("name")
@click.option("--no-prefix-caching", is_flag=True, help="Never cache this tenant's prompts.")
@common_options
def tenants_create(name: str, no_prefix_caching: bool, **opts: Any) -> None:
    """Create tenant NAME (with salt version 1)."""
    from tenants.errors import DuplicateTenant

    repo = open_repository(settings_from_options(**opts))
    try:
        t = repo.tenants.create(name, enable_prefix_caching=not no_prefix_caching, actor=cli_actor())
    except (DuplicateTenant, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"tenant {t.name} id={t.id} salt_version={t.current_salt_version}")


@tenants.command("list")
@common_options
def tenants_list(**opts: Any) -> None:
    """List tenants."""

    for t in open_repository(settings_from_options(**opts)).tenants.list_all():
        state = "disabled" if t.disabled else "active"
        click.echo(f"{t.id}  {t.name}  {state}  salt_version={t.current_salt_version}  "
                   f"weight={t.weight}")


def _cache_bound(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    from tenants.tenant_store import UNCHANGED

    if value is None:
        return UNCHANGED
    if value.lower() == "none":
        return None
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter("an integer >= 0, or 'none' for no bound") from None
    if n < 0:
        raise click.BadParameter("an integer >= 0, or 'none' for no bound")
    return n


@tenants.command("set-share")
@click.argument("tenant")
@click.option("--weight", type=click.IntRange(1, 1000), default=None,
              help="Share of each engine step's token budget and of the cached KV blocks, "
                   "relative to other tenants' weights. [unchanged; new tenants: 1]")
@click.option("--min-cache-blocks", callback=_cache_bound, default=None, metavar="N|none",
              help="Cached blocks the tenant keeps before share-based eviction. [unchanged]")
@click.option("--max-cache-blocks", callback=_cache_bound, default=None, metavar="N|none",
              help="Above this many cached blocks the tenant is always over its share. "
                   "[unchanged]")
@common_options
def tenants_set_share(tenant: str, weight: int | None, min_cache_blocks: Any,
                      max_cache_blocks: Any, **opts: Any) -> None:
    """Set TENANT's capacity share (name or id); applies from its next request."""

    repo = open_repository(settings_from_options(**opts))
    try:
        t = repo.tenants.update(tenant_id_of(repo, tenant), weight=weight,
                                min_cache_blocks=min_cache_blocks,
                                max_cache_blocks=max_cache_blocks, actor=cli_actor())
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"tenant {t.name} id={t.id} weight={t.weight} "
               f"min_cache_blocks={t.min_cache_blocks} max_cache_blocks={t.max_cache_blocks}")


def _set_disabled(tenant: str, disabled: bool, opts: dict[str, Any]) -> None:
    from app.cluster import ClusterConfig, publish_now

    settings = settings_from_options(**opts)
    repo = open_repository(settings)
    before = repo.tenants.get(tenant_id_of(repo, tenant))
    t = repo.tenants.update(before.id, disabled=disabled, actor=cli_actor())
    if t.cache_epoch != before.cache_epoch:  # disabled: running servers drop its cache
        publish_now(ClusterConfig(settings.redis_url, settings.redis_namespace, "cli"), t.id,
                    "reset")
    click.echo(f"tenant {t.name} id={t.id} {'disabled' if t.disabled else 'active'}")


@tenants.command("disable")
@click.argument("tenant")
@common_options
def tenants_disable(tenant: str, **opts: Any) -> None:
    """Disable TENANT (name or id): its keys and tokens are refused from the next request."""
    _set_disabled(tenant, True, opts)


@tenants.command("enable")
@click.argument("tenant")
@common_options
def tenants_enable(tenant: str, **opts: Any) -> None:
    """Enable TENANT (name or id) again."""
    _set_disabled(tenant, False, opts)


@tenants.command("rotate-salt")
@click.argument("tenant")
@common_options
def tenants_rotate_salt(tenant: str, **opts: Any) -> None:
    """Rotate TENANT's salt (name or id): the new version is current at once.

    The old cached blocks are unreachable from that moment. With SALTSERVE_REDIS_URL set, every
    running replica drops them at once (app.cluster); otherwise a server drops them on the
    tenant's next request (reason salt_rotation).
    """
    from app.cluster import ClusterConfig, publish_now

    settings = settings_from_options(**opts)
    repo = open_repository(settings)
    tenant_id = tenant_id_of(repo, tenant)
    version = repo.tenants.rotate_salt(tenant_id, actor=cli_actor())
    told = publish_now(ClusterConfig(settings.redis_url, settings.redis_namespace, "cli"),
                       tenant_id, "salt_rotation")
    click.echo(f"tenant {tenant} id={tenant_id} salt_version={version}"
               + (f" (replicas told: {told})" if settings.redis_url else ""))


def _retention(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    from tenants.tenant_store import UNCHANGED

    if value is None:
        return UNCHANGED
    return None if value == "default" else value


@tenants.command("set-retention")
@click.argument("tenant")
@click.option("--default", "default_", type=click.Choice(["in_memory", "24h", "default"]),
              callback=_retention, default=None,
              help="Retention of calls that ask none (OpenAI prompt_cache_retention); "
                   "'default' resets it to 24h. [unchanged]")
@click.option("--max", "maximum", type=click.Choice(["in_memory", "24h", "default"]),
              callback=_retention, default=None,
              help="The longest a call may ask; in_memory: nothing of the tenant's is written "
                   "to an offload tier (disk, Redis). 'default' resets it to 24h. [unchanged]")
@common_options
def tenants_set_retention(tenant: str, default_: Any, maximum: Any, **opts: Any) -> None:
    """Set TENANT's prompt-cache retention default and maximum (name or id); apply from its
    next request. Blobs it already has in the tiers stay until its cache is reset."""
    repo = open_repository(settings_from_options(**opts))
    try:
        t = repo.tenants.update(tenant_id_of(repo, tenant), prompt_cache_retention=default_,
                                max_prompt_cache_retention=maximum, actor=cli_actor())
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"tenant {t.name} id={t.id} prompt_cache_retention="
               f"{t.prompt_cache_retention or '24h'} max_prompt_cache_retention="
               f"{t.max_prompt_cache_retention or '24h'}")


@tenants.command("set-limits")
@click.argument("tenant")
@click.option("--rpm", callback=_cache_bound, default=None, metavar="N|none",
              help="Requests per minute. [unchanged]")
@click.option("--tpm", callback=_cache_bound, default=None, metavar="N|none",
              help="Tokens (prompt + max_tokens) per minute. [unchanged]")
@click.option("--max-concurrent", callback=_cache_bound, default=None, metavar="N|none",
              help="Requests in flight at once. [unchanged]")
@common_options
def tenants_set_limits(tenant: str, rpm: Any, tpm: Any, max_concurrent: Any,
                       **opts: Any) -> None:
    """Set TENANT's rate limits (name or id; 'none' removes one); apply from its next
    request."""
    repo = open_repository(settings_from_options(**opts))
    try:
        t = repo.tenants.update(tenant_id_of(repo, tenant), rpm_limit=rpm, tpm_limit=tpm,
                                max_concurrent=max_concurrent, actor=cli_actor())
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"tenant {t.name} id={t.id} rpm={t.rpm_limit} tpm={t.tpm_limit} "
               f"max_concurrent={t.max_concurrent}")
