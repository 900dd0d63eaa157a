"""The server's parts are built in one place (``app.parts``) and reached through typed
dependencies (``app.deps``): no module reads ``app.state`` by name, and the generation rule is
wired one way (broadcast -> service <- listener)."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"
# The one reader (app.deps.get_parts) and the one writer (app.server.create_app).
ALLOWED = {"deps.py", "server.py"}


def app_state_uses(source: str) -> list[int]:
    """Lines where ``<anything>.app.state`` or ``app.state`` is used (the request's own
    ``request.state`` is per request and allowed)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "state":
            inner = node.value
            if (isinstance(inner, ast.Attribute) and inner.attr == "app") or (
                    isinstance(inner, ast.Name) and inner.id == "app"):
                lines.append(node.lineno)
    return lines


def test_only_deps_and_server_touch_app_state():
    offenders = {}
    for path in APP.rglob("*.py"):
        rel = path.relative_to(APP).as_posix()
        if rel in ALLOWED:
            continue
        lines = app_state_uses(path.read_text())
        if lines:
            offenders[rel] = lines
    assert offenders == {}, f"read parts through app.deps instead: {offenders}"
    assert app_state_uses((APP / "deps.py").read_text())  # the check sees the real reader


def test_the_check_sees_state_lookups():
    """Negative control: the lookups the routes used to make are found."""
    src = ("def f(request):\n"
           "    a = request.app.state.admin\n"
           "    request.state.principal = 1\n"
           "    app.state.engine = 2\n")
    assert app_state_uses(src) == [2, 4]


def test_the_generation_rule_is_one_object_wired_one_way(app_env):
    """Auth, the admin service and the cluster listener share one generation service, which
    announces through the replica's broadcast; nothing is attached after construction."""
    parts = app_env.client.app.state.parts
    assert parts.admin.generations is parts.generations
    assert parts.generations._broadcast is parts.broadcast
    assert parts.listener._apply == parts.generations.on_broadcast
    assert parts.listener._origin == parts.broadcast.origin  # its own events are skipped
    assert not hasattr(parts.admin, "events")
