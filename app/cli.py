"""``saltserve`` command line: ``serve``, ``tenants ...``, ``keys ...`` (click).

Every ``serve`` flag also reads ``SALTSERVE_<NAME>`` from the environment; flags win.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import re
import socket
import sys
import types
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import click
import pydantic

from app.bench import IN_PROCESS_URL, PROFILES, SWEEP_AXES
from app.logs import LOG_FORMATS, LOG_LEVELS, configure_logging
from app.settings import Settings
from engine.config import EngineConfig


def _open_repository(settings: Settings):
    """``app.bootstrap.open_repository``; a bad database file or key file is a one-line error."""
    from app.bootstrap import open_repository

    try:
        return open_repository(settings)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def _cli_actor() -> str:
    """The audit actor of a CLI action: ``cli:<OS user>``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name for this uid (e.g. a bare container)
        user = f"uid{os.getuid()}"
    return f"cli:{user}"


def _settings(**overrides: Any) -> Settings:
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _common(fn):  # --data-dir and --database-url for every command
    fn = click.option("--database-url", default=None,
                      help="SQLAlchemy URL. [sqlite in the data dir; env SALTSERVE_DATABASE_URL]")(fn)
    fn = click.option("--data-dir", type=click.Path(path_type=Path), default=None,
                      help="All state lives here. [./.saltserve; env SALTSERVE_DATA_DIR]")(fn)
    return fn


@click.group()
@click.version_option(package_name="saltserve", prog_name="saltserve")
def main() -> None:
    """saltserve: multi-tenant OpenAI-compatible LLM serving with tenant-salted prefix caching."""
    os.umask(0o077)  # the database, journal and key files this process creates are private
    try:
        env = Settings()
        configure_logging(env.log_format, env.log_level, env.replica_id or socket.gethostname())
    except (ValueError, pydantic.ValidationError):  # serve reports bad settings in full
        configure_logging()


def engine_option_specs() -> list[tuple[str, dict[str, Any]]]:
    """``(declaration, click.option kwargs)`` per ``EngineConfig`` field but ``model``, in order.

    Flag ``--<name with - for _>``; bool fields become ``--x/--no-x``; ``T | None`` takes ``T``;
    ``metadata["choices"]`` becomes ``click.Choice``; help is ``metadata["help"]`` plus the
    default and env var in brackets. Click defaults stay None so that ``Settings`` fills in
    unset flags (env ``SALTSERVE_<NAME>``, then EngineConfig's default).
    """
    hints = get_type_hints(EngineConfig)
    specs = []
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        flag, typ = "--" + f.name.replace("_", "-"), hints[f.name]
        if get_origin(typ) in (Union, types.UnionType):  # X | None -> X
            typ = next(a for a in get_args(typ) if a is not type(None))
        shown = f.metadata.get("unset") if f.default is None else f.default
        kwargs: dict[str, Any] = {"default": None}
        if typ is bool:
            decl, shown = f"{flag}/--no-{flag[2:]}", "on" if f.default else "off"
        else:
            decl = flag
            kwargs["type"] = click.Choice(f.metadata["choices"]) if "choices" in f.metadata else typ
        kwargs["help"] = f"{f.metadata['help']} [{shown}; env SALTSERVE_{f.name.upper()}]"
        specs.append((decl, kwargs))
    return specs


def _serve_options(fn):
    for decl, kwargs in reversed(engine_option_specs()):
        fn = click.option(decl, **kwargs)(fn)
    fn = click.option("--model", default=None,
                      help="Hugging Face folder (safetensors). [bundled SmolLM2-135M-Instruct]")(fn)
    fn = click.option("--port", type=int, default=None, help="[8000; env SALTSERVE_PORT]")(fn)
    fn = click.option("--host", default=None, help="[127.0.0.1; env SALTSERVE_HOST]")(fn)
    fn = click.option("--log-format", type=click.Choice(LOG_FORMATS), default=None,
                      help="text, or JSON lines with timestamp, level, request, tenant and "
                           "replica ids (uvicorn's access log too). [text; env "
                           "SALTSERVE_LOG_FORMAT]")(fn)
    fn = click.option("--log-level", type=click.Choice(LOG_LEVELS), default=None,
                      help="Also uvicorn's. [info; env SALTSERVE_LOG_LEVEL]")(fn)
    fn = click.option("--drain-seconds", type=click.FloatRange(min=0), default=None,
                      help="On SIGTERM: /health answers 503 for this long, then the server "
                           "stops accepting and lets running requests finish (rolling "
                           "restarts behind a load balancer). [0; env SALTSERVE_DRAIN_SECONDS]")(fn)
    fn = click.option("--redis-url", default=None,
                      help="Redis shared by the replicas (cache evictions, rate limits). "
                           "[unset: one replica; env SALTSERVE_REDIS_URL]")(fn)
    fn = click.option("--replica-id", default=None,
                      help="This replica's name in log lines. [<hostname>:<port>; env "
                           "SALTSERVE_REPLICA_ID]")(fn)
    return _common(fn)


