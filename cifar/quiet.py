"""Quiet start-up: TensorFlow's native libraries print their start-up lines (oneDNN, CUDA, absl) straight
to file descriptor 2, past every log setting; they reach the terminal and the worker's log otherwise.

`CIFAR_VERBOSE=1` in the environment turns this off and lets every start-up line through.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

VERBOSE_ENV = "CIFAR_VERBOSE"


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
