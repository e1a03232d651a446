"""The registered pyfunc, as MLflow's scoring server (`mlflow models serve`) handles requests, answers like the
SavedModel and refuses input outside its contract (uint8 images [batch, 32, 32, 3]) with a 400 that states the
contract. The project's endpoint: tests/test_endpoint.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from mlflow.exceptions import MlflowException
from mlflow.pyfunc import PythonModel
from test_evaluate import prepare_fixture_data, write_checkpoints

from cifar import serving_contract
from cifar.compat import raw_input_signature
from cifar.config import make_config
from cifar.data.synthetic import CLASS_NAMES
from cifar.evaluate import evaluate, load_split
from cifar.export import INPUT_NAME, export_model, serving_outputs
from cifar.registry import register_and_promote
from cifar.serving_contract import CONTRACT, InputContractError, validate_images


def with_value(images: np.ndarray, value) -> list:
    """`images` as JSON lists with one pixel channel set to `value` (a value uint8 cannot hold)."""
    changed = images.astype(object)
    changed[-1, 2, 3, 1] = value
    return changed.tolist()


def contract_violations(images: np.ndarray) -> dict[str, object]:
    """Requests' "inputs" that break the contract, each a mistake a client makes."""
    return {
        "float images in 0..1": (images / 255.0).tolist(),
        "integer-valued floats": images.astype(np.float64).tolist(),
        "grayscale [N, 32, 32]": images[..., 0].tolist(),
        "28x28 images [N, 28, 28, 3]": images[:, :28, :28].tolist(),
        "one image without the batch axis": images[0].tolist(),
        "pixel value 256": with_value(images, 256),
        "pixel value -1": with_value(images, -1),
    }


@pytest.mark.slow
def test_the_registered_pyfunc_answers_like_the_saved_model_through_mlflow(python_archive, tmp_path, monkeypatch):
    """The registered version as MLflow loads it (`mlflow.pyfunc.load_model`, models from code) and as its scoring
    server (what `mlflow models serve` runs) handles requests, in process. The project serves with its own
    endpoint (tests/test_endpoint.py); this keeps the pyfunc's contract for those who load the version with MLflow."""
    import mlflow
    from mlflow.pyfunc import scoring_server

    workdir = tmp_path / "workdir"
    data_dir = prepare_fixture_data(python_archive, workdir)
    checkpoint_dir = workdir / "runs" / "tiny" / "checkpoints"
    write_checkpoints(data_dir, checkpoint_dir, epochs=1)
    tracking_uri = f"sqlite:///{workdir / 'mlflow.db'}"
    config = make_config(
        "default",
        {"train": {"model": "tiny"}, "evaluate": {"flip_tta": False}, "tracking": {"tracking_uri": tracking_uri}},
    )
    evaluation = evaluate(config, data_dir, checkpoint_dir, workdir, mlflow_run_id=None, tracking_uri=None)
    exported = export_model(
        config, data_dir, checkpoint_dir, workdir, evaluation, mlflow_run_id=None, tracking_uri=None
    )
    images, _ = load_split(data_dir, "test")
    promotion = register_and_promote(
        config, exported, data_dir, mlflow_run_id=None, tracking_uri=None, input_example=images[:2]
    )
    assert promotion.champion and promotion.registered_model_version == 1

    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracking_uri)  # Both: see test_registry.py.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    local = mlflow.artifacts.download_artifacts("models:/cifar10@champion", dst_path=str(tmp_path / "model"))
    model = scoring_server.load_model_with_mlflow_config(local)
    schema = model.metadata.get_input_schema()

    def post_json(_url: str, payload) -> tuple[int, dict]:
        try:
            reply = scoring_server.invocations(json.dumps(payload), "application/json", model, schema)
        except MlflowException as error:
            return error.get_http_status_code(), json.loads(error.serialize_as_json())
        return reply.status, json.loads(reply.response)

    url = "/invocations"
    batch = images[:20]
    status, answer = post_json(url, {"inputs": batch.tolist()})
    refusals = {name: post_json(url, {"inputs": bad}) for name, bad in contract_violations(images[:2]).items()}
    status_named, answer_named = post_json(url, {"inputs": {"images": images[:2].tolist()}})
    status_instances, reply_instances = post_json(url, {"instances": images[:2].tolist()})

    assert status == 200, answer
    predictions = answer["predictions"]
    expected = serving_outputs(exported.export_dir, batch, batch_size=len(batch))
    assert predictions["class_ids"] == expected["class_ids"].tolist()
    assert predictions["class_names"] == [CLASS_NAMES[index] for index in expected["class_ids"]]
    np.testing.assert_allclose(np.array(predictions["probabilities"]), expected["probabilities"], atol=1e-6)
    assert status_named == 200 and answer_named["predictions"]["class_ids"] == expected["class_ids"][:2].tolist()

    for name, (code, reply) in refusals.items():
        print(f"{name}: HTTP {code} {json.dumps(reply)}")  # The record of what clients see (pytest -rP).
        assert code == 400, (name, reply)
        assert reply["error_code"] == "INVALID_PARAMETER_VALUE", (name, reply)
        assert reply["message"].startswith("Invalid input: ") and reply["message"].endswith(CONTRACT), (name, reply)
        assert len(reply["message"]) < 1000, (name, "the reply echoes the request")
    assert "got floating-point values" in refusals["float images in 0..1"][1]["message"]
    assert "got pixel value 256 at [1, 2, 3, 1]" in refusals["pixel value 256"][1]["message"]
    assert "got shape [2, 32, 32]" in refusals["grayscale [N, 32, 32]"][1]["message"]
    # Only {"inputs": ...} reaches the model: MLflow itself refuses the other request formats.
    print(f"instances: HTTP {status_instances} {json.dumps(reply_instances)}")
    assert status_instances == 400 and "'inputs'" in reply_instances["message"], reply_instances