def env_only_settings() -> list[str]:
    """``SALTSERVE_*`` settings that have no ``serve`` flag (secrets and rarely changed
    options), for ``serve --help``."""
    flags = {p.name for p in serve.params}
    return [f"SALTSERVE_{name.upper()}" for name in Settings.model_fields if name not in flags]


def _journal_name(settings: Settings) -> str:
    """The usage journal's folder in the data dir: one per replica when replicas share a data
    dir (``--replica-id``), so that each journals its own rows."""
    if settings.replica_id is None:
        return "usage-journal"
    return "usage-journal-" + re.sub(r"[^A-Za-z0-9_.-]", "_", settings.replica_id)[:64]


class _ServeCommand(click.Command):
    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_paragraph()
        formatter.write_text("Environment-only settings (docs/deployment.md describes each): "
                             + ", ".join(env_only_settings()) + ".")


def _freeze_startup_heap() -> int:
    """Moves every object alive now (the model, tokenizer, app: about 320 thousand) out of the
    garbage collector's sight, as vLLM's ``freeze_gc_heap`` does, and returns how many.

    Why: a full collection walks every tracked object while holding the GIL, so it stops the
    engine thread's step and every stream with it: 175-181 ms for a gguf server's startup heap,
    0.0 ms once frozen (AMD EPYC, 2026-12-06). The startup heap mostly lives as long as the
    process; what of it later becomes cyclic garbage is not collected while serving, a cost
    bounded by that heap. Called once, just before serving; tests that build apps in-process
    never call it (their heaps do not live long).

    The heap is given back at exit (``atexit``): objects still frozen then are never
    finalised, and triton's bindings (nanobind) print a "leaked N instances / functions /
    types" report of about 40 lines, which a first start (it converts the model, and froze
    triton's objects) printed on Ctrl-C or on the engine's death."""
    import atexit
    import gc

    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    # "app.cli" by name: run as ``python -m app.cli`` this module's __name__ is "__main__".
    logging.getLogger("app.cli").info("froze %d startup objects: full garbage collections skip "
                                      "them", frozen)
    return frozen


@main.command(cls=_ServeCommand)
@_serve_options
def serve(**opts: Any) -> None:
    """Start the OpenAI-compatible server (first start converts the model and creates a key)."""
    import uvicorn

    from app.bootstrap import bootstrap, make_jwt_verifier
    from app.cluster import ClusterConfig
    from app.console.sessions import ConsoleSessions
    from app.draining import DrainingServer
    from app.server import create_app
    from engine.async_engine import AsyncLLM

    settings = _settings(**opts)
    replica_id = settings.replica_id or f"{socket.gethostname()}:{settings.port}"
    configure_logging(settings.log_format, settings.log_level, replica_id)
    click.echo(f"saltserve: data dir {settings.data_dir.resolve()}")
    try:
        settings.engine_config(settings.data_dir / "models")  # a bad engine flag: before any write
        boot = bootstrap(settings)
        verifier = make_jwt_verifier(settings)
        console_sessions = ConsoleSessions(settings.console_session_idle_s,
                                           settings.console_session_max_s,
                                           secure_cookie=settings.console_secure_cookie)
        # Built and stepped on one thread: see AsyncLLM.from_config.
        client = AsyncLLM.from_config(settings.engine_config(boot.model_dir))
    except (ValueError, FileNotFoundError) as e:  # a bad flag, missing weights or GGUF
        raise click.UsageError(str(e)) from None
    server: uvicorn.Server | None = None

    def stop_serving() -> None:  # the engine died: stop, then exit non-zero (below)
        if server is not None:
            server.should_exit = True

    try:
        app = create_app(client, boot.repo, settings.max_request_body_bytes,
                         settings.metrics_token, jwt_verifier=verifier,
                         on_engine_death=stop_serving,
                         usage_journal_dir=settings.data_dir / _journal_name(settings),
                         console_sessions=console_sessions,
                         cluster=ClusterConfig(settings.redis_url, settings.redis_namespace,
                                               replica_id))
    except RuntimeError as e:  # another server already uses this data dir's usage journal
        raise click.ClickException(str(e)) from None
    base = f"http://{settings.host}:{settings.port}"
    if boot.demo_key and sys.stdout.isatty():
        click.echo("\nCreated tenant 'demo' with an API key (shown once; also saved with mode "
                   f"0600 in {boot.demo_key_file}):\n\n    {boot.demo_key}\n")
    elif boot.demo_key:  # stdout is a log someone keeps: never the key itself
        click.echo(f"\nCreated tenant 'demo' with an API key, saved with mode 0600 in "
                   f"{boot.demo_key_file} (not printed: stdout is not a terminal).\n")
    key_file = boot.demo_key_file or "<file with your API key>"
    name = client.model_info().served_model_name
    click.echo(f"""Try it:

  curl {base}/v1/chat/completions \\
    -H "Authorization: Bearer $(cat {key_file})" -H "Content-Type: application/json" \\
    -d '{{"model": "{name}", "max_tokens": 64,
         "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  from pathlib import Path
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key=Path("{key_file}").read_text().strip())
  r = client.chat.completions.create(model="{name}", max_tokens=64,
                                     messages=[{{"role": "user", "content": "Hello!"}}])
  print(r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)
""")
    _freeze_startup_heap()
    # log_config=None: uvicorn's loggers keep app.logs' handler and format.
    # timeout_keep_alive above a load balancer's idle-connection lifetime (HAProxy's is a
    # few seconds): the balancer, not the server, closes idle connections, so it never sends a
    # request on one the server is closing.
    from app.services.preprocess import shutdown_parse_pool

    # on_stop: uvicorn ends the process with the SIGTERM it caught once it has stopped, so the
    # parse pool is shut down before that (the finally covers the other ways out).
    server = DrainingServer(uvicorn.Config(app, host=settings.host, port=settings.port,
                                           log_level=settings.log_level, log_config=None,
                                           timeout_keep_alive=75),
                            app, settings.drain_seconds, on_stop=shutdown_parse_pool)
    try:
        server.run()
    finally:
        shutdown_parse_pool()
    if client.errored:
        click.echo("saltserve: the inference engine died; exiting with status 1 so that a "
                   "supervisor restarts the server", err=True)
        raise SystemExit(1)


