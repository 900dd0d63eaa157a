"""The ``kernels`` name clash, and the ``transformers>=5,<5.25`` pin in pyproject.toml it forces.

Our top-level ``kernels`` package has the import name of Hugging Face's ``kernels``, which
transformers 5.25 made a hard dependency and imports at load when it is installed
(``transformers.integrations.hub_kernels``, behind ``is_kernels_available()``, which asks the
``kernels`` distribution's version). Measured with transformers 5.25.0 + kernels 0.19.1:

- this repository first on ``sys.path``: ``import transformers.modeling_utils`` raises
  ``ImportError: cannot import name 'CUDAProperties' from 'kernels' (.../kernels/__init__.py)``,
  and converting the bundled GGUF goes through it;
- Hugging Face's package first: ``import kernels.cpu_linear`` raises ``ModuleNotFoundError``;
- as wheels, both distributions write ``site-packages/kernels/__init__.py``.

These tests hold the pin to the condition that forces it here: they fail when our package no
longer takes the name ``kernels`` (then the pin can go), or when the pin no longer keeps
transformers and Hugging Face's ``kernels`` out of this environment. They cannot see a future
transformers release that stops importing ``kernels``: ``scripts/check_transformers_pin.sh
[VERSION]`` re-checks a newer release in a throwaway venv (needs the package index), and prints
NO CLASH when the pin may be lifted.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[2]
FIRST_WITH_KERNELS = Version("5.25")  # the first transformers requiring Hugging Face's kernels


def _transformers_requirement() -> Requirement:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return next(r for r in reqs if r.name == "transformers")


def test_import_kernels_is_ours() -> None:
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve() == REPO_ROOT / "kernels" / "__init__.py", (
        f"`import kernels` now finds {spec.origin}, not this repository's kernels/: if ours was "
        "renamed the clash is gone, so lift `transformers<5.25` in pyproject.toml and delete "
        "this file; if it is Hugging Face's package, it shadows ours (see this module's docstring)")


def test_pyproject_pins_transformers_below_the_first_with_kernels() -> None:
    req = _transformers_requirement()
    assert not req.specifier.contains(FIRST_WITH_KERNELS), (
        f"pyproject.toml allows transformers {FIRST_WITH_KERNELS} ({req}), which imports Hugging "
        "Face's `kernels` at load, shadowed by ours; run scripts/check_transformers_pin.sh first")


def test_installed_transformers_is_in_the_pin_and_needs_no_kernels() -> None:
    req = _transformers_requirement()
    installed = importlib.metadata.version("transformers")
    assert req.specifier.contains(installed), f"installed transformers {installed} not in {req}"
    hard = [r for r in map(Requirement, importlib.metadata.requires("transformers") or [])
            if r.name == "kernels" and (r.marker is None or r.marker.evaluate({"extra": ""}))]
    assert not hard, f"transformers {installed} requires Hugging Face's kernels: {hard}"


def test_hugging_face_kernels_is_not_installed() -> None:
    """transformers imports Hugging Face's ``kernels`` wherever a distribution of that name is
    installed (an optional extra before 5.25), and gets ours."""
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise AssertionError(f"Hugging Face's kernels {version} is installed: transformers will "
                         "import our `kernels` in its place; uninstall it")
