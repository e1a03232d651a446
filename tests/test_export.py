"""Export stage: given evaluated checkpoints, expect a verified TF-Serving SavedModel version, never a half one."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image
from test_evaluate import prepare_fixture_data, write_checkpoints

import cifar.export as export_module
from cifar import calibration, compat
from cifar.checkpoints import load_eval_model, load_index
from cifar.config import make_config
from cifar.data.synthetic import CLASS_NAMES
from cifar.evaluate import evaluate, load_split, predict_logits
from cifar.export import ExportVerificationError, export_model, serving_outputs


def exported_versions(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir())


@pytest.fixture(scope="module")
def setup(python_archive, tmp_path_factory) -> dict:
    """Prepared data, checkpoints of a tiny and a tutorial model, and their test accuracies."""
    workdir = tmp_path_factory.mktemp("export")
    data_dir = prepare_fixture_data(python_archive, workdir)
    found = {"workdir": workdir, "data_dir": data_dir}
    for model_name in ("tiny", "tutorial"):
        checkpoint_dir = workdir / "runs" / model_name / "checkpoints"
        write_checkpoints(data_dir, checkpoint_dir, model_name=model_name, epochs=1)
        settings = {"flip_tta": False, "robustness_images": 0}  # Calibrated (a temperature), robustness not needed.
        config = make_config("default", {"train": {"model": model_name}, "evaluate": settings})
        result = evaluate(config, data_dir, checkpoint_dir, workdir, mlflow_run_id=None, tracking_uri=None)
        found[model_name] = {"config": config, "checkpoint_dir": checkpoint_dir, "evaluation": result}
    return found


def export(setup, model_name: str, *, refresh: bool = True, **evaluation_fields):
    """Exports a model's evaluated checkpoint; `evaluation_fields` alter what the evaluation claims."""
    entry = setup[model_name]
    evaluation = entry["evaluation"].model_copy(update=evaluation_fields)
    return export_model(
        entry["config"],
        setup["data_dir"],
        entry["checkpoint_dir"],
        setup["workdir"],
        evaluation,
        refresh=refresh,
        mlflow_run_id=None,
        tracking_uri=None,
    )


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["tiny", "tutorial"])
def test_saved_model_reproduces_the_in_memory_model(setup, model_name):
    result = export(setup, model_name)
    assert Path(result.export_dir).parent == setup["workdir"] / "export" / "cifar10"
    assert Path(result.export_dir).name == str(result.version)
    assert result.verified_accuracy == setup[model_name]["evaluation"].test_accuracy
    assert result.signatures == ["serving_bytes", "serving_default"]

    images, labels = load_split(setup["data_dir"], "test")
    checkpoint_dir = setup[model_name]["checkpoint_dir"]
    model = load_eval_model(checkpoint_dir, load_index(checkpoint_dir).entries[0])
    size = model.input_shape[1]
    offset = (32 - size) // 2
    logits = predict_logits(model, images[:, offset : offset + size, offset : offset + size], 500)
    # The served probabilities are calibrated: softmax(logits / T), T fitted on the validation split; the
    # raw logits are served beside them.
    temperature = setup[model_name]["evaluation"].temperature
    assert temperature is not None and temperature != 1.0 and result.temperature == temperature
    expected = calibration.softmax(logits, temperature)

    outputs = serving_outputs(result.export_dir, images, batch_size=64)
    assert outputs["probabilities"].dtype == np.float32 and outputs["probabilities"].shape == (len(labels), 10)
    assert outputs["class_ids"].dtype == np.int64
    np.testing.assert_array_equal(outputs["class_ids"], expected.argmax(axis=1))
    np.testing.assert_allclose(outputs["probabilities"], expected, atol=1e-5)
    np.testing.assert_allclose(outputs["logits"], logits, atol=1e-4)
    names = [name.decode() for name in outputs["class_names"]]
    assert names == [CLASS_NAMES[index] for index in outputs["class_ids"]]

    # The bytes signature decodes PNGs to the same pixels and answers the same.
    encoded = []
    for image in images[:8]:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    serve_bytes = tf.saved_model.load(result.export_dir).signatures["serving_bytes"]
    from_bytes = serve_bytes(image_bytes=tf.constant(encoded))
    np.testing.assert_array_equal(from_bytes["class_ids"].numpy(), outputs["class_ids"][:8])


