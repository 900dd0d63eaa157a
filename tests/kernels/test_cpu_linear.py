"""Our CPU linear kernel (``kernels/cpu/linear.cpp`` through ``kernels.cpu_linear``): equal to
``F.linear`` to fp32 rounding at every tile remainder, the same bits for a row whatever its batch,
the fallback where it does not apply, and a clear refusal of inputs it does not take."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear

REPO = Path(__file__).resolve().parents[2]

# Skipped only where the kernel cannot apply (no AVX2/FMA, or switched off); a failed build on a
# machine that can run it is a failure: test_the_kernel_builds_where_it_applies says why.
_LOADED = cpu_linear.load()
pytestmark = pytest.mark.skipif(
    not _LOADED and not cpu_linear.unavailable_reason().startswith("build failed"),
    reason=f"kernel does not apply here: {cpu_linear.unavailable_reason()}")


def test_the_kernel_builds_where_it_applies():
    assert _LOADED, cpu_linear.unavailable_reason()


def _op(x, w, b=None):
    return torch.ops.saltserve_cpu.linear_small_m(x, w, b)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 16, 31, 32])
@pytest.mark.parametrize("n,k", [(960, 576), (7, 13), (3, 8), (1, 5), (50, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear_to_fp32_rounding(m, n, k, with_bias):
    """Every remainder: rows not a multiple of 4 or 2, outputs not a multiple of 3, inputs not
    a multiple of 8 (the scalar tail), one output, and the bias."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    got, want = _op(x, w, b), F.linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)
    # Not the reference by accident: the weight reversed along K gives another answer.
    assert not torch.allclose(_op(x, w.flip(1), b), want)


def test_a_rows_result_does_not_depend_on_its_batch():
    """Each output is summed in the same order whatever the number of rows (4-row, 2-row and
    1-row tiles), so a sequence's logits are the same bits alone or beside others."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(13, 576, generator=gen), torch.randn(100, 576, generator=gen)
    batch = _op(x, w)
    for i in range(13):
        assert torch.equal(batch[i:i + 1], _op(x[i:i + 1], w))
    assert torch.equal(batch[4:9], _op(x[4:9], w))


def test_linear_dispatches_small_fp32_batches_and_falls_back_otherwise():
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(64, 96, generator=gen), torch.randn(64, generator=gen)
    small = torch.randn(cpu_linear.MAX_ROWS, 96, generator=gen)
    assert cpu_linear.usable(small, w)
    assert torch.equal(cpu_linear.linear(small, w, b), _op(small, w, b))
    # A non-contiguous view (a slice of columns) is made contiguous, not misread.
    wide = torch.randn(3, 200, generator=gen)
    torch.testing.assert_close(cpu_linear.linear(wide[:, 10:106], w, b),
                               F.linear(wide[:, 10:106], w, b))
    big = torch.randn(cpu_linear.MAX_ROWS + 1, 96, generator=gen)
    for x, weight in [(big, w), (small.double(), w.double()), (small.bfloat16(), w.bfloat16()),
                      (small[None], w), (small[:0], w)]:
        assert not cpu_linear.usable(x, weight)
        assert torch.equal(cpu_linear.linear(x, weight), F.linear(x, weight))


def test_the_op_refuses_what_it_cannot_compute():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32 only"):
        _op(x.double(), w.double())
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and w \[N, K\] expected"):
        _op(x, torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="contiguous inputs only"):
        _op(x, torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="bias"):
        _op(x, w, torch.randn(5))


def test_switched_off_it_is_f_linear_with_one_warning():
    """``SALTSERVE_CPU_KERNELS=0``: load() says no and why, and linear is F.linear."""
    code = ("import logging, torch, torch.nn.functional as F\n"
            "logging.basicConfig(level=logging.WARNING)\n"
            "from kernels import cpu_linear\n"
            "assert cpu_linear.load() is False and cpu_linear.load() is False\n"
            "print(cpu_linear.unavailable_reason())\n"
            "x, w = torch.randn(3, 16), torch.randn(5, 16)\n"
            "assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))\n")
    env = {**os.environ, "SALTSERVE_CPU_KERNELS": "0", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "SALTSERVE_CPU_KERNELS=0"
    assert out.stderr.count("CPU linear kernel off") == 1
