"""``saltserve`` command line (click): the ``main`` group and its command groups, one module
each (``serve``, ``tenants``, ``keys``, ``token``, ``usage``, ``cache``, ``bench``)."""

from __future__ import annotations

import os
import socket

import click
import pydantic

from app.cli.bench import bench
from app.cli.cache import cache
from app.cli.keys import keys
from app.cli.serve import serve
from app.cli.tenants import tenants
from app.cli.token import token
from app.cli.usage import usage
from app.logs import configure_logging
from app.settings import Settings


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


for group in (serve, tenants, keys, token, usage, cache, bench):
    main.add_command(group)
