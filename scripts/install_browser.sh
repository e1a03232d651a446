#!/usr/bin/env bash
# What scripts/ui_check/ needs beyond `make setup`: Debian's Chromium and the Python `playwright`
# client in the venv. Playwright's own browser download (`playwright install`) is never used: the
# harness launches /usr/bin/chromium through `executable_path`, so this works offline with only the
# apt and PyPI mirrors. Idempotent: a no-op (well under a second) when both are present.
#
#   scripts/install_browser.sh                 # uses .venv/bin/python
#   PYTHON=/path/to/python scripts/install_browser.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
PLAYWRIGHT_SPEC="${PLAYWRIGHT_SPEC:-playwright>=1.49,<2}"
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"

if [ ! -x "$CHROMIUM" ]; then
    if ! command -v apt-get >/dev/null; then
        echo "install_browser.sh: $CHROMIUM is missing and there is no apt-get; install Chromium and set CHROMIUM=" >&2
        exit 1
    fi
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    echo "install_browser.sh: installing Debian's chromium (apt-get)" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null
fi

if ! "$PY" -c "import playwright.sync_api" 2>/dev/null; then
    echo "install_browser.sh: installing $PLAYWRIGHT_SPEC into $("$PY" -c 'import sys; print(sys.prefix)')" >&2
    # constraints.txt pins it (and greenlet) when the project lists playwright there; harmless otherwise.
    "$PY" -m pip install --quiet -c constraints.txt "$PLAYWRIGHT_SPEC"
fi

"$CHROMIUM" --version
"$PY" -c "import importlib.metadata as m; print('playwright', m.version('playwright'))"
