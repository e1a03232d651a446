"""Batch inference: score a source of unlabelled images with a registered model, and monitor what it saw.

    result = predict("cifar-10-batches-py/test_batch", workdir, model="models:/cifar10@champion")

Sources (`open_source`), told apart by what the path is:

    folder      PNG/JPEG files anywhere under PATH, in sorted relative-path order, decoded as the data store
                decodes additions (cifar.data.additions.decode_image); a file that cannot be used
                (undecodable, truncated, another size, not RGB, a link) is listed with why, and skipped
    batch file  a CIFAR batch (the pickle layout of data_batch_N, e.g. the archive's test_batch), read with
                the archive's restricted unpickler; its labels are ignored
    .npy        a uint8 array (N, 32, 32, 3), read chunk by chunk from the file, never loaded whole
    TFRecord    our shards (`image` = 3,072 raw bytes, cifar.data.manifest): a .tfrecord file, a directory
                of them, or a glob, in name order; a shard that cannot be read to its end is listed, and skipped

Images of another size are refused unless `resize` names one of RESIZE_METHODS (folders only); the
method is recorded.

Reuse, one rule: a job's key is the input's digest (SHA-256 of its files' relative names and bytes, and
the resize method) and the model version (an alias is resolved to its version first). A finished job
leaves WORKDIR/predictions/<digest[:16]>-<model>-v<version>/ with predictions.parquet, drift.png and
summary.json, written in a temp directory and renamed into place together; when that directory exists,
a job with the same key returns its summary and scores nothing (the verdict is judged again under the
current thresholds, from the recorded profile).

Memory: images stream in chunks of `chunk_size`: read, scored with the registered pyfunc (as serving loads
it), their features and answers summed into the monitoring profile, their rows appended to the Parquet
file as one row group. Reading and the features of the next chunks run in a thread while the model scores
(`read_ahead`). Nothing grows with the input but the list of a folder's files and of the problems.

Monitoring (cifar.monitoring): the images' drift profile, the answers' class counts and low-confidence
share, against the version's recorded reference (its training images, its answers on the test split).
Each scoring job is an MLflow run of its own (experiment `cifar10-predictions`) with the model version
as its input.
"""

from __future__ import annotations

import glob
import hashlib
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from cifar import locks
from cifar.config import MonitorConfig
from cifar.data.additions import RESIZE_METHODS, FileProblem, decode_image, read_batch_rows, walk_files
from cifar.data.drift import FEATURE_RANGES, Profile, image_features
from cifar.data.manifest import IMAGE_BYTES, IMAGE_SHAPE, NUM_CLASSES
from cifar.io import CHUNK_BYTES, atomic_directory, atomic_write_bytes, atomic_write_json, read_json
from cifar.monitoring import MonitoringReference, MonitoringReport, answers_summary, load_reference, monitor

DEFAULT_MODEL = "models:/cifar10@champion"
# Images read, scored and written at a time: enough to amortise each call's fixed cost (the signature call,
# a Parquet row group), few enough that a chunk in flight takes tens of MB (3 MB of pixels, 12 MB as floats).
CHUNK_IMAGES = 1000
EXPERIMENT = "cifar10-predictions"  # The MLflow experiment of prediction jobs.
PREDICTIONS_DIR = "predictions"  # WORKDIR/predictions/<key>/
PREDICTIONS_FILE = "predictions.parquet"
SUMMARY_FILE = "summary.json"
DRIFT_PNG = "drift.png"
TFRECORD_SUFFIX = ".tfrecord"
DIGEST_PREFIX = b"cifar-predict-input-v1\n"  # Versions the digest's definition, not the data.
MODEL_URI = re.compile(r"models:/(?P<name>[A-Za-z0-9._-]+)(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>[0-9]+))")
GLOB_CHARACTERS = set("*?[")
KIND_NAMES = {"folder": "image folder", "batch_file": "CIFAR batch file", "npy": ".npy array", "tfrecord": "TFRecords"}


