"""app/logs.py: JSON and text lines carry the replica, request and tenant ids."""

from __future__ import annotations

import io
import json
import logging

import pytest

from app.logs import ContextFilter, configure_logging
from tenants.usage import current_request_id, current_tenant_id


def _capture(fmt: str) -> tuple[logging.Logger, io.StringIO]:
    """A private logger with the handler ``configure_logging`` would install (not the root's:
    pytest's own capture stays in place)."""
    out = io.StringIO()
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    try:
        configure_logging(fmt, "debug", "replica-7")  # builds the handler on the root
        handler = root.handlers[0]
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    handler.setStream(out)
    logger = logging.getLogger(f"test-logs-{fmt}")
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.DEBUG)
    return logger, out


def test_json_lines_carry_the_request_tenant_and_replica():
    logger, out = _capture("json")
    logger.info("outside a request")
    req, ten = current_request_id.set("r" * 32), current_tenant_id.set("t" * 32)
    try:
        logger.warning("inside %s", "one")
    finally:
        current_tenant_id.reset(ten)
        current_request_id.reset(req)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["request_id"] is None and first["tenant_id"] is None
    assert second["message"] == "inside one" and second["level"] == "WARNING"
    assert (second["request_id"], second["tenant_id"], second["replica_id"]) == (
        "r" * 32, "t" * 32, "replica-7")
    assert second["timestamp"].endswith("+00:00") and second["logger"] == "test-logs-json"


def test_access_lines_get_fields_and_text_lines_the_ids():
    logger, out = _capture("json")
    access = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                               '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5000", "GET", "/v1/models", "1.1", 200), None)
    logger.handle(access)
    line = json.loads(out.getvalue())
    assert (line["method"], line["path"], line["status"]) == ("GET", "/v1/models", 200)
    for status in (200, 503):  # a load balancer's checks: only the failing ones are kept
        logger.handle(logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                                        '%s - "%s %s HTTP/%s" %d',
                                        ("127.0.0.1:5001", "GET", "/health", "1.1", status),
                                        None))
    health = [json.loads(x) for x in out.getvalue().splitlines() if '"/health"' in x]
    assert [h["status"] for h in health] == [503]
    text_logger, text_out = _capture("text")
    text_logger.error("boom")
    assert "[replica=replica-7 req=None tenant=None]: boom" in text_out.getvalue()
    assert isinstance(text_logger.handlers[0].filters[0], ContextFilter)


def test_bad_format_or_level_is_refused():
    with pytest.raises(ValueError):
        configure_logging("xml")
    with pytest.raises(ValueError):
        configure_logging("json", "loud")
