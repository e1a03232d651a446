"""What a fresh process imports: Keras's optional scikit-learn and pyplot are refused to Keras alone
(cifar._keras_imports); the flows leave TensorFlow, matplotlib and scipy.spatial to the stages that use them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cifar._keras_imports import KerasOptionalImports
from harness import REPO_ROOT


def find_from(module_name: str, name: str):
    """The finder asked for `name` by code running as module `module_name` (its frame's __name__)."""
    namespace = {"__name__": module_name, "finder": KerasOptionalImports(), "name": name}
    exec("spec = finder.find_spec(name)", namespace)
    return namespace["spec"]


@pytest.mark.parametrize(
    ("importer", "name"),
    [("keras.src.wrappers.fixes", "sklearn"), ("keras.src.visualization.plot_image_gallery", "matplotlib.pyplot")],
)
def test_keras_optional_imports_are_refused_to_keras(importer, name):
    with pytest.raises(ModuleNotFoundError, match="cifar._keras_imports"):
        find_from(importer, name)


@pytest.mark.parametrize(
    ("importer", "name"),
    [
        ("cifar.plots", "matplotlib.pyplot"),  # Our code, Optuna, MLflow: found as usual.
        ("optuna.visualization.matplotlib", "matplotlib.pyplot"),
        ("keras.src.trainers.data_adapters", "sklearn"),  # Keras elsewhere: not ours to refuse.
        ("keras.src.wrappers.fixes", "numpy"),  # Only the listed packages.
        ("keras.src.wrappers.fixes", "sklearn.base"),  # Submodules come only after the package itself.
    ],
)
def test_every_other_import_is_left_to_the_other_finders(importer, name):
    assert find_from(importer, name) is None


@pytest.mark.slow
def test_tensorflow_imported_after_cifar_leaves_both_out_and_both_still_import():
    script = (
        "import sys, cifar, tensorflow, keras\n"
        "print(sorted(name for name in ('sklearn', 'matplotlib.pyplot') if name in sys.modules))\n"
        "import sklearn, matplotlib.pyplot\n"
        "from keras.src.wrappers import sklearn_wrapper\n"
        "print(sklearn_wrapper.sklearn is None, matplotlib.pyplot.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["[]", "True matplotlib.pyplot"]


@pytest.mark.slow
def test_importing_the_flows_leaves_tensorflow_mlflow_matplotlib_and_scipy_spatial_to_the_stages_that_use_them():
    # Every flow run, `prefect deploy`, `flows/promote.py`, dry run and resumed run imports the flows first;
    # those that never train, track, draw or compare histograms spare ~1.8 CPU-s each (bench/startup.py).
    script = (
        "import sys, flows.pipeline, flows.retrain, flows.promote, flows.ingest, flows.search, flows.sweep\n"
        "import flows.predict, flows.approval\n"
        "names = ('tensorflow', 'mlflow', 'matplotlib', 'scipy.spatial')\n"
        "print(sorted(name for name in names if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["[]"]