def saved_model_cli_show(export_dir: str) -> str:
    """The output of the real `saved_model_cli show --dir DIR --all` (the CLI of this environment)."""
    executable = Path(sys.executable).parent / "saved_model_cli"
    command = (
        [str(executable)] if executable.exists() else [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
    )
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([*command, "show", "--dir", export_dir, "--all"], capture_output=True, text=True,
                            timeout=600, env=environment)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.slow
def test_saved_model_cli_describes_the_serving_signature(setup):
    result = export(setup, "tiny")
    description = saved_model_cli_show(result.export_dir)

    # The export verifies itself with the same text, computed in-process (cifar.compat); the CLI prints
    # the graph's operations as a Python set, whose order differs from process to process.
    def lines(text: str) -> list[str]:
        return [
            line.split("{")[0] + str(sorted(re.findall(r"'([^']+)'", line))) if "ops: {" in line else line
            for line in text.strip().splitlines()
        ]

    assert lines(compat.saved_model_description(result.export_dir)) == lines(description)
    assert "signature_def['serving_default']" in description
    assert "inputs['images']" in description and "DT_UINT8" in description
    assert "outputs['class_names']" in description and "outputs['probabilities']" in description


@pytest.mark.slow
def test_interrupted_export_leaves_no_half_version_and_numbering_continues(setup, monkeypatch):
    root = setup["workdir"] / "export" / "cifar10"
    before = export(setup, "tiny")
    listing = exported_versions(root)
    real_save = tf.saved_model.save

    def save_then_crash(module, path, signatures=None):
        real_save(module, path, signatures=signatures)
        raise KeyboardInterrupt("simulated interruption after the files were written")

    monkeypatch.setattr(export_module.tf.saved_model, "save", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        export(setup, "tiny")
    monkeypatch.undo()
    assert exported_versions(root) == listing  # Neither a new version nor a leftover temp dir.

    # A temp dir a killed process left behind long ago is neither a version nor kept.
    stale = root / ".export-killed.partial"
    (stale / "variables").mkdir(parents=True)
    old = 1_000_000_000
    os.utime(stale, (old, old))
    after = export(setup, "tiny")
    assert after.version == before.version + 1
    assert not stale.exists()


def test_a_published_version_is_world_readable(setup):
    # TF Serving often runs as another user: directories 0755, files 0644 (temp directories start 0700).
    export_dir = Path(export(setup, "tiny").export_dir)
    paths = [export_dir, *export_dir.rglob("*")]
    assert {oct(path.stat().st_mode & 0o777) for path in paths if path.is_dir()} == {"0o755"}
    assert {oct(path.stat().st_mode & 0o777) for path in paths if path.is_file()} == {"0o644"}


@pytest.mark.slow
def test_an_export_of_the_same_key_is_found_not_made_again(setup):
    root = setup["workdir"] / "export" / "cifar10"
    first = export(setup, "tutorial")
    listing = exported_versions(root)
    again = export(setup, "tutorial", refresh=False)
    assert again.reused and again.version == first.version and again.export_dir == first.export_dir
    assert again.model_dump(exclude={"reused"}) == first.model_dump(exclude={"reused"})
    assert exported_versions(root) == listing
    # Another evaluation (another key) is another version.
    other = export(setup, "tutorial", refresh=False, key="another-evaluation")
    assert not other.reused and other.version == max(int(name) for name in listing) + 1


def test_export_that_does_not_reproduce_the_accuracy_is_rejected(setup):
    root = setup["workdir"] / "export" / "cifar10"
    listing = exported_versions(root)
    evaluation = setup["tiny"]["evaluation"]
    wrong = (
        (evaluation.correct + 1) / evaluation.num_examples
        if evaluation.correct < evaluation.num_examples
        else (evaluation.correct - 1) / evaluation.num_examples
    )
    with pytest.raises(ExportVerificationError):
        export(setup, "tiny", test_accuracy=wrong)
    assert exported_versions(root) == listing
    with pytest.raises(ValueError):
        export(setup, "tiny", test_accuracy=0.123456789)
    with pytest.raises(ValueError):
        export(setup, "tiny", epoch=99)
