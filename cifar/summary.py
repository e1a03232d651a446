"""What a pipeline run produced, as one typed record: each stage's result in its own field.

`PipelineSummary` is what the `cifar` flow returns and what `WORKDIR/summary.json` holds (its JSON dump,
`summary_version` 2: README, "What a run produces"). The lines the command line prints, the rows of the
run's report and the MLflow links are derived here, so every reader sees the same values.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, computed_field, model_validator

from cifar.config import PipelineConfig, Stage
from cifar.io import read_json
from cifar.results import (
    ApprovalRecord,
    ArchiveInfo,
    DataResult,
    EvaluationResult,
    ExportResult,
    PromotionResult,
    RetrainPlan,
    TrainResult,
    ValidationResult,
)
from cifar.text import duration
from cifar.tracking import UI_MODE_QUERY, mlflow_client, runs_table_url
from cifar.workdir import summary_path

SUMMARY_VERSION = 2  # 1 was the flat dict of issue 34 and before (no `summary_version` key).
logger = logging.getLogger(__name__)
LOCAL_MLFLOW_UI = "http://127.0.0.1:5000"  # Where `make mlflow-ui` serves a local store (MLFLOW_PORT=5000).


def training_time(training: TrainResult) -> str | None:
    """What the epochs took, and what was estimated before the last attempt's epochs (cifar.estimate)."""
    took = f"{training.training_seconds / 60:.1f} min" if training.training_seconds else None
    estimated = f"estimated {duration(training.estimated_seconds)}" if training.estimated_seconds else None
    if took and estimated:
        return f"{took} ({estimated})"
    return took or estimated


def percent(value: float | None) -> str | None:
    """`0.91234` -> `91.23 %`; None stays None (callers show `-` or leave the row out)."""
    return None if value is None else f"{100 * float(value):.2f} %"


class MlflowRunLink(BaseModel):
    """A run in the MLflow UI: its name, its page, its experiment's runs table and, for a local store, the
    command that serves that UI."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    name: str | None  # None when the store could not be asked.
    url: str
    runs_url: str | None = None
    ui_command: str | None = None  # `make mlflow-ui MLFLOW_TRACKING_URI=...` for a store no server serves.

    @classmethod
    def lookup(cls, tracking_uri: str | None, run_id: str | None) -> MlflowRunLink | None:
        """The link of `run_id` in `tracking_uri`'s UI (None without either); asks the store for its name."""
        if not tracking_uri or not run_id:
            return None
        try:
            info = mlflow_client(tracking_uri).get_run(run_id).info
            experiment_id, name = info.experiment_id, info.run_name
        except Exception as error:  # The link still leads to the run; only its name is missing.
            logger.warning("Could not look up MLflow run %s: %s", run_id, error)
            experiment_id, name = None, None
        served = urlsplit(tracking_uri).scheme in {"http", "https"}
        ui_url = tracking_uri.rstrip("/") if served else LOCAL_MLFLOW_UI
        fragment = f"#/experiments/{experiment_id}/runs/{run_id}" if experiment_id else f"#/runs/{run_id}"
        return cls(
            run_id=run_id,
            name=name,
            url=f"{ui_url}/{fragment}?{UI_MODE_QUERY}",
            runs_url=runs_table_url(ui_url, experiment_id) if experiment_id else None,
            ui_command=None if served else f"make mlflow-ui MLFLOW_TRACKING_URI={tracking_uri}",
        )

    def markdown(self) -> str:
        """A clickable link to the run (and its runs table); for a local store, with the command to run first."""
        link = f"[{self.name or self.run_id}]({self.url})"
        if self.runs_url:
            link += f", [all runs]({self.runs_url})"
        return f"{link} (local store: run `{self.ui_command}` first)" if self.ui_command else link


