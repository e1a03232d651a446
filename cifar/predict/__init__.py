"""Batch inference: score a source of unlabelled images with a registered model, and monitor what it saw.

    result = predict("cifar-10-batches-py/test_batch", workdir, model="models:/cifar10@champion")

`sources` (what a path holds, read in chunks), `model` (the registry version, loaded as serving loads it),
`job` (key and outputs), `scoring` (`predict`), `result` (the verdict, the drift figure), `tracking` (the
job's MLflow run). Inputs, outputs, reuse, memory and monitoring: docs/BATCH_INFERENCE.md.
"""

from cifar.predict.job import DRIFT_PNG, PREDICTIONS_DIR, PREDICTIONS_FILE, SUMMARY_FILE, Job, output_key
from cifar.predict.model import DEFAULT_MODEL, ModelVersion, ScoringModel, parse_model_uri, resolve_model
from cifar.predict.result import PredictionResult, judge, judged_again
from cifar.predict.scoring import predict
from cifar.predict.sources import (
    CHUNK_IMAGES,
    KIND_NAMES,
    Chunk,
    ImageSource,
    check_shards,
    input_digest,
    npy_layout,
    open_source,
    read_ahead,
    read_chunks,
    read_usable,
)
from cifar.predict.tracking import EXPERIMENT

__all__ = [
    "CHUNK_IMAGES",
    "DEFAULT_MODEL",
    "DRIFT_PNG",
    "EXPERIMENT",
    "KIND_NAMES",
    "PREDICTIONS_DIR",
    "PREDICTIONS_FILE",
    "SUMMARY_FILE",
    "Chunk",
    "ImageSource",
    "Job",
    "ModelVersion",
    "PredictionResult",
    "ScoringModel",
    "check_shards",
    "input_digest",
    "judge",
    "judged_again",
    "npy_layout",
    "open_source",
    "output_key",
    "parse_model_uri",
    "predict",
    "read_ahead",
    "read_chunks",
    "read_usable",
    "resolve_model",
]
