"""Prefect flows composing the tasks: the pipeline, its sweep and search, retraining, ingestion, prediction.

Importing the package quiets the frameworks first (cifar.quiet; CIFAR_VERBOSE=1 turns it off): every flow
file imports flows.runtime before TensorFlow, MLflow or Prefect load.
"""

from cifar.quiet import quiet_environment

quiet_environment()
