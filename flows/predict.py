"""The `cifar-predict` flow: score unlabelled images with a registered model, and say when they drift.

    python flows/predict.py --input PATH [--model models:/cifar10@champion] [--workdir W] [--resize bilinear]
                            [--set monitor.max_image_drift=0.1]
    prefect deployment run cifar-predict/predict -p input=/data/incoming

Inputs, outputs, reuse and the drift checks: README "Batch inference and monitoring", docs/BATCH_INFERENCE.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # This checkout first, installed or not.

from flows.runtime import DryRunPlan, Request, dry_run_plan, run_command

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.runtime import flow_run
from prefect.states import Completed, State

from cifar.config import ConfigOverrides, PipelineConfig, resolve_workdir
from cifar.data.additions import RESIZE_METHODS
from cifar.predict import DEFAULT_MODEL, KIND_NAMES, PredictionResult, open_source, parse_model_uri
from cifar.predict import predict as predict_images
from cifar.summary import MlflowRunLink
from cifar.text import printable
from cifar.tracking import resolve_tracking_uri
from flows.cli import add_set_argument, flow_parser, overrides_from_args
from tasks.artifacts import ProgressReporter

DRIFT_EVENT = "cifar.drift.detected"  # prefect.yaml's drift trigger on the nightly retrain expects this name.
DRIFT_DETECTED = "Drift detected"  # The Completed state's name when the scored images drifted.
ResizeMethod = Literal["bilinear", "bicubic", "lanczos", "box", "nearest"]


class Progress:
    """The job's progress on the terminal (a bar, when it is one) and in Prefect (a progress artifact)."""

    def __init__(self, description: str) -> None:
        from tqdm import tqdm

        self.reporter = ProgressReporter("predict-progress", description)
        self.bar = tqdm(desc=description, unit="img", disable=None, leave=False)  # None: off unless a terminal.

    def __call__(self, done: int, total: int | None) -> None:
        if total is not None and self.bar.total != total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)
        if total:
            self.reporter.update(100.0 * done / total, f"{self.reporter.description}: {done:,} of {total:,}")

    def close(self) -> None:
        self.bar.close()
        self.reporter.finish()


@task(name="predict", cache_policy=NO_CACHE)
def predict_task(input: str, model: str, workdir: str, resize: str | None, config: PipelineConfig) -> PredictionResult:
    """Scores the input (or finds it scored), with the monitoring verdict; the library decides reuse."""
    progress = Progress(f"Scoring {Path(input).name}")
    try:
        return predict_images(
            open_source(input, resize=resize),
            workdir,
            model=model,
            settings=config.monitor,
            tracking_uri=resolve_tracking_uri(config.tracking, workdir),
            progress=progress,
        )
    finally:
        progress.close()


def report_markdown(result: PredictionResult) -> str:
    """The job as a person reads it: what was scored with what, where it went, each value against its threshold."""
    link = MlflowRunLink.lookup(result.tracking_uri, result.mlflow_run_id)
    run = f"[{link.name}]({link.url})" if link else "-"
    rows = [
        ("Input", f"`{result.input}` ({KIND_NAMES[result.kind]}, digest `{result.digest[:16]}`)"),
        ("Model", f"{result.model_name} v{result.model_version} (`{result.model_uri}`)"),
        ("Images scored", f"{result.images:,}" + (" (already scored: not scored again)" if result.reused else "")),
        ("Files skipped", f"{len(result.problems):,}"),
        ("Predictions", f"`{result.predictions_path}`"),
        ("Drift report", f"`{result.drift_png}`"),
        ("Throughput", f"{result.images_per_second:,.0f} images/s"),
        ("MLflow run", run),
        ("Verdict", result.verdict()),
    ]
    lines = [f"# Batch prediction: {DRIFT_DETECTED.lower() if result.drift else 'done'}", ""]
    lines += ["| | |", "|---|---|", *[f"| {name} | {value} |" for name, value in rows]]
    report = result.monitoring
    if report is not None:
        thresholds = report.thresholds
        increase = report.low_confidence_share - report.reference_low_confidence_share
        image = f"image drift (Jensen-Shannon, {report.worst_feature})"
        unsure = f"unsure answers (below {thresholds['confidence_threshold']:g}), rise over the test split's"
        measures = [
            (image, f"{report.image_drift_max:.4f}", f"{thresholds['max_image_drift']:g}"),
            (
                "prediction drift (L-infinity)",
                f"{report.prediction_drift:.3f}",
                f"{thresholds['max_prediction_drift']:g}",
            ),
            (unsure, f"{100 * increase:+.1f} points", f"{100 * thresholds['max_low_confidence_increase']:g} points"),
        ]
        lines += ["", "| measure | value | threshold |", "|---|---:|---:|"]
        lines += [f"| {name} | {value} | {threshold} |" for name, value, threshold in measures]
    if result.problems:
        lines += ["", "| skipped file | problem | detail |", "|---|---|---|"]
        lines += [
            f"| `{printable(problem.file)}` | {problem.problem} | {printable(problem.detail)} |"
            for problem in result.problems[:50]
        ]
        if len(result.problems) > 50:
            lines.append(f"| ... {len(result.problems) - 50} more in summary.json | | |")
    return "\n".join(lines) + "\n"


