"""Keras's optional imports that no stage uses, refused to Keras alone: about a second of CPU per process.

`import tensorflow` imports Keras, and Keras imports scikit-learn (with scipy.stats) for its
`keras.wrappers.SKLearn*` classes and `matplotlib.pyplot` for `keras.visualization`, whenever they are
installed. MLflow installs both. Nothing here uses those Keras features, yet every process that imports
TensorFlow paid for them: `import tensorflow` takes 3.9 CPU-s as shipped, 2.9 with them refused (0.74x;
bench/startup.py on AMD EPYC family 26 model 2, 2026-11-28), in each of the ~60 processes a test run starts
(pipelines, flow runs, workers) and in every worker of the stack. Keras wraps both imports in
`try/except ImportError`; only those features then say that the package is missing.

The refusal is narrow: only an import made directly by a module of `keras.src.wrappers` or
`keras.src.visualization`, and only while the package is not imported yet. Anyone else (our plots, Optuna,
MLflow) imports scikit-learn and pyplot as usual, and Keras finds them too once they are in `sys.modules`.
"""

from __future__ import annotations

import importlib.abc
import sys

# The package Keras imports -> the Keras modules whose import of it is refused.
REFUSED = {"sklearn": ("keras.src.wrappers",), "matplotlib.pyplot": ("keras.src.visualization",)}
# Frames of the import machinery between the importing module and a finder.
_IMPORT_MACHINERY = ("importlib", "_frozen_importlib")


class KerasOptionalImports(importlib.abc.MetaPathFinder):
    """A finder first on `sys.meta_path` that refuses the imports in REFUSED and finds nothing else."""

    def find_spec(self, name, path=None, target=None):
        importers = REFUSED.get(name)
        if importers is None:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(_IMPORT_MACHINERY):
            frame = frame.f_back
        importer = "" if frame is None else frame.f_globals.get("__name__", "")
        if importer.startswith(importers):
            raise ModuleNotFoundError(f"{name} is not imported for {importer} (cifar._keras_imports)", name=name)
        return None


def install() -> None:
    """Put the finder first on `sys.meta_path`, once per process."""
    if not any(isinstance(finder, KerasOptionalImports) for finder in sys.meta_path):
        sys.meta_path.insert(0, KerasOptionalImports())
