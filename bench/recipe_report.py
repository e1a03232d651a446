"""A finished recipe run, published: its test results, its curves from MLflow, and the sittings it took.

Reads a pipeline run's workdir (summary.json, the evaluation's metrics.json and the run's MLflow store)
and, with `--prefect-api` and `--deployment`, the flow runs of that deployment (each a sitting: a
resumed run continues the same MLflow run). Checks that MLflow holds every epoch's metrics exactly once,
plots the per-epoch curves to docs/images/recipe-<preset>.png and writes a section of docs/BENCHMARKS.md.

    .venv/bin/python bench/recipe_report.py --workdir ~/cifar-full/repo/workdir \\
        --prefect-api http://127.0.0.1:4400/api --deployment cifar/full --write-docs
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

CURVE_METRICS = ("loss", "accuracy", "val_loss", "val_accuracy", "learning_rate", "examples_per_second",
                 "epoch_seconds")  # fmt: skip
MIN_PER_KIND = 50  # Test images of each provenance a class needs to enter the within-class comparison.


def metric_histories(tracking_uri: str, run_id: str) -> dict[str, dict[int, tuple[float, int]]]:
    """metric -> epoch -> (value, timestamp in ms); ValueError if MLflow holds an epoch twice."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    histories = {}
    for key in CURVE_METRICS:
        entries = client.get_metric_history(run_id, key)
        steps = [entry.step for entry in entries]
        if len(steps) != len(set(steps)):
            twice = sorted({step for step in steps if steps.count(step) > 1})
            raise ValueError(f"MLflow run {run_id} holds {key} more than once at epochs {twice}")
        histories[key] = {entry.step: (entry.value, entry.timestamp) for entry in entries}
    return histories


def sittings(api_url: str, deployment: str, epoch_times: dict[int, int]) -> list[dict]:
    """Each flow run of the deployment, oldest first: name, start, end, state and the epochs it logged."""
    import httpx

    with httpx.Client(timeout=60) as client:
        found = client.get(f"{api_url}/deployments/name/{deployment}")
        found.raise_for_status()
        body = {"deployments": {"id": {"any_": [found.json()["id"]]}}, "sort": "START_TIME_ASC"}
        runs = client.post(f"{api_url}/flow_runs/filter", json=body).json()
    rows = []
    for run in runs:
        if not run.get("start_time"):
            continue
        start = datetime.fromisoformat(run["start_time"]).timestamp() * 1000
        end = datetime.fromisoformat(run["end_time"]).timestamp() * 1000 if run.get("end_time") else float("inf")
        epochs = sorted(epoch for epoch, stamp in epoch_times.items() if start <= stamp <= end)
        rows.append({"name": run["name"], "start": run["start_time"][:16].replace("T", " "), "end": (run.get(
            "end_time") or "")[:16].replace("T", " "), "state": run["state"]["type"], "epochs": epochs})  # fmt: skip
    return rows


def plot_curves(histories: dict, preset: str, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(14, 3.6))
    FigureCanvasAgg(figure)
    panels = {"loss": ("loss", "val_loss"), "accuracy": ("accuracy", "val_accuracy"),
              "learning rate": ("learning_rate",), "images/s": ("examples_per_second",)}  # fmt: skip
    for axis, (title, keys) in zip(figure.subplots(1, len(panels)), panels.items()):
        for key in keys:
            epochs = sorted(histories[key])
            axis.plot(epochs, [histories[key][epoch][0] for epoch in epochs], marker="o", markersize=2, label=key)
        axis.set_title(f"{preset}: {title}")
        axis.set_xlabel("epoch")
        axis.grid(alpha=0.3)
        if title == "loss":
            axis.set_yscale("log")
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    return path


@dataclass(frozen=True)
class RecipeRun:
    """What the report needs of a run's summary.json, in either layout."""

    preset: str
    model: str
    run_name: str
    mlflow_run_id: str
    tracking_uri: str
    epochs_completed: int
    metrics_path: str
    predictions_path: str
    source: str  # The archive the run read.

    @classmethod
    def read(cls, workdir: Path) -> RecipeRun:
        """From `workdir/summary.json`: version 2 (`PipelineSummary`) or the flat version 1, which a run of a
        checkout from before issue 35 writes (the headline `full` run's frozen clone is one)."""
        from cifar.io import read_json
        from cifar.summary import PipelineSummary

        path = workdir / "summary.json"
        values = read_json(path)
        if "summary_version" in values:
            summary = PipelineSummary.read(path)
            training, evaluation = summary.training, summary.evaluation
            if training is None or evaluation is None or not training.mlflow_run_id:
                raise ValueError(f"{path} holds no evaluated training with an MLflow run")
            return cls(summary.preset, training.model, training.run_name, training.mlflow_run_id,
                       training.tracking_uri, training.epochs_completed, evaluation.metrics_path,
                       evaluation.predictions_path, summary.config.data.source)  # fmt: skip
        missing = [name for name in cls.__dataclass_fields__ if not values.get(name)]
        if missing:
            raise ValueError(f"{path} (summary version 1) lacks {', '.join(missing)}: no evaluated training?")
        return cls(**{name: values[name] for name in cls.__dataclass_fields__})


