"""The input contract of the registered model: uint8 images [batch, 32, 32, 3], pixel values integers 0..255.

Over REST "uint8" means nested lists of JSON integers in 0..255 forming one such array; anything else
(floats such as 0.5 or 3.0, values out of range, another shape, ragged lists, strings, booleans) is
refused with a 400 that states the contract, never cast to uint8 and answered (README, "Serving").
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from cifar.data.manifest import IMAGE_SHAPE

INPUT_NAME = "images"  # = cifar.export.INPUT_NAME (not imported: that module loads TensorFlow).
CONTRACT = (
    "The model takes uint8 images shaped [batch, 32, 32, 3] (32x32 RGB, channels last) with pixel values "
    "integers 0..255, not floats and not scaled to 0..1. Over REST, POST Content-Type application/json "
    '{"inputs": [[[[r, g, b], ...32 pixels], ...32 rows], ...one per image]} with JSON integers to '
    '/invocations, e.g. json.dumps({"inputs": images.astype("uint8").tolist()}); from Python, '
    "predict(a numpy uint8 array of shape (batch, 32, 32, 3))."
)


class InputContractError(MlflowException):
    """A request that breaks the contract: INVALID_PARAMETER_VALUE, which MLflow's server answers with HTTP 400.

    The message is fixed at creation: the scoring server rewrites an error raised in predict as
    "Failed to predict data '<the whole request>'. Error: <message>", which for images would echo
    megabytes of pixels back; the reply keeps just the problem and the contract.
    """

    def __init__(self, problem: str):
        super().__init__(f"Invalid input: {problem}. {CONTRACT}", error_code=INVALID_PARAMETER_VALUE)

    @property
    def message(self) -> str:
        return self._message

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_message"):  # Set once by MlflowException.__init__; later rewrites are ignored.
            self._message = value


def validate_images(model_input: Any, *, may_hold_booleans: bool = True) -> np.ndarray:
    """The images in `model_input` as a uint8 array [batch, 32, 32, 3]; raises InputContractError otherwise.

    Takes what the scoring server passes (the JSON value of "inputs": nested lists, or a dict
    {"images": ...}) and what Python callers pass (numpy arrays, also in a dict). Integer arrays
    of any integer dtype are accepted when every value is in 0..255; no value is ever cast lossily.

    Why the model checks the raw request itself: for a tensor signature, MLflow's scoring server builds
    the input with `np.array(json_value, dtype=<signature dtype>)` (`convert_data_type`), and numpy
    truncates floats to uint8 without a word (0.7 -> 0). So the pyfunc's signature carries MLflow's
    type-hint mark (`cifar.compat.raw_input_signature`): the server hands predict the JSON as parsed,
    PyFuncModel.predict skips MLflow's schema enforcement, and this is the one check, for REST and
    Python callers alike; MLflow then takes only `{"inputs": ...}`. Versions logged before the mark
    still load and answer uint8 input as before, and MLflow still casts what they are sent.
    """
    if isinstance(model_input, dict):
        if set(model_input) != {INPUT_NAME}:
            raise InputContractError(
                f"got named inputs {sorted(map(str, model_input))}; the only input is {INPUT_NAME!r}"
            )
        model_input = model_input[INPUT_NAME]
    if isinstance(model_input, (list, tuple)):
        try:
            images = np.asarray(model_input)
        except (ValueError, TypeError, OverflowError):
            raise InputContractError("the nested lists do not form one [batch, 32, 32, 3] array") from None
    elif isinstance(model_input, np.ndarray):
        images = model_input
    else:
        raise InputContractError(f"got {type(model_input).__name__}")

    if images.ndim != 1 + len(IMAGE_SHAPE) or tuple(images.shape[1:]) != IMAGE_SHAPE:
        raise InputContractError(f"got shape {list(images.shape)}")
    kind = images.dtype.kind
    if kind == "f":
        raise InputContractError(f"got floating-point values ({_first_float(images)}); send integers (3, not 3.0)")
    if kind not in "iu":  # bool, strings, objects (None, numbers beyond 64 bits, mixed values), ...
        what = {"b": "booleans", "U": "strings", "S": "bytes"}.get(kind, f"non-integer values (dtype {images.dtype})")
        raise InputContractError(f"got {what}")
    # `may_hold_booleans=False`: the caller saw the JSON text has no `true` or `false` (the endpoint, sparing a
    # walk over every value of a large request).
    if may_hold_booleans and isinstance(model_input, (list, tuple)) and _holds_booleans(model_input):
        raise InputContractError("got booleans among the pixel values (numpy would read true as 1)")
    if images.dtype == np.uint8:
        return images
    outside = np.argwhere((images < 0) | (images > 255))
    if len(outside):
        index = tuple(int(i) for i in outside[0])
        raise InputContractError(f"got pixel value {images[index]} at {list(index)}; values must be 0..255")
    return images.astype(np.uint8)


def _holds_booleans(values: list | tuple) -> bool:
    """Whether nested lists hold a boolean anywhere: JSON true and false, which numpy reads as 1 and 0."""
    pending = [values]
    while pending:
        item = pending.pop()
        if isinstance(item, bool):
            return True
        if isinstance(item, (list, tuple)):
            pending.extend(item)
    return False


def _first_float(images: np.ndarray) -> str:
    """Where a float array first shows it is no uint8 image: a fractional or non-finite value, else its first."""
    if images.size == 0:
        return str(images.dtype)
    fractional = np.argwhere(~np.isfinite(images) | (images != np.round(images)))
    index = tuple(int(i) for i in (fractional[0] if len(fractional) else np.zeros(images.ndim, dtype=int)))
    return f"{images.dtype}, e.g. {float(images[index])!r} at {list(index)}"