@main.group()
def tenants() -> None:
    """Manage tenants."""


@tenants.command("create")
@click.argument("name")
@click.option("--no-prefix-caching", is_flag=True, help="Never cache this tenant's prompts.")
@_common
def tenants_create(name: str, no_prefix_caching: bool, **opts: Any) -> None:
    """Create tenant NAME (with salt version 1)."""
    from tenants.errors import DuplicateTenant

    repo = _open_repository(_settings(**opts))
    try:
        t = repo.tenants.create(name, enable_prefix_caching=not no_prefix_caching, actor=_cli_actor())
    except (DuplicateTenant, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"tenant {t.name} id={t.id} salt_version={t.current_salt_version}")


@tenants.command("list")
@_common
def tenants_list(**opts: Any) -> None:
    """List tenants."""

    for t in _open_repository(_settings(**opts)).tenants.list_all():
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
@_common
def tenants_set_share(tenant: str, weight: int | None, min_cache_blocks: Any,
                      max_cache_blocks: Any, **opts: Any) -> None:
    """Set TENANT's capacity share (name or id); applies from its next request."""

    repo = _open_repository(_settings(**opts))
    try:
        t = repo.tenants.update(_tenant_id(repo, tenant), weight=weight,
                                min_cache_blocks=min_cache_blocks,
                                max_cache_blocks=max_cache_blocks, actor=_cli_actor())
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"tenant {t.name} id={t.id} weight={t.weight} "
               f"min_cache_blocks={t.min_cache_blocks} max_cache_blocks={t.max_cache_blocks}")


def _set_disabled(tenant: str, disabled: bool, opts: dict[str, Any]) -> None:

    repo = _open_repository(_settings(**opts))
    t = repo.tenants.update(_tenant_id(repo, tenant), disabled=disabled, actor=_cli_actor())
    click.echo(f"tenant {t.name} id={t.id} {'disabled' if t.disabled else 'active'}")


@tenants.command("disable")
@click.argument("tenant")
@_common
def tenants_disable(tenant: str, **opts: Any) -> None:
    """Disable TENANT (name or id): its keys and tokens are refused from the next request."""
    _set_disabled(tenant, True, opts)


@tenants.command("enable")
@click.argument("tenant")
@_common
def tenants_enable(tenant: str, **opts: Any) -> None:
    """Enable TENANT (name or id) again."""
    _set_disabled(tenant, False, opts)


@tenants.command("rotate-salt")
@click.argument("tenant")
@_common
def tenants_rotate_salt(tenant: str, **opts: Any) -> None:
    """Rotate TENANT's salt (name or id): the new version is current at once.

    The old cached blocks are unreachable from that moment. With SALTSERVE_REDIS_URL set, every
    running replica drops them at once (app.cluster); otherwise a server drops them on the
    tenant's next request (reason salt_rotation).
    """
    from app.cluster import ClusterConfig, publish_now

    settings = _settings(**opts)
    repo = _open_repository(settings)
    tenant_id = _tenant_id(repo, tenant)
    version = repo.tenants.rotate_salt(tenant_id, actor=_cli_actor())
    told = publish_now(ClusterConfig(settings.redis_url, settings.redis_namespace, "cli"),
                       tenant_id, "salt_rotation")
    click.echo(f"tenant {tenant} id={tenant_id} salt_version={version}"
               + (f" (replicas told: {told})" if settings.redis_url else ""))


@main.group()
def keys() -> None:
    """Manage tenant API keys."""


def _tenant_id(repo, tenant: str) -> str:
    """The id of the tenant with id ``tenant``, else named ``tenant`` (ids first; ClickException
    if none, or if it is one tenant's id and another's name)."""
    from tenants.errors import TenantNotFound

    try:
        return repo.tenants.resolve(tenant).id
    except (TenantNotFound, ValueError) as e:
        raise click.ClickException(str(e)) from None


