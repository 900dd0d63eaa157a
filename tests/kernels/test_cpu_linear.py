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
from int8_dot_reference import round_activations

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
    for x, weight in [(small.double(), w.double()), (small.bfloat16(), w.bfloat16()),
                      (small[None], w), (small[:0], w)]:
        assert not cpu_linear.usable(x, weight)
        assert torch.equal(cpu_linear.linear(x, weight), F.linear(x, weight))
    # Above MAX_ROWS fp32 rows: oneDNN's GEMM (faster than MKL's sgemm on AMD), equal to
    # F.linear to fp32 rounding; switched off, F.linear itself.
    # Its rows go up to a multiple of ONEDNN_ROW_BUCKET with zeros (a bounded set of shapes for
    # oneDNN's per-shape caches), sliced off the output.
    assert not cpu_linear.usable(big, w)
    padded = torch.cat([big, big.new_zeros(cpu_linear.ONEDNN_ROW_BUCKET - len(big), 96)])
    onednn = torch.ops.mkldnn._linear_pointwise(padded, w, b, "none", [], "")[:len(big)]
    got = cpu_linear.linear(big, w, b)
    assert got.shape == (len(big), w.shape[0]) and got.is_contiguous()
    assert torch.equal(got, onednn)
    torch.testing.assert_close(onednn, F.linear(big, w, b), rtol=1e-5, atol=1e-5)
    exact = torch.randn(2 * cpu_linear.ONEDNN_ROW_BUCKET, 96, generator=gen)  # no padding
    assert torch.equal(cpu_linear.linear(exact, w, b),
                       torch.ops.mkldnn._linear_pointwise(exact, w, b, "none", [], ""))
    assert torch.equal(cpu_linear.linear(big, w, b, onednn=False), F.linear(big, w, b))


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
    assert out.stderr.count("CPU kernels off") == 1