# Sources: what a path is, the files it covers, and its images in chunks.


@dataclass(frozen=True)
class ImageSource:
    """A source of images to score: its kind, its files (relative to `root`, sorted) and how to read them."""

    kind: str  # folder, batch_file, npy or tfrecord
    path: str  # As given, made absolute (a glob stays a pattern).
    root: Path  # Files are relative to it.
    files: tuple[str, ...]  # Every file the source covers, sorted: what its digest reads.
    not_regular: frozenset[str] = frozenset()  # Links and special files of a folder: listed, never read.
    resize: str | None = None


@dataclass
class Chunk:
    """Images read from a source, their names, and the files left out while reading them."""

    images: np.ndarray  # (n, 32, 32, 3) uint8
    names: list[str]  # Per image: its file (folder) or `<file>#<index>`.
    problems: list[FileProblem] = field(default_factory=list)
    consumed: int = 0  # Progress made: files of a folder, images otherwise.
    total: int | None = None  # What progress counts up to, once the reader knows.


def parse_model_uri(model: str) -> tuple[str, str | None, int | None]:
    """(name, alias, version) of `models:/<name>@<alias>` or `models:/<name>/<version>`; ValueError otherwise."""
    match = MODEL_URI.fullmatch(model.strip())
    if match is None:
        raise ValueError(f"model must be models:/<name>@<alias> or models:/<name>/<version>, got {model!r}")
    version = match.group("version")
    return match.group("name"), match.group("alias"), int(version) if version is not None else None


def open_source(path: str | Path, *, resize: str | None = None) -> ImageSource:
    """What `path` is (folder, batch file, .npy, TFRecord shards) and its files; ValueError naming the problem.

    Only names, sizes and headers are read here: nothing is decoded or scored.
    """
    if resize is not None and resize not in RESIZE_METHODS:
        raise ValueError(f"resize must be one of {', '.join(RESIZE_METHODS)}, got {resize!r}")
    text = str(path)
    candidate = Path(text).expanduser()
    if not candidate.exists() and GLOB_CHARACTERS & set(text):
        source = _tfrecord_glob(candidate)
    elif candidate.is_dir():
        source = _directory(candidate.resolve())
    elif candidate.is_file():
        source = _single_file(candidate.resolve())
    else:
        raise ValueError(f"no file or folder at {text}")
    if resize is not None and source.kind != "folder":
        raise ValueError(
            f"resize applies to image folders; {source.path} is a {KIND_NAMES[source.kind]} (32x32 images)"
        )
    return ImageSource(**{**source.__dict__, "resize": resize})


def _tfrecord_glob(pattern: Path) -> ImageSource:
    shards = [Path(name).resolve() for name in glob.glob(str(pattern)) if name.endswith(TFRECORD_SUFFIX)]
    shards = [shard for shard in shards if shard.is_file()]
    if not shards:
        raise ValueError(f"no {TFRECORD_SUFFIX} files match {pattern}")
    root = Path(os.path.commonpath([str(shard.parent) for shard in shards]))
    files = tuple(sorted(str(shard.relative_to(root)) for shard in shards))
    return ImageSource(kind="tfrecord", path=str(Path.cwd() / pattern), root=root, files=files)


def _directory(path: Path) -> ImageSource:
    shards = sorted(
        entry.name
        for entry in os.scandir(path)
        if entry.name.endswith(TFRECORD_SUFFIX) and entry.is_file(follow_symlinks=False)
    )
    if shards:  # Our data directories hold shards (and manifest, statistics): the shards are the images.
        return ImageSource(kind="tfrecord", path=str(path), root=path, files=tuple(shards))
    entries = walk_files(path)
    if not entries:
        raise ValueError(f"{path} is an empty folder: expected PNG/JPEG files (or .tfrecord shards)")
    return ImageSource(
        kind="folder",
        path=str(path),
        root=path,
        files=tuple(relative for relative, _ in entries),
        not_regular=frozenset(relative for relative, entry in entries if entry is None),
    )


