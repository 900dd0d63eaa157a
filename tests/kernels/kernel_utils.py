"""Shared helpers for the kernel tests: random paged batches, tolerances, the interpreter bounds
checker and a launch recorder for the sm_90 compile test."""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRETING or not torch.cuda.is_available() else "cuda"

# (rtol, atol) vs the fp32 reference rounded to the dtype; the GPU path rounds the softmax
# probabilities to fp16/bf16 before the P @ V product, hence the slack beyond one ulp.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@dataclass
class PagedBatch:
    """One variable-length batch over a paged cache (``engine/attention/metadata.py`` layouts)."""

    query: torch.Tensor            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor         # [num_seqs] int32
    block_tables: torch.Tensor     # [num_seqs, max_blocks] int32
    query_lens: tuple[int, ...]

    @property
    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.query_start_loc,
                self.seq_lens, self.block_tables, self.query.shape[-1] ** -0.5)


def make_batch(seqs: Sequence[tuple[int, int]], *, num_kv_heads: int, group: int,
               head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0,
               spare_blocks: int = 3, device: str = DEVICE) -> PagedBatch:
    """Random batch. ``seqs`` is ``[(context_len, query_len), ...]``.

    Each sequence gets ``cdiv(context + query, block_size)`` distinct blocks drawn at random from
    the pool (so tables are not contiguous), tables padded with 0 to the widest one plus one, and
    the cache is random everywhere (the kernel must read only the table's blocks).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + q) // block_size) for c, q in seqs]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(need) + 1
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used:used + n].int()
        used += n
    qsl = [0]
    for _c, q in seqs:
        qsl.append(qsl[-1] + q)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(qsl[-1], num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return PagedBatch(q.to(device), kc.to(device), vc.to(device),
                      torch.tensor(qsl, dtype=torch.int32, device=device),
                      torch.tensor([c + q for c, q in seqs], dtype=torch.int32, device=device),
                      tables.to(device), tuple(q for _c, q in seqs))


def paged_attention_variants_ref(query: torch.Tensor, key_cache: torch.Tensor,
                                 value_cache: torch.Tensor, query_start_loc: torch.Tensor,
                                 seq_lens: torch.Tensor, block_tables: torch.Tensor,
                                 scale: float, *, sliding_window: int | None = None,
                                 logit_softcap: float | None = None,
                                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``triton_reference.paged_attention_ref`` with the attention variants, fp32, a sequence
    at a time over its whole score matrix (no tiling, no online softmax).

    Args:
        query: [num_tokens, num_heads, head_dim]; caches [num_blocks, block_size, kvh, head_dim];
            metadata as ``paged_attention`` takes it.
        sliding_window: key k visible from position p iff p - W < k <= p (HF
            ``masking_utils.sliding_window_overlay`` on the causal mask).
        logit_softcap: scores = c * tanh(scores / c) before the mask (HF Gemma 2
            ``eager_attention_forward``).
        sinks: [num_heads] fp32, a per-head logit column appended to the scores and dropped
            after the softmax (HF gpt-oss ``eager_attention_forward``).

    Returns:
        [num_tokens, num_heads, head_dim] in ``query``'s dtype.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float32)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[s], starts[s + 1]
        if q_end == q_start:
            continue
        positions = torch.arange(seq_len)
        blocks = block_tables[s].long().cpu()[positions // block_size]
        k = key_cache.cpu()[blocks, positions % block_size].float()
        v = value_cache.cpu()[blocks, positions % block_size].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].cpu().float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale               # [h, q_len, seq_len]
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        q_pos = seq_len - (q_end - q_start) + torch.arange(q_end - q_start)
        visible = positions[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= positions[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.cpu().float()[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(query.dtype).to(query.device)


def guarded(t: torch.Tensor, guard: float, pad: int = 7) -> torch.Tensor:
    """A copy of ``t`` living inside a larger buffer filled with ``guard``: ``pad`` guard elements
    before and after, and ``pad`` more after every row of the last dimension (so the view is not
    contiguous and every row is fenced on both sides)."""
    shape = tuple(t.shape)
    row = shape[-1] + pad
    rows = t.numel() // shape[-1]
    buf = torch.full((2 * pad + rows * row,), guard, dtype=t.dtype, device=t.device)
    view = torch.as_strided(buf, shape, _row_fenced_strides(shape, row), pad)
    view.copy_(t)
    return view


def _row_fenced_strides(shape: Sequence[int], row_stride: int) -> tuple[int, ...]:
    strides = [1] * len(shape)
    acc = row_stride
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = acc
        acc *= shape[i]
    return tuple(strides)


def guard_intact(view: torch.Tensor, guard: float) -> bool:
    """Whether every element of ``view``'s storage outside ``view`` still holds ``guard``."""
    storage = torch.empty(0, dtype=view.dtype, device=view.device).set_(view.untyped_storage())
    inside = torch.zeros(storage.numel(), dtype=torch.bool, device=view.device)
    idx = torch.arange(storage.numel(), device=view.device)
    inside[idx.as_strided(view.shape, view.stride(), view.storage_offset()).reshape(-1)] = True
    outside = storage[~inside]
    if isinstance(guard, float) and math.isnan(guard):
        return bool(torch.isnan(outside).all())
    return bool((outside == guard).all())


