"""Process logging: text for a terminal, JSON lines for a log pipeline (``--log-format``).

Every record carries the replica id and, while a request is served, its request id and tenant
id (from ``tenants.usage``'s context variables), in both formats. Uvicorn's own loggers
(``uvicorn.error``, ``uvicorn.access``) propagate to the same handler, so its access log has the
same shape; in JSON an access line also has ``client``, ``method``, ``path``, ``status`` fields.
Successful ``GET /health`` lines are left out (a load balancer checks every second).
``--log-level`` governs uvicorn too. Prompts, token ids, salts and keys are never logged (the
code never passes them to a logger; nothing here adds them).
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

from pythonjsonlogger.json import JsonFormatter

from tenants.usage import current_request_id, current_tenant_id

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# Chatty libraries stay at WARNING whatever the level (their INFO lines are per request/step).
_QUIET = ("httpx", "transformers", "alembic", "urllib3")
_TEXT = ("%(asctime)s %(levelname)s %(name)s [replica=%(replica_id)s req=%(request_id)s "
         "tenant=%(tenant_id)s]: %(message)s")


class ContextFilter(logging.Filter):
    """Stamps each record with ``replica_id``, ``request_id`` and ``tenant_id`` (None outside a
    request); on uvicorn's access lines, also the request's parts as fields. Drops the access
    lines of successful health checks."""

    def __init__(self, replica_id: str) -> None:
        super().__init__()
        self.replica_id = replica_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.replica_id = self.replica_id
        record.request_id = current_request_id.get()
        record.tenant_id = current_tenant_id.get()
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) \
                and len(record.args) == 5:
            client, method, path, _, status = record.args
            if path == "/health" and status == 200:
                return False
            record.client, record.method, record.path, record.status = (client, method, path,
                                                                        status)
        return True


def configure_logging(fmt: LogFormat = "text", level: str = "info",
                      replica_id: str = "local") -> None:
    """Sends every log record (uvicorn's included) to stderr in ``fmt`` at ``level``.

    Raises:
        ValueError: an unknown format or level.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter(replica_id))
    if fmt == "json":
        handler.setFormatter(JsonFormatter(
            "%(levelname)s %(name)s %(message)s %(replica_id)s %(request_id)s %(tenant_id)s",
            rename_fields={"levelname": "level", "name": "logger"}, timestamp=True))
    else:
        handler.setFormatter(logging.Formatter(_TEXT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()  # uvicorn's own handlers would print a second copy
        logger.propagate = True
        logger.setLevel(level.upper())
    for name in _QUIET:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
