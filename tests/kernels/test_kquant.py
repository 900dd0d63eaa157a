"""kernels/cpu/kquant_vnni.cpp: GGUF Q4_K, Q5_K, Q6_K and Q8_0 weights served as the file stores
them. The kernel's arithmetic equals a torch reference of it; with activations its rounding
keeps exactly, it equals the exact product of the dequantized weights (so no weight is rounded
again: a per-channel int8 copy of the same weights misses by orders of magnitude more); a row's
bits do not depend on its batch, nor on the ISA path (VNNI or AVX2); and bad operands are
refused with a message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from int8_dot_reference import round_activations

from engine.quantization.kquant import GGML_TYPE, KQuantBlocks, KQuantLinear, KQuantWeight
from kernels import cpu_linear

REPO = Path(__file__).resolve().parents[2]
_LOADED = cpu_linear.load()
pytestmark = pytest.mark.skipif(
    not _LOADED and not cpu_linear.unavailable_reason().startswith("build failed"),
    reason=f"kernel does not apply here: {cpu_linear.unavailable_reason()}")
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")


def random_blocks(type_name: str, n: int, k: int, seed: int) -> KQuantBlocks:
    """Random valid blocks: every code and integer scale of the type's range, fp16 ``d``."""
    g = torch.Generator().manual_seed(seed)

    def fp16(*shape):
        return (torch.rand(*shape, generator=g) * 0.01 + 1e-4).half().float()

    def ints(lo, hi, *shape, dtype=torch.uint8):
        return torch.randint(lo, hi, shape, generator=g, dtype=dtype)

    if type_name == "Q8_0":
        return KQuantBlocks("Q8_0", ints(0, 256, n, k), fp16(n, k // 32))
    if type_name == "Q6_K":
        return KQuantBlocks("Q6_K", ints(0, 64, n, k), fp16(n, k // 256),
                            ints(-128, 128, n, k // 16, dtype=torch.int8))
    top = 16 if type_name == "Q4_K" else 32
    return KQuantBlocks(type_name, ints(0, top, n, k), fp16(n, k // 256), ints(0, 64, n, k // 32),
                        fp16(n, k // 256), ints(0, 64, n, k // 32))


def _reference(x: torch.Tensor, w: KQuantWeight, bias, act_bits: int) -> torch.Tensor:
    """The kernel's arithmetic in float64: activations rounded per group of 32 to int8 (with 16
    bits plus a residual in 1/256 steps); Q4_K / Q5_K's minimums against the exact group sums
    of x (as llama.cpp's Q8_K sums), every other term against the rounded activations."""
    xg, q, dx = round_activations(x, act_bits)
    xr = (q * dx).view(x.shape).double()
    outs = []
    for p in w.parts:
        if p.type_name in ("Q4_K", "Q5_K"):
            dm = (p.dmin.repeat_interleave(8, dim=1) * p.m.float()).double()  # [n, k / 32]
            no_min = KQuantBlocks(p.type_name, p.codes, p.d, p.sc, torch.zeros_like(p.dmin),
                                  p.m).dequantize()
            outs.append(xr @ no_min.double().t() - xg.sum(-1).double() @ dm.t())
        else:
            outs.append(xr @ p.dequantize().double().t())
    y = torch.cat(outs, dim=1)
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("types", [("Q4_K",), ("Q5_K",), ("Q6_K",), ("Q8_0",),
                                   ("Q4_K", "Q6_K", "Q5_K", "Q8_0")], ids="+".join)
@pytest.mark.parametrize("m", [1, 3, 8, 13])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_kquant_equals_its_reference(types, m, act_bits):
    """Every format alone and all four stacked in one weight (tiles of mixed types), every
    register block of rows (8, 4, 2, 1), a bias on odd row counts."""
    w = KQuantWeight(tuple(random_blocks(t, 32, 512, i + m) for i, t in enumerate(types)))
    gen = torch.Generator().manual_seed(m + act_bits)
    x = torch.randn(m, 512, generator=gen) * torch.rand(512, generator=gen) * 3
    b = torch.randn(w.shape[0], generator=gen) if m % 2 else None
    layer = KQuantLinear.from_weight(w, b, act_bits)
    got = layer(x)
    assert got.shape == (m, w.shape[0]) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x, w, b, act_bits),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("type_name", TYPES)
def test_no_weight_is_rounded_again(type_name):
    """Activations the kernel's rounding keeps exactly (integers up to 127 per group with a 127
    in each): the output is the dequantized weights' exact product to fp32 summation; the same
    weights quantized per channel to int8 (what these types were served as before) are far off."""
    blocks = random_blocks(type_name, 48, 768, 7)
    w = KQuantWeight((blocks,))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-127, 128, (5, 768), generator=gen).float()
    x.view(5, -1, 32)[..., 0] = 127
    x = x / 16
    exact = (x.double() @ w.dequantize().double().t())
    got = KQuantLinear.from_weight(w, None, 8)(x).double()
    scale = exact.abs().max()
    assert ((got - exact).abs().max() / scale) < 1e-6
    dense = w.dequantize()
    per_channel = dense.abs().amax(1, keepdim=True) / 127
    requantized = torch.round(dense / per_channel) * per_channel
    assert ((x.double() @ requantized.double().t() - exact).abs().max() / scale) > 1e-4


@pytest.mark.parametrize("act_bits", [8, 16])
def test_rows_do_not_depend_on_their_batch_and_zero_rows_give_the_bias(act_bits):
    w = KQuantWeight(tuple(random_blocks(t, 16, 256, 3) for t in TYPES))
    b = torch.randn(w.shape[0])
    layer = KQuantLinear.from_weight(w, b, act_bits)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(4))
    x[2] = 0
    x[5, :32] = 1e-40  # a denormal group counts as zero
    batch = layer(x)
    for i in range(11):
        assert torch.equal(batch[i:i + 1], layer(x[i:i + 1]))
    assert torch.equal(batch[2], b)
    assert torch.isfinite(batch).all()


def test_the_kernel_reads_each_types_own_layout():
    """Not the reference by accident: the same codes packed as another type's layout, or in
    another order, give another answer."""
    blocks = random_blocks("Q5_K", 16, 256, 2)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    good = KQuantLinear.from_weight(KQuantWeight((blocks,)), None, 16)(x)
    flipped = KQuantBlocks("Q5_K", blocks.codes.flip(1), blocks.d, blocks.sc, blocks.dmin,
                           blocks.m)
    other = KQuantLinear.from_weight(KQuantWeight((flipped,)), None, 16)(x)
    assert not torch.allclose(good, other, atol=1e-3)
    as_q4 = KQuantBlocks("Q4_K", blocks.codes & 15, blocks.d, blocks.sc, blocks.dmin, blocks.m)
    assert not torch.allclose(good, KQuantLinear.from_weight(KQuantWeight((as_q4,)), None,
                                                             16)(x), atol=1e-3)


def test_memory_is_close_to_the_files():
    """Bytes of the kernel's layout over the GGUF's bytes for the same weights (per 256 inputs:
    Q4_K 144, Q5_K 176, Q6_K 210; Q8_0 34 per 32)."""
    file_bytes = {"Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q6_K": 210 / 256, "Q8_0": 34 / 32}
    for t in TYPES:
        layer = KQuantLinear.from_weight(KQuantWeight((random_blocks(t, 64, 1024, 0),)), None)
        ratio = layer.weight_bytes / (64 * 1024 * file_bytes[t])
        assert 1.0 <= ratio < 1.07, (t, ratio)


def test_bad_operands_are_refused_with_a_message():
    w = KQuantWeight((random_blocks("Q6_K", 16, 256, 0),))
    codes, scales, meta = KQuantLinear.from_weight(w, None).packed
    x = torch.randn(1, 256)
    bad_type = meta.clone()
    bad_type[0, 0] = 2  # Q4_0: not this kernel's
    with pytest.raises(RuntimeError, match="ggml type 2"):
        cpu_linear.kquant_linear(x, codes, scales, bad_type)
    outside = meta.clone()
    outside[0, 1] = codes.numel()
    with pytest.raises(RuntimeError, match="outside the buffers"):
        cpu_linear.kquant_linear(x, codes, scales, outside)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        cpu_linear.kquant_linear(torch.randn(1, 224), codes, scales, meta)
    with pytest.raises(RuntimeError, match="act_bits"):
        cpu_linear.kquant_linear(x, codes, scales, meta, None, 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_linear.pack_kquant([(GGML_TYPE["Q6_K"], w.parts[0].codes[:8], w.parts[0].d[:8],
                                 w.parts[0].sc[:8], None, None)])
    assert not cpu_linear.kquant_usable([16, 8], 256, {12})
    assert not cpu_linear.kquant_usable([16], 224, {12})
    assert cpu_linear.kquant_usable([16, 32], 224, {8})


_ISA_CASES = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from kernels import cpu_linear
assert cpu_linear.load()
from test_kquant import TYPES, random_blocks
from engine.quantization.kquant import KQuantLinear, KQuantWeight
w = KQuantWeight(tuple(random_blocks(t, 32, 1024, i) for i, t in enumerate(TYPES)))
b = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(2))
g = torch.Generator().manual_seed(11)
x = torch.randn(13, 1024, generator=g) * torch.rand(1024, generator=g) * 4
x[3] = 0
x[7, 64:96] = 1e-40
x[9, :32] = 3e4
out = {}
for bits in (8, 16):
    layer = KQuantLinear.from_weight(w, b, bits)
    for m in (1, 2, 5, 13):
        out[f"{bits} {m}"] = layer(x[:m])
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(not (_LOADED and cpu_linear.int8_dot_isa() == "avx512_vnni"),
                    reason="needs our kernels loaded on an AVX-512 VNNI CPU (both paths)")
def test_the_vnni_and_avx2_paths_give_the_same_bits(tmp_path):
    results = {}
    for flag in ("1", "0"):
        path = tmp_path / f"vnni{flag}.pt"
        env = {**os.environ, "SALTSERVE_VNNI": flag, "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-c", _ISA_CASES, str(path), str(Path(__file__).parent)],
                       env=env, check=True, timeout=300, capture_output=True)
        results[flag] = torch.load(path)
    assert results["1"].keys() == results["0"].keys() and len(results["1"]) == 8
    for key, got in results["1"].items():
        assert torch.isfinite(got).all(), key
        assert torch.equal(got, results["0"][key]), key