# -- bounds checker -----------------------------------------------------------------------------


class BoundsViolation(AssertionError):
    pass


def _valid_addresses(t: torch.Tensor) -> np.ndarray:
    """Sorted byte addresses of every element of ``t`` (exact, strides and gaps respected)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint64)
    idx = torch.arange(t.untyped_storage().nbytes() // t.element_size(), dtype=torch.int64)
    elems = idx.as_strided(t.shape, t.stride(), t.storage_offset()).reshape(-1).numpy()
    base = t.untyped_storage().data_ptr()
    return np.unique(base + elems.astype(np.uint64) * np.uint64(t.element_size()))


@contextlib.contextmanager
def bounds_checked(*kernels) -> Iterator[list[str]]:
    """Fails any interpreted load or store, of the given ``@triton.jit`` kernels' launches, whose
    mask is on at an address that is not an element of one of the launch's tensor arguments.

    How: a pre-run hook on each kernel records, per launch, the exact byte address of every element
    of every tensor argument (views, strides and gaps respected, so a guard element next to a view
    is out of bounds); ``InterpreterBuilder.create_masked_load/create_masked_store`` (which every
    ``tl.load``/``tl.store`` reaches in the interpreter, masked or not) are wrapped to check the
    active lanes' addresses against that set and their alignment. A violation raises at once (the
    interpreter wraps it) and is also listed in the yielded list, which must be empty on exit.
    """
    from triton.runtime import interpreter

    builder_cls = interpreter.InterpreterBuilder
    allowed: list[np.ndarray] = []
    violations: list[str] = []

    def hook(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        allowed[:] = [np.unique(np.concatenate([_valid_addresses(t) for t in tensors]))]

    def check(ptrs, mask, what: str) -> None:
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        on = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        active = addr[on]
        if active.size == 0:
            return
        if not allowed:
            raise BoundsViolation("bounds checker: a launch ran without the pre-run hook")
        valid = allowed[0]
        pos = np.clip(np.searchsorted(valid, active), 0, max(valid.size - 1, 0))
        bad = active[valid[pos] != active] if valid.size else active
        if bad.size:
            msg = (f"out-of-bounds {what}: {bad.size} of {active.size} active lanes outside the "
                   f"launch's tensors (first address {int(bad[0]):#x})")
            violations.append(msg)
            raise BoundsViolation(msg)

    orig_load = builder_cls.create_masked_load
    orig_store = builder_cls.create_masked_store

    def masked_load(self, ptrs, mask, other, *args, **kwargs):
        check(ptrs, mask, "load")
        return orig_load(self, ptrs, mask, other, *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        check(ptrs, mask, "store")
        return orig_store(self, ptrs, value, mask, *args, **kwargs)

    for k in kernels:
        k.add_pre_run_hook(hook)
    builder_cls.create_masked_load = masked_load
    builder_cls.create_masked_store = masked_store
    try:
        yield violations
    finally:
        builder_cls.create_masked_load = orig_load
        builder_cls.create_masked_store = orig_store
        for k in kernels:
            k.pre_run_hooks.remove(hook)
    assert not violations, violations


# -- launch recorder for the compile test --------------------------------------------------------


@dataclass
class Launch:
    kernel: object      # the @triton.jit object (JITFunction or InterpretedFunction)
    grid: tuple
    args: tuple
    kwargs: dict


class LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel: ``rec[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, kernel, launches: list[Launch]) -> None:
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(Launch(self.kernel, tuple(grid), args, kwargs))
        return launch


_TORCH_TO_TRITON = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                    torch.int32: "i32", torch.int64: "i64"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


def compile_launch(launch: Launch, capability: int = 90):
    """Compiles a recorded launch for ``GPUTarget("cuda", capability, 32)`` the way the JIT would
    (same types, constexprs and 16-divisibility hints). Returns the ``CompiledKernel``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    fn = launch.kernel.fn
    params = list(inspect.signature(fn).parameters.values())
    kwargs = {k: v for k, v in launch.kwargs.items() if k not in _LAUNCH_OPTIONS}
    bound = dict(zip([p.name for p in params], launch.args))
    bound.update(kwargs)
    assert set(bound) == {p.name for p in params}, (set(bound) ^ {p.name for p in params})
    signature: dict[str, str] = {}
    constexprs: dict[str, object] = {}
    attrs: dict[tuple[int], list] = {}
    for i, p in enumerate(params):
        value, ann = bound[p.name], str(p.annotation)
        if "constexpr" in ann:
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + _TORCH_TO_TRITON[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            signature[p.name] = "i64" if "int64" in ann else "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{p.name}: unsupported launch argument {type(value)}")
    src = triton.compiler.ASTSource(fn=JITFunction(fn), signature=signature,
                                    constexprs=constexprs, attrs=attrs)
    options = {k: launch.kwargs[k] for k in _LAUNCH_OPTIONS if k in launch.kwargs}
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