@keys.command("create")
@click.option("--tenant", required=True, help="Tenant name or id.")
@click.option("--name", default=None, help="Label for the key.")
@click.option("--expires-in-days", type=int, default=None, help="Expiry. [never]")
@_common
def keys_create(tenant: str, name: str | None, expires_in_days: int | None, **opts: Any) -> None:
    """Create an API key; the key is printed once and never stored in plain text."""

    repo = _open_repository(_settings(**opts))
    expires = (datetime.now(UTC) + timedelta(days=expires_in_days)) if expires_in_days else None
    try:
        key, info = repo.keys.create(_tenant_id(repo, tenant), name, expires,
                                     actor=_cli_actor())
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"key id {info.id} for tenant {tenant} (shown once):", err=True)
    click.echo(key)


@keys.command("list")
@click.option("--tenant", required=True, help="Tenant name or id.")
@_common
def keys_list(tenant: str, **opts: Any) -> None:
    """List a tenant's keys (display prefix and last 4 characters only)."""

    repo = _open_repository(_settings(**opts))
    for k in repo.keys.list_for_tenant(_tenant_id(repo, tenant)):
        state = "revoked" if k.revoked_at else "active"
        click.echo(f"{k.id}  {k.display_prefix}-...{k.last4}  {state}  name={k.name}")


@keys.command("revoke")
@click.argument("key_id")
@_common
def keys_revoke(key_id: str, **opts: Any) -> None:
    """Revoke key KEY_ID (effective on the next request)."""
    from tenants.errors import TenantError

    try:
        _open_repository(_settings(**opts)).keys.revoke(key_id, actor=_cli_actor())
    except TenantError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"revoked {key_id}")


@keys.command("rotate-master")
@_common
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

    settings = _settings(**opts)
    repo = _open_repository(settings)
    new_text = generate_master_key()
    new_cipher = SaltCipher(decode_master_key(new_text))
    if settings.master_key:
        n = repo.tenants.reencrypt_salts(new_cipher, actor=_cli_actor())
        click.echo(f"re-encrypted {n} salts; set SALTSERVE_MASTER_KEY to the new key "
                   "(shown once) and restart servers:", err=True)
        click.echo(new_text)
        return
    path = settings.data_dir / MASTER_KEY_FILENAME
    staged, backup = path.with_name(path.name + ".new"), path.with_name(path.name + ".bak")
    write_secret_file(staged, new_text)
    try:
        n = repo.tenants.reencrypt_salts(new_cipher, actor=_cli_actor())
    except BaseException:
        staged.unlink()
        raise
    os.replace(path, backup)
    os.chmod(backup, 0o600)
    os.replace(staged, path)
    click.echo(f"re-encrypted {n} salts under a new master key in {path} (old key kept in "
               f"{backup}); restart running servers")


@main.group()
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
@_common
def token_issue(tenant: str | None, role: str, ttl: int, subject: str | None,
                **opts: Any) -> None:
    """Print a signed JWT (shown once, never stored)."""
    from app.bootstrap import prepare_data_dir
    from tenants.tokens import issue_token, load_or_create_platform_key, token_jti

    settings = _settings(**opts)
    tenant_id = None
    if tenant is not None:
        tenant_id = _tenant_id(_open_repository(settings), tenant)
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
    _open_repository(settings).usage.audit(
        _cli_actor(), "token.issue", tenant_id,
        f"role={role} sub={subject[:64]!r} ttl_s={ttl} jti={jti}")
    click.echo(f"jti {jti} (revoke with: saltserve token revoke {jti})", err=True)
    click.echo(token)


@token.command("revoke")
@click.argument("jti")
@_common
def token_revoke(jti: str, **opts: Any) -> None:
    """Revoke a platform JWT by its jti: refused from its next request on, on every server."""

    try:
        _open_repository(_settings(**opts)).revocations.revoke(jti, actor=_cli_actor())
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"revoked jti {jti}")



# -- usage reports and the running server's cache -----------------------------------------------
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


@main.group()
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
@_common
def usage_report(tenant: str | None, since: str | None, until: str | None, bucket: str,
                 group_by: str, fmt: str, **opts: Any) -> None:
    """Usage per calendar bucket (UTC): requests, errors, tokens, hit rate, TTFT p50 / p95."""
    from tenants.usage_reports import REPORT_COLUMNS, csv_text, default_query, report_dicts

    now = datetime.now(UTC)
    repo = _open_repository(_settings(**opts))
    try:
        query = default_query(bucket, _when(since, now), _when(until, now),
                              tuple(g.strip() for g in group_by.split(",") if g.strip()),
                              _tenant_id(repo, tenant) if tenant else None)
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
             "requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens",
             "hit_rate", "ttft_p50_s", "ttft_p95_s"]

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


@tenants.command("set-limits")
@click.argument("tenant")
@click.option("--rpm", callback=_cache_bound, default=None, metavar="N|none",
              help="Requests per minute. [unchanged]")
@click.option("--tpm", callback=_cache_bound, default=None, metavar="N|none",
              help="Tokens (prompt + max_tokens) per minute. [unchanged]")
