#!/usr/bin/env bash
# What the tests need beyond Python packages: Debian's Chromium for the
# browser tests, and OpenSSH's server (and a plain test account) for the
# onboarding tests, which start their own sshd on a loopback address. Playwright drives /usr/bin/chromium; it never downloads a
# browser of its own (`playwright install` is not used).
set -euo pipefail
CHROMIUM=/usr/bin/chromium
SSHD=/usr/sbin/sshd
# An unprivileged account the onboarding tests log in as (no password, no
# sudo): the preflight must name what it cannot do.
SSH_TEST_USER=llmgw-ssh-test

apt_install() {
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "$1 is missing: install Debian's '$1' package as root" >&2; exit 1; }
    SUDO="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq "$@" >/dev/null
}

if [ ! -x "$SSHD" ]; then
  echo "installing openssh-server (Debian) for the onboarding tests"
  apt_install openssh-server
fi
if ! id "$SSH_TEST_USER" >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # '*': no password, yet not locked (sshd refuses a locked account even a key).
  useradd --system --no-create-home --home-dir /nonexistent --shell /bin/bash --password '*' "$SSH_TEST_USER"
fi

if [ ! -x "$CHROMIUM" ]; then
  echo "installing chromium (Debian) for the browser tests"
  apt_install chromium
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
