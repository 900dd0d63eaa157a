"""The server's parts are built in one place (``app.parts``) and reached through typed
dependencies (``app.deps``): no module reads ``app.state`` by name, and the generation rule is
wired one way (broadcast -> service <- listener)."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"
# The one reader (app.deps.get_parts) and the one writer (app.server.create_app).
ALLOWED = {"deps.py", "server.py"}


def _names_an_app(node: ast.AST) -> bool:
    """``app``, ``self._app``, ``request.app``, ``request.scope["app"]``: an application."""
    if isinstance(node, ast.Name):
        return node.id.lstrip("_").endswith("app")
    if isinstance(node, ast.Attribute):
        return node.attr.lstrip("_").endswith("app")
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value == "app"
    return False


def app_state_uses(source: str) -> list[int]:
    """Lines where an application's ``state`` is used: ``<app>.state`` or ``getattr(<app>,
    "state")`` (the request's own ``request.state`` is per request and allowed)."""
    def is_use(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "state" and _names_an_app(node.value)
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "getattr" and len(node.args) >= 2
                and _names_an_app(node.args[0]) and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "state")

    return sorted(node.lineno for node in ast.walk(ast.parse(source)) if is_use(node))


def test_only_deps_and_server_touch_app_state():
    offenders = {}
    for path in [*APP.rglob("*.py"), *(APP.parent / "tenants").rglob("*.py"),
                 *(APP.parent / "engine").rglob("*.py")]:
        rel = path.relative_to(APP.parent).as_posix().removeprefix("app/")
        if rel in ALLOWED:
            continue
        lines = app_state_uses(path.read_text())
        if lines:
            offenders[rel] = lines
    assert offenders == {}, f"read parts through app.deps instead: {offenders}"
    assert app_state_uses((APP / "deps.py").read_text())  # the check sees the real reader


def test_the_check_sees_state_lookups():
    """Negative control: the lookups the routes used to make are found."""
    src = ("def f(request, self):\n"
           "    a = request.app.state.admin\n"
           "    request.state.principal = 1\n"
           "    app.state.engine = 2\n"
           "    self._app.state.draining = True\n"
           "    b = request.scope['app'].state\n"
           "    c = getattr(request.app, 'state')\n")
    assert app_state_uses(src) == [2, 4, 5, 6, 7]


def test_the_generation_rule_is_one_object_wired_one_way(app_env):
    """Auth, the admin service and the cluster listener share one generation service, which
    announces through the replica's broadcast; nothing is attached after construction."""
    parts = app_env.parts
    assert parts.admin.generations is parts.generations
    assert parts.generations._broadcast is parts.broadcast
    assert parts.listener._apply == parts.generations.on_broadcast
    assert parts.listener._origin == parts.broadcast.origin  # its own events are skipped
    assert not hasattr(parts.admin, "events")
