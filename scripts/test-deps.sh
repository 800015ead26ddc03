#!/usr/bin/env bash
# What the tests need beyond Python packages, from Debian's packages when
# missing: Chromium for the browser tests (Playwright drives /usr/bin/chromium;
# it never downloads a browser of its own: `playwright install` is not used),
# nginx for the test of the TLS reverse proxy sample (deploy/nginx-llmgw.conf),
# and OpenSSH's server (and a plain test account) for the onboarding tests,
# which start their own sshd on a loopback address.
set -euo pipefail
CHROMIUM=/usr/bin/chromium
NGINX=/usr/sbin/nginx
SSHD=/usr/sbin/sshd
# An unprivileged account the onboarding tests log in as (no password, no
# sudo): the preflight must name what it cannot do.
SSH_TEST_USER=llmgw-ssh-test

missing=()
[ -x "$CHROMIUM" ] || missing+=(chromium)
[ -x "$NGINX" ] || missing+=(nginx-light)
[ -x "$SSHD" ] || missing+=(openssh-server)
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
  # nginx-light's and openssh-server's packages start servers of their own; the tests start theirs.
  if command -v service >/dev/null 2>&1; then
    [[ " ${missing[*]} " == *" nginx-light "* ]] && { $SUDO service nginx stop >/dev/null 2>&1 || true; }
    [[ " ${missing[*]} " == *" openssh-server "* ]] && { $SUDO service ssh stop >/dev/null 2>&1 || true; }
  fi
fi
if ! id "$SSH_TEST_USER" >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # '*': no password, yet not locked (sshd refuses a locked account even a key).
  useradd --system --no-create-home --home-dir /nonexistent --shell /bin/bash --password '*' "$SSH_TEST_USER"
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
