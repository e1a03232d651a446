"""The model a prediction job scores with: a registry version named by URI, loaded as serving loads it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

DEFAULT_MODEL = "models:/cifar10@champion"
MODEL_URI = re.compile(r"models:/(?P<name>[A-Za-z0-9._-]+)(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>[0-9]+))")


def parse_model_uri(model: str) -> tuple[str, str | None, int | None]:
    """(name, alias, version) of `models:/<name>@<alias>` or `models:/<name>/<version>`; ValueError otherwise."""
    match = MODEL_URI.fullmatch(model.strip())
    if match is None:
        raise ValueError(f"model must be models:/<name>@<alias> or models:/<name>/<version>, got {model!r}")
    version = match.group("version")
    return match.group("name"), match.group("alias"), int(version) if version is not None else None


class ModelVersion(BaseModel):
    """A registered model version, as a prediction job names it."""

    model_config = ConfigDict(extra="forbid")

    name: str
    version: int
    requested: str  # What was asked for: models:/cifar10@champion or models:/cifar10/3.
    model_id: str | None = None  # MLflow 3's logged model behind the version.
    run_id: str | None = None  # The run that logged it.

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def resolve_model(model: str, tracking_uri: str) -> ModelVersion:
    """The version `model` names now (an alias resolved); ValueError when the registry has no such version."""
    from mlflow.exceptions import MlflowException

    from cifar.tracking import mlflow_client

    name, alias, number = parse_model_uri(model)
    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
        raise ValueError(f"no MLflow store at {tracking_uri.removeprefix('sqlite:///')}: nothing is registered there")
    client = mlflow_client(tracking_uri)
    try:
        found = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, str(number))
    except MlflowException as error:
        raise ValueError(f"{model}: no such model version in {tracking_uri} ({error.message})") from None
    return ModelVersion(
        name=name,
        version=int(found.version),
        requested=model.strip(),
        model_id=getattr(found, "model_id", None),
        run_id=found.run_id,
    )


class ScoringModel:
    """A version's pyfunc (cifar/serving_model.py), loaded once: predict(uint8 images) -> ids, names, probabilities."""

    def __init__(self, version: ModelVersion, tracking_uri: str) -> None:
        import mlflow

        from cifar.compat import mlflow_tracking_uri
        from cifar.quiet import import_tensorflow

        import_tensorflow()  # The pyfunc loads TensorFlow: without its start-up lines.
        self.version = version
        with mlflow_tracking_uri(tracking_uri):  # models:/ URIs resolve against this registry.
            self.pyfunc = mlflow.pyfunc.load_model(version.uri)

    def predict(self, images: np.ndarray) -> dict[str, np.ndarray]:
        return self.pyfunc.predict(images)