# Kernel variants the wrappers launch, each recorded from one call with representative inputs.
# name -> (wrapper, kwargs for make_batch or the store shapes). The sm_90 compile runs in a child
# process without TRITON_INTERPRET: under the interpreter triton.language's own @jit helpers
# (tl.sum, tl.cdiv, ...) are interpreter objects the compiler cannot inline.
ATTENTION_VARIANTS = {
    # name: (dtype, head_dim, group, block_size, seqs, num_splits[, attention variant kwargs])
    # ("sinks": True stands for a [num_heads] fp32 tensor)
    "decode-bf16-d128-g4": (torch.bfloat16, 128, 4, 16, [(40, 1), (7, 1)], None),
    "prefill-bf16-d128-g1": (torch.bfloat16, 128, 1, 16, [(0, 40), (20, 1)], None),
    "prefill-fp16-d80-g3-bs32": (torch.float16, 80, 3, 32, [(16, 30)], None),
    "prefill-fp32-d64-g4": (torch.float32, 64, 4, 16, [(0, 30)], None),
    "decode-fp32-d128-g1": (torch.float32, 128, 1, 16, [(33, 1), (3, 1)], None),
    "prefill-bf16-d256-g2": (torch.bfloat16, 256, 2, 16, [(0, 20)], None),
    "smollm2-decode-bf16-d64-g3": (torch.bfloat16, 64, 3, 16, [(50, 1), (9, 1)], None),
    "smollm2-prefill-bf16-d64-g3": (torch.bfloat16, 64, 3, 16, [(32, 17)], None),
    "splitk-bf16-d64-g3": (torch.bfloat16, 64, 3, 16, [(100, 1)], 4),
    "splitk-fp32-d128-g4": (torch.float32, 128, 4, 32, [(100, 1)], 2),
    # Gemma 2 (head_dim 256, soft-cap 50, window 4096 on every other layer); gpt-oss (head_dim
    # 64, 8 queries per kv head, window 128 on every other layer, sinks everywhere).
    "gemma2-prefill-bf16-d256-g2-window-softcap": (
        torch.bfloat16, 256, 2, 16, [(0, 40), (20, 1)], None,
        {"sliding_window": 4096, "logit_softcap": 50.0}),
    "gemma2-decode-bf16-d256-g2-softcap": (
        torch.bfloat16, 256, 2, 16, [(40, 1), (7, 1)], None, {"logit_softcap": 50.0}),
    "gptoss-prefill-bf16-d64-g8-window-sinks": (
        torch.bfloat16, 64, 8, 16, [(0, 40), (20, 1)], None,
        {"sliding_window": 128, "sinks": True}),
    "gptoss-decode-bf16-d64-g8-sinks": (
        torch.bfloat16, 64, 8, 16, [(50, 1), (9, 1)], None, {"sinks": True}),
    "splitk-bf16-d64-g8-window-sinks": (
        torch.bfloat16, 64, 8, 16, [(100, 1)], 4, {"sliding_window": 128, "sinks": True}),
    "prefill-fp32-d64-g4-all-variants": (
        torch.float32, 64, 4, 16, [(10, 30)], None,
        {"sliding_window": 7, "logit_softcap": 30.0, "sinks": True}),
}
STORE_VARIANTS = {
    # name: (dtype, num_kv_heads, head_dim)
    "store-fp16-h8-d128": (torch.float16, 8, 128),
    "store-bf16-h3-d80": (torch.bfloat16, 3, 80),
    "store-fp32-h2-d64": (torch.float32, 2, 64),
}


