"""Registry stage: with a real SQLite MLflow store and real SavedModels, expect the champion alias to move only
as the gate's comparison on the same test images says, or by a person, with the record to show why."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import mlflow
import numpy as np
import pytest
import tensorflow as tf
from test_evaluate import prepare_fixture_data, write_checkpoints

from cifar.config import make_config
from cifar.evaluate import evaluate, load_split
from cifar.export import INPUT_NAME, SERVING_SIGNATURE, export_model, serving_outputs
from cifar.model_card import PERTURBATIONS, perturbed
from cifar.registry import (
    CHAMPION_ALIAS,
    COMPARISON_ARTIFACT,
    HISTORY_TAG,
    champion_history,
    promote_by_hand,
    register_and_promote,
)

SUPPRESSED_CLASS = 3  # The class the deliberately worse model never predicts.


@pytest.fixture(scope="module")
def exported(python_archive, tmp_path_factory) -> dict:
    """One verified export of a tiny model, a copy that never predicts one class, and the SQLite store."""
    workdir = tmp_path_factory.mktemp("registry")
    data_dir = prepare_fixture_data(python_archive, workdir)
    checkpoint_dir = workdir / "runs" / "tiny" / "checkpoints"
    write_checkpoints(data_dir, checkpoint_dir, epochs=2)
    config = make_config(
        "default",
        {
            "train": {"model": "tiny"},
            "evaluate": {"flip_tta": False, "robustness_images": 40},  # 40 x 75 corrupted images: a test's cost.
            "tracking": {"tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}"},
        },
    )
    evaluation = evaluate(config, data_dir, checkpoint_dir, workdir, mlflow_run_id=None, tracking_uri=None)
    result = export_model(config, data_dir, checkpoint_dir, workdir, evaluation, mlflow_run_id=None, tracking_uri=None)
    images, labels = load_split(data_dir, "test")
    worse_dir = workdir / "worse-saved-model"
    save_without_class(result.export_dir, worse_dir, SUPPRESSED_CLASS)
    return {
        "workdir": workdir,
        "data_dir": data_dir,
        "config": config,
        "export": result,
        "worse_export": result.model_copy(update={"export_dir": str(worse_dir), "key": "export-worse"}),
        "images": images,
        "labels": labels,
        "tracking_uri": config.tracking.tracking_uri,
        "evaluation": evaluation,
    }


def save_without_class(export_dir: str, target, class_id: int) -> None:
    """A SavedModel with `export_dir`'s serving signature whose answers never name `class_id`."""
    module = tf.Module()
    module.original = tf.saved_model.load(export_dir)  # Kept alive: its signature reads its variables.
    serve = module.original.signatures[SERVING_SIGNATURE]

    @tf.function(input_signature=[tf.TensorSpec([None, 32, 32, 3], tf.uint8, name=INPUT_NAME)])
    def without_class(images):
        outputs = serve(**{INPUT_NAME: images})
        probabilities = outputs["probabilities"] * (1.0 - tf.one_hot(class_id, 10))
        class_ids = tf.argmax(probabilities, axis=1, output_type=tf.int64)
        names = tf.constant(["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"])
        return {"class_ids": class_ids, "class_names": tf.gather(names, class_ids), "probabilities": probabilities}

    module.without_class = without_class
    tf.saved_model.save(module, str(target), signatures={SERVING_SIGNATURE: without_class})


def as_export(exported: dict, number: int, worse: bool = False):
    """The fixture's export under a key of its own: each registration below stands for another export."""
    export = exported["worse_export" if worse else "export"]
    return export.model_copy(update={"key": f"export-{number}"})


def new_run(tracking_uri: str, workdir) -> str:
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("cifar10")
    experiment_id = (
        experiment.experiment_id
        if experiment
        else client.create_experiment("cifar10", artifact_location=(workdir / "mlartifacts" / "cifar10").as_uri())
    )
    return client.create_run(experiment_id).info.run_id


def register(
    exported: dict, number: int, *, worse: bool = False, config=None, run_id: str | None = None, card: bool = False
):
    tracking_uri, workdir = exported["tracking_uri"], exported["workdir"]
    return register_and_promote(
        config or exported["config"],
        as_export(exported, number, worse),
        exported["data_dir"],
        mlflow_run_id=run_id or new_run(tracking_uri, workdir),
        tracking_uri=tracking_uri,
        input_example=exported["images"][:3],
        evaluation=exported["evaluation"] if card else None,
    )


def champion_version(client) -> int:
    return int(client.get_model_version_by_alias("cifar10", CHAMPION_ALIAS).version)