def test_validate_images_passes_uint8_images_and_integers_0_to_255():
    images = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    assert validate_images(images) is images  # No copy for what Python callers pass.
    np.testing.assert_array_equal(validate_images({"images": images}), images)
    for given in (images.tolist(), images.astype(np.int64), images.astype(np.uint16), {"images": images.tolist()}):
        checked = validate_images(given)  # JSON integers arrive as Python ints: int64 once in numpy.
        assert checked.dtype == np.uint8
        np.testing.assert_array_equal(checked, images)
    assert serving_contract.INPUT_NAME == INPUT_NAME
    edges = np.zeros((1, 32, 32, 3), dtype=np.int64)
    edges[0, 0, 0] = [0, 128, 255]
    np.testing.assert_array_equal(validate_images(edges.tolist()), edges)


def refused(model_input) -> str:
    with pytest.raises(InputContractError) as caught:
        validate_images(model_input)
    error = caught.value
    assert error.error_code == "INVALID_PARAMETER_VALUE" and error.get_http_status_code() == 400
    assert error.message.startswith("Invalid input: ") and error.message.endswith(CONTRACT)
    return error.message


def test_validate_images_refuses_anything_else_with_the_contract():
    images = np.random.default_rng(1).integers(1, 256, (2, 32, 32, 3), dtype=np.uint8)
    for bad in contract_violations(images).values():
        refused(bad)
        refused(np.asarray(bad))
    assert "got floating-point values (float64, e.g. 0.5 at [0, 0, 0, 0])" in refused([[[[0.5, 0, 0]] * 32] * 32])
    assert "e.g. 3.0 at [0, 0, 0, 0]" in refused(np.full((1, 32, 32, 3), 3.0))
    assert "got pixel value 256 at [1, 2, 3, 1]" in refused(with_value(images, 256))
    assert "got pixel value -1 at [1, 2, 3, 1]" in refused(with_value(images, -1))
    assert "got shape [2, 28, 28, 3]" in refused(images[:, :28, :28])
    assert "got shape [0]" in refused([])
    assert "do not form one" in refused([images[0].tolist(), images[1, :5].tolist()])  # Ragged lists.
    assert "got strings" in refused(images.astype(str).tolist())
    assert "got booleans" in refused(images.astype(bool))
    # Found by the fuzz suite (tests/test_fuzz_serving.py): one JSON false among integers was read as 0 and answered.
    assert "got booleans among the pixel values" in refused(with_value(images, False))
    assert "non-integer values" in refused(with_value(images, 2**70))  # Beyond int64: an object array.
    assert "non-integer values" in refused(with_value(images, None))
    assert "(float32, e.g. " in refused(images.astype(np.float32))
    assert "the only input is 'images'" in refused({"pixels": images})
    assert "got str" in refused("images")


def test_contract_error_keeps_its_message_when_the_server_prefixes_the_request():
    error = InputContractError("got shape [2, 32, 32]")
    error.message = f"Failed to predict data '{list(range(10_000))}'. \nError: {error.message}"  # What the server does.
    assert error.message == f"Invalid input: got shape [2, 32, 32]. {CONTRACT}"
    assert json.loads(error.serialize_as_json())["message"] == error.message


class CheckedSum(PythonModel):
    """A stand-in for SavedModelClassifier without TensorFlow: checks its input, answers the pixel sum."""

    def predict(self, context, model_input: np.ndarray, params: dict | None = None) -> dict[str, list]:
        images = validate_images(model_input)
        return {"dtype": [str(images.dtype)], "sum": [int(images.sum(dtype=np.int64))]}


def test_the_scoring_server_hands_the_json_input_uncast_to_the_model(tmp_path):
    """MLflow's own request handling (what `mlflow models serve` runs), in process: no cast before the check."""
    import mlflow
    from mlflow.models import infer_signature
    from mlflow.pyfunc import scoring_server

    images = np.random.default_rng(2).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    signature = raw_input_signature(infer_signature(images, {"sum": np.array([1])}))
    mlflow.pyfunc.save_model(
        tmp_path / "model", python_model=CheckedSum(), signature=signature, input_example=images, pip_requirements=[]
    )
    model = scoring_server.load_model_with_mlflow_config(str(tmp_path / "model"))
    assert str(model.metadata.get_input_schema()) == "[Tensor('uint8', (-1, 32, 32, 3))]"
    assert model.predict(images) == {"dtype": ["uint8"], "sum": [int(images.sum(dtype=np.int64))]}

    def invoke(payload) -> tuple[int, dict]:
        try:
            reply = scoring_server.invocations(
                json.dumps(payload), "application/json", model, model.metadata.get_input_schema()
            )
        except MlflowException as error:
            return error.get_http_status_code(), json.loads(error.serialize_as_json())
        return reply.status, json.loads(reply.response)

    assert invoke({"inputs": images.tolist()}) == (200, {"predictions": model.predict(images)})
    code, reply = invoke({"inputs": (images / 255.0).tolist()})  # Cast to uint8 zeros without the mark.
    assert code == 400 and "got floating-point values" in reply["message"] and reply["message"].endswith(CONTRACT)
    code, reply = invoke({"inputs": with_value(images, 256)})  # numpy's OverflowError without the mark.
    assert code == 400 and "got pixel value 256" in reply["message"]
