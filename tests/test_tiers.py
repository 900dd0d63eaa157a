"""The test tiers of tests/conftest.py: every file, function and fixture its rules name still
exists (a renamed one would silently move slow tests into `make test-fast`), and every kind is a
marker registered in pyproject.toml."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

TESTS_DIR = Path(__file__).resolve().parent


def _root_conftest(config: pytest.Config) -> ModuleType:
    for plugin in config.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) and Path(plugin.__file__).resolve() == (
                TESTS_DIR / "conftest.py"):
            return plugin
    raise AssertionError("tests/conftest.py is not loaded")


def _function_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_slow_rule_names_an_existing_test(pytestconfig: pytest.Config) -> None:
    for key in _root_conftest(pytestconfig).SLOW_TESTS:
        file, _, function = key.partition("::")
        path = TESTS_DIR / file
        assert path.is_file(), f"tests/conftest.py SLOW_TESTS names a missing file: {file}"
        if function:
            assert function in _function_names(path), f"no test {function} in {file}"


def test_every_fixture_rule_names_an_existing_fixture(pytestconfig: pytest.Config) -> None:
    conftest = _root_conftest(pytestconfig)
    defined = set().union(*(_function_names(p) for p in TESTS_DIR.rglob("conftest.py")))
    for name in conftest.REAL_MODEL_FIXTURES | conftest.FAKE_MODEL_BUILDERS:
        assert name in defined, f"no fixture {name} in any conftest.py (tests/conftest.py tiers)"


def test_every_kind_is_a_registered_marker(pytestconfig: pytest.Config) -> None:
    ini = tomllib.loads((TESTS_DIR.parent / "pyproject.toml").read_text())
    registered = {m.split(":", 1)[0] for m in ini["tool"]["pytest"]["ini_options"]["markers"]}
    kinds = {k for kinds in _root_conftest(pytestconfig).SLOW_TESTS.values() for k in kinds}
    assert kinds | {"slow", "real_model"} <= registered


@pytest.mark.slow
def test_the_fast_tier_collects_no_slow_test() -> None:
    """The effect, not only the names: ``-m "not slow"`` (``make test-fast``) collects none of
    the slow files or of the tests that reach the real model, and still collects the bulk of
    the suite (a marking rule that swallowed the app tests would fail the floor)."""
    import os
    import subprocess
    import sys

    root = TESTS_DIR.parent
    env = {**os.environ, "SALTSERVE_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-m", "not slow", "tests"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    slow_files = {"tests/app/test_console_browser.py", "tests/app/test_cluster_haproxy.py",
                  "tests/app/test_cluster.py", "tests/app/test_serve_e2e.py",
                  "tests/app/test_timing_side_channel.py", "tests/engine/test_fused_decode.py",
                  "tests/kernels/test_cpu_linear.py", "tests/kernels/test_kernel_compile.py"}
    leaked = [i for i in ids if i.split("::", 1)[0] in slow_files]
    assert leaked == [], leaked[:5]
    assert not [i for i in ids if "test_the_fast_tier_collects_no_slow_test" in i]
    assert len(ids) > 800, len(ids)