def accuracy_by_provenance(predictions_path: str, provenance: Path) -> dict[str, tuple[float, int]] | None:
    """Accuracy on the test images that kept their original pixels against those decoded from a JPEG copy,
    within the classes that have at least 50 of each kind, averaged over those classes.

    The shared archive's `cifar-10-provenance.npz` (beside it) marks each test image with its original
    pixels (`test_exact`); the others went through JPEG at quality 75. The marks follow the classes (every
    airplane, automobile, ship and truck test image is original, about one in ten of the animals'), so
    an overall split would compare easy classes with hard ones: within each class it does not.
    None without that file."""
    import numpy as np
    import pyarrow.parquet as pq

    if not provenance.is_file():
        return None
    exact = common.exact_test_images(provenance)
    table = pq.read_table(predictions_path, columns=["index", "label", "correct"])
    order = np.argsort(table["index"].to_numpy())  # Rows by test image index, the archive's order.
    labels, correct = table["label"].to_numpy()[order], table["correct"].to_numpy()[order]
    if len(correct) != len(exact):
        raise ValueError(f"{predictions_path} has {len(correct)} rows, {provenance} marks {len(exact)} test images")
    kinds = {"with their original pixels": exact, "decoded from a JPEG copy at quality 75": ~exact}
    classes = [
        k for k in np.unique(labels) if all(((labels == k) & mask).sum() >= MIN_PER_KIND for mask in kinds.values())
    ]
    if not classes:
        return None
    return {
        name: (
            float(np.mean([correct[(labels == k) & mask].mean() for k in classes])),
            int(sum(((labels == k) & mask).sum() for k in classes)),
        )
        for name, mask in kinds.items()
    }


def report(run: RecipeRun, api_url: str | None, deployment: str | None) -> tuple[str, Path]:
    from cifar.results import EvaluationMetrics

    metrics = EvaluationMetrics.read(run.metrics_path)
    histories = metric_histories(run.tracking_uri, run.mlflow_run_id)
    epochs = sorted(histories["loss"])
    if epochs != list(range(1, run.epochs_completed + 1)):
        raise ValueError(f"MLflow holds epochs {epochs[:3]}...{epochs[-3:]}, not 1-{run.epochs_completed}")
    seconds = sum(value for value, _ in histories["epoch_seconds"].values())
    speed = statistics.median(value for value, _ in histories["examples_per_second"].values())
    plot = plot_curves(histories, run.preset, common.REPO_ROOT / "docs" / "images" / f"recipe-{run.preset}.png")

    provenance = Path(run.source).expanduser().parent / common.PROVENANCE_FILE
    by_provenance = accuracy_by_provenance(run.predictions_path, provenance)

    def percent(value: float | None) -> str:
        return "—" if value is None else f"{100 * value:.2f} %"

    lines = [
        f"Preset `{run.preset}` ({run.model}), run `{run.run_name}`, MLflow run "
        f"`{run.mlflow_run_id}`; {common.cpu_model()}, {common.cores()} cores.",
        "",
        "| | |",
        "|---|---|",
        f"| test accuracy (checkpoint of epoch {metrics.epoch}) | **{percent(metrics.test_accuracy)}** "
        f"({metrics.correct:,} of {metrics.num_examples:,}) |",
        f"| with flip TTA | {percent(metrics.flip_tta_accuracy)} |",
        f"| with flip + translation TTA | {percent(metrics.tta_accuracy)} |",
        f"| on the {metrics.deduplicated_examples or 0:,} test images without a near-duplicate in training "
        f"(`test_accuracy_deduplicated`) | {percent(metrics.test_accuracy_deduplicated)} |",
        *[
            f"| on the {count:,} test images {name}, in the classes that have both kinds (mean of the "
            f"classes' accuracies; {provenance.name}) | {percent(value)} |"
            for name, (value, count) in (by_provenance or {}).items()
        ],
        f"| epochs | {run.epochs_completed}, each logged once in MLflow |",
        f"| training wall time (epochs, validation included) | {seconds / 3600:.2f} h |",
        f"| images/s (median over epochs) | {speed:.0f} |",
        "",
        "| class | accuracy | precision | test images |",
        "|---|---:|---:|---:|",
    ]
    for name, values in metrics.per_class.items():
        lines.append(f"| {name} | {percent(values.accuracy)} | {percent(values.precision)} | {values.support:,} |")
    if api_url and deployment:
        epoch_times = {epoch: stamp for epoch, (_, stamp) in histories["loss"].items()}
        rows = sittings(api_url, deployment, epoch_times)
        lines += ["", f"Sittings: {len(rows)} flow runs of `{deployment}`, each continuing the same MLflow run "
                  "(a sitting stopped with its machine ends CRASHED when the next one marks it so: its end time "
                  "is then that moment).", "",
                  "| flow run | started (UTC) | ended | state | epochs logged |", "|---|---|---|---|---|"]  # fmt: skip
        for row in rows:
            span = f"{row['epochs'][0]}-{row['epochs'][-1]}" if row["epochs"] else "none"
            lines.append(f"| {row['name']} | {row['start']} | {row['end']} | {row['state']} | {span} |")
    lines += ["", f"![{run.preset} curves](images/{plot.name})"]
    return "\n".join(lines), plot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--prefect-api", help="the Prefect API the run's deployment is on (for its sittings)")
    parser.add_argument("--deployment", help="flow/deployment, e.g. cifar/full")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    run = RecipeRun.read(args.workdir.expanduser())
    body, plot = report(run, args.prefect_api, args.deployment)
    print(body)
    if args.write_docs:
        common.write_section(f"## Recipe results: `{run.preset}`", body)
    print(f"curves: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