@click.option("--max-concurrent", callback=_cache_bound, default=None, metavar="N|none",
              help="Requests in flight at once. [unchanged]")
@_common
def tenants_set_limits(tenant: str, rpm: Any, tpm: Any, max_concurrent: Any,
                       **opts: Any) -> None:
    """Set TENANT's rate limits (name or id; 'none' removes one); apply from its next
    request."""
    repo = _open_repository(_settings(**opts))
    try:
        t = repo.tenants.update(_tenant_id(repo, tenant), rpm_limit=rpm, tpm_limit=tpm,
                                max_concurrent=max_concurrent, actor=_cli_actor())
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"tenant {t.name} id={t.id} rpm={t.rpm_limit} tpm={t.tpm_limit} "
               f"max_concurrent={t.max_concurrent}")


def _server_call(method: str, path: str, url: str, opts: dict[str, Any]) -> dict:
    """Calls the running server's admin API with a 60-second admin JWT signed with the data
    dir's platform key (the audit actor is ``cli:<OS user>``)."""
    import urllib.error
    import urllib.request

    from app.bootstrap import prepare_data_dir
    from tenants.tokens import issue_token, load_or_create_platform_key

    settings = _settings(**opts)
    key = load_or_create_platform_key(prepare_data_dir(settings.data_dir))
    jwt = issue_token(key, settings.jwt_config(), subject=_cli_actor(), role="admin",
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


@main.group()
def cache() -> None:
    """The running server's prefix cache (through its admin API)."""


@cache.command("stats")
@_server_url
@_common
def cache_stats(url: str, **opts: Any) -> None:
    """Pool blocks and each tenant's resident blocks, hit rate and evictions."""
    s = _server_call("GET", "/admin/cache", url, opts)
    click.echo(f"blocks: {s['num_blocks_total']} total, {s['num_blocks_free']} free, "
               f"{s['num_blocks_used']} used, {s['num_blocks_cached']} cached")
    for t in s["tenants"]:
        rate = "-" if t["hit_rate"] is None else f"{t['hit_rate']:.3f}"
        evictions = " ".join(f"{k}={v}" for k, v in sorted(t["evictions"].items()))
        click.echo(f"{t['tenant_name'] or t['tenant_id']}: resident={t['resident_blocks']} "
                   f"hit_rate={rate} queried={t['queried_tokens']} evictions: {evictions}")


@cache.command("reset")
@click.option("--tenant", default=None, help="Only this tenant (name or id). [every tenant]")
@_server_url
@_common
def cache_reset(tenant: str | None, url: str, **opts: Any) -> None:
    """Drop cached blocks (running requests are unharmed); audited."""
    from urllib.parse import quote

    path = f"/admin/tenants/{quote(tenant, safe='')}/cache/reset" if tenant else "/admin/cache/reset"
    r = _server_call("POST", path, url, opts)
    click.echo(f"blocks dropped: {r['blocks_dropped']}")



@main.group()
def bench() -> None:
    """Benchmark prefix caching against a running server, or in-process (docs/benchmarks.md)."""


def _bench_report(url: str, out: Path | None, run: Any, fmt: Any, plot: Path | None = None,
                  draw: Any = None) -> dict:
    """Runs a bench (``run()``: its report), writes the JSON report to ``out``, prints
    ``fmt(report)`` and, with ``plot``, draws it there (``draw(report, plot)``); an unreachable
    or refusing server is a one-line error."""
    import httpx

    try:
        report = run()
    except (httpx.HTTPError, RuntimeError) as e:
        raise click.ClickException(f"{url}: {e}") from None
    except (OSError, ValueError) as e:  # a bad --hf-model folder, a peer's bad JSON
        raise click.ClickException(str(e)) from None
    if out is not None:
        out.write_text(json.dumps(report, indent=2))
    click.echo(fmt(report))
    if plot is not None:
        draw(report, plot)
    return report


def _check_plot(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    import importlib.util

    if value is not None and importlib.util.find_spec("matplotlib") is None:
        raise click.BadParameter("needs matplotlib: pip install 'saltserve[bench]'")
    return value


def _bench_plot(fn):  # --plot for the bench commands that draw one (checked before the run)
    return click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
                        callback=_check_plot,
                        help="Also draw the results into this PNG (matplotlib: pip install "
                             "'saltserve[bench]').")(fn)


def _bench_target(fn):  # --url and --out for every bench command
    fn = click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
                      help="Write the full JSON report here.")(fn)
    return click.option("--url", envvar="SALTSERVE_URL", default="http://127.0.0.1:8000",
                        show_default=True, help="The server. [$SALTSERVE_URL]")(fn)


