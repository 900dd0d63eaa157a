"""``saltserve`` command line: ``serve``, ``tenants ...``, ``keys ...`` (click).

Every ``serve`` flag also reads ``SALTSERVE_<NAME>`` from the environment; flags win.
"""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click

from app.settings import Settings

_ENGINE_FLAGS: list[tuple[str, Any, str]] = [
    ("--block-size", int, "Tokens per KV block (vLLM --block-size). [16]"),
    ("--max-model-len", int, "Prompt + output tokens per request. [8192]"),
    ("--max-num-seqs", int, "Running requests per step. [64]"),
    ("--max-num-batched-tokens", int, "Tokens per step (chunked prefill budget). [2048]"),
    ("--prefix-caching-hash-algo", click.Choice(["sha256", "sha256_cbor", "xxhash"]),
     "Block hash function. [sha256]"),
    ("--num-gpu-blocks-override", int, "Exact number of KV blocks (testing)."),
    ("--kv-cache-memory-bytes", int, "KV cache budget in bytes. [1 GiB on CPU]"),
    ("--gpu-memory-utilization", float, "Fraction of free GPU memory for the KV cache. [0.9]"),
    ("--dtype", click.Choice(["auto", "float32", "bfloat16", "float16"]),
     "Model dtype. [auto: fp32 on CPU, bf16 on CUDA]"),
    ("--device", click.Choice(["auto", "cpu", "cuda"]), "Device. [auto]"),
    ("--attention-backend", click.Choice(["auto", "torch", "triton"]),
     "Attention implementation. [auto: triton on CUDA, torch on CPU]"),
    ("--served-model-name", str, "Model id reported by /v1/models. [model folder name]"),
    ("--seed", int, "Seed for unseeded sampling. [0]"),
]


def _settings(**overrides: Any) -> Settings:
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _common(fn):  # --data-dir and --database-url for every command
    fn = click.option("--database-url", default=None,
                      help="SQLAlchemy URL. [sqlite in the data dir; env SALTSERVE_DATABASE_URL]")(fn)
    fn = click.option("--data-dir", type=click.Path(path_type=Path), default=None,
                      help="All state lives here. [./.saltserve; env SALTSERVE_DATA_DIR]")(fn)
    return fn


@click.group()
def main() -> None:
    """saltserve: multi-tenant OpenAI-compatible LLM serving with tenant-salted prefix caching."""
    logging.basicConfig(level=os.environ.get("SALTSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "transformers", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _serve_options(fn):
    for flag, typ, help_ in reversed(_ENGINE_FLAGS):
        fn = click.option(flag, type=typ, default=None, help=help_)(fn)
    fn = click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None,
                      help="Automatic prefix caching. [on]")(fn)
    fn = click.option("--model", default=None,
                      help="Hugging Face folder (safetensors). [bundled SmolLM2-135M-Instruct]")(fn)
    fn = click.option("--port", type=int, default=None, help="[8000; env SALTSERVE_PORT]")(fn)
    fn = click.option("--host", default=None, help="[127.0.0.1; env SALTSERVE_HOST]")(fn)
    return _common(fn)


@main.command()
@_serve_options
def serve(**opts: Any) -> None:
    """Start the OpenAI-compatible server (first start converts the model and creates a key)."""
    import uvicorn

    from app.bootstrap import bootstrap
    from app.server import create_app
    from engine.async_engine import AsyncLLM
    from engine.llm_engine import LLMEngine

    settings = _settings(**opts)
    click.echo(f"saltserve: data dir {settings.data_dir.resolve()}")
    boot = bootstrap(settings)
    try:
        engine = LLMEngine(settings.engine_config(boot.model_dir))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    app = create_app(AsyncLLM(engine), boot.repo, settings.max_request_body_bytes,
                     settings.metrics_token)
    base = f"http://{settings.host}:{settings.port}"
    if boot.demo_key:
        click.echo("\nCreated tenant 'demo' with an API key (shown once; also saved with mode "
                   f"0600 in {boot.demo_key_file}):\n\n    {boot.demo_key}\n")
    key_file = boot.demo_key_file or "<file with your API key>"
    name = engine.served_model_name
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
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")


@main.group()
def tenants() -> None:
    """Manage tenants."""


@tenants.command("create")
@click.argument("name")
@click.option("--no-prefix-caching", is_flag=True, help="Never cache this tenant's prompts.")
@_common
def tenants_create(name: str, no_prefix_caching: bool, **opts: Any) -> None:
    """Create tenant NAME (with salt version 1)."""
    from app.bootstrap import open_repository
    from tenants.errors import DuplicateTenant

    repo = open_repository(_settings(**opts))
    try:
        t = repo.create_tenant(name, enable_prefix_caching=not no_prefix_caching, actor="cli")
    except (DuplicateTenant, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"tenant {t.name} id={t.id} salt_version={t.current_salt_version}")


@tenants.command("list")
@_common
def tenants_list(**opts: Any) -> None:
    """List tenants."""
    from app.bootstrap import open_repository

    for t in open_repository(_settings(**opts)).list_tenants():
        state = "disabled" if t.disabled else "active"
        click.echo(f"{t.id}  {t.name}  {state}  salt_version={t.current_salt_version}")


@main.group()
def keys() -> None:
    """Manage tenant API keys."""


def _tenant_id(repo, tenant: str) -> str:
    from tenants.errors import TenantNotFound

    try:
        return repo.get_tenant_by_name(tenant).id
    except TenantNotFound:
        try:
            return repo.get_tenant(tenant).id
        except TenantNotFound:
            raise click.ClickException(f"no tenant named or with id {tenant!r}") from None


@keys.command("create")
@click.option("--tenant", required=True, help="Tenant name or id.")
@click.option("--name", default=None, help="Label for the key.")
@click.option("--expires-in-days", type=int, default=None, help="Expiry. [never]")
@_common
def keys_create(tenant: str, name: str | None, expires_in_days: int | None, **opts: Any) -> None:
    """Create an API key; the key is printed once and never stored in plain text."""
    from app.bootstrap import open_repository

    repo = open_repository(_settings(**opts))
    expires = (datetime.now(UTC) + timedelta(days=expires_in_days)) if expires_in_days else None
    key, info = repo.create_api_key(_tenant_id(repo, tenant), name, expires, actor="cli")
    click.echo(f"key id {info.id} for tenant {tenant} (shown once):", err=True)
    click.echo(key)


@keys.command("list")
@click.option("--tenant", required=True, help="Tenant name or id.")
@_common
def keys_list(tenant: str, **opts: Any) -> None:
    """List a tenant's keys (display prefix and last 4 characters only)."""
    from app.bootstrap import open_repository

    repo = open_repository(_settings(**opts))
    for k in repo.list_api_keys(_tenant_id(repo, tenant)):
        state = "revoked" if k.revoked_at else "active"
        click.echo(f"{k.id}  {k.display_prefix}-...{k.last4}  {state}  name={k.name}")


@keys.command("revoke")
@click.argument("key_id")
@_common
def keys_revoke(key_id: str, **opts: Any) -> None:
    """Revoke key KEY_ID (effective on the next request)."""
    from app.bootstrap import open_repository
    from tenants.errors import TenantError

    try:
        open_repository(_settings(**opts)).revoke_api_key(key_id, actor="cli")
    except TenantError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"revoked {key_id}")


if __name__ == "__main__":
    main()
