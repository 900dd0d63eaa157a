"""``saltserve serve``: the OpenAI-compatible server (flags from ``app.cli.options``)."""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

import click

from app.cli.options import env_only_settings, serve_options, settings_from_options
from app.logs import configure_logging


class _ServeCommand(click.Command):
    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_paragraph()
        formatter.write_text("Environment-only settings (docs/deployment.md describes each): "
                             + ", ".join(env_only_settings(self)) + ".")


def _freeze_startup_heap() -> int:
    """Moves every object alive now (the model, tokenizer, app: about 320 thousand) out of the
    garbage collector's sight, as vLLM's ``freeze_gc_heap`` does, and returns how many.

    Why: a full collection walks every tracked object while holding the GIL, so it stops the
    engine thread's step and every stream with it: about 180 ms for a gguf server's startup
    heap, none once frozen. The startup heap mostly lives as long as the process; what of it
    later becomes cyclic garbage is not collected while serving, a cost bounded by that heap.
    Called once, just before serving; tests that build apps in-process never call it (their
    heaps do not live long).

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
    # "app.cli", not __name__ ("app.cli.serve"): the CLI's log lines keep one logger name.
    logging.getLogger("app.cli").info("froze %d startup objects: full garbage collections skip "
                                      "them", frozen)
    return frozen


@click.command(cls=_ServeCommand)
@serve_options
def serve(**opts: Any) -> None:
    """Start the OpenAI-compatible server (first start converts the model and creates a key)."""
    import uvicorn

    from app.draining import DrainingServer
    from app.parts import parts_from_settings
    from app.server import create_app
    from tenants.usage_journal import JournalInUse

    settings = settings_from_options(**opts)
    replica_id = settings.replica_id or f"{socket.gethostname()}:{settings.port}"
    configure_logging(settings.log_format, settings.log_level, replica_id)
    click.echo(f"saltserve: data dir {settings.data_dir.resolve()}")
    server: uvicorn.Server | None = None

    def stop_serving() -> None:  # the engine died: stop, then exit non-zero (below)
        if server is not None:
            server.should_exit = True

    try:
        built = parts_from_settings(settings, replica_id, on_engine_death=stop_serving)
    except (ValueError, FileNotFoundError) as e:  # a bad flag, missing weights or GGUF
        raise click.UsageError(str(e)) from None
    except JournalInUse as e:  # another server already uses this data dir's usage journal
        raise click.ClickException(str(e)) from None
    parts = built.parts
    app = create_app(parts)
    base = f"http://{settings.host}:{settings.port}"
    if built.demo_key and sys.stdout.isatty():
        click.echo("\nCreated tenant 'demo' with an API key (shown once; also saved with mode "
                   f"0600 in {built.demo_key_file}):\n\n    {built.demo_key}\n")
    elif built.demo_key:  # stdout is a log someone keeps: never the key itself
        click.echo(f"\nCreated tenant 'demo' with an API key, saved with mode 0600 in "
                   f"{built.demo_key_file} (not printed: stdout is not a terminal).\n")
    key_file = built.demo_key_file or "<file with your API key>"
    name = parts.engine.model_info().served_model_name
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
                            settings.drain_seconds, on_drain=parts.start_draining,
                            on_stop=shutdown_parse_pool)
    try:
        server.run()
    finally:
        shutdown_parse_pool()
    if parts.engine.errored:
        click.echo("saltserve: the inference engine died; exiting with status 1 so that a "
                   "supervisor restarts the server", err=True)
        raise SystemExit(1)
