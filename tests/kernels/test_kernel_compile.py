"""Every kernel variant the wrappers launch compiles for the H200 (sm_90) on this CPU machine.

The interpreter accepts code the GPU compiler rejects (tl.dot with a dimension < 16, mixed
dot dtypes, non-power-of-2 aranges, type errors in loop-carried values, ...), so each variant is
recorded from a real wrapper call and compiled down to a cubin with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``. The compiles run in one
child process without ``TRITON_INTERPRET`` (``kernel_utils.py`` as a script).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_utils import ATTENTION_VARIANTS, STORE_VARIANTS

import kernels.triton.paged_attention as pa
import kernels.triton.store_kv_cache as skc

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
VARIANTS = [*ATTENTION_VARIANTS, *STORE_VARIANTS]
KERNELS = [pa._paged_attention_kernel, pa._reduce_segments_kernel, skc._store_kv_cache_kernel]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(HERE / "kernel_utils.py"), *VARIANTS],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO,
                          check=False)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("VARIANT "):
            r = json.loads(line.removeprefix("VARIANT "))
            results[r["name"]] = r
    assert results, f"compile process produced nothing (rc {proc.returncode}):\n{proc.stderr}"
    return results


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_compiles_for_sm90(compiled, variant):
    r = compiled.get(variant)
    assert r is not None, f"{variant}: no result (child crashed?)"
    assert r["ok"], f"{variant}: {r.get('error')}"
    assert r["kernels"] and all(k["cubin"] for k in r["kernels"])
    # Hopper allows 227 KiB of shared memory per block.
    assert all(k["shared_bytes"] <= 227 * 1024 for k in r["kernels"]), r["kernels"]


def test_variants_cover_every_kernel(compiled):
    names = {k["kernel"] for r in compiled.values() if r["ok"] for k in r["kernels"]}
    assert names == {k.fn.__name__ for k in KERNELS}


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.fn.__name__)
def test_kernel_signature_style(kernel):
    """STYLE.md: strides as int64, constexprs UPPER_CASE. Every scalar is annotated: the JIT
    turns an unannotated int that happens to be 1 (one sequence, one kv head) into a constexpr,
    a variant this compile test would not see."""
    for p in inspect.signature(kernel.fn).parameters.values():
        ann = "" if p.annotation is inspect.Parameter.empty else str(p.annotation)
        if p.name.startswith("stride"):
            assert "int64" in ann, f"{p.name} must be annotated tl.int64"
        if "constexpr" in ann:
            assert p.name.isupper(), f"constexpr {p.name} must be UPPER_CASE"
        elif not p.name.endswith("_ptr"):
            assert ann, f"scalar {p.name} must be annotated (tl.int32, tl.int64, tl.float32)"
