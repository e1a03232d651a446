"""`predict`: a job scored chunk by chunk into WORKDIR/predictions/<key>/, or its stored result when it was done."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from cifar import locks
from cifar.config import MonitorConfig
from cifar.data.additions import FileProblem
from cifar.data.drift import Profile
from cifar.data.manifest import NUM_CLASSES
from cifar.io import atomic_directory, atomic_write_bytes, atomic_write_json, read_json
from cifar.monitoring import answers_summary, load_reference
from cifar.predict.job import DRIFT_PNG, PREDICTIONS_FILE, SUMMARY_FILE, Job, output_key, predictions_root
from cifar.predict.model import DEFAULT_MODEL, ScoringModel, resolve_model
from cifar.predict.result import PredictionResult, drift_png, judge, judged_again
from cifar.predict.sources import CHUNK_IMAGES, Chunk, ImageSource, input_digest, open_source, read_usable
from cifar.predict.tracking import finish_run, start_run

Progress = Callable[[int, int | None], None]


def predict(
    source: ImageSource | str | Path,
    workdir: str | Path,
    *,
    model: str = DEFAULT_MODEL,
    settings: MonitorConfig | None = None,
    tracking_uri: str | None = None,
    chunk_size: int = CHUNK_IMAGES,
    progress: Progress | None = None,
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


@dataclass
class Tally:
    """What the chunks scored so far add up to: nothing here grows with the input but the problems."""

    profile: Profile = field(default_factory=Profile)
    counts: np.ndarray = field(default_factory=lambda: np.zeros(NUM_CLASSES, np.int64))  # Answers per class.
    low: int = 0  # Answers below the confidence threshold.
    images: int = 0
    names: dict[int, str] = field(default_factory=dict)  # Class id -> name, as the model answered.
    problems: list[FileProblem] = field(default_factory=list)


def _score(job: Job, model: ScoringModel, progress: Progress | None) -> PredictionResult:
    """Scores the job's images chunk by chunk into a temp directory, renamed into place once complete."""
    from cifar.tracking import end_run, mark_failed

    reference = job.reference
    threshold = reference.confidence_threshold if reference is not None else job.settings.confidence_threshold
    start = time.perf_counter()
    chunks = read_usable(job.source, job.chunk_size)  # No image at all: refused here, before any record.
    with contextlib.closing(chunks):
        run_id = start_run(job)
        try:
            with atomic_directory(job.output) as temp:
                tally = _write_predictions(job, model, threshold, chunks, temp / PREDICTIONS_FILE, progress)
                result = _result(job, tally, threshold, start, run_id)
                atomic_write_bytes(temp / DRIFT_PNG, drift_png(result, reference))
                atomic_write_json(temp / SUMMARY_FILE, result.model_dump(mode="json", exclude={"reused"}))
                finish_run(job.tracking_uri, run_id, result, temp)
        except BaseException as error:
            mark_failed(job.tracking_uri, run_id, f"{type(error).__name__}: {error}")
            raise
    end_run(job.tracking_uri, run_id)
    return result


def _write_predictions(
    job: Job,
    model: ScoringModel,
    threshold: float,
    chunks: Iterator[tuple[Chunk, Profile]],
    path: Path,
    progress: Progress | None,
) -> Tally:
    """Scores every chunk, appending its rows to the Parquet file at `path` as one row group; returns the totals."""
    import pyarrow.parquet as pq

    tally, done = Tally(), 0
    with pq.ParquetWriter(path, _schema(job)) as writer:
        for chunk, chunk_profile in chunks:
            tally.problems += chunk.problems
            if len(chunk.images):
                outputs = model.predict(chunk.images)
                writer.write_table(_table(chunk.names, outputs, job.version.version))
                chunk_counts, chunk_low = answers_summary(outputs["probabilities"], threshold)
                tally.counts += chunk_counts
                tally.low += round(chunk_low * len(chunk.images))  # This chunk's share, back to a count.
                tally.profile += chunk_profile
                tally.images += len(chunk.images)
                tally.names.update(zip(outputs["class_ids"].tolist(), outputs["class_names"].tolist()))
            done += chunk.consumed
            if progress is not None:
                progress(done, chunk.total)
    return tally


def _result(job: Job, tally: Tally, threshold: float, start: float, run_id: str) -> PredictionResult:
    """The job's result from its totals, judged against its reference; `start` is when scoring began."""
    source, images = job.source, tally.images
    class_counts = [int(count) for count in tally.counts]
    profile = tally.profile.model_copy(update={"classes": class_counts})
    share = tally.low / images if images else 0.0
    report, note = judge(profile, class_counts, share, job.reference, job.settings)
    seconds = time.perf_counter() - start
    return PredictionResult(
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
        problems=tally.problems,
        class_names=[tally.names.get(index, f"class {index}") for index in range(NUM_CLASSES)],
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
