"""The API layer talks to the engine only through ``engine.protocol.EngineClient``: importing any
module under ``app/`` (the server, auth, routes, services, CLI) must not load torch."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import app

APP_MODULES = sorted(m.name for m in pkgutil.walk_packages(app.__path__, "app."))


def test_app_package_is_enumerated():
    assert {"app.auth", "app.server", "app.routes.openai", "app.routes.admin",
            "app.services.completions", "app.cli"} <= set(APP_MODULES)


def test_no_app_module_imports_torch():
    code = ("import sys\n"
            f"for name in {APP_MODULES!r}:\n"
            "    __import__(name)\n"
            "    assert 'torch' not in sys.modules, name\n"
            "print('ok', len(sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")


def test_the_check_would_notice_torch(tmp_path):
    """Negative control: the same check fails for a module that imports torch (a stand-in
    ``torch`` here, so the control costs no real torch import)."""
    (tmp_path / "torch.py").write_text("")
    (tmp_path / "uses_torch.py").write_text("import torch\n")
    code = ("import sys\n"
            "for name in ['app.auth', 'uses_torch']:\n"
            "    __import__(name)\n"
            "    assert 'torch' not in sys.modules, name\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, cwd=Path(__file__).resolve().parents[2], timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode != 0 and "AssertionError: uses_torch" in out.stderr
