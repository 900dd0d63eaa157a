"""The projection kinds are one table written twice: ``SPEC_*`` in ``engine/quantization.py``
and ``enum Kind`` in ``kernels/cpu/decode_layer.cpp``. They must agree name for name and value
for value, or the fused decode would run one kernel's operands through another."""

from __future__ import annotations

import re
from pathlib import Path

from engine import quantization

CPP = Path(__file__).resolve().parents[2] / "kernels" / "cpu" / "decode_layer.cpp"


def cpp_kinds(source: str) -> dict[str, int]:
    """``enum Kind``'s members as normalised name -> value (``kLinearOneDnn`` -> linearonednn)."""
    body = re.search(r"enum\s+Kind\s*:\s*int64_t\s*\{(.*?)\}", source, re.DOTALL)
    assert body is not None, "no enum Kind in decode_layer.cpp"
    return {name[1:].lower(): int(value)
            for name, value in re.findall(r"\b(k\w+)\s*=\s*(\d+)", body.group(1))}


def python_kinds() -> dict[str, int]:
    return {name.removeprefix("SPEC_").replace("_", "").lower(): value
            for name, value in vars(quantization).items()
            if name.startswith("SPEC_") and isinstance(value, int)}


def test_the_python_and_cpp_kind_tables_agree():
    python = python_kinds()
    assert len(python) >= 9
    assert cpp_kinds(CPP.read_text()) == python


def test_the_check_sees_a_renumbered_kind():
    source = CPP.read_text().replace("kQ8Vnni = 8", "kQ8Vnni = 9")
    assert cpp_kinds(source) != python_kinds()


def test_every_cpp_file_of_kernels_cpu_is_built():
    """The build's source list is kept by hand (``kernels/cpu_linear.py``): a new .cpp left
    out of it would register no op and fail only at run time."""
    from kernels import cpu_linear

    built = {p.name for p in (cpu_linear.SOURCE, cpu_linear.Q4_SOURCE, cpu_linear.Q4_VNNI_SOURCE,
                              *cpu_linear.OPS_SOURCES)}
    assert built == {p.name for p in CPP.parent.glob("*.cpp")}