def _bench_in_process(fn):  # --in-process, --model-dir and --data-dir: ours without a server
    fn = click.option("--data-dir", type=click.Path(path_type=Path), default=None,
                      help="Where the bundled model is converted. [./.saltserve; env "
                           "SALTSERVE_DATA_DIR]")(fn)
    fn = click.option("--model-dir", type=click.Path(exists=True, file_okay=False,
                                                     path_type=Path), default=None,
                      help="The model folder that --in-process loads (and sweep's pool_size "
                           "servers, and profiles' --hf-baseline). [the bundled "
                           "SmolLM2-135M-Instruct, converted in --data-dir]")(fn)
    return click.option("--in-process", is_flag=True,
                        help="No server: run our engine in this process, through its engine "
                             "interface (no HTTP, auth or database), on --model-dir with "
                             "serve's engine settings (SALTSERVE_* env, e.g. "
                             "SALTSERVE_QUANTIZATION=gguf); --url and the keys are unused.")(fn)


def _bench_seeded(fn):  # --seed and --run-nonce: a prompt set a later run can replay
    fn = click.option("--run-nonce", default=None,
                      help="Opens every prompt, so none is cached from an earlier run; give a "
                           "report's nonce and --seed to send the same prompts again. [random; "
                           "the report records it]")(fn)
    return click.option("--seed", type=int, default=0, show_default=True,
                        help="Draws the prompt texts (with --run-nonce: the same prompts).")(fn)


def _model_dir(model_dir: Path | None, data_dir: Path | None) -> Path:
    from engine.weights import ensure_default_model

    return model_dir or ensure_default_model(_settings(data_dir=data_dir).data_dir)


def _ours(stack: Any, in_process: bool, model_dir: Path | None, data_dir: Path | None,
          url: str, api_key: str | None, api_key_no_cache: str | None, model: str | None,
          metrics_token: str | None) -> tuple[Any, Any, Any]:
    """Our endpoints with caching on and off (``off`` None without ``api_key_no_cache``) and
    the probe of our cache counters (None without a metrics token): a server's, or, with
    ``in_process``, an engine's in this process, closed with ``stack``."""
    from app.bench.profiles import MetricsProbe
    from app.bench.validate import Endpoint

    if in_process:
        from app.bench.in_process import InProcessEngine

        settings = _settings(data_dir=data_dir)
        engine = stack.enter_context(InProcessEngine(
            settings.engine_config(_model_dir(model_dir, data_dir))))
        return engine.endpoint("bench-on"), engine.endpoint("bench-off", False), engine.probe()
    on = Endpoint(url, api_key, model, metrics_token=metrics_token)
    off = Endpoint(url, api_key_no_cache, on.model) if api_key_no_cache else None
    return on, off, MetricsProbe(url, metrics_token) if metrics_token else None


def _need_keys(in_process: bool, **keys: str | None) -> None:
    missing = [name for name, value in keys.items() if not value]
    if not in_process and missing:
        raise click.UsageError("without --in-process, give "
                               + " and ".join("--" + m.replace("_", "-") for m in missing))


@bench.command("validate")
@_bench_target
@_bench_in_process
@click.option("--api-key", envvar="SALTSERVE_API_KEY", default=None,
              help="A tenant's API key. [$SALTSERVE_API_KEY]")
@click.option("--model", default=None, help="[the server's first model]")
@click.option("--prefix-tokens", type=click.IntRange(min=1000), default=1000,
              show_default=True, help="Length of the shared prefix.")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Cold / warm / negative triples, each on a new prefix.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@_bench_seeded
@click.option("--min-warm-drop", type=float, default=0.30, show_default=True,
              help="Gate: warm TTFT at least this much below cold.")
@click.option("--min-hit-rate", type=float, default=0.60, show_default=True,
              help="Gate: warm cached_tokens / prompt tokens.")
@click.option("--neg-min-ratio", type=float, default=0.70, show_default=True,
              help="Gate: negative-control TTFT at least this share of cold.")
@click.option("--max-p99-ratio", type=float, default=1.0, show_default=True,
              help="Gate: warm TTFT p99 at most this multiple of cold p99 (no regression).")
@click.option("--require-cold/--no-require-cold", default=True, show_default=True,
              help="Gate: the cold requests get cached_tokens 0 (a prefix new to the server).")
@click.option("--metrics-token", envvar="SALTSERVE_METRICS_TOKEN", default=None,
              help="Reads block size, pool size and device from /metrics. "
                   "[$SALTSERVE_METRICS_TOKEN]")
def bench_validate(url: str, api_key: str, model: str | None, prefix_tokens: int,
                   rounds: int, max_tokens: int, seed: int, min_warm_drop: float,
                   min_hit_rate: float, neg_min_ratio: float, max_p99_ratio: float,
                   require_cold: bool, metrics_token: str | None,
                   out: Path | None, run_nonce: str | None, in_process: bool,
                   model_dir: Path | None, data_dir: Path | None) -> None:
    """The seed's cold / warm / negative-control test of prefix caching, with gates; exits 1
    when a gate fails."""

    from app.bench.validate import Gates, format_report, run_validate

    _need_keys(in_process, api_key=api_key)

    def run() -> dict:
        with contextlib.ExitStack() as stack:
            endpoint, _, _ = _ours(stack, in_process, model_dir, data_dir, url, api_key, None,
                                   model, metrics_token)
            with click.progressbar(length=rounds, label="rounds", file=sys.stderr) as bar:
                return run_validate(endpoint, prefix_tokens, rounds, seed, max_tokens,
                                    Gates(min_warm_drop, min_hit_rate, neg_min_ratio, max_p99_ratio,
                                          require_cold),
                                    progress=lambda done, total: bar.update(1),
                                    run_nonce=run_nonce)

    report = _bench_report(IN_PROCESS_URL if in_process else url, out, run, format_report)
    if not report["passed"]:
        raise SystemExit(1)


