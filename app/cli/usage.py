"""``saltserve usage report``: usage per calendar bucket, from the database."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from app.cli.options import common_options, open_repository, settings_from_options, tenant_id_of


def _when(text: str | None, now: datetime) -> datetime | None:
    """``7d``, ``12h``, ``30m`` (before now) or an ISO 8601 time (UTC when it has no zone)."""
    if text is None:
        return None
    units = {"d": timedelta(days=1), "h": timedelta(hours=1), "m": timedelta(minutes=1)}
    try:
        if re.fullmatch(r"[0-9]{1,7}[dhm]", text):
            return now - int(text[:-1]) * units[text[-1]]
        t = datetime.fromisoformat(text)
    except (ValueError, OverflowError):
        raise click.BadParameter("7d, 12h, 30m or an ISO 8601 time") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


@click.group()
def usage() -> None:
    """Usage reports (from the database)."""


@usage.command("report")
@click.option("--tenant", default=None, help="Tenant name or id. [all tenants]")
@click.option("--since", default=None, help="7d, 12h, 30m or ISO 8601. [30d for 1d buckets]")
@click.option("--until", default=None, help="As --since. [now]")
@click.option("--bucket", type=click.Choice(["1m", "1h", "1d"]), default="1d", show_default=True)
@click.option("--group-by", default="tenant", show_default=True,
              help="Comma-separated: tenant, key, model, end_user.")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True)
@common_options
def usage_report(tenant: str | None, since: str | None, until: str | None, bucket: str,
                 group_by: str, fmt: str, **opts: Any) -> None:
    """Usage per calendar bucket (UTC): requests, errors, tokens, hit rate, TTFT p50 / p95."""
    from tenants.usage_reports import REPORT_COLUMNS, csv_text, default_query, report_dicts

    now = datetime.now(UTC)
    repo = open_repository(settings_from_options(**opts))
    try:
        query = default_query(bucket, _when(since, now), _when(until, now),
                              tuple(g.strip() for g in group_by.split(",") if g.strip()),
                              tenant_id_of(repo, tenant) if tenant else None)
        rows = repo.usage.report(query)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    data = report_dicts(rows)
    if fmt == "json":
        click.echo(json.dumps(data, default=lambda v: v.isoformat(), indent=1))
        return
    if fmt == "csv":
        click.echo(csv_text(data, REPORT_COLUMNS), nl=False)
        return
    shown = ["bucket_start", *[c for c in ("tenant_name", "key_id", "model", "end_user")
                               if any(row[c] for row in data)],
             "requests", "errors", "prompt_tokens", "cached_tokens", "tier_cached_tokens",
             "completion_tokens", "hit_rate", "ttft_p50_s", "ttft_p95_s"]

    def cell(v: Any) -> str:
        if isinstance(v, datetime):
            return v.strftime("%Y-%m-%d %H:%M")
        if isinstance(v, float):
            return f"{v:.3f}"
        return "-" if v is None else str(v)

    table = [shown] + [[cell(row[c]) for c in shown] for row in data]
    widths = [max(len(r[i]) for r in table) for i in range(len(shown))]
    for r in table:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
