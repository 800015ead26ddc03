#!/usr/bin/env bash
# What the tests need beyond Python packages: Debian's chromium for the
# browser tests (Playwright drives /usr/bin/chromium; it never downloads one).
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  echo "installing chromium (Debian) for the browser tests"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq chromium >/dev/null
fi
