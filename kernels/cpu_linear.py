"""Our CPU linear kernel for decode-sized batches (``kernels/cpu/linear.cpp``), built on first use.

``linear(x, weight, bias)`` is ``F.linear`` for fp32 CPU inputs of at most ``MAX_ROWS`` rows: the
shape of a decode step (one row per running sequence) and of the short stall-free steps the fair
scheduler runs beside another tenant's decodes. torch's sgemm (MKL) takes its generic path on
AMD CPUs for 2-32 rows, so 4 rows cost about 2-3x one row although the step is bound by reading
the weights once; the kernel reads each weight row once per call and reuses it for 4 rows from
registers (``benchmarks/bench_cpu_linear.py`` prints both against each other). Each output is
summed in the same order whatever the number of rows (1 to ``MAX_ROWS``), so within a dense fp32
decode step a sequence's logits do not depend on what else is in its batch; above ``MAX_ROWS``
rows, or on quantized layers below their dense threshold, other kernels run and that no longer holds.

The C++ source is compiled once per machine by ``torch.utils.cpp_extension`` (about 10 s; cached
under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``, keyed on the source) and
registered as ``torch.ops.saltserve_cpu.linear_small_m``. It needs a C++ compiler and a CPU with
AVX2 and FMA; without them, or with ``SALTSERVE_CPU_KERNELS=0``, every call is ``F.linear`` and
one warning says why.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "linear.cpp"
# Up to this many rows the kernel beats MKL's sgemm at this model's shapes on AVX2 (measured by
# benchmarks/bench_cpu_linear.py); prefill chunks above it are compute-bound GEMMs MKL blocks for.
MAX_ROWS = 32
ENV_SWITCH = "SALTSERVE_CPU_KERNELS"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "why": str (when not ok)


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        return False
    return {"avx2", "fma"} <= set(flags.split(":", 1)[-1].split())


def load() -> bool:
    """Builds (first time on this machine) and registers the kernel; True when it can be used.

    Never raises: a missing compiler, a CPU without AVX2/FMA, a failed build or
    ``SALTSERVE_CPU_KERNELS=0`` log one warning and make ``linear`` fall back to ``F.linear``.
    Thread-safe; the build itself is serialised across processes by torch's lock file.
    """
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        why = ""
        if os.environ.get(ENV_SWITCH, "1") == "0":
            why = f"{ENV_SWITCH}=0"
        elif not _cpu_has_avx2_fma():
            why = "this CPU lacks AVX2 or FMA"
        else:
            try:
                from torch.utils.cpp_extension import load as build

                # pip's ninja sits beside the interpreter, off PATH when the venv is not activated.
                bindir = os.path.dirname(sys.executable)
                if bindir not in os.environ.get("PATH", "").split(os.pathsep):
                    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
                build("saltserve_cpu", [str(SOURCE)], is_python_module=False, verbose=False,
                      extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                      extra_ldflags=["-fopenmp"])
                torch.ops.saltserve_cpu.linear_small_m  # noqa: B018 - raises if not registered
            except Exception as e:  # noqa: BLE001 - any build failure means: use F.linear
                why = f"build failed ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
        _state["ok"], _state["why"] = not why, why
        if why:
            logger.warning("CPU linear kernel off, using torch's F.linear: %s", why)
        return not why


def loaded() -> bool:
    """Whether ``load()`` has run and succeeded in this process (never builds)."""
    return bool(_state.get("ok"))


def unavailable_reason() -> str:
    """Why ``load()`` returned False ("" when it did not, or was not called)."""
    return str(_state.get("why", ""))


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` would run the kernel for these operands (``load()`` must be True)."""
    return (loaded() and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and weight.is_contiguous() and not x.requires_grad)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the kernel where ``usable``, else ``F.linear``.

    Args:
        x: [num_tokens, in_features] activations.
        weight: [out_features, in_features], as ``nn.Linear`` holds it.
        bias: [out_features] or None.

    Returns:
        [num_tokens, out_features] in ``x``'s dtype.
    """
    if usable(x, weight):
        return torch.ops.saltserve_cpu.linear_small_m(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)