def record_variant(name: str) -> list[Launch]:
    """Calls the wrapper for variant ``name`` with its kernels replaced by recorders."""
    import kernels.triton.paged_attention as pa
    import kernels.triton.store_kv_cache as skc

    launches: list[Launch] = []
    saved = (pa._paged_attention_kernel, pa._reduce_segments_kernel, pa._interpreting,
             skc._store_kv_cache_kernel)
    pa._paged_attention_kernel = LaunchRecorder(saved[0], launches)
    pa._reduce_segments_kernel = LaunchRecorder(saved[1], launches)
    pa._interpreting = lambda: False           # record the GPU variant (native-dtype dots)
    skc._store_kv_cache_kernel = LaunchRecorder(saved[3], launches)
    try:
        if name in ATTENTION_VARIANTS:
            dtype, head_dim, group, block_size, seqs, splits, *more = ATTENTION_VARIANTS[name]
            variant = dict(more[0]) if more else {}
            if variant.get("sinks"):
                variant["sinks"] = torch.zeros(2 * group, dtype=torch.float32)
            b = make_batch(seqs, num_kv_heads=2, group=group, head_dim=head_dim,
                           block_size=block_size, dtype=dtype, device="cpu")
            pa.paged_attention(*b.args, max_query_len=max(b.query_lens), num_splits=splits,
                               **variant)
        else:
            dtype, heads, head_dim = STORE_VARIANTS[name]
            k = torch.zeros(4, heads, head_dim, dtype=dtype)
            cache = torch.zeros(3, 16, heads, head_dim, dtype=dtype)
            skc.store_kv_cache(k, k, cache, cache.clone(), torch.tensor([0, -1, 5, 40]))
    finally:
        (pa._paged_attention_kernel, pa._reduce_segments_kernel, pa._interpreting,
         skc._store_kv_cache_kernel) = saved
    return launches


def _compile_main(names: Sequence[str]) -> None:
    """Child-process entry: compiles every launch of each variant for sm_90, one JSON line each."""
    import json
    import time

    for name in names:
        t0 = time.perf_counter()
        try:
            results = []
            for launch in record_variant(name):
                ck = compile_launch(launch)
                results.append({"kernel": launch.kernel.fn.__name__,
                                "shared_bytes": ck.metadata.shared,
                                "cubin": "cubin" in ck.asm})
            line = {"name": name, "ok": True, "kernels": results}
        except Exception as e:  # noqa: BLE001 - reported to the parent test
            line = {"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"[-3000:]}
        line["seconds"] = round(time.perf_counter() - t0, 2)
        print("VARIANT " + json.dumps(line), flush=True)


if __name__ == "__main__":
    import sys

    _compile_main(sys.argv[1:] or [*ATTENTION_VARIANTS, *STORE_VARIANTS])
