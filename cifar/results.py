"""What each stage returns: one definition per stage, free of TensorFlow so importing them stays cheap.

Prefect tasks return these as they are (persisted as JSON in the task cache), the flow copies them
into `summary.json`, and every result carries its stage's `key` (see `cifar.reuse`) and whether the
stage `reused` finished work instead of computing it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict


class StageResult(BaseModel):
    """Fields every stage result has."""

    model_config = ConfigDict(extra="forbid")

    key: str  # The stage's key (cifar.reuse): same key, same output.
    reused: bool = False  # True when the stage returned finished work without computing it.


class ArchiveInfo(BaseModel):
    """A verified archive: where it is, its digests, and the source the caller asked for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str  # Absolute path of the verified archive.
    sha256: str
    md5: str
    source: str  # What the caller passed.


class DataResult(StageResult):
    """Where the data stage's output is."""

    data_dir: str
    manifest_path: str
    source_sha256: str
    counts: dict[str, int]  # Examples per split.
    snapshot: str | None = None  # The data snapshot (cifar.data.snapshots) the directory holds.
    additions: list[str] = []  # Its additions' digests.


class ValidationResult(BaseModel):
    """The data validation gate's verdict in a few values; the full report is the JSON at `report_path`."""

    model_config = ConfigDict(extra="forbid")

    passed: bool
    enforce: bool
    snapshot: str
    reference: str
    reference_reason: str
    new_examples: int
    failed: list[str]  # The names of the checks that failed.
    summary: str  # One line: passed, or which checks failed and why.
    report_path: str
    metrics: dict[str, float]  # Every measured value, as logged to MLflow (`data_*`).


class TrainResult(StageResult):
    """Where a training run's checkpoints are, its MLflow run and its validation metrics (no model)."""

    run_name: str
    run_dir: str
    checkpoint_dir: str
    mlflow_run_id: str | None
    tracking_uri: str
    epochs_completed: int
    best_epoch: int | None
    val_accuracy: float | None  # Of the best epoch; None without a validation split.
    metrics: dict[str, float]  # The last epoch's metrics.
    model: str
    training_seconds: float | None = None  # The checkpointed epochs' wall time, validation included.
    estimate: str | None = None  # What was said before this attempt's epochs started (cifar.estimate).
    estimated_seconds: float | None = None


class EvaluationResult(StageResult):
    """Test metrics of the chosen checkpoint and where the evaluation's files are."""

    epoch: int
    test_accuracy: float
    test_loss: float
    flip_tta_accuracy: float | None
    tta_accuracy: float | None = None  # Flip + 1-pixel translations (airbench's TTA level 2).
    num_examples: int
    correct: int  # Correctly classified test images: the exact count behind test_accuracy.
    # On the test images with no near-duplicate in the training batches (cifar.data.neardup).
    test_accuracy_deduplicated: float | None = None
    deduplicated_examples: int | None = None
    new_data_accuracy: float | None = None  # On the `new_data` slice (the additions' validation images).
    new_data_examples: int = 0
    metrics_path: str
    predictions_path: str
    confusion_matrix_plot: str
    misclassified_plot: str
    per_checkpoint: list[dict]  # epoch, accuracy, loss (and val_accuracy) for every evaluated checkpoint.
    # Calibration and robustness (cifar.trust): trust.json, and its headline figures.
    trust_path: str | None = None
    temperature: float | None = None  # Fitted on the validation split; None when nothing was held out.
    ece: float | None = None  # Test ECE with the temperature (without one: of the plain softmax).
    ece_before: float | None = None  # Test ECE of the plain softmax.
    mean_corruption_accuracy: float | None = None  # Over the 15 corruptions x 5 severities.


class ClassMetrics(BaseModel):
    """One class's results on the test split."""

    model_config = ConfigDict(extra="forbid")

    precision: float
    recall: float
    accuracy: float  # Its share of the class's images classified correctly (= recall).
    support: int


class EvaluationMetrics(BaseModel):
    """The evaluation's metrics.json (EvaluationResult.metrics_path): the chosen checkpoint in full."""

    model_config = ConfigDict(extra="forbid")

    epoch: int
    checkpoint: str
    model: str
    num_examples: int
    correct: int
    test_accuracy: float
    test_loss: float
    flip_tta_accuracy: float | None = None
    tta_accuracy: float | None = None
    test_accuracy_deduplicated: float | None = None
    deduplicated_examples: int | None = None
    new_data_accuracy: float | None = None
    new_data_examples: int = 0
    new_data_trained_on: bool = False  # The `new_data` slice was part of training (train.use_all_training_data).
    class_names: list[str]
    per_class: dict[str, ClassMetrics]  # By class name.
    confusion_matrix: list[list[int]]  # Rows: true class, columns: predicted.
    per_checkpoint: list[dict]

    @classmethod
    def read(cls, path: str | Path) -> EvaluationMetrics:
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))


class ExportResult(StageResult):
    """Where the verified SavedModel version lives and what it scored."""

    export_dir: str
    version: int
    verified_accuracy: float
    epoch: int
    signatures: list[str]
    num_examples: int
    correct: int
    temperature: float = 1.0  # Served probabilities are softmax(logits / temperature); the logits are served too.


class PromotionResult(StageResult):
    """The registered version and whether it became the champion, with the numbers behind the decision."""

    registered_model_version: int | None
    champion: bool
    test_accuracy: float
    champion_accuracy_before: float | None
    champion_version_before: int | None = None
    model_uri: str | None = None  # The logged model (models:/<model id>).
    reason: str
    rule: str = ""  # The gate's rule that decided (cifar.comparison.decide).
    p_value: float | None = None  # McNemar's exact test against the champion.
    comparison_artifact: str | None = None  # Where the run keeps the full comparison.
    comparison: dict | None = None  # The full comparison (cifar.comparison.Comparison) as JSON values.
    model_card: str | None = None  # The version's model card (Markdown; HTML beside it).
    awaiting_approval: bool = False  # The gate passed it and promotion.approval is required: a person decides.


class RetrainPlan(BaseModel):
    """What a retrain would use, and whether that differs from what was already trained and judged."""

    model_config = ConfigDict(extra="forbid")

    snapshot: str
    additions: int  # Additions in the snapshot.
    data_key: str
    training_key: str
    champion_version: int | None
    judged_version: int | None = None  # A registered version trained under this very key.
    judged_reason: str | None = None  # The gate's decision on it.
    nothing_changed: bool
    changes: list[str]  # What differs from the champion's training, one line each.
    summary: str  # One sentence for the log, the report and the flow run's state.


ApprovalState = Literal["waiting", "approved", "rejected", "expired"]
Via = Literal["form", "command line", "timeout"]


class ApprovalRecord(BaseModel):
    """A version's sign-off: waiting, or decided (by whom, how, when and why)."""

    model_config = ConfigDict(extra="forbid")

    model_name: str
    version: int
    state: ApprovalState
    flow_run_id: str | None  # The run that waits (and resumes to apply the decision).
    champion_version_before: int | None  # The champion the gate compared it with.
    waiting_since: str
    timeout_hours: float
    decided_at: str | None = None
    decided_by: str | None = None
    via: Via | None = None
    reason: str | None = None

    @property
    def expires_at(self) -> datetime:
        return datetime.fromisoformat(self.waiting_since.replace("Z", "+00:00")) + timedelta(hours=self.timeout_hours)

    def describe(self) -> str:
        if self.state == "waiting":
            return f"{self.model_name} v{self.version} awaits approval (since {self.waiting_since})"
        return f"{self.model_name} v{self.version} {self.state} by {self.decided_by} ({self.via}): {self.reason}"
