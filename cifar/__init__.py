"""cifar: CIFAR-10 from the raw tarball to a served model. Plain Python + TF/Keras; no Prefect here."""

from cifar import _keras_imports

__version__ = "0.1.0"

# Before any stage imports TensorFlow: Keras's scikit-learn and pyplot imports, unused here, cost ~1 CPU-s.
_keras_imports.install()