def _q4_reference(x, codes, scale, minimum, bias=None):
    """The kernel's arithmetic in torch: activations rounded to int8 per group of 32 (scale
    max|x| / 127), exact integer dot products with the codes, fp32 for the rest."""
    m, k = x.shape
    xg = x.view(m, k // 32, 32)
    dx = xg.abs().amax(-1) / 127
    # x * (1 / d), as the kernel rounds it (x / d differs in a few roundings per million).
    qx = torch.where(dx[..., None] > 0, torch.round(xg * (1 / dx[..., None])), torch.zeros(()))
    dots = torch.einsum("mgi,ngi->mng", qx.double(), codes.view(-1, k // 32, 32).double())
    y = (dots * (scale[None] * dx[:, None]).double()).sum(-1)
    y = y + (xg.sum(-1).double() @ minimum.double().t())
    return (y if bias is None else y + bias.double()).float()


def _q4_weights(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02
    minimum = -8 * scale + torch.randn(n, k // 32, generator=gen) * 0.01
    return codes, scale.half(), minimum.half()  # fp16, as a GGUF stores them


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 15])
@pytest.mark.parametrize("n,k", [(960, 576), (7, 64), (1, 32), (3, 96), (5, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_q4_equals_its_reference_and_stays_near_the_dequantized_product(m, n, k, with_bias):
    """Every tile remainder (1 and 2+ rows, outputs not a multiple of 4 or 2); the kernel
    computes its own arithmetic exactly (int8 activations) and stays within that rounding of
    the fp32 product with the dequantized weight."""
    codes, scale, minimum = _q4_weights(n, k, m * 100 + n + k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    got = cpu_linear.q4_linear(x, cpu_linear.pack_q4(codes), scale, minimum, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, _q4_reference(x, codes, scale, minimum, b),
                               rtol=1e-4, atol=1e-4)
    w = (codes.view(n, k // 32, 32).float() * scale.float()[..., None]
         + minimum.float()[..., None]).view(n, k)
    exact = F.linear(x, w, b)
    # Within the int8 rounding of the activations: each input moves by at most half its
    # group's step (max|x| / 127 / 2), so an output by at most sum |w| * that.
    step = (x.view(m, k // 32, 32).abs().amax(-1) / 127 / 2).repeat_interleave(32, dim=1)
    assert ((got - exact).abs() <= step @ w.abs().t() + 1e-4).all()
    # Not the reference by accident: codes in the other nibble order give another answer.
    swapped = cpu_linear.pack_q4(codes.view(n, k // 32, 2, 16).flip(2).reshape(n, k))
    assert not torch.allclose(cpu_linear.q4_linear(x, swapped, scale, minimum, b), got,
                              atol=1e-3)


def test_q4_rows_do_not_depend_on_their_batch_and_zero_rows_give_the_bias():
    codes, scale, minimum = _q4_weights(64, 128, 7)
    packed = cpu_linear.pack_q4(codes)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    x[2] = 0  # a zero group: scale 0, codes 0, no division by zero
    b = torch.randn(64)
    batch = cpu_linear.q4_linear(x, packed, scale, minimum, b)
    for i in range(6):
        assert torch.equal(batch[i:i + 1], cpu_linear.q4_linear(x[i:i + 1], packed, scale,
                                                               minimum, b))
    assert torch.equal(batch[2], b)


def test_q4_refuses_what_it_cannot_compute():
    codes, scale, minimum = _q4_weights(4, 64, 1)
    packed, x = cpu_linear.pack_q4(codes), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_linear.q4_linear(torch.randn(2, 96), packed, scale, minimum)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_linear.q4_linear(x, packed, scale[:, :1], minimum)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.q4_linear(x.double(), packed, scale, minimum)
    with pytest.raises(RuntimeError, match="float16"):
        cpu_linear.q4_linear(x, packed, scale.float(), minimum.float())
    with pytest.raises(RuntimeError, match="bias"):
        cpu_linear.q4_linear(x, packed, scale, minimum, torch.randn(5))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear.pack_q4(torch.zeros(4, 48, dtype=torch.uint8))



# kernels/cpu/q4_vnni.cpp runs on every CPU the kernels load on: vpdpbusd with AVX-512 VNNI,
# vpmaddubsw + vpmaddwd with AVX2 (the module's skip covers the rest).
_VNNI = cpu_linear.VNNI_FLAGS <= cpu_linear.cpu_flags()
needs_vnni = pytest.mark.skipif(not _LOADED, reason="our CPU kernels are off here")


def _q4_vnni_reference(x, codes, scale, minimum, bias, act_bits):
    """kernels/cpu/q4_vnni.cpp's arithmetic in torch: int8 groups as ``_q4_reference``; with
    16 bits also the residual x - dx q rounded to 1/256 steps of dx (clamped to +-127)."""
    k = x.shape[1]
    xg, q, dx = round_activations(x, act_bits)
    dots = torch.einsum("mgi,ngi->mng", q.double(), codes.view(-1, k // 32, 32).double())
    y = (dots * (scale[None] * dx[:, None, :, 0]).double()).sum(-1)
    y = y + (xg.sum(-1).double() @ minimum.double().t())
    return (y if bias is None else y + bias.double()).float()


@needs_vnni
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(960, 576), (16, 32), (48, 1536)])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_q4_vnni_equals_its_reference_and_its_rounding_bound(m, n, k, act_bits):
    """Every register tile of rows (1-8, balanced past 8), one tile of outputs or many, one
    group or 48; with a bias on odd row counts. 8-bit activations give q4_linear's answer; 16-bit
    ones stay within 1/256 of a group's int8 step of the exact dequantized product."""
    codes, scale, minimum = _q4_weights(n, k, m * 10 + n + k + act_bits)
    gen = torch.Generator().manual_seed(m + act_bits)
    x = torch.randn(m, k, generator=gen) * torch.rand(k, generator=gen) * 3  # uneven groups
    b = torch.randn(n, generator=gen) if m % 2 else None
    vc, vsm = cpu_linear.pack_q4_vnni(codes, scale, minimum)
    assert vc.shape == (n // 16, k // 32, 256) and vsm.shape == (n // 16, k // 32, 32)
    got = cpu_linear.q4_linear_vnni(x, vc, vsm, b, act_bits)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, _q4_vnni_reference(x, codes, scale, minimum, b, act_bits),
                               rtol=1e-4, atol=1e-4)
    w = (codes.view(n, k // 32, 32).float() * scale.float()[..., None]
         + minimum.float()[..., None]).view(n, k)
    exact = F.linear(x, w, b)
    step = (x.view(m, k // 32, 32).abs().amax(-1) / 127).repeat_interleave(32, dim=1)
    if act_bits == 8:
        torch.testing.assert_close(got, cpu_linear.q4_linear(x, cpu_linear.pack_q4(codes),
                                                             scale, minimum, b),
                                   rtol=1e-5, atol=1e-5)
        assert ((got - exact).abs() <= (step / 2) @ w.abs().t() + 1e-4).all()
    else:
        assert ((got - exact).abs() <= (step / 256) @ w.abs().t() + 1e-4).all()
        # and well inside the 8-bit bound: the residual is really used
        err8 = (cpu_linear.q4_linear_vnni(x, vc, vsm, b, 8) - exact).abs().max()
        assert (got - exact).abs().max() < err8 / 16
    # Not the reference by accident: codes of the other tile order give another answer.
    other = cpu_linear.pack_q4_vnni(codes.flip(1), scale, minimum)
    assert not torch.allclose(cpu_linear.q4_linear_vnni(x, *other, b, act_bits), got,
                              atol=1e-3)


@needs_vnni
@pytest.mark.parametrize("act_bits", [8, 16])
def test_q4_vnni_rows_do_not_depend_on_their_batch_and_zero_rows_give_the_bias(act_bits):
    codes, scale, minimum = _q4_weights(64, 128, 9)
    vc, vsm = cpu_linear.pack_q4_vnni(codes, scale, minimum)
    x = torch.randn(19, 128, generator=torch.Generator().manual_seed(4))
    x[2] = 0  # a zero row: scale 0, codes 0, no division by zero
    x[5, :32] = 1e-40  # a denormal group counts as zero
    b = torch.randn(64)
    batch = cpu_linear.q4_linear_vnni(x, vc, vsm, b, act_bits)
    for i in range(19):
        assert torch.equal(batch[i:i + 1], cpu_linear.q4_linear_vnni(x[i:i + 1], vc, vsm, b,
                                                                     act_bits))
    assert torch.equal(batch[2], b)
    assert torch.isfinite(batch).all()


_ISA_CASES = """
import sys, torch
from kernels import cpu_linear
assert cpu_linear.load()
g = torch.Generator().manual_seed(11)
codes = torch.randint(0, 16, (96, 1536), generator=g, dtype=torch.uint8)
scale = (torch.rand(96, 48, generator=g) * 0.02).half()
minimum = (-torch.rand(96, 48, generator=g) * 0.1).half()
vc, vsm = cpu_linear.pack_q4_vnni(codes, scale, minimum)
q8 = cpu_linear.pack_q8_vnni(torch.randint(-127, 128, (48, 1536), generator=g, dtype=torch.int8))
s8, b = torch.rand(48, generator=g) * 0.01, torch.randn(96, generator=g)
x = torch.randn(21, 1536, generator=g) * torch.rand(1536, generator=g) * 4
x[3] = 0
x[7, 64:96] = 1e-40
x[9, :32] = 3e4
out = {}
for bits in (8, 16):
    for m in (1, 4, 5, 21):
        out[f"q4 {bits} {m}"] = cpu_linear.q4_linear_vnni(x[:m], vc, vsm, b, bits)
        out[f"q8 {bits} {m}"] = cpu_linear.q8_linear_vnni(x[:m], q8, s8, b[:48], bits)
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(not _VNNI, reason="this CPU lacks AVX-512 VNNI: only the AVX2 path runs")
def test_the_vnni_and_avx2_paths_give_the_same_bits(tmp_path):
    """The same exact integer dots and fp32 operations in the same order: on a VNNI CPU the
    AVX2 path (``SALTSERVE_VNNI=0``) gives every output's bits, for 4-bit and int8 weights,
    both activation roundings, every register tile of rows, a zero row and a denormal group."""
    results = {}
    for flag in ("1", "0"):
        path = tmp_path / f"vnni{flag}.pt"
        env = {**os.environ, "SALTSERVE_VNNI": flag, "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-c", _ISA_CASES, str(path)], env=env, check=True,
                       timeout=300, capture_output=True)
        results[flag] = torch.load(path)
    assert results["1"].keys() == results["0"].keys() and len(results["1"]) == 16
    for key, got in results["1"].items():
        assert torch.isfinite(got).all(), key
        assert torch.equal(got, results["0"][key]), key


_AMX = _LOADED and cpu_linear.int8_amx()
needs_amx = pytest.mark.skipif(
    not _AMX, reason="no AMX-INT8 here (or SALTSERVE_AMX=0): the VNNI or AVX2 path runs alone")


@needs_amx
@pytest.mark.parametrize("act_bits", [8, 16])
def test_the_amx_and_vnni_paths_give_the_same_bits(act_bits):
    """AMX's tile dots are exact integers and its fp32 epilogue is the VNNI tile's, operation
    for operation: switching it off (``int8_amx(False)``) changes no bit, for 4-bit and int8
    weights, row counts below, at and past the thresholds (16 and 6 rows) and across 8-row
    blocks, with a zero row, a denormal group, a huge group and a bias; and both are the
    reference's answer."""
    g = torch.Generator().manual_seed(act_bits)
    codes = torch.randint(0, 16, (96, 1536), generator=g, dtype=torch.uint8)
    scale = (torch.rand(96, 48, generator=g) * 0.02).half()
    minimum = (-torch.rand(96, 48, generator=g) * 0.1).half()
    vc, vsm = cpu_linear.pack_q4_vnni(codes, scale, minimum)
    q = torch.randint(-127, 128, (48, 1536), generator=g, dtype=torch.int8)
    q8, s8 = cpu_linear.pack_q8_vnni(q), torch.rand(48, generator=g) * 0.01
    b = torch.randn(96, generator=g)
    x = torch.randn(41, 1536, generator=g) * torch.rand(1536, generator=g) * 4
    x[3] = 0
    x[7, 64:96] = 1e-40
    x[9, :32] = 3e4
    rows = (5, 6, 8, 15, 16, 17, 24, 33, 41)
    # one, two and three groups (the two tile sets' pipeline at its ends), and no input at all
    small = {k: (cpu_linear.pack_q4_vnni(codes[:, :k], scale[:, :k // 32], minimum[:, :k // 32]),
                 cpu_linear.pack_q8_vnni(q[:, :k])) for k in (32, 64, 96)}
    before = cpu_linear.int8_amx()
    results, calls = {}, {}
    try:
        for on in (True, False):
            assert cpu_linear.int8_amx(on) is on
            assert cpu_linear.int8_dot_isa() == ("avx512_vnni+amx_int8" if on else "avx512_vnni")
            start = cpu_linear.int8_amx_calls()
            out = {("q4", m): cpu_linear.q4_linear_vnni(x[:m], vc, vsm, b, act_bits) for m in rows}
            out.update({("q8", m): cpu_linear.q8_linear_vnni(x[:m], q8, s8, b[:48], act_bits)
                        for m in rows})
            for k, ((c4, sm4), c8) in small.items():
                out[("q4", k, "k")] = cpu_linear.q4_linear_vnni(x[:17, :k], c4, sm4, b, act_bits)
                out[("q8", k, "k")] = cpu_linear.q8_linear_vnni(x[:17, :k], c8, s8, None, act_bits)
            out[("q8", 0, "k")] = cpu_linear.q8_linear_vnni(
                x[:8, :0], torch.empty(3, 0, 512, dtype=torch.uint8), s8, b[:48], act_bits)
            calls[on] = cpu_linear.int8_amx_calls() - start
            results[on] = out
    finally:
        cpu_linear.int8_amx(before)
    # on: every 4-bit call from 16 rows, every int8 one from 6 (none with no input); off: none
    assert calls[True] == sum(m >= 16 for m in rows) + sum(m >= 6 for m in rows) + 6
    assert calls[False] == 0
    assert torch.equal(results[True][("q8", 0, "k")], b[:48].expand(8, 48))
    for key, got in results[True].items():
        assert torch.isfinite(got).all(), key
        assert torch.equal(got, results[False][key]), key
    keep = torch.arange(41) != 7  # the reference has no answer for a denormal group
    want = _q4_vnni_reference(x[keep], codes, scale, minimum, b, act_bits)
    torch.testing.assert_close(results[True][("q4", 41)][keep], want, rtol=1e-4, atol=1e-4)
    # a row alone (VNNI: under both thresholds) has its bits in a 41-row batch (AMX)
    assert torch.equal(results[True][("q4", 41)][9],
                       cpu_linear.q4_linear_vnni(x[9:10], vc, vsm, b, act_bits)[0])


@needs_vnni
def test_q4_vnni_refuses_what_it_cannot_compute():
    codes, scale, minimum = _q4_weights(32, 64, 1)
    vc, vsm = cpu_linear.pack_q4_vnni(codes, scale, minimum)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_linear.q4_linear_vnni(torch.randn(2, 96), vc, vsm)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_linear.q4_linear_vnni(x, vc, vsm[:, :, :16].contiguous())
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.q4_linear_vnni(x.double(), vc, vsm)
    with pytest.raises(RuntimeError, match="float16"):
        cpu_linear.q4_linear_vnni(x, vc, vsm.float())
    with pytest.raises(RuntimeError, match="bias"):
        cpu_linear.q4_linear_vnni(x, vc, vsm, torch.randn(5))
    with pytest.raises(RuntimeError, match="act_bits"):
        cpu_linear.q4_linear_vnni(x, vc, vsm, None, 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_linear.pack_q4_vnni(codes[:24], scale[:24], minimum[:24])
    assert not cpu_linear.q4_vnni_usable(24, 64) and cpu_linear.q4_vnni_usable(32, 64)


@needs_vnni
@pytest.mark.parametrize("m", [1, 5, 16, 23])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_q8_vnni_is_near_the_int8_product_and_rows_keep_their_bits(m, act_bits):
    """Per-channel int8 weights (the LM head's): within the activations' rounding of the exact
    product (half an int8 step, or 1/256 of one with 16 bits), the same bits alone as in the
    batch, a bias added, and a clear refusal of bad shapes."""
    gen = torch.Generator().manual_seed(m + act_bits)
    q = torch.randint(-128, 128, (48, 96), generator=gen, dtype=torch.int8)  # Q8_0 holds -128
    q[0, :32] = -128
    scale = torch.rand(48, generator=gen) * 0.01
    x = torch.randn(m, 96, generator=gen) * 2
    b = torch.randn(48, generator=gen)
    codes = cpu_linear.pack_q8_vnni(q)
    got = cpu_linear.q8_linear_vnni(x, codes, scale, b, act_bits)
    w = q.float() * scale[:, None]
    step = (x.view(m, 3, 32).abs().amax(-1) / 127).repeat_interleave(32, dim=1)
    bound = (step / (256 if act_bits == 16 else 2)) @ w.abs().t() + 1e-4
    assert ((got - F.linear(x, w, b)).abs() <= bound).all()
    for i in range(m):
        assert torch.equal(got[i:i + 1], cpu_linear.q8_linear_vnni(x[i:i + 1], codes, scale, b,
                                                                   act_bits))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_linear.q8_linear_vnni(x, codes, scale[:16])
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_linear.pack_q8_vnni(q[:40])
