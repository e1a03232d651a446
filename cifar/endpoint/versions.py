"""A registered version made ready to serve: fetched from MLflow, loaded, and verified before it answers anyone.

Verification replays the export's probe (cifar.workdir.EXPORT_PROBE_PATH: the first test images and the
probabilities the verified export gave them) and demands the same answers. A version whose files are damaged
fails to load or answers differently, and is refused; the version already serving keeps serving. Versions
exported before probes existed are checked for well-formed answers only, and `verified` says so.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cifar.data.manifest import IMAGE_SHAPE
from cifar.serving_contract import INPUT_NAME
from cifar.serving_model import SAVED_MODEL_ARTIFACT, SERVING_SIGNATURE
from cifar.workdir import EXPORT_METADATA_PATH, EXPORT_PROBE_PATH

logger = logging.getLogger(__name__)

PROBE_TOLERANCE = 1e-3  # Probabilities: the same graph on another CPU or batch size differs by ~1e-6.
CARD_ARTIFACT = "model_card/model_card.html"  # Logged to the version's run by cifar.registry.write_model_card.


class VersionRefused(RuntimeError):
    """A version that cannot be served (it does not load, or answers the probe differently): one line why."""


@dataclass(frozen=True)
class ServedVersion:
    """One loaded, verified version. `classify` maps uint8 images (N, 32, 32, 3) to probabilities (N, classes)."""

    model_name: str
    version: int
    run_id: str | None
    class_names: tuple[str, ...]
    classify: Callable[[np.ndarray], np.ndarray] = field(repr=False)
    verified: str
    loaded_at: float = field(default_factory=time.time)
    load_seconds: float = 0.0

    def describe(self) -> dict:
        return {
            "model": self.model_name,
            "version": self.version,
            "run_id": self.run_id,
            "classes": list(self.class_names),
            "verified": self.verified,
            "loaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.loaded_at)),
            "load_seconds": round(self.load_seconds, 2),
        }


def load_version(
    client, tracking_uri: str, model_name: str, version: int, cache_dir: str | None = None
) -> ServedVersion:
    """Downloads, loads and verifies `model_name` version `version`; raises VersionRefused with the reason why it
    cannot be served, or MLflow's own error when the registry or its artifacts cannot be reached."""
    import mlflow

    started = time.monotonic()
    details = client.get_model_version(model_name, str(version))
    download = Path(tempfile.mkdtemp(prefix=f"{model_name}-v{version}-", dir=cache_dir))
    try:
        # A registry or artifact store out of reach raises as it is: the follower tries again at its next look.
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=client.get_model_version_download_uri(model_name, str(version)),
            dst_path=str(download),
            tracking_uri=tracking_uri,
        )
        export_dir = saved_model_dir(Path(local))
        # TensorFlow reads every variable into memory while loading: the files may go right after.
        classify, class_names = load_saved_model(export_dir)
        verified = verify(classify, class_names, export_dir)
    finally:
        shutil.rmtree(download, ignore_errors=True)
    return ServedVersion(
        model_name=model_name,
        version=int(version),
        run_id=details.run_id,
        class_names=class_names,
        classify=classify,
        verified=verified,
        load_seconds=time.monotonic() - started,
    )


def saved_model_dir(model_dir: Path) -> Path:
    """The SavedModel among a downloaded pyfunc's artifacts, where its MLmodel file says it is."""
    from mlflow.models import Model

    try:
        artifacts = Model.load(str(model_dir)).flavors["python_function"]["artifacts"]
        path = (model_dir / artifacts[SAVED_MODEL_ARTIFACT]["path"]).resolve()
    except Exception as error:  # noqa: BLE001 - a damaged or foreign MLmodel file.
        raise VersionRefused(f"its MLmodel file names no {SAVED_MODEL_ARTIFACT}: {one_line(error)}") from None
    if not path.is_relative_to(model_dir.resolve()) or not (path / "saved_model.pb").is_file():
        raise VersionRefused(f"its files hold no SavedModel at {artifacts[SAVED_MODEL_ARTIFACT]['path']!r}")
    return path


def load_saved_model(export_dir: Path) -> tuple[Callable[[np.ndarray], np.ndarray], tuple[str, ...]]:
    """The SavedModel's serving_default as a numpy function, and the class names its export recorded."""
    import tensorflow as tf

    try:
        metadata = json.loads((export_dir / EXPORT_METADATA_PATH).read_text())
        class_names = tuple(str(name) for name in metadata["class_names"])
        serve = tf.saved_model.load(str(export_dir)).signatures[SERVING_SIGNATURE]
    except Exception as error:  # noqa: BLE001 - damaged files fail in many ways (OSError, DataLossError, KeyError).
        raise VersionRefused(f"the SavedModel does not load: {one_line(error)}") from None

    def classify(images: np.ndarray) -> np.ndarray:
        return serve(**{INPUT_NAME: tf.constant(images, dtype=tf.uint8)})["probabilities"].numpy()

    return classify, class_names


def verify(classify: Callable[[np.ndarray], np.ndarray], class_names: tuple[str, ...], export_dir: Path) -> str:
    """What was verified, in words; raises VersionRefused when the answers are not the recorded ones."""
    probe_path = export_dir / EXPORT_PROBE_PATH
    if probe_path.exists():
        try:
            with np.load(probe_path, allow_pickle=False) as probe:
                images, expected = probe["images"], probe["probabilities"]
        except Exception as error:  # noqa: BLE001 - a damaged npz: zipfile, ValueError, KeyError.
            raise VersionRefused(f"its probe cannot be read: {one_line(error)}") from None
    else:
        images, expected = np.zeros((1, *IMAGE_SHAPE), np.uint8), None
    try:
        answered = np.asarray(classify(images), np.float32)
    except Exception as error:  # noqa: BLE001 - a graph that loads but cannot run.
        raise VersionRefused(f"it cannot classify: {one_line(error)}") from None
    if answered.shape != (len(images), len(class_names)) or not np.all(np.isfinite(answered)):
        raise VersionRefused(f"it answers probabilities of shape {answered.shape}, not ({len(images)}, "
                             f"{len(class_names)}) finite values")  # fmt: skip
    if not np.allclose(answered.sum(axis=1), 1.0, atol=1e-3):
        raise VersionRefused("its probabilities do not sum to 1")
    if expected is None:
        return "no probe recorded at export (an older version): checked for well-formed answers only"
    difference = float(np.max(np.abs(answered - expected))) if answered.shape == expected.shape else np.inf
    if difference > PROBE_TOLERANCE:
        raise VersionRefused(
            f"it answers its export's {len(images)} probe images differently (largest probability difference "
            f"{difference:.3g}, tolerance {PROBE_TOLERANCE:g})"
        )
    return f"answers its export's {len(images)} probe images as recorded (within {PROBE_TOLERANCE:g})"


def model_card_html(tracking_uri: str, run_id: str | None) -> str | None:
    """The version's model card (HTML) from its run's artifacts, or None when it has none."""
    import mlflow

    if not run_id:
        return None
    with tempfile.TemporaryDirectory() as directory:
        try:
            path = mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path=CARD_ARTIFACT, dst_path=directory, tracking_uri=tracking_uri
            )
        except Exception:  # noqa: BLE001 - no card logged (an older version) or a store that cannot be read.
            logger.info("no model card for run %s", run_id)
            return None
        return Path(path).read_text(encoding="utf-8")


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"