def _single_file(path: Path) -> ImageSource:
    if path.name.endswith(".npy"):
        npy_layout(path)  # Refuses another dtype or shape now, before any work.
        return ImageSource(kind="npy", path=str(path), root=path.parent, files=(path.name,))
    if path.name.endswith(TFRECORD_SUFFIX):
        return ImageSource(kind="tfrecord", path=str(path), root=path.parent, files=(path.name,))
    with open(path, "rb") as handle:
        start = handle.read(2)
    if len(start) < 2 or start[0] != 0x80:  # Pickle protocol 2+ opens with PROTO (0x80); CIFAR's batches are 2.
        raise ValueError(
            f"{path} is not a source of images: expected a folder of PNG/JPEG files, a CIFAR batch file "
            f"(a pickle, e.g. test_batch), a .npy uint8 array (N, 32, 32, 3) or {TFRECORD_SUFFIX} shards"
        )
    return ImageSource(kind="batch_file", path=str(path), root=path.parent, files=(path.name,))


def npy_layout(path: str | Path) -> tuple[int, int, bool]:
    """(images, byte offset of the data, C order) of a .npy file of uint8 images (N, 32, 32, 3); ValueError else.

    Only the header is read: np.load with mmap_mode maps the file without touching its pages.
    """
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise ValueError(f"{path} is not a readable .npy file: {error}") from None
    if not isinstance(array, np.memmap):  # An .npz archive, opened as such.
        raise ValueError(f"{path} is not a single .npy array")
    if array.dtype != np.uint8 or array.ndim != 4 or tuple(array.shape[1:]) != IMAGE_SHAPE:
        raise ValueError(
            f"{path} holds {array.dtype} {tuple(array.shape)}; expected uint8 images (N, 32, 32, 3): integers "
            "0..255, channels last (a folder of image files can be resized with a declared method)"
        )
    layout = len(array), int(array.offset), bool(array.flags.c_contiguous)
    del array  # Unmaps the file.
    return layout