@pytest.mark.slow
def test_the_gate_judges_challenger_and_champion_on_the_same_images(exported, monkeypatch):
    tracking_uri = exported["tracking_uri"]
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    labels = exported["labels"]
    expected = serving_outputs(exported["export"].export_dir, exported["images"], batch_size=200)["class_ids"]
    accuracy = float(np.mean(expected == labels))

    with warnings.catch_warnings():  # Logging a model from code: no CloudPickle and no type-hint warning.
        warnings.simplefilter("error", UserWarning)
        first = register(exported, 1)
    assert first.registered_model_version == 1 and first.champion and first.rule == "passed"
    assert first.champion_accuracy_before is None and "first champion" in first.reason
    assert first.test_accuracy == pytest.approx(accuracy)  # Scored through the registry, as serving loads it.
    assert champion_version(client) == 1

    # The same model again: identical answers, a tie, promoted (a challenger need not beat the champion).
    same_run = new_run(tracking_uri, exported["workdir"])
    same = register(exported, 2, run_id=same_run, card=True)
    comparison = same.comparison
    assert same.champion and same.rule == "passed" and champion_version(client) == 2
    assert comparison["examples"] == len(labels) == 200
    assert comparison["champion"]["version"] == 1 and comparison["challenger"]["version"] == 2
    assert comparison["champion"]["accuracy"] == comparison["challenger"]["accuracy"] == pytest.approx(accuracy)
    assert (comparison["challenger_only"], comparison["champion_only"], comparison["p_value"]) == (0, 0, 1.0)
    artifact = client.download_artifacts(same_run, COMPARISON_ARTIFACT, str(exported["workdir"] / "downloaded"))
    assert json.loads(open(artifact).read()) == comparison
    # Calibration and robustness weighed too: the champion scored the challenger's 40 x 75 corrupted images.
    assert comparison["corruption_examples"] == 40 and abs(comparison["corruption_difference"]) <= 0.01
    assert (
        comparison["champion"]["ece"] == pytest.approx(comparison["challenger"]["ece"])
        and comparison["ece_increase"] == 0
    )
    assert comparison["criteria"]["corruption_drop"].startswith("passed: mean accuracy under corruptions")
    assert comparison["criteria"]["calibration"].startswith("passed: ECE")
    tags = client.get_model_version("cifar10", "2").tags
    assert tags["gate.corruption_drop"] == comparison["criteria"]["corruption_drop"]
    assert tags["gate.calibration"] == comparison["criteria"]["calibration"]

    # A model that never names one class: worse on that class beyond the limit, refused for that reason.
    worse = register(exported, 3, worse=True)
    drop = worse.comparison["largest_class_drop"]
    cats = labels == SUPPRESSED_CLASS
    assert drop == pytest.approx(np.mean(expected[cats] == SUPPRESSED_CLASS)) and drop > 0.05
    assert not worse.champion and worse.rule == "class_drop" and champion_version(client) == 2
    assert worse.reason.startswith(f"class cat drops {100 * drop:.2f} points, more than export.max_class_drop 5.00")
    version = client.get_model_version("cifar10", "3")
    assert json.loads(version.tags["promotion"])["rule"] == "class_drop"
    assert version.description.startswith("Test accuracy") and "not promoted (class_drop)" in version.description
    assert worse.comparison["champion_only"] > 0  # The cats it no longer names (others it now gets right).

    strict = exported["config"].model_copy(
        update={"export": exported["config"].export.model_copy(update={"min_accuracy": 0.999})}
    )
    below_minimum = register(exported, 4, config=strict)
    assert not below_minimum.champion and below_minimum.rule == "min_accuracy"
    unregistered = exported["config"].model_copy(
        update={"export": exported["config"].export.model_copy(update={"register_model": False})}
    )
    skipped = register(exported, 5, config=unregistered)
    assert skipped.registered_model_version is None and not skipped.champion and skipped.model_uri
    assert champion_version(client) == 2
    assert [move["version"] for move in champion_history(client, "cifar10")] == [1, 2]

    # The registered champion, loaded the way a server loads it, answers like the SavedModel, and its
    # model is code (cifar/serving_model.py, copied beside it), not a pickled object.
    # Through the environment, so it is undone after the test; the tracking URI too: MLflow's `models:` resolution
    # opens a tracking client, whose default store (./mlflow.db) two test processes would create at once.
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracking_uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    loaded = mlflow.pyfunc.load_model("models:/cifar10@champion")
    predictions = loaded.predict(exported["images"][:16])
    reference = serving_outputs(exported["export"].export_dir, exported["images"][:16], batch_size=16)
    np.testing.assert_array_equal(predictions["class_ids"], reference["class_ids"])
    np.testing.assert_allclose(predictions["probabilities"], reference["probabilities"], atol=1e-6)
    flavor = loaded.metadata.flavors["python_function"]
    assert flavor["loader_module"] == "mlflow.pyfunc.loaders.code_model" and "python_model" not in flavor


def test_registering_an_export_again_returns_its_version_and_decision(exported):
    client = mlflow.MlflowClient(tracking_uri=exported["tracking_uri"])
    first = register(exported, 10)
    count = len(client.search_model_versions("name = 'cifar10'"))
    again = register(exported, 10)
    assert again.reused and again.model_dump(exclude={"reused"}) == first.model_dump(exclude={"reused"})
    assert len(client.search_model_versions("name = 'cifar10'")) == count

    # An attempt that registered the version and died before the gate decided: the decision is taken now.
    version = str(first.registered_model_version)
    client.delete_model_version_tag("cifar10", version, "promotion")
    decided = register(exported, 10)
    assert not decided.reused and decided.registered_model_version == first.registered_model_version
    assert json.loads(client.get_model_version("cifar10", version).tags["promotion"])["champion"] == decided.champion
    assert len(client.search_model_versions("name = 'cifar10'")) == count


