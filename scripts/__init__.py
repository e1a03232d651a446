"""The checks `make stack-check` and `make ui-check` run (`python -m scripts.stack_check`, `scripts.ui_check`), and
`make stack-env` (`python -m scripts.stack_env`)."""
