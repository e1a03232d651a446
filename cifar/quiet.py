"""Quiet start-up: TensorFlow's native libraries print their start-up lines (oneDNN, CUDA, absl) straight
to file descriptor 2, past every log setting; they reach the terminal and the worker's log otherwise.
Offline, MLflow's and Prefect's usage telemetry only adds failures to the logs (it sends nothing of ours).

`CIFAR_VERBOSE=1` in the environment turns all of this off and lets every line through.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

VERBOSE_ENV = "CIFAR_VERBOSE"
# Defaults only: a value already in the environment wins.
QUIET_DEFAULTS = {
    "TF_CPP_MIN_LOG_LEVEL": "2",  # TensorFlow's C++ INFO and WARNING lines.
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # The ephemeral server's usage reports.
}


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