def drift_markdown(result: PredictionResult) -> str:
    reasons = "\n".join(f"- {reason}" for reason in result.monitoring.reasons)
    return (
        f"# Warning: drift in the images scored by {result.model_name} v{result.model_version}\n\n"
        f"{result.images:,} images of `{result.input}`:\n\n{reasons}\n\n"
        f"Histograms against the model's reference: `{result.drift_png}`. Retraining on the same labelled data "
        "does not cure drift: label some of these images and ingest them (flows/ingest.py), then retrain.\n"
    )


def emit_drift(result: PredictionResult, workdir: str) -> None:
    """The `cifar.drift.detected` event: which model version saw drift in which input, and the values."""
    report = result.monitoring
    emit_event(
        event=DRIFT_EVENT,
        resource={
            "prefect.resource.id": f"cifar.model.{result.model_name}.{result.model_version}",
            "prefect.resource.name": f"{result.model_name} v{result.model_version}",
        },
        payload={
            "model": result.model_name,
            "version": result.model_version,
            "input": result.input,
            "input_digest": result.digest,
            "images": result.images,
            "values": report.metrics(),
            "reasons": report.reasons,
            "predictions": result.predictions_path,
            "workdir": workdir,
        },
    )


def predict_run_name() -> str:
    """The flow run's name in the Prefect UI: what it scores with which model, `predict-test_batch-cifar10@champion`."""
    parameters = flow_run.parameters
    model = str(parameters.get("model") or DEFAULT_MODEL).removeprefix("models:/").replace("/", "-v")
    return f"predict-{Path(str(parameters.get('input', ''))).name or 'input'}-{model}"


@flow(name="cifar-predict", log_prints=True, flow_run_name=predict_run_name)
def predict(
    input: str,
    model: str = DEFAULT_MODEL,
    workdir: str = "./workdir",
    resize: ResizeMethod | None = None,
    config: ConfigOverrides = ConfigOverrides(),
) -> dict[str, Any] | DryRunPlan | State:
    """Scores unlabelled images with a registered model, and judges their drift against the model's reference.

    Args:
        input: A path on the worker: a folder of PNG/JPEG files, a CIFAR batch file, a .npy uint8 array
            (N, 32, 32, 3), or .tfrecord shards (a file, a directory, or a glob).
        model: models:/<name>@<alias> or models:/<name>/<version>; an alias is resolved to its version.
        workdir: Where predictions/ goes (and the MLflow store, unless tracking.tracking_uri or
            MLFLOW_TRACKING_URI says otherwise).
        resize: Resize images of another size with this method (folders only; recorded). None refuses them.
        config: The drift thresholds (monitor.*) and the MLflow store (tracking.*); None means the preset's.
    """
    overrides = config
    config = overrides.resolve()
    plan = dry_run_plan("cifar-predict", config, workdir, input=input, model=model, resize=resize)
    if plan:
        return plan
    workdir = str(resolve_workdir(workdir))
    result = predict_task(input, model, workdir, resize, config)
    create_markdown_artifact(report_markdown(result), key="cifar-predict", description="Batch prediction")
    print(result.summary())
    summary = result.model_dump(mode="json") | {"drift": result.drift, "verdict": result.verdict()}
    if not result.drift:
        return summary
    create_markdown_artifact(drift_markdown(result), key="cifar-drift", description=DRIFT_DETECTED)
    emit_drift(result, workdir)
    return Completed(name=DRIFT_DETECTED, message=result.verdict(), data=summary)


def build_parser() -> argparse.ArgumentParser:
    parser = flow_parser(
        "predict",
        "Score unlabelled images with a registered model and judge their drift (Prefect flow `cifar-predict`).",
        "--input /tmp/cifar-10-batches-py/test_batch --workdir workdir",
    )
    add = parser.add_argument
    kinds = "a folder of PNG/JPEG files, a CIFAR batch file, a .npy uint8 array (N, 32, 32, 3), or .tfrecord shards"
    add("--input", required=True, metavar="PATH", help=f"{kinds} (a file, a directory or a quoted glob)")
    add("--model", default=DEFAULT_MODEL, help=f"models:/<name>@<alias> or models:/<name>/<version> ({DEFAULT_MODEL})")
    add("--workdir", default="./workdir", help="where predictions/ goes; its MLflow store unless MLFLOW_TRACKING_URI")
    add("--resize", choices=RESIZE_METHODS, help="resize images of another size with this method (recorded)")
    add_set_argument(parser, "monitor.max_image_drift=0.1")
    return parser


def check(args: argparse.Namespace) -> Request:
    """Everything a person can get wrong, checked before any work: the overrides, the model URI, the input."""
    overrides = overrides_from_args(args)
    parse_model_uri(args.model)
    source = open_source(args.input, resize=args.resize)
    workdir = resolve_workdir(args.workdir)

    def run() -> int:
        state = predict(
            input=source.path,
            model=args.model,
            workdir=str(workdir),
            resize=args.resize,
            config=overrides,
            return_state=True,
        )
        summary = state.result()
        print(PredictionResult.model_validate({key: summary[key] for key in PredictionResult.model_fields}).summary())
        return 0

    return Request(workdir, run)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command("predict", build_parser(), check, argv)


if __name__ == "__main__":
    sys.exit(main())