@bench.command("profiles")
@_bench_target
@_bench_in_process
@click.option("--api-key", envvar="SALTSERVE_API_KEY", default=None,
              help="Key of a tenant with prefix caching on. [$SALTSERVE_API_KEY]")
@click.option("--api-key-no-cache", default=None,
              help="Key of a tenant with prefix caching off (saltserve tenants create "
                   "bench-off --no-prefix-caching), for the off runs.")
@click.option("--model", default=None, help="[the server's first model]")
@click.option("--profile", "profiles", multiple=True,
              type=click.Choice(list(PROFILES)),
              help="Run only these. [all four]")
@click.option("--requests", type=click.IntRange(min=2), default=16, show_default=True,
              help="Requests per run.")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@_bench_seeded
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Interleaved rounds per profile: each sends a new prompt set to caching off "
                   "and on (in alternating order) and to each peer, and the report pools them "
                   "and lists each round's on/off ratio, so machine drift hits both sides.")
@click.option("--metrics-token", envvar="SALTSERVE_METRICS_TOKEN", default=None,
              help="Adds the server's own cache figures from /metrics. "
                   "[$SALTSERVE_METRICS_TOKEN]")
@click.option("--peer", "peer_specs", multiple=True, metavar="NAME=URL[,KEY,MODEL]",
              help="Also run every profile against this OpenAI-compatible server (e.g. vLLM "
                   "with --enable-prefix-caching --enable-prompt-tokens-details); repeatable.")
@click.option("--hf-baseline", is_flag=True,
              help="Also run every profile through Hugging Face transformers generate in this "
                   "process, one prompt at a time (loads the model: --hf-model).")
