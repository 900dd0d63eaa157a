"""The options every command shares (``--data-dir``, ``--database-url``), the ``serve`` flags
generated from ``EngineConfig`` (one declaration per setting), and the helpers that turn options
into ``Settings``, a repository, a tenant id and an audit actor.

Every ``serve`` flag also reads ``SALTSERVE_<NAME>`` from the environment; flags win.
"""

from __future__ import annotations

import getpass
import os
import types
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union, get_args, get_origin, get_type_hints

import click

from app.logs import LOG_FORMATS, LOG_LEVELS
from app.settings import Settings
from engine.config import EngineConfig

if TYPE_CHECKING:
    from tenants.repository import TenantRepository

F = TypeVar("F", bound=Callable[..., Any])


def open_repository(settings: Settings) -> TenantRepository:
    """``app.bootstrap.open_repository`` (checks, migrates, opens).

    Raises:
        click.ClickException: a bad database file or key file, as one line.
    """
    from app.bootstrap import open_repository as open_and_migrate

    try:
        return open_and_migrate(settings)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def cli_actor() -> str:
    """The audit actor of a CLI action: ``cli:<OS user>``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name for this uid (e.g. a bare container)
        user = f"uid{os.getuid()}"
    return f"cli:{user}"


def settings_from_options(**overrides: Any) -> Settings:
    """``Settings`` from the environment, with every option the user gave (not None) on top."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def common_options(fn: F) -> F:
    """Adds ``--data-dir`` and ``--database-url``, which every command takes."""
    fn = click.option("--database-url", default=None,
                      help="SQLAlchemy URL. [sqlite in the data dir; env SALTSERVE_DATABASE_URL]")(fn)
    fn = click.option("--data-dir", type=click.Path(path_type=Path), default=None,
                      help="All state lives here. [./.saltserve; env SALTSERVE_DATA_DIR]")(fn)
    return fn


def tenant_id_of(repo: TenantRepository, tenant: str) -> str:
    """The id of the tenant with id ``tenant``, else named ``tenant`` (ids first; ClickException
    if none, or if it is one tenant's id and another's name)."""
    from tenants.errors import TenantNotFound

    try:
        return repo.tenants.resolve(tenant).id
    except (TenantNotFound, ValueError) as e:
        raise click.ClickException(str(e)) from None


class _Bytes(click.ParamType):
    """A size: a number of bytes, or with a unit (``8GiB``, ``500MB``; pydantic's ByteSize)."""

    name = "bytes"

    def convert(self, value, param, ctx):
        from pydantic import ByteSize, TypeAdapter, ValidationError

        try:
            return int(TypeAdapter(ByteSize).validate_python(value))
        except ValidationError:
            self.fail(f"{value!r} is not a size (a number of bytes, or e.g. 8GiB, 500MB)",
                      param, ctx)


BYTES = _Bytes()


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
        if f.name == "model" or f.metadata.get("flag") is False:
            continue
        flag, typ = "--" + f.name.replace("_", "-"), hints[f.name]
        if get_origin(typ) in (Union, types.UnionType):  # X | None -> X
            typ = next(a for a in get_args(typ) if a is not type(None))
        shown = f.metadata.get("unset") if f.default is None else f.default
        if f.metadata.get("bytes") and isinstance(shown, int):
            shown = f"{shown >> 30}GiB" if shown and not shown % (1 << 30) else shown
        kwargs: dict[str, Any] = {"default": None}
        if typ is bool:
            decl, shown = f"{flag}/--no-{flag[2:]}", "on" if f.default else "off"
        else:
            decl = flag
            kwargs["type"] = (click.Choice(f.metadata["choices"]) if "choices" in f.metadata
                              else BYTES if f.metadata.get("bytes") else typ)
        kwargs["help"] = f"{f.metadata['help']} [{shown}; env SALTSERVE_{f.name.upper()}]"
        specs.append((decl, kwargs))
    return specs


def serve_options(fn: F) -> F:
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
    return common_options(fn)


def env_only_settings(serve: click.Command) -> list[str]:
    """``SALTSERVE_*`` settings that have no flag on ``serve`` (the serve command): secrets
    and rarely changed options, for ``serve --help``."""
    flags = {p.name for p in serve.params}
    return [f"SALTSERVE_{name.upper()}" for name in Settings.model_fields if name not in flags]
