"""Quiet start-up: the frameworks' own lines stay off the terminal (CIFAR_VERBOSE=1 lets every line through).

TensorFlow's native libraries print their start-up lines (oneDNN, CUDA, absl) straight to file
descriptor 2, past every log setting; MLflow's loggers write to stderr themselves (database set-up,
system metrics, model validation) and draw download bars; offline, MLflow's and Prefect's usage
telemetry only adds failures to the logs (it sends nothing of ours).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence

VERBOSE_ENV = "CIFAR_VERBOSE"
# Defaults only: a value already in the environment wins.
QUIET_DEFAULTS = {
    "TF_CPP_MIN_LOG_LEVEL": "2",  # TensorFlow's C++ INFO and WARNING lines.
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # The ephemeral server's usage reports.
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # A multi-line bar per model download (the gate, predict).
}
# The loggers MLflow configures itself (mlflow.utils.logging_utils), with the levels it gives them.
FRAMEWORK_LOGGERS = {"mlflow": "INFO", "alembic": "WARNING", "sqlalchemy.engine": "WARNING", "huey": "WARNING"}


def quiet_environment() -> None:
    """Sets the quiet defaults in this process's environment (inherited by its children), unless verbose."""
    if os.environ.get(VERBOSE_ENV) == "1":
        return
    for name, value in QUIET_DEFAULTS.items():
        os.environ.setdefault(name, value)


@contextlib.contextmanager
def native_output_silenced() -> Iterator[None]:
    """Sends file descriptor 2 to /dev/null for the block, unless CIFAR_VERBOSE=1."""
    if os.environ.get(VERBOSE_ENV) == "1":
        yield
        return
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def import_tensorflow() -> None:
    """Imports TensorFlow (and lists its devices, which prints too) without its start-up lines."""
    with native_output_silenced():
        import tensorflow as tf

        tf.config.list_physical_devices()


class OursOnly(logging.Filter):
    """Keeps the frameworks' own INFO lines off a handler; their warnings and errors pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        ours = not any(record.name == name or record.name.startswith(f"{name}.") for name in FRAMEWORK_LOGGERS)
        return ours or record.levelno >= logging.WARNING


def route_framework_logs(terminals: Sequence[logging.Handler]) -> None:
    """MLflow's loggers hand their records to the root logger's handlers (a log file) instead of printing
    them on stderr themselves; the `terminals` handlers leave their INFO lines out."""
    os.environ["MLFLOW_CONFIGURE_LOGGING"] = "false"  # An MLflow imported later leaves its loggers as set here.
    for name, level in FRAMEWORK_LOGGERS.items():
        logger = logging.getLogger(name)
        logger.handlers = []
        logger.setLevel(os.environ.get("MLFLOW_LOGGING_LEVEL", level).upper() if name == "mlflow" else level)
        logger.propagate = True
    for handler in terminals:
        handler.addFilter(OursOnly())
