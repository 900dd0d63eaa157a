#!/usr/bin/env bash
# Re-fetches the console's front-end libraries from the npm registry at the versions pinned in
# app/console/static/vendor/VENDOR.json (npm checks each tarball's integrity), copies the
# built files and licences, and prints their sha256 for VENDOR.json. Run by hand, never at
# run time; to upgrade, change the versions in VENDOR.json first.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=app/console/static/vendor
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$dest/VENDOR.json" > "$work/list" <<'PY'
import json, sys
for name, f in json.load(open(sys.argv[1]))["files"].items():
    print(name, f"{f['package']}@{f['version']}", f["path"], f["license_file"])
PY
while read -r name spec path license_file; do
  (cd "$work" && npm pack --silent "$spec" >/dev/null)
  tgz=$(ls "$work"/*.tgz | head -1)
  mkdir -p "$work/x" && tar xzf "$tgz" -C "$work/x"
  cp "$work/x/package/$path" "$dest/$name"
  cp "$work/x/package/$(cd "$work/x/package" && ls | grep -i '^licen[cs]e' | head -1)" "$dest/$license_file"
  rm -rf "$work/x" "$tgz"
  echo "$name $(sha256sum "$dest/$name" | cut -d' ' -f1)"
done < "$work/list"
