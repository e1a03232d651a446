"""cifar: CIFAR-10 from the raw tarball to a served model. Plain Python + TF/Keras; no Prefect here."""

__version__ = "0.1.0"