def input_digest(source: ImageSource) -> str:
    """SHA-256 of the source's files (relative names, sizes, bytes; in sorted order) and its resize method."""
    digest = hashlib.sha256(DIGEST_PREFIX)
    digest.update(f"resize={source.resize}\n".encode())
    for name in source.files:
        digest.update(name.encode("utf-8", "surrogateescape") + b"\0")
        if name in source.not_regular:
            digest.update(b"not a regular file\0")
            continue
        with open(source.root / name, "rb") as handle:
            digest.update(os.fstat(handle.fileno()).st_size.to_bytes(8, "little"))
            while chunk := handle.read(CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def read_chunks(source: ImageSource, chunk_size: int = CHUNK_IMAGES) -> Iterator[Chunk]:
    """The source's images, `chunk_size` at a time (fewer at the end of a file), in the source's order."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    readers = {"folder": _folder_chunks, "batch_file": _batch_chunks, "npy": _npy_chunks, "tfrecord": _tfrecord_chunks}
    return readers[source.kind](source, chunk_size)


def read_ahead(source: ImageSource, chunk_size: int = CHUNK_IMAGES, depth: int = 2) -> Iterator[tuple[Chunk, Profile]]:
    """`read_chunks` with each chunk's image profile, made in a thread up to `depth` chunks ahead of the caller.

    Decoding, reading and the drift features are numpy, PIL and file work that release the GIL, so they
    run while the model scores the previous chunk; at most `depth` + 1 chunks are in memory at once.
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def offer(item) -> bool:
        """Puts `item` once there is room; False when the caller has stopped reading."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for chunk in read_chunks(source, chunk_size):
                if not offer((chunk, Profile.of(image_features(chunk.images)) if len(chunk.images) else Profile())):
                    return
            offer(end)
        except BaseException as error:  # Raised in the caller's thread, where it can be handled.
            offer(error)

    producer = threading.Thread(target=produce, name="cifar-read-ahead", daemon=True)
    producer.start()
    try:
        while (item := ready.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        producer.join()


def _folder_chunks(source: ImageSource, chunk_size: int) -> Iterator[Chunk]:
    chunk = Chunk(np.zeros((0, *IMAGE_SHAPE), np.uint8), [], total=len(source.files))
    images: list[np.ndarray] = []
    for relative in source.files:
        chunk.consumed += 1
        if relative in source.not_regular:
            detail = "links and special files are not read"
            chunk.problems.append(FileProblem(file=relative, problem="link", detail=detail))
        else:
            image, problem = decode_image(source.root / relative, source.resize)
            if problem is not None:
                chunk.problems.append(FileProblem(file=relative, problem=problem[0], detail=problem[1]))
            else:
                images.append(image)
                chunk.names.append(relative)
        if len(images) == chunk_size:
            chunk.images = np.stack(images)
            yield chunk
            chunk, images = Chunk(np.zeros((0, *IMAGE_SHAPE), np.uint8), [], total=len(source.files)), []
    if images or chunk.problems:
        if images:
            chunk.images = np.stack(images)
        yield chunk


def _batch_chunks(source: ImageSource, chunk_size: int) -> Iterator[Chunk]:
    from cifar.data.archive import rows_to_images

    name = source.files[0]
    rows, _labels = read_batch_rows(source.root / name)  # (N, 3072); the labels are not the model's business.
    for start in range(0, len(rows), chunk_size):
        stop = min(start + chunk_size, len(rows))
        names = [f"{name}#{index}" for index in range(start, stop)]
        yield Chunk(rows_to_images([rows[start:stop]]), names, consumed=stop - start, total=len(rows))


def _npy_chunks(source: ImageSource, chunk_size: int) -> Iterator[Chunk]:
    # Chunks are read into buffers of their own rather than sliced from a memory map: a mapped page, once
    # touched, counts in the process's resident memory until the kernel needs it back, so a map would grow
    # the RSS to the file's size; a read leaves the bytes in the page cache only.
    name = source.files[0]
    path = source.root / name
    count, offset, c_order = npy_layout(path)
    with open(path, "rb") as handle:
        for start in range(0, count, chunk_size):
            stop = min(start + chunk_size, count)
            if c_order:
                images = np.empty((stop - start, *IMAGE_SHAPE), np.uint8)
                handle.seek(offset + start * IMAGE_BYTES)
                if handle.readinto(memoryview(images).cast("B")) != images.nbytes:
                    raise ValueError(f"{path} ends before its {count:,} images: truncated")
            else:  # Fortran order (rare): copied out of the map.
                images = np.ascontiguousarray(np.load(path, mmap_mode="r", allow_pickle=False)[start:stop])
            names = [f"{name}#{index}" for index in range(start, stop)]
            yield Chunk(images, names, consumed=stop - start, total=count)


def _tfrecord_chunks(source: ImageSource, chunk_size: int) -> Iterator[Chunk]:
    readable, problems = check_shards(source, chunk_size)
    total = sum(count for _, count in readable)
    if problems:
        yield Chunk(np.zeros((0, *IMAGE_SHAPE), np.uint8), [], problems, total=total)
    for name, _count in readable:
        index = 0
        for images in _shard_dataset(source.root / name, chunk_size):
            batch = images.numpy()  # (B, 32, 32, 3)
            names = [f"{name}#{position}" for position in range(index, index + len(batch))]
            yield Chunk(batch, names, consumed=len(batch), total=total)
            index += len(batch)


def _shard_dataset(path: Path, chunk_size: int):
    """The images of one shard in batches: uint8 (B, 32, 32, 3); labels, if any, are not read."""
    import tensorflow as tf

    from cifar.input_pipeline import FEATURES

    def images_of(serialized):
        features = tf.io.parse_example(serialized, {"image": FEATURES["image"]})
        return tf.reshape(tf.io.decode_raw(features["image"], tf.uint8), [-1, *IMAGE_SHAPE])

    return tf.data.TFRecordDataset(str(path)).batch(chunk_size).map(images_of).prefetch(1)


def check_shards(
    source: ImageSource, chunk_size: int = CHUNK_IMAGES
) -> tuple[list[tuple[str, int]], list[FileProblem]]:
    """(readable shards with their image counts, problems): each shard read once to its end before any is scored,
    so a shard that breaks halfway is skipped whole rather than scored in part."""
    import tensorflow as tf

    readable, problems = [], []
    for name in source.files:
        count = 0
        try:
            for images in _shard_dataset(source.root / name, chunk_size):
                count += int(images.shape[0])
        except tf.errors.OpError as error:
            detail = f"unreadable after {count:,} images: {error.message.splitlines()[0][:300]}"
            problems.append(FileProblem(file=name, problem="undecodable", detail=detail))
            continue
        readable.append((name, count))
    return readable, problems


# The model: a registry version, loaded as serving loads it.


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


# The job: key, reuse, scoring, monitoring, outputs.


class PredictionResult(BaseModel):
    """What a prediction job scored, where the outputs are, and how the images compare with the model's reference."""

    model_config = ConfigDict(extra="forbid")

    key: str  # <input digest[:16]>-<model>-v<version>
    output_dir: str
    predictions_path: str
    summary_path: str
    drift_png: str
    input: str
    kind: str
    digest: str
    resize: str | None
    model_name: str
    model_version: int
    model_uri: str  # As asked for when the images were scored.
    images: int
    problems: list[FileProblem]
    class_names: list[str]  # Index = class id; "class <i>" for a class the model never answered.
    class_counts: list[int]  # Predicted images per class.
    confidence_threshold: float
    low_confidence_share: float
    profile: Profile  # The scored images' features; classes = predicted class counts.
    monitoring: MonitoringReport | None  # None: no reference recorded for the version, or nothing scored.
    monitoring_note: str | None = None
    seconds: float  # Reading, scoring, monitoring and writing (not loading the model).
    images_per_second: float
    mlflow_run_id: str | None
    tracking_uri: str
    created_at: str
    reused: bool = False

    @property
    def drift(self) -> bool:
        return self.monitoring is not None and self.monitoring.drift

    def verdict(self) -> str:
        """One line: drift and why, no drift, or why it was not judged."""
        report = self.monitoring
        if report is None:
            return f"not judged: {self.monitoring_note}"
        if not report.judged:
            return f"not judged: {report.examples} images, fewer than monitor.min_examples"
        if report.drift:
            return "DRIFT: " + "; ".join(report.reasons)
        return (
            f"no drift (image {report.image_drift_max:.4f} {report.worst_feature}, predictions "
            f"{report.prediction_drift:.3f}, unsure {100 * report.low_confidence_share:.1f} %)"
        )

    def summary(self) -> str:
        """A few lines for a person: what was scored with what, where it went, the verdict."""
        reused = " (already scored: not scored again)" if self.reused else ""
        skipped = f", {len(self.problems)} files skipped" if self.problems else ""
        lines = [
            f"Scored {self.images:,} images of {self.input} ({KIND_NAMES[self.kind]}) with "
            f"{self.model_name} v{self.model_version}{skipped}{reused}",
            f"  predictions {self.predictions_path}",
            f"  drift       {self.verdict()}",
        ]
        for problem in self.problems[:10]:
            lines.append(f"  skipped     {problem.file}: {problem.problem} ({problem.detail})")
        if len(self.problems) > 10:
            lines.append(f"  skipped     ... {len(self.problems) - 10} more in {self.summary_path}")
        return "\n".join(lines)


def predictions_root(workdir: str | Path) -> Path:
    return Path(workdir) / PREDICTIONS_DIR


def output_key(digest: str, version: ModelVersion) -> str:
    """The one key of a job's outputs: the input's digest and the model version."""
    return f"{digest[:16]}-{version.name}-v{version.version}"


@dataclass(frozen=True)
class Job:
    """One prediction job: what is scored with which version, where it goes, and what it is judged against."""

    source: ImageSource
    digest: str
    version: ModelVersion
    workdir: Path
    tracking_uri: str
    settings: MonitorConfig
    reference: MonitoringReference | None
    chunk_size: int

    @property
    def key(self) -> str:
        return output_key(self.digest, self.version)

    @property
    def output(self) -> Path:
        return predictions_root(self.workdir) / self.key


def predict(
    source: ImageSource | str | Path,
    workdir: str | Path,
    *,
    model: str = DEFAULT_MODEL,
    settings: MonitorConfig | None = None,
    tracking_uri: str | None = None,
    chunk_size: int = CHUNK_IMAGES,
    progress: Callable[[int, int | None], None] | None = None,
    scoring_model: ScoringModel | None = None,
) -> PredictionResult:
    """Scores `source` with `model` into WORKDIR/predictions/<key>/, or returns that job's result if it was done.

    `progress(done, total)` is called after every chunk (files of a folder, images otherwise; total None
    until known). `scoring_model` is a model already loaded (it must be the version `model` names).
    """
    from cifar.config import TrackingConfig
    from cifar.tracking import resolve_tracking_uri

    workdir = Path(workdir).resolve()
    tracking_uri = tracking_uri or resolve_tracking_uri(TrackingConfig(), workdir)
    source = source if isinstance(source, ImageSource) else open_source(source)
    version = resolve_model(model, tracking_uri)
    if scoring_model is not None and scoring_model.version.uri != version.uri:
        raise ValueError(f"the loaded model is {scoring_model.version.uri}, but {model} is {version.uri}")
    digest = input_digest(source)
    root = predictions_root(workdir)
    key = output_key(digest, version)
    # Jobs of one key take turns: a second one waits for the first, then finds its outputs.
    with locks.exclusive(root / f".{key}.lock", f"the predictions {key}"):
        reference = load_reference(tracking_uri, version.name, version.version)
        settings = settings or MonitorConfig()
        if (root / key / SUMMARY_FILE).is_file():
            stored = PredictionResult.model_validate(read_json(root / key / SUMMARY_FILE))
            return judged_again(stored, reference, settings)
        job = Job(source, digest, version, workdir, tracking_uri, settings, reference, chunk_size)
        return _score(job, scoring_model or ScoringModel(version, tracking_uri), progress)


def judged_again(
    result: PredictionResult, reference: MonitoringReference | None, settings: MonitorConfig
) -> PredictionResult:
    """A finished job's result, its verdict judged under `settings` from its recorded profile and answers."""
    report, note = judge(result.profile, result.class_counts, result.low_confidence_share, reference, settings)
    return result.model_copy(update={"monitoring": report, "monitoring_note": note, "reused": True})


def judge(
    profile: Profile,
    class_counts: list[int],
    low_confidence_share: float,
    reference: MonitoringReference | None,
    settings: MonitorConfig,
) -> tuple[MonitoringReport | None, str | None]:
    """(report, note): the monitoring report against the reference, or None and why there is none."""
    if reference is None:
        return None, "no monitoring reference recorded for this version (registered before references were)"
    if profile.count == 0:
        return None, "no images were scored"
    note = None
    if reference.confidence_threshold != settings.confidence_threshold:
        # The reference's share was counted at its own threshold: the current one is too, to compare like with like.
        note = (
            f"low confidence counted below the reference's threshold {reference.confidence_threshold:g}, "
            f"not monitor.confidence_threshold {settings.confidence_threshold:g}"
        )
        settings = settings.model_copy(update={"confidence_threshold": reference.confidence_threshold})
    return monitor(reference, profile, class_counts, low_confidence_share, settings), note


def _score(job: Job, model: ScoringModel, progress: Callable[[int, int | None], None] | None) -> PredictionResult:
    """Scores the job's images chunk by chunk into a temp directory, renamed into place once complete."""
    import pyarrow.parquet as pq

    from cifar.tracking import end_run, mark_failed

    reference, source = job.reference, job.source
    threshold = reference.confidence_threshold if reference is not None else job.settings.confidence_threshold
    run_id = _start_run(job)
    try:
        with atomic_directory(job.output) as temp:
            start = time.perf_counter()
            profile, counts, low, images, done = Profile(), np.zeros(NUM_CLASSES, np.int64), 0, 0, 0
            names: dict[int, str] = {}
            problems: list[FileProblem] = []
            with pq.ParquetWriter(temp / PREDICTIONS_FILE, _schema(job)) as writer:
                for chunk, chunk_profile in read_ahead(source, job.chunk_size):
                    problems += chunk.problems
                    if len(chunk.images):
                        outputs = model.predict(chunk.images)
                        writer.write_table(_table(chunk.names, outputs, job.version.version))
                        chunk_counts, chunk_low = answers_summary(outputs["probabilities"], threshold)
                        counts += chunk_counts
                        low += round(chunk_low * len(chunk.images))  # This chunk's share, back to a count.
                        profile += chunk_profile
                        images += len(chunk.images)
                        names.update(zip(outputs["class_ids"].tolist(), outputs["class_names"].tolist()))
                    done += chunk.consumed
                    if progress is not None:
                        progress(done, chunk.total)
            class_counts = [int(count) for count in counts]
            profile = profile.model_copy(update={"classes": class_counts})
            share = low / images if images else 0.0
            report, note = judge(profile, class_counts, share, reference, job.settings)
            seconds = time.perf_counter() - start
            result = PredictionResult(
                key=job.key,
                output_dir=str(job.output),
                predictions_path=str(job.output / PREDICTIONS_FILE),
                summary_path=str(job.output / SUMMARY_FILE),
                drift_png=str(job.output / DRIFT_PNG),
                input=source.path,
                kind=source.kind,
                digest=job.digest,
                resize=source.resize,
                model_name=job.version.name,
                model_version=job.version.version,
                model_uri=job.version.requested,
                images=images,
                problems=problems,
                class_names=[names.get(index, f"class {index}") for index in range(NUM_CLASSES)],
                class_counts=class_counts,
                confidence_threshold=threshold,
                low_confidence_share=share,
                profile=profile,
                monitoring=report,
                monitoring_note=note,
                seconds=seconds,
                images_per_second=images / seconds if seconds > 0 else 0.0,
                mlflow_run_id=run_id,
                tracking_uri=job.tracking_uri,
                created_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
            atomic_write_bytes(temp / DRIFT_PNG, drift_png(result, reference))
            atomic_write_json(temp / SUMMARY_FILE, result.model_dump(mode="json", exclude={"reused"}))
            _finish_run(job.tracking_uri, run_id, result, temp)
    except BaseException as error:
        mark_failed(job.tracking_uri, run_id, f"{type(error).__name__}: {error}")
        raise
    end_run(job.tracking_uri, run_id)
    return result


def _schema(job: Job):
    import pyarrow as pa

    fields = [("image", pa.string()), ("class_id", pa.int64()), ("class_name", pa.string())]
    fields += [(f"prob_{index}", pa.float32()) for index in range(NUM_CLASSES)]
    fields += [("confidence", pa.float32()), ("model_version", pa.int64())]
    metadata = {"cifar.input_digest": job.digest, "cifar.model": job.version.uri}
    return pa.schema(fields, metadata=metadata)


def _table(names: list[str], outputs: dict[str, np.ndarray], version: int):
    import pyarrow as pa

    probabilities = np.asarray(outputs["probabilities"], np.float32)  # (n, 10)
    columns: dict[str, Any] = {
        "image": pa.array(names, pa.string()),
        "class_id": pa.array(outputs["class_ids"], pa.int64()),
        "class_name": pa.array(outputs["class_names"].tolist(), pa.string()),
    }
    columns |= {f"prob_{index}": pa.array(probabilities[:, index]) for index in range(NUM_CLASSES)}
    columns["confidence"] = pa.array(probabilities.max(axis=1))
    columns["model_version"] = pa.array(np.full(len(names), version, np.int64))
    return pa.table(columns)


def drift_png(result: PredictionResult, reference: MonitoringReference | None) -> bytes:
    """The scored images' histograms over the reference's, per feature, and the predicted classes."""
    from cifar.plots import drift_png as plot

    report = result.monitoring
    features = {}
    for name, (low, high) in FEATURE_RANGES.items():
        value = f"JS divergence {report.image_drift[name]:.4f}" if report is not None else "no reference"
        reference_counts = reference.images.features[name] if reference is not None else None
        features[name] = (reference_counts, result.profile.features.get(name, [0]), (low, high), value)
    value = f"L-infinity {report.prediction_drift:.3f}" if report is not None else "no reference"
    classes = (reference.predictions if reference is not None else None, result.class_counts, value)
    title = (
        f"{result.images:,} images of {Path(result.input).name} against {result.model_name} v{result.model_version}'s "
        "reference (training images; answers on the test split)"
    )
    return plot(features, classes, result.class_names, title)


def _start_run(job: Job) -> str:
    """The job's MLflow run (RUNNING): its params, the model version as its input, tags linking the version."""
    from urllib.parse import urlsplit

    from cifar.tracking import NOTE_TAG, create_run, log_params, mlflow_client, source_tags

    source, version, tracking_uri = job.source, job.version, job.tracking_uri
    tags = {
        **source_tags(),
        "mlflow.source.name": "flows/predict.py",
        "model_name": version.name,
        "model_version": str(version.version),
        "model_uri": version.uri,
        NOTE_TAG: f"Batch prediction of `{source.path}` with registered model {version.name} version "
        f"{version.version} (asked for as `{version.requested}`).",
    }
    if urlsplit(tracking_uri).scheme in {"http", "https"}:
        tags["registry_url"] = f"{tracking_uri.rstrip('/')}/#/models/{version.name}/versions/{version.version}"
    run_name = f"predict-{version.name}-v{version.version}-{job.digest[:8]}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    run_id = create_run(tracking_uri, job.workdir, EXPERIMENT, run_name, tags)
    params = {
        "input": source.path,
        "input_kind": source.kind,
        "input_digest": job.digest,
        "input_files": len(source.files),
        "model_uri": version.requested,
        "model_version": version.version,
        "resize": source.resize,
        "chunk_size": job.chunk_size,
    }
    log_params(tracking_uri, run_id, params)
    if version.model_id:
        from mlflow.entities import LoggedModelInput

        mlflow_client(tracking_uri).log_inputs(run_id, models=[LoggedModelInput(version.model_id)])
    return run_id


def _finish_run(tracking_uri: str, run_id: str, result: PredictionResult, directory: Path) -> None:
    """The job's values as single-value metrics, its verdict as a tag, summary.json and drift.png as artifacts."""
    from mlflow.entities import Metric

    from cifar.tracking import finite_metrics, mlflow_client

    client = mlflow_client(tracking_uri)
    metrics = {
        "images": float(result.images),
        "skipped_files": float(len(result.problems)),
        "images_per_second": result.images_per_second,
        "seconds": result.seconds,
        "low_confidence_share": result.low_confidence_share,
    }
    if result.monitoring is not None:
        metrics |= result.monitoring.metrics()
    timestamp = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, timestamp, 0) for k, v in finite_metrics(metrics).items()])
    client.set_tag(run_id, "monitoring", "drift" if result.drift else "no drift" if result.monitoring else "not judged")
    for name in (SUMMARY_FILE, DRIFT_PNG):
        client.log_artifact(run_id, str(directory / name))