class PipelineSummary(BaseModel):
    """One pipeline run: its request, each stage's result (None when the run stopped before it), how each task ended."""

    model_config = ConfigDict(extra="forbid")

    summary_version: Literal[2] = SUMMARY_VERSION
    until: Stage  # The last stage asked for (a pruned trial stops after training anyway).
    workdir: str
    config: PipelineConfig  # Fully resolved: the preset with every override applied.
    archive: ArchiveInfo
    data: DataResult
    validation: ValidationResult
    training: TrainResult | None = None
    mlflow: MlflowRunLink | None = None  # The training run in the MLflow UI.
    trial_state: str | None = None  # COMPLETE or PRUNED when the run is a trial of a search.
    evaluation: EvaluationResult | None = None
    export: ExportResult | None = None
    promotion: PromotionResult | None = None  # The registry's decision (export.register_model).
    approval: ApprovalRecord | None = None  # A person's decision on it (promotion.approval required).
    retrain: RetrainPlan | None = None  # What changed, when a `cifar-retrain` run trained this.
    task_states: dict[str, str] = {}  # Task name -> Completed, Cached or Reused.

    @model_validator(mode="before")
    @classmethod
    def _without_derived(cls, values: Any) -> Any:
        """summary.json carries the derived `stage_keys` for its readers; they are not read back."""
        if isinstance(values, dict) and "stage_keys" in values:
            values = {name: value for name, value in values.items() if name != "stage_keys"}
        return values

    @computed_field
    @property
    def stage_keys(self) -> dict[str, str]:
        """Each stage's key (cifar.reuse) by stage: data, train, evaluate, export, register."""
        stages = {
            "data": self.data,
            "train": self.training,
            "evaluate": self.evaluation,
            "export": self.export,
            "register": self.promotion,
        }
        return {stage: result.key for stage, result in stages.items() if result is not None}

    @property
    def preset(self) -> str:
        return self.config.preset

    @property
    def summary_path(self) -> str:
        """WORKDIR/summary.json: the latest run's summary."""
        return str(summary_path(Path(self.workdir)))

    @property
    def pruned(self) -> bool:
        """Whether the search's pruner stopped this trial (its flow run ends `Pruned`)."""
        return self.trial_state == "PRUNED"

    @classmethod
    def read(cls, path: str | Path) -> PipelineSummary:
        """A summary.json of this layout; ValueError naming the file for another layout."""
        values = read_json(path)
        if values.get("summary_version") != SUMMARY_VERSION:
            found = values.get("summary_version", 1)
            raise ValueError(f"{path} has summary_version {found}; this code reads version {SUMMARY_VERSION}")
        return cls.model_validate(values)

    def state(self, *tasks: str) -> str:
        """How these tasks ended, `  [prepare cached]`; empty when none of them ran."""
        shown = [f"{task} {self.task_states[task].lower()}" for task in tasks if task in self.task_states]
        return f"  [{', '.join(shown)}]" if shown else ""

    def describe(self) -> str:
        """A few human lines about what the run produced (the command line's, and the flow run's last log lines)."""
        counts = self.data.counts
        lines = [
            f"cifar pipeline done (preset {self.preset}, until {self.until})",
            f"  data       {self.data.data_dir}  train/validation/test "
            f"{counts.get('train')}/{counts.get('validation')}/{counts.get('test')}{self.state('download', 'prepare')}",
            f"  validation snapshot {self.validation.snapshot}: {self.validation.summary}{self.state('validate-data')}",
        ]
        if self.training is not None:
            lines.append(
                f"  training   {self.training.run_name}: {self.training.epochs_completed} epochs, best epoch "
                f"{self.training.best_epoch}, validation accuracy {percent(self.training.val_accuracy) or '-'}"
                f"{self.state('train')}"
            )
        if self.evaluation is not None:
            lines.append(self._test_line(self.evaluation))
            trust = self._trust_text(self.evaluation)
            if trust:
                lines.append(f"  trust      {trust}")
        if self.export is not None:
            lines.append(f"  export     {self.export.export_dir}{self.state('export')}")
        if self.promotion is not None:
            verdict = "champion" if self.promotion.champion else "not promoted"
            lines.append(
                f"  registry   version {self.promotion.registered_model_version}, {verdict}: "
                f"{self.promotion.reason}{self.state('register')}"
            )
        if self.approval is not None:
            lines.append(f"  approval   {self.approval.describe()}")
        if self.mlflow is not None:
            serve = f"  (after `{self.mlflow.ui_command}`)" if self.mlflow.ui_command else ""
            lines.append(f"  mlflow     {self.mlflow.url}{serve}")
        lines.append(f"  summary    {self.summary_path}")
        return "\n".join(lines)

    def _test_line(self, evaluation: EvaluationResult) -> str:
        extras = [
            f"{name} {percent(value)}"
            for name, value in (
                ("flip TTA", evaluation.flip_tta_accuracy),
                ("flip+translate TTA", evaluation.tta_accuracy),
                ("deduplicated", evaluation.test_accuracy_deduplicated),
            )
            if value is not None
        ]
        if evaluation.new_data_accuracy is not None:
            extras.append(f"new data {percent(evaluation.new_data_accuracy)} of {evaluation.new_data_examples}")
        return (
            f"  test       accuracy {percent(evaluation.test_accuracy)}, loss {evaluation.test_loss:.4f}"
            f"{''.join(', ' + item for item in extras)}{self.state('evaluate')}"
        )

    @staticmethod
    def _trust_text(evaluation: EvaluationResult) -> str | None:
        """Calibration and robustness (cifar.trust), when they were measured."""
        parts = []
        if evaluation.ece is not None:
            if evaluation.temperature:
                how = f"with temperature {evaluation.temperature:.2f}, {percent(evaluation.ece_before)} without"
            else:
                how = "no validation split to fit a temperature on"
            parts.append(f"ECE {percent(evaluation.ece)} ({how})")
        if evaluation.mean_corruption_accuracy is not None:
            parts.append(
                f"mean accuracy under 15 corruptions x 5 severities {percent(evaluation.mean_corruption_accuracy)}"
            )
        return ", ".join(parts) or None

    def report_rows(self) -> list[tuple[str, str]]:
        """The report's table (name, value), leaving out what this run has no value for."""
        training, evaluation, promotion = self.training, self.evaluation, self.promotion
        examples = "/".join(str(self.data.counts.get(split, "-")) for split in ("train", "validation", "test"))
        rows: list[tuple[str, Any]] = [
            ("Data", self.data.data_dir),
            ("Examples (train/validation/test)", examples),
            ("Data snapshot", self.data.snapshot),
            ("Data validation", self.validation.summary),
            ("Training run", self.training_run()),
            ("Epochs completed", training and training.epochs_completed),
            ("Training time (estimated before it)", training and training_time(training)),
            ("Validation accuracy (best epoch)", training and percent(training.val_accuracy)),
        ]
        if evaluation is not None:
            rows += [
                ("Test accuracy", percent(evaluation.test_accuracy)),
                ("Test accuracy with flip TTA", percent(evaluation.flip_tta_accuracy)),
                ("Test accuracy with flip + translate TTA", percent(evaluation.tta_accuracy)),
                (
                    f"Test accuracy without near-duplicates of training images ({evaluation.deduplicated_examples})",
                    percent(evaluation.test_accuracy_deduplicated),
                ),
                (f"New data accuracy ({evaluation.new_data_examples} images)", percent(evaluation.new_data_accuracy)),
                ("Calibration and robustness", self._trust_text(evaluation)),
            ]
        rows.append(("Export", self.export and self.export.export_dir))
        if promotion is not None:
            rows += [
                ("Registered version", promotion.registered_model_version),
                ("Champion", promotion.champion),
                ("Promotion", promotion.reason),
            ]
        rows.append(("MLflow run", self.mlflow.markdown() if self.mlflow else training and training.mlflow_run_id))
        return [(name, str(value)) for name, value in rows if value is not None]

    def training_run(self) -> str | None:
        """The MLflow run's name (what the UIs show) and the training directory's (where the files are)."""
        if self.training is None:
            return None
        directory, name = self.training.run_name, self.mlflow and self.mlflow.name
        return f"{name} (directory runs/{directory})" if name else directory