@click.option("--hf-model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="Hugging Face folder for --hf-baseline. [--model-dir]")
@_bench_plot
def bench_profiles(url: str, api_key: str, api_key_no_cache: str, model: str | None,
                   profiles: tuple[str, ...], requests: int, concurrency: int,
                   max_tokens: int, seed: int, run_nonce: str | None, rounds: int,
                   metrics_token: str | None, out: Path | None, peer_specs: tuple[str, ...],
                   hf_baseline: bool,
                   hf_model: Path | None, data_dir: Path | None, plot: Path | None,
                   in_process: bool, model_dir: Path | None) -> None:
    """The seed's four workload profiles (shared system prompt, RAG document, few-shot,
    mostly unique), each with prefix caching on and off, beside any peers and HF generate."""

    import httpx

    from app.bench.baselines import HFGenerate, parse_peer
    from app.bench.plots import plot_profiles
    from app.bench.profiles import format_profiles, run_profiles
    from app.bench.validate import Endpoint

    _need_keys(in_process, api_key=api_key, api_key_no_cache=api_key_no_cache)
    chosen = profiles or PROFILES
    try:
        peers = [parse_peer(spec) for spec in peer_specs]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--peer") from None
    if len({p.name for p in peers}) != len(peers):
        raise click.BadParameter("peer names must differ", param_hint="--peer")

    def run() -> dict:
        with contextlib.ExitStack() as stack:  # an in-process engine is closed at the end
            on, off, probe = _ours(stack, in_process, model_dir, data_dir, url, api_key,
                                   api_key_no_cache, model, metrics_token)
            peer_eps = {}
            for p in peers:
                try:
                    peer_eps[p.name] = Endpoint(p.url, p.api_key, p.model,
                                                metrics_token=p.api_key)
                except httpx.HTTPError as e:
                    raise RuntimeError(f"peer {p.name} at {p.url}: {e}") from None
            hf = None
            if hf_baseline:
                from engine.weights import DEFAULT_MODEL_NAME

                if hf_model is None and model_dir is None and on.model != DEFAULT_MODEL_NAME:
                    raise RuntimeError(f"the server serves {on.model}; give --hf-model (its "
                                       "Hugging Face folder) for the generate baseline")
                hf = HFGenerate(hf_model or _model_dir(model_dir, data_dir))
            with click.progressbar(length=len(chosen), label="profiles", file=sys.stderr) as bar:
                return run_profiles(on, off, requests, concurrency, max_tokens, seed, chosen,
                                    progress=lambda name: bar.update(1), peers=peer_eps, hf=hf,
                                    probe=probe, rounds=rounds, nonce=run_nonce)

    _bench_report(IN_PROCESS_URL if in_process else url, out, run, format_profiles, plot,
                  plot_profiles)


@bench.command("tenants")
@_bench_target
@click.option("--admin-token", envvar="SALTSERVE_ADMIN_TOKEN", required=True,
              help="An admin JWT: creates the run's tenants (disabled afterwards) and reads "
                   "/metrics. [$SALTSERVE_ADMIN_TOKEN]")
@click.option("--tenants", "n_tenants", type=click.IntRange(min=1), default=4,
              show_default=True, help="Tenants with their own system prompt.")
@click.option("--requests", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests per tenant, one at a time.")
@click.option("--flood-requests", type=click.IntRange(min=1), default=32, show_default=True,
              help="Unique prompts the flooding tenant sends meanwhile.")
@click.option("--flood-concurrency", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@_bench_seeded
@_bench_plot
def bench_tenants(url: str, admin_token: str, n_tenants: int, requests: int,
                  flood_requests: int, flood_concurrency: int, max_tokens: int, seed: int,
                  run_nonce: str | None, out: Path | None, plot: Path | None) -> None:
    """N tenants share the pool while one floods unique prompts: per-tenant hit rate, TTFT and
    the blocks the flood evicted from each."""

    from app.bench.plots import plot_tenants
    from app.bench.tenants import format_tenants, run_tenants

    def run() -> dict:
        total = n_tenants * (requests + 1) + flood_requests
        with click.progressbar(length=total, label="requests", file=sys.stderr) as bar:
            return run_tenants(url, admin_token, n_tenants, requests, flood_requests,
                               flood_concurrency, max_tokens, seed, nonce=run_nonce,
                               progress=lambda: bar.update(1))

    _bench_report(url, out, run, format_tenants, plot, plot_tenants)


@bench.command("sweep")
@_bench_target
@_bench_in_process
@click.option("--api-key", envvar="SALTSERVE_API_KEY", default=None,
              help="Key of a tenant with prefix caching on (every axis but pool_size). "
                   "[$SALTSERVE_API_KEY]")
@click.option("--api-key-no-cache", default=None,
              help="Key of a tenant with prefix caching off (every axis but pool_size).")
@click.option("--axis", type=click.Choice(list(SWEEP_AXES)), default="prefix_length",
              show_default=True, help="What varies (docs/benchmarks.md).")
@click.option("--values", default=None,
              help="Comma-separated values of the axis. [prefix_length 250,500,1000,2000 "
                   "tokens; match_rate 0,0.25,0.5,0.75,1; concurrency 1,2,4,8; output_length "
                   "1,16,64,128 tokens; pool_size 80,160,240,320 blocks]")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="prefix_length: cold / warm / off triples per value.")
@click.option("--requests", type=click.IntRange(min=1), default=12, show_default=True,
              help="Requests per run (every other axis).")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True,
              help="output_length: requests in flight.")
@click.option("--prefix-tokens", type=click.IntRange(min=16), default=1000, show_default=True,
              help="match_rate, pool_size: length of each prefix / document.")
@click.option("--documents", type=click.IntRange(min=1), default=3, show_default=True,
              help="pool_size: documents asked about in turn.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=4, show_default=True)
@_bench_seeded
@click.option("--metrics-token", envvar="SALTSERVE_METRICS_TOKEN", default=None,
              help="Adds block size, pool and device to the report.")
@_bench_plot
def bench_sweep(url: str, api_key: str | None, api_key_no_cache: str | None, axis: str,
                values: str | None, rounds: int, requests: int, concurrency: int,
                prefix_tokens: int, documents: int, max_tokens: int, seed: int,
                run_nonce: str | None, metrics_token: str | None, model_dir: Path | None,
                data_dir: Path | None,
                out: Path | None, plot: Path | None, in_process: bool) -> None:
    """One axis at a time (prefix length, match rate, concurrency, output length, pool size),
    caching on and off; pool_size starts its own servers and needs no --url."""

    from app.bench.plots import plot_sweep
    from app.bench.sweep import DEFAULT_VALUES, format_sweep, parse_values, run_sweep

    try:
        chosen = parse_values(axis, values or DEFAULT_VALUES[axis])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--values") from None
    if axis != "pool_size":
        _need_keys(in_process, api_key=api_key, api_key_no_cache=api_key_no_cache)

    def run() -> dict:
        with click.progressbar(length=len(chosen), label=axis, file=sys.stderr) as bar:
            kwargs = {"rounds": rounds, "max_tokens": max_tokens, "seed": seed,
                      "requests": requests, "concurrency": concurrency,
                      "prefix_tokens": prefix_tokens, "documents": documents,
                      "progress": lambda _: bar.update(1), "nonce": run_nonce}
            if axis == "pool_size":  # its own servers, one per size
                return run_sweep(axis, chosen, model_dir=_model_dir(model_dir, data_dir),
                                 **kwargs)
            with contextlib.ExitStack() as stack:
                on, off, _ = _ours(stack, in_process, model_dir, data_dir, url, api_key,
                                   api_key_no_cache, None, metrics_token)
                return run_sweep(axis, chosen, on, off, **kwargs)

    _bench_report(IN_PROCESS_URL if in_process else url, out, run, format_sweep, plot,
                  plot_sweep)


if __name__ == "__main__":  # python -m app.cli (after every command is defined)
    main()
