"""``saltserve cache ...``: the running server's prefix cache, through its admin API."""

from __future__ import annotations

import json
from typing import Any

import click

from app.cli.options import cli_actor, common_options, settings_from_options


def _server_call(method: str, path: str, url: str, opts: dict[str, Any]) -> dict:
    """Calls the running server's admin API with a 60-second admin JWT signed with the data
    dir's platform key (the audit actor is ``cli:<OS user>``)."""
    import urllib.error
    import urllib.request

    from app.bootstrap import prepare_data_dir
    from tenants.tokens import issue_token, load_or_create_platform_key

    settings = settings_from_options(**opts)
    key = load_or_create_platform_key(prepare_data_dir(settings.data_dir))
    jwt = issue_token(key, settings.jwt_config(), subject=cli_actor(), role="admin",
                      tenant_id=None, ttl_s=60)
    req = urllib.request.Request(url.rstrip("/") + path, method=method,
                                 headers={"Authorization": f"Bearer {jwt}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise click.ClickException(f"{e.code}: {message}") from None
    except urllib.error.URLError as e:
        raise click.ClickException(f"no server at {url}: {e.reason}") from None


def _server_url(fn):
    return click.option("--url", default="http://127.0.0.1:8000", show_default=True,
                        envvar="SALTSERVE_URL", help="The running server. [env SALTSERVE_URL]")(fn)


@click.group()
def cache() -> None:
    """The running server's prefix cache (through its admin API)."""


@cache.command("stats")
@_server_url
@common_options
def cache_stats(url: str, **opts: Any) -> None:
    """Pool blocks, each offload tier, and each tenant's resident blocks, hit rate, tier hits
    and evictions."""
    s = _server_call("GET", "/admin/cache", url, opts)
    click.echo(f"blocks: {s['num_blocks_total']} total, {s['num_blocks_free']} free, "
               f"{s['num_blocks_used']} used, {s['num_blocks_cached']} cached")
    for tier in s.get("tiers", []):
        click.echo(f"tier {tier['name']}{'' if tier['up'] else ' (unreachable)'}: "
                   f"{tier['used_bytes'] / 2**20:.1f} of {tier['capacity_bytes'] / 2**20:.0f} MiB, "
                   f"{tier['blobs']} blocks; written {tier['written_blocks']}, loaded "
                   f"{tier['loaded_blocks']}; gone: capacity {tier['evicted_blobs']}, reset "
                   f"{tier.get('dropped_blobs', 0)}, invalid {tier['load_failed']}")
    for t in s["tenants"]:
        rate = "-" if t["hit_rate"] is None else f"{t['hit_rate']:.3f}"
        evictions = " ".join(f"{k}={v}" for k, v in sorted(t["evictions"].items()))
        shares = t.get("tier_share_bytes", {})
        tiers = "".join(f" {name}={n / 2**20:.1f}/{shares.get(name, 0) / 2**20:.1f}MiB"
                        for name, n in sorted(t.get("tier_bytes", {}).items()))
        click.echo(f"{t['tenant_name'] or t['tenant_id']}: resident={t['resident_blocks']} "
                   f"hit_rate={rate} queried={t['queried_tokens']} "
                   f"tier_hits={t.get('tier_hit_tokens', 0)}{tiers} evictions: {evictions}")


@cache.command("reset")
@click.option("--tenant", default=None, help="Only this tenant (name or id). [every tenant]")
@_server_url
@common_options
def cache_reset(tenant: str | None, url: str, **opts: Any) -> None:
    """Drop cached blocks (running requests are unharmed); audited."""
    from urllib.parse import quote

    path = f"/admin/tenants/{quote(tenant, safe='')}/cache/reset" if tenant else "/admin/cache/reset"
    r = _server_call("POST", path, url, opts)
    click.echo(f"blocks dropped: {r['blocks_dropped']}")
