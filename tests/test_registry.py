"""Registry stage: with a real SQLite MLflow store, expect the champion alias to move only through the gate."""

from __future__ import annotations

import json

import mlflow
import numpy as np
import pytest
from test_evaluate import prepare_fixture_data, write_checkpoints

from cifar.config import make_config
from cifar.evaluate import evaluate, load_split
from cifar.export import export_model, serving_outputs
from cifar.registry import CHAMPION_ALIAS, promotion_decision, register_and_promote


@pytest.fixture(scope="module")
def exported(python_archive, tmp_path_factory) -> dict:
    """One verified export of a tiny model and the SQLite store beside it."""
    workdir = tmp_path_factory.mktemp("registry")
    data_dir = prepare_fixture_data(python_archive, workdir)
    checkpoint_dir = workdir / "runs" / "tiny" / "checkpoints"
    write_checkpoints(data_dir, checkpoint_dir, epochs=1)
    config = make_config(
        "default",
        {
            "train": {"model": "tiny"},
            "evaluate": {"flip_tta": False},
            "tracking": {"tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}"},
        },
    )
    evaluation = evaluate(config, data_dir, checkpoint_dir, workdir, mlflow_run_id=None, tracking_uri=None)
    result = export_model(config, data_dir, checkpoint_dir, workdir, evaluation, mlflow_run_id=None, tracking_uri=None)
    images, _ = load_split(data_dir, "test")
    return {
        "workdir": workdir,
        "config": config,
        "export": result,
        "images": images,
        "tracking_uri": config.tracking.tracking_uri,
    }


def as_export(exported: dict, number: int):
    """The fixture's export under a key of its own: each registration below stands for another export."""
    return exported["export"].model_copy(update={"key": f"export-{number}"})


def new_run(tracking_uri: str, workdir) -> str:
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("cifar10")
    experiment_id = (
        experiment.experiment_id
        if experiment
        else client.create_experiment("cifar10", artifact_location=(workdir / "mlartifacts" / "cifar10").as_uri())
    )
    return client.create_run(experiment_id).info.run_id


def test_gate_promotes_first_and_better_models_and_keeps_the_champion_against_worse(exported, monkeypatch):
    tracking_uri, workdir, config = exported["tracking_uri"], exported["workdir"], exported["config"]
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    images = exported["images"][:3]

    first_run = new_run(tracking_uri, workdir)
    first = register_and_promote(
        config, as_export(exported, 1), 0.50, mlflow_run_id=first_run, tracking_uri=tracking_uri, input_example=images
    )
    assert first.registered_model_version == 1 and first.champion and first.champion_accuracy_before is None
    assert int(client.get_model_version_by_alias("cifar10", CHAMPION_ALIAS).version) == 1
    assert client.get_model_version("cifar10", "1").tags["test_accuracy"] == "0.5"
    run = client.get_run(first_run)
    assert run.data.tags["promotion.champion"] == "true" and run.data.metrics["promotion_test_accuracy"] == 0.5

    worse = register_and_promote(
        config,
        as_export(exported, 2),
        0.40,
        mlflow_run_id=new_run(tracking_uri, workdir),
        tracking_uri=tracking_uri,
        input_example=images,
    )
    assert worse.registered_model_version == 2 and not worse.champion
    assert worse.champion_accuracy_before == 0.5 and "keeping the champion v1" in worse.reason
    assert int(client.get_model_version_by_alias("cifar10", CHAMPION_ALIAS).version) == 1

    better_run = new_run(tracking_uri, workdir)
    better = register_and_promote(
        config, as_export(exported, 3), 0.60, mlflow_run_id=better_run, tracking_uri=tracking_uri, input_example=images
    )
    assert better.registered_model_version == 3 and better.champion and better.champion_accuracy_before == 0.5
    assert int(client.get_model_version_by_alias("cifar10", CHAMPION_ALIAS).version) == 3
    run = client.get_run(better_run)
    assert run.data.metrics["promotion_champion_accuracy_before"] == 0.5
    assert run.data.tags["registry.model_version"] == "3"

    strict = config.model_copy(update={"export": config.export.model_copy(update={"min_accuracy": 0.99})})
    below_minimum = register_and_promote(
        strict,
        as_export(exported, 4),
        0.70,
        mlflow_run_id=new_run(tracking_uri, workdir),
        tracking_uri=tracking_uri,
        input_example=images,
    )
    assert not below_minimum.champion and "min_accuracy" in below_minimum.reason
    unregistered = config.model_copy(update={"export": config.export.model_copy(update={"register_model": False})})
    skipped = register_and_promote(
        unregistered,
        as_export(exported, 5),
        0.90,
        mlflow_run_id=new_run(tracking_uri, workdir),
        tracking_uri=tracking_uri,
        input_example=images,
    )
    assert skipped.registered_model_version is None and not skipped.champion and skipped.model_uri
    assert int(client.get_model_version_by_alias("cifar10", CHAMPION_ALIAS).version) == 3

    # The registered champion, loaded the way a server loads it, answers like the SavedModel.
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracking_uri)  # Through the environment, so it is undone after the test.
    loaded = mlflow.pyfunc.load_model("models:/cifar10@champion")
    predictions = loaded.predict(exported["images"][:16])
    expected = serving_outputs(exported["export"].export_dir, exported["images"][:16], batch_size=16)
    np.testing.assert_array_equal(predictions["class_ids"], expected["class_ids"])
    np.testing.assert_allclose(predictions["probabilities"], expected["probabilities"], atol=1e-6)
    assert loaded.metadata.get_input_schema() is not None and loaded.metadata.get_output_schema() is not None


def test_registering_an_export_again_returns_its_version_and_decision(exported):
    tracking_uri, workdir, config = exported["tracking_uri"], exported["workdir"], exported["config"]
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    export = exported["export"].model_copy(update={"key": "export-registered-twice"})
    first = register_and_promote(
        config, export, 0.55, mlflow_run_id=new_run(tracking_uri, workdir), tracking_uri=tracking_uri
    )
    count = len(client.search_model_versions("name = 'cifar10'"))
    again = register_and_promote(
        config, export, 0.55, mlflow_run_id=new_run(tracking_uri, workdir), tracking_uri=tracking_uri
    )
    assert again.reused and again.model_dump(exclude={"reused"}) == first.model_dump(exclude={"reused"})
    assert len(client.search_model_versions("name = 'cifar10'")) == count

    # An attempt that registered the version and died before the gate decided: the decision is taken now.
    version = str(first.registered_model_version)
    client.delete_model_version_tag("cifar10", version, "promotion")
    decided = register_and_promote(
        config, export, 0.55, mlflow_run_id=new_run(tracking_uri, workdir), tracking_uri=tracking_uri
    )
    assert not decided.reused and decided.registered_model_version == first.registered_model_version
    assert json.loads(client.get_model_version("cifar10", version).tags["promotion"])["champion"] == decided.champion
    assert len(client.search_model_versions("name = 'cifar10'")) == count


def test_promotion_decision_rules():
    assert promotion_decision(0.3, None, min_accuracy=0.5, tolerance=0.0)[0] is False
    assert promotion_decision(0.6, None, min_accuracy=0.5, tolerance=0.0)[0] is True
    assert promotion_decision(0.69, 0.70, min_accuracy=0.0, tolerance=0.02, champion_version=1)[0] is True
    assert promotion_decision(0.67, 0.70, min_accuracy=0.0, tolerance=0.02, champion_version=1)[0] is False
    promote, reason = promotion_decision(0.9, None, min_accuracy=0.0, tolerance=0.0, champion_version=4)
    assert not promote and "v4" in reason
