"""The registered model's code: an MLflow pyfunc calling the exported SavedModel's `serving_default`.

MLflow logs this file as the model ("models from code"): loading a version runs this file, which names
the model with `set_model`, instead of unpickling an object. The SavedModel directory is its one artifact;
input is checked by `cifar.serving_contract.validate_images`. Versions logged before this file were
pickled `cifar.registry.SavedModelClassifier` objects; they still load.
"""

from __future__ import annotations

import numpy as np
from mlflow.models import set_model
from mlflow.pyfunc import PythonModel, PythonModelContext

from cifar.serving_contract import INPUT_NAME, validate_images

SAVED_MODEL_ARTIFACT = "saved_model"  # The key of the SavedModel directory among the model's artifacts.
SERVING_SIGNATURE = "serving_default"  # = cifar.export.SERVING_SIGNATURE (that module imports TensorFlow).


class SavedModelClassifier(PythonModel):
    """Class ids, names, calibrated probabilities and logits of uint8 images (N, 32, 32, 3), from a SavedModel."""

    def load_context(self, context: PythonModelContext) -> None:
        self.load(context.artifacts[SAVED_MODEL_ARTIFACT])

    def load(self, export_dir: str) -> SavedModelClassifier:
        import tensorflow as tf

        self._serve = tf.saved_model.load(export_dir).signatures[SERVING_SIGNATURE]
        return self

    # `np.ndarray` is the type MLflow leaves unchecked: the contract is checked here, for REST requests
    # (the parsed JSON of "inputs") and Python callers (an array) alike.
    def predict(
        self, context: PythonModelContext | None, model_input: np.ndarray, params: dict | None = None
    ) -> dict[str, np.ndarray]:
        import tensorflow as tf

        images = validate_images(model_input)  # The serving contract: refuses (HTTP 400) rather than casts.
        outputs = self._serve(**{INPUT_NAME: tf.constant(images)})
        answers = {
            "class_ids": outputs["class_ids"].numpy().astype(np.int64),
            "class_names": np.array([name.decode("utf-8") for name in outputs["class_names"].numpy()]),
            "probabilities": outputs["probabilities"].numpy().astype(np.float32),
        }
        if "logits" in outputs:  # Exports since the calibration (issue 48): the raw logits beside the probabilities.
            answers["logits"] = outputs["logits"].numpy().astype(np.float32)
        return answers


set_model(SavedModelClassifier())
