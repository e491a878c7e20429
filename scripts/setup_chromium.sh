#!/usr/bin/env bash
# Debian's Chromium for the dashboard's browser test (Playwright drives it with
# executable_path; no browser is downloaded). Installs it with apt-get when it
# is missing: as root, or through sudo where that works without a password.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "chromium is missing and this user cannot install it: run 'apt-get install chromium' as root" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get install -y -q chromium >/dev/null 2>&1 \
    || { "${as_root[@]}" apt-get update -q >/dev/null && "${as_root[@]}" apt-get install -y -q chromium >/dev/null; }
command -v chromium >/dev/null
