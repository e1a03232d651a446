"""The registry's champion: which version serves, and what it was trained with.

Every registered version carries, as tags, what made it (`TrainedWith`): the data snapshot, the data
and training keys (cifar.reuse), the training fields that shape the model and the seed, and the
version of every module training runs. The data validation gate takes the champion's snapshot as the
reference new data is compared with; continuous training compares the champion's record with what a
retrain would use, to tell whether anything changed. Only MLflow is needed here, not TensorFlow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from cifar.config import PipelineConfig
from cifar.results import DataResult, TrainResult
from cifar.reuse import TRAIN_FIELDS_IGNORED, code_files

CHAMPION_ALIAS = "champion"
ACCURACY_TAG = "test_accuracy"
SNAPSHOT_TAG = "data_snapshot"
DATA_KEY_TAG = "data_key"
TRAINING_KEY_TAG = "training_key"
TRAIN_CONFIG_TAG = "train_config"  # JSON: the training fields that shape the model, and the seed.
CODE_TAG = "train_code"  # JSON: module path -> SHA-256 prefix, for every module training runs.


class TrainedWith(BaseModel):
    """What a model was trained with; None where a version registered before this was recorded."""

    model_config = ConfigDict(extra="forbid")

    snapshot: str | None = None
    data_key: str | None = None
    training_key: str | None = None
    train_config: dict[str, Any] | None = None
    code: dict[str, str] | None = None

    @classmethod
    def of(cls, config: PipelineConfig, dataset: DataResult, training: TrainResult) -> TrainedWith:
        return cls(
            snapshot=dataset.snapshot,
            data_key=dataset.key,
            training_key=training.key,
            train_config=training_config(config),
            code={path: digest[:12] for path, digest in code_files("train").items()},
        )

    def tags(self) -> dict[str, str]:
        values = {
            SNAPSHOT_TAG: self.snapshot,
            DATA_KEY_TAG: self.data_key,
            TRAINING_KEY_TAG: self.training_key,
            TRAIN_CONFIG_TAG: json.dumps(self.train_config, sort_keys=True) if self.train_config is not None else None,
            CODE_TAG: json.dumps(self.code, sort_keys=True) if self.code is not None else None,
        }
        return {key: value for key, value in values.items() if value is not None}

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> TrainedWith:
        def parsed(key: str):
            return json.loads(tags[key]) if key in tags else None

        return cls(
            snapshot=tags.get(SNAPSHOT_TAG),
            data_key=tags.get(DATA_KEY_TAG),
            training_key=tags.get(TRAINING_KEY_TAG),
            train_config=parsed(TRAIN_CONFIG_TAG),
            code=parsed(CODE_TAG),
        )


def training_config(config: PipelineConfig) -> dict[str, Any]:
    """The training fields that shape a model (those of the training key) and the seed."""
    return {"seed": config.seed, **config.train.model_dump(mode="json", exclude=TRAIN_FIELDS_IGNORED)}


class Champion(BaseModel):
    """The version holding the champion alias."""

    model_config = ConfigDict(extra="forbid")

    model_name: str
    version: int
    test_accuracy: float | None
    trained_with: TrainedWith
    run_id: str | None = None
    source: str | None = None  # The logged model's URI.

    @classmethod
    def of_version(cls, model_name: str, version) -> Champion:
        """The record of a registry version (MLflow's ModelVersion)."""
        accuracy = version.tags.get(ACCURACY_TAG)
        return cls(
            model_name=model_name,
            version=int(version.version),
            test_accuracy=float(accuracy) if accuracy is not None else None,
            trained_with=TrainedWith.from_tags(version.tags),
            run_id=version.run_id,
            source=version.source,
        )


def find_champion(tracking_uri: str, model_name: str) -> Champion | None:
    """The current champion of `model_name` in the registry at `tracking_uri`, or None when there is none."""
    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
        return None  # No store yet, so no registry: do not create one just to look.
    from mlflow.exceptions import MlflowException

    from cifar.tracking import mlflow_client

    try:
        version = mlflow_client(tracking_uri).get_model_version_by_alias(model_name, CHAMPION_ALIAS)
    except MlflowException:  # No such registered model, or no champion yet.
        return None
    return Champion.of_version(model_name, version)
