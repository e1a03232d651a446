"""`make ui-check`: what a person sees in the Prefect and MLflow UIs after a smoke run and a sweep, in Chromium.

    scripts/install_browser.sh                          # once: Debian's chromium + the playwright client
    .venv/bin/python -m scripts.ui_check                # screenshots into docs/images/, exit 1 on a failed check
    .venv/bin/python -m scripts.ui_check --keep         # ... then leave the servers up (Ctrl-C ends)
    .venv/bin/python -m scripts.ui_check --attach TMP   # only the browser part, against a --keep run's servers
    .venv/bin/python -m scripts.ui_check --out /tmp/shots --archive PATH [--sha256 HEX]

What it starts, visits and leaves behind: docs/ORCHESTRATION.md, "The UI check".
"""
