"""Prefect flows composing the tasks: the pipeline, its sweep and search, retraining, ingestion, prediction.

Importing the package quiets the frameworks first (cifar.quiet; CIFAR_VERBOSE=1 turns it off): every flow
file imports flows.runtime before TensorFlow, MLflow or Prefect load.
"""

import os

from cifar.quiet import quiet_environment

quiet_environment()
# Prefect waits 20 s for a run's temporary server; several runs starting at once on 2 busy cores took longer.
# Set before Prefect reads its settings, at import (a command line's run is a fork of its first process).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