@pytest.mark.slow
def test_a_person_promotes_a_refused_version_and_rolls_back_with_the_record(exported):
    tracking_uri = exported["tracking_uri"]
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    champion = register(exported, 20)  # Promoted (a tie with the champion).
    refused = register(exported, 21, worse=True)
    assert champion.champion and not refused.champion
    before = champion_version(client)

    record = promote_by_hand(
        tracking_uri, "cifar10", refused.registered_model_version, "customers need it today", by="alice"
    )
    assert champion_version(client) == refused.registered_model_version
    tag = json.loads(client.get_model_version("cifar10", str(refused.registered_model_version)).tags["override"])
    assert tag == record and (tag["how"], tag["by"], tag["reason"]) == ("override", "alice", "customers need it today")
    assert tag["previous_champion"] == before and tag["at"].endswith("Z")

    rolled = promote_by_hand(tracking_uri, "cifar10", None, "class cat broke in production", rollback=True, by="bob")
    assert champion_version(client) == before and rolled["previous_champion"] == refused.registered_model_version
    history = json.loads(client.get_registered_model("cifar10").tags[HISTORY_TAG])
    assert [(move["version"], move["how"], move["by"]) for move in history[-2:]] == [
        (refused.registered_model_version, "override", "alice"),
        (before, "rollback", "bob"),
    ]
    with pytest.raises(ValueError, match="a reason is required"):
        promote_by_hand(tracking_uri, "cifar10", before, "  ")
    assert champion_version(client) == before


def test_every_version_gets_a_model_card_with_every_section(exported):
    client = mlflow.MlflowClient(tracking_uri=exported["tracking_uri"])
    run_id = new_run(exported["tracking_uri"], exported["workdir"])
    config = exported["config"].model_copy(deep=True)
    config.export.card_robustness_examples = 150  # Of the 200 test images: the table says which.
    result = register(exported, 30, run_id=run_id, card=True, config=config)

    card = Path(result.model_card).read_text()
    assert "(TensorFlow image ops), on the first 150 of the 200 test images:" in card
    for heading in ("## Intended use", "**Input contract.**", "## Data", "**Known caveats.**", "## Training",
                    "## Evaluation", "## Robustness", "## Against the champion of the day"):  # fmt: skip
        assert heading in card, heading
    assert f"Model card: cifar10 v{result.registered_model_version}" in card and "uint8 images" in card
    assert "test images have a near-duplicate in the training batches" in card
    assert "| cat |" in card and "Confusion matrix" in card and "Weakest class: " in card
    for perturbation in PERTURBATIONS.values():
        assert f"| {perturbation} |" in card
    assert result.comparison["reason"] in card and "McNemar's exact test: p =" in card
    # Calibration and the CIFAR-10-C table with its heat map, from the evaluation (40 images in this fixture).
    assert "## Calibration" in card and "| ECE (15 bins) |" in card and "fitted on the 100 validation images" in card
    assert "## Common corruptions (CIFAR-10-C)" in card and "Accuracy on a fixed 40 test images" in card
    rows = [line for line in card.splitlines() if line.startswith("| ") and line.count("|") == 8]
    assert [row.split(" | ")[0][2:] for row in rows[1:16]][:3] == ["gaussian noise", "shot noise", "impulse noise"]
    assert "](data:image/png;base64," in card
    html = Path(result.model_card).with_suffix(".html").read_text()
    assert html.startswith("<!doctype html>") and "<table>" in html and "Robustness</h2>" in html
    version = client.get_model_version("cifar10", str(result.registered_model_version))
    assert version.description.endswith(f"Model card: runs:/{run_id}/model_card/model_card.html")
    assert {item.path for item in client.list_artifacts(run_id, "model_card")} == {
        "model_card/model_card.html",
        "model_card/model_card.md",
    }


def test_perturbations_change_the_images_as_described():
    images = np.full((2, 32, 32, 3), 100, np.uint8)
    images[:, 10:20, 10:20] = 200
    assert (perturbed(images, "brightness") > images).all()  # +0.25 on the 0..1 scale: +64 levels.
    contrast = perturbed(images, "contrast").astype(int)
    assert np.ptp(contrast) < np.ptp(images.astype(int)) and contrast.mean() == pytest.approx(images.mean(), abs=2)
    blurred = perturbed(images, "blur").astype(int)
    assert 100 < blurred[0, 10, 15, 0] < 200 and blurred[0, 0, 0, 0] == 100  # Edges soften, flat areas stay.
    noisy = perturbed(images, "gaussian_noise").astype(int)
    assert 10 < np.std(noisy[:, :8, :8] - 100) < 30  # Standard deviation 0.08 x 255 = 20 levels.
    assert np.abs(perturbed(images, "jpeg_50").astype(int) - images).max() > 0
