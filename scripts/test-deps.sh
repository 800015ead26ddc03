#!/usr/bin/env bash
# What the tests need beyond Python packages: Debian's Chromium for the
# browser tests (Playwright drives /usr/bin/chromium; it never downloads a
# browser of its own: `playwright install` is not used), and nginx, for the
# test of the TLS reverse proxy sample (deploy/nginx-llmgw.conf).
set -euo pipefail
CHROMIUM=/usr/bin/chromium
NGINX=/usr/sbin/nginx

missing=()
[ -x "$CHROMIUM" ] || missing+=(chromium)
[ -x "$NGINX" ] || missing+=(nginx-light)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing ${missing[*]} (Debian) for the tests"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "missing: install Debian's ${missing[*]} as root" >&2; exit 1; }
    SUDO="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  # nginx-light's package starts a server on port 80; the tests start their own.
  if [[ " ${missing[*]} " == *" nginx-light "* ]] && command -v service >/dev/null 2>&1; then
    $SUDO service nginx stop >/dev/null 2>&1 || true
  fi
fi
# A Chromium that cannot start fails every browser test the same way: say so once.
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
if ! timeout 60 "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run --user-data-dir="$profile" \
    --dump-dom 'data:text/html,<p>ok</p>' 2>/dev/null | grep -q '<p>ok</p>'; then
  echo "$CHROMIUM is installed but does not start headless" >&2
  exit 1
fi
