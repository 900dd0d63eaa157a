#!/usr/bin/env bash
# Re-checks whether `transformers<5.25` (pyproject.toml) is still needed: installs transformers
# VERSION (default: the newest on the index) and the Hugging Face `kernels` it requires into a
# throwaway venv layered over .venv (nothing in .venv changes), then imports what the engine
# imports with this repository first on sys.path, and our kernels beside theirs.
# Prints CLASH (keep the pin) or NO CLASH (try lifting it: make test with that transformers).
# Usage: bash scripts/check_transformers_pin.sh [VERSION]   (needs .venv and the package index)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PIP="$ROOT/.venv/bin/pip"
VERSION="${1:-$("$PIP" index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p')}"
[ -n "$VERSION" ] || { echo "could not find the newest transformers on the index" >&2; exit 2; }
WORK="$(mktemp -d "${TMPDIR:-/tmp}/saltserve-pin.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

"$PIP" download -q --no-deps -d "$WORK/dl" "transformers==$VERSION"
KERNELS_REQ="$("$ROOT/.venv/bin/python" - "$WORK"/dl/transformers-*.whl <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    for line in whl.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.name == "kernels" and (req.marker is None or req.marker.evaluate({"extra": ""})):
                print(str(req).replace(" ", ""))
EOF
)"
echo "transformers $VERSION requires: ${KERNELS_REQ:-no kernels package}"

python_bin="$ROOT/.venv/bin/python"
"$python_bin" -m venv "$WORK/venv"
SITE="$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
# .venv's packages after the throwaway venv's own (a .pth line is appended to sys.path).
"$python_bin" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > "$SITE/zz_saltserve_venv.pth"
"$WORK/venv/bin/pip" install -q --no-deps "$WORK"/dl/transformers-*.whl ${KERNELS_REQ:+"$KERNELS_REQ" tomlkit}

status=0
echo "-- repository first on sys.path: import transformers.modeling_utils (what engine/weights.py needs)"
(cd "$ROOT" && HF_HUB_OFFLINE=1 "$WORK/venv/bin/python" -c 'import transformers.modeling_utils' \
    2>&1 | tail -n 1) || true
(cd "$ROOT" && HF_HUB_OFFLINE=1 "$WORK/venv/bin/python" -c 'import transformers.modeling_utils' \
    >/dev/null 2>&1) || status=1
echo "-- installed packages first: import kernels.cpu_linear (ours)"
(cd "$WORK" && "$WORK/venv/bin/python" -c "import sys; sys.path.append('$ROOT'); import kernels.cpu_linear" \
    2>&1 | tail -n 1) || true
(cd "$WORK" && "$WORK/venv/bin/python" -c "import sys; sys.path.append('$ROOT'); import kernels.cpu_linear" \
    >/dev/null 2>&1) || status=1

if [ "$status" = 0 ]; then
    echo "NO CLASH with transformers $VERSION: the pin is not needed for it (lift it, then make test)"
else
    echo "CLASH with transformers $VERSION: keep transformers<5.25 in pyproject.toml"
fi
exit "$status"
