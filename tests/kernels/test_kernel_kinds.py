"""The projection kinds are one table in two languages: ``enum Kind`` in ``kernels/cpu/kinds.h``
(what ``decode_layer.cpp`` switches on) and ``Kind`` in ``kernels/cpu/kinds.py`` (what
``engine.quantization``'s ``SPEC_*`` are). They must agree name for name and value for value,
or the fused decode would run one kernel's operands through another. Also: the native build
compiles every .cpp of ``kernels/cpu/``, and only ``bindings.cpp`` registers ops."""

from __future__ import annotations

import re
from pathlib import Path

from engine import quantization
from kernels.cpu import build, kinds

CPU_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cpu"
HEADER = CPU_DIR / "kinds.h"


def cpp_kinds(source: str) -> dict[str, int]:
    """``enum Kind``'s members as normalised name -> value (``kLinearOneDnn`` -> linearonednn)."""
    body = re.search(r"enum\s+Kind\s*:\s*int64_t\s*\{(.*?)\}", source, re.DOTALL)
    assert body is not None, "no enum Kind in kinds.h"
    return {name[1:].lower(): int(value)
            for name, value in re.findall(r"\b(k\w+)\s*=\s*(\d+)", body.group(1))}


def python_kinds() -> dict[str, int]:
    """``kinds.Kind``'s members, normalised as ``cpp_kinds`` (``LINEAR_ONEDNN`` -> linearonednn)."""
    return {kind.name.replace("_", "").lower(): int(kind) for kind in kinds.Kind}


def test_the_python_and_cpp_kind_tables_agree():
    python = python_kinds()
    assert len(python) >= 9
    assert cpp_kinds(HEADER.read_text()) == python


def test_the_check_sees_a_renumbered_kind():
    source = HEADER.read_text().replace("kQ8Vnni = 8", "kQ8Vnni = 9")
    assert cpp_kinds(source) != python_kinds()


def test_decode_layer_switches_on_the_shared_enum():
    source = (CPU_DIR / "decode_layer.cpp").read_text()
    assert '#include "kinds.h"' in source
    assert re.search(r"enum\s+Kind\b", source) is None


def test_engine_quantization_exports_every_kind_as_spec():
    specs = {name.removeprefix("SPEC_"): value for name, value in vars(quantization).items()
             if name.startswith("SPEC_")}
    assert specs == {kind.name: kind.value for kind in kinds.Kind}
    assert all(type(value) is int for value in specs.values())


def test_every_cpp_file_of_kernels_cpu_is_built():
    """The build compiles whatever .cpp is in ``kernels/cpu/`` (``kernels.cpu.build.SOURCES``):
    a new kernel needs no list edit."""
    assert {p.name for p in build.SOURCES} == {p.name for p in CPU_DIR.glob("*.cpp")}
    assert "bindings.cpp" in {p.name for p in build.SOURCES}


def test_only_bindings_cpp_registers_ops():
    """Every op's schema and registration is in ``bindings.cpp``, each op named in ``OPS``."""
    registering = {p.name for p in CPU_DIR.glob("*.cpp") if "TORCH_LIBRARY" in p.read_text()}
    assert registering == {"bindings.cpp"}
    bindings = (CPU_DIR / "bindings.cpp").read_text()
    defined = set(re.findall(r'm\.def\("(\w+)\(', bindings))
    implemented = set(re.findall(r'm\.impl\("(\w+)"', bindings))
    assert defined == implemented == set(build.OPS)
