"""The build of our C++ CPU kernels: every ``kernels/cpu/*.cpp`` compiled into one torch
extension, ``saltserve_cpu``, whose ops ``bindings.cpp`` registers as ``torch.ops.saltserve_cpu.*``.

``load()`` compiles the sources once per machine with ``torch.utils.cpp_extension`` (1-3
minutes on 2 cores; cached under ``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``, and rebuilt when a source or a flag changes) and registers the
ops. It needs a C++ compiler and a CPU with AVX2, FMA and F16C; without them, or with
``SALTSERVE_CPU_KERNELS=0``, it returns False, logs one warning, and the Python APIs
(``kernels.cpu_linear``, ``kernels.cpu_ops``) compute the same things with torch's ops.

A new .cpp in ``kernels/cpu/`` is built without editing anything here; its ops are registered
in ``bindings.cpp`` (declared in ``ops.h``) and, to fail the load when one is missing, named in
``OPS``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DIR = Path(__file__).resolve().parent
# Every C++ source of the extension, sorted: the list does not depend on the file system's order.
SOURCES = sorted(DIR.glob("*.cpp"))
NAME = "saltserve_cpu"  # the extension and its torch library (torch.ops.saltserve_cpu)
# -ffp-contract=off: no fused multiply-add the source does not write (the kernels' bits rely on
# it). Where the first build fails (e.g. an assembler without AMX), it runs again with
# FALLBACK_FLAGS: no AMX tiles, no bf16 KV cache path.
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp")
FALLBACK_FLAGS = ("-DSALTSERVE_HAVE_AMX=0", "-DSALTSERVE_HAVE_BF16=0")
LDFLAGS = ("-fopenmp",)
ENV_SWITCH = "SALTSERVE_CPU_KERNELS"  # "0": do not build, use torch's ops
# Every op bindings.cpp registers: load() fails where one is missing.
OPS = ("linear_small_m", "q4_linear", "q4_linear_vnni", "q8_linear_vnni", "kquant_linear",
       "int8_amx", "int8_amx_calls", "rms_norm", "add_rms_norm", "decode_attention", "bf16_kv_cache",
       "attention_avx512", "attention_amx", "rotary_neox_", "reshape_and_cache", "decode_layer",
       "decode_layers", "silu_and_mul", "argmax_rows")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "why": str (when not ok)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[-1].split())


def _cpu_has_avx2_fma_f16c() -> bool:
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def load() -> bool:
    """Builds (first time on this machine) and registers the kernels; True when they can be used.

    Never raises: a missing compiler, a CPU without AVX2/FMA/F16C, a failed build or
    ``SALTSERVE_CPU_KERNELS=0`` log one warning and make every Python API fall back to torch's
    ops. Thread-safe; the build itself is serialised across processes by torch's lock file.
    """
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        why = ""
        if os.environ.get(ENV_SWITCH, "1") == "0":
            why = f"{ENV_SWITCH}=0"
        elif not _cpu_has_avx2_fma_f16c():
            why = "this CPU lacks AVX2, FMA or F16C"
        else:
            try:
                from torch.utils.cpp_extension import load as build

                # pip's ninja sits beside the interpreter, off PATH when the venv is not activated.
                bindir = os.path.dirname(sys.executable)
                if bindir not in os.environ.get("PATH", "").split(os.pathsep):
                    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
                sources = [str(p) for p in SOURCES]
                try:
                    build(NAME, sources, is_python_module=False, verbose=False,
                          extra_cflags=list(FLAGS), extra_ldflags=list(LDFLAGS))
                except Exception:  # noqa: BLE001 - e.g. an assembler without AMX: build without
                    logger.warning("CPU kernel build failed; building again without AMX and "
                                   "the bf16 KV cache path")
                    build(NAME, sources, is_python_module=False, verbose=False,
                          extra_cflags=[*FLAGS, *FALLBACK_FLAGS], extra_ldflags=list(LDFLAGS))
                for op in OPS:
                    getattr(torch.ops.saltserve_cpu, op)  # raises if not registered
            except Exception as e:  # noqa: BLE001 - any build failure means: use torch's ops
                why = f"build failed ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
        _state["ok"], _state["why"] = not why, why
        if why:
            logger.warning("CPU kernels off (linear, 4-bit, norm, attention, rotary), "
                           "using torch's ops: %s", why)
        return not why


def loaded() -> bool:
    """Whether ``load()`` has run and succeeded in this process (never builds)."""
    return bool(_state.get("ok"))


def unavailable_reason() -> str:
    """Why ``load()`` returned False ("" when it did not, or was not called)."""
    return str(_state.get("why", ""))
