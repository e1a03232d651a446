"""The one typed, validated configuration object of the pipeline.

`PipelineConfig` is built once (from a preset plus overrides), validated by pydantic, and passed
down to every stage. Prefect renders it as the flow's parameter form. Presets override only the
fields that differ from the defaults; an invalid value fails early with an error naming the field.

Each section belongs to one stage: `data`, `validate`, `train`, `evaluate`, `export`, `tracking`.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from cifar.io import normalise_digest
from cifar.names import SOURCE_SCHEMES, TRACKING_SCHEMES, check_location, check_name, parse_model_name

OFFICIAL_PYTHON_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
OFFICIAL_PYTHON_MD5 = "c58f30108f718f92721af3b95e74349a"
OFFICIAL_BINARY_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
OFFICIAL_BINARY_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
OFFICIAL_MD5_BY_URL = {OFFICIAL_PYTHON_URL: OFFICIAL_PYTHON_MD5, OFFICIAL_BINARY_URL: OFFICIAL_BINARY_MD5}

TRAIN_EXAMPLES = 50_000  # Images in the official training batches.
TEST_EXAMPLES = 10_000  # Images in the official test batch.

# The presets (PRESETS below): a closed set, so a server validates the choice before a run is created.
PresetName = Literal["default", "smoke", "full", "fast-sgd", "sprint-sgd", "fast", "sprint"]

WORKDIR_ROOT_ENV = "CIFAR_WORKDIR_ROOT"  # Set on a worker: every workdir must lie inside it.

STAGES = ("data", "train", "evaluate", "export")
Stage = Literal["data", "train", "evaluate", "export"]


SafeName = Annotated[str, AfterValidator(check_name)]
SourceLocation = Annotated[str, AfterValidator(lambda value: check_location(value, SOURCE_SCHEMES))]
TrackingLocation = Annotated[str, AfterValidator(lambda value: check_location(value, TRACKING_SCHEMES))]


class Section(BaseModel):
    """Base for every config section: unknown fields are errors, values are re-validated on assignment."""

    # Infinity and NaN are refused everywhere: no setting means them (whitening_bias_epochs=inf crashed training).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class DataConfig(Section):
    """Where the archive comes from and how it becomes TFRecord shards."""

    source: SourceLocation = Field(OFFICIAL_PYTHON_URL, description="http(s)/file:// URL or local path of the archive.")
    sha256: str | None = Field(None, description="Expected SHA-256 of the archive (hex).")
    md5: str | None = Field(None, description="Expected MD5 of the archive (hex); defaults to the official one.")
    validation_size: int = Field(5_000, ge=0, lt=TRAIN_EXAMPLES, description="Images held out of training.")
    train_shards: int = Field(8, ge=1, le=1024)
    validation_shards: int = Field(1, ge=1, le=1024)
    test_shards: int = Field(2, ge=1, le=1024)
    download_retries: int = Field(5, ge=0, le=50, description="Retries of a failed download request.")
    expect_official_counts: bool = Field(True, description="Require 50,000 train / 10,000 test images.")
    snapshot: str = Field(
        "latest",
        pattern=r"^(latest|base|[0-9a-f]{16})$",
        description="Data snapshot to train on: latest (the archive plus every addition ingested into the "
        "workdir), base (the archive alone), or a snapshot key from `python flows/ingest.py --list`.",
    )
    near_duplicate_similarity: float = Field(
        0.97,
        gt=0.5,
        le=1,
        description="Two images are near-duplicates at or above this similarity (shift-, crop-, colour- and "
        "JPEG-robust; cifar.data.neardup): such additions of test images are kept out of training, and test "
        "images with one in the training data are left out of test_accuracy_deduplicated.",
    )

    @field_validator("sha256", "md5")
    @classmethod
    def _hex_digest(cls, value: str | None, info) -> str | None:
        return normalise_digest(info.field_name, value)

    def expected_md5(self) -> str | None:
        """The MD5 to check: the user's, else the official one when the source is an official URL."""
        if self.md5 is not None:
            return self.md5
        if self.sha256 is None:
            return OFFICIAL_MD5_BY_URL.get(self.source)
        return None


class ValidateConfig(Section):
    """The data validation gate before any training: each check's threshold (cifar.data.gate_checks).

    New data (the examples of a snapshot that its reference lacks: the champion's training data, else
    the base archive) is checked for schema problems, size, label and image-statistics drift, exact
    duplicates and leakage of test images. A failed check stops the run before training unless
    `enforce` is false, which records the report and goes on.
    """

    enforce: bool = Field(True, description="Stop the run when a check fails; false records the report and goes on.")
    max_invalid_files: int = Field(
        0,
        ge=0,
        description="Files of an addition that cannot be used (undecodable, truncated, wrong size, unknown class).",
    )
    max_added_ratio: float = Field(
        1.0, gt=0, le=1000, description="Examples added, at most this many times the reference's training examples."
    )
    max_label_drift: float = Field(
        0.25,
        ge=0,
        le=1,
        description="L-infinity distance between the class frequencies of the new data and the reference.",
    )
    max_image_drift: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Jensen-Shannon divergence (base 2, 0..1) of per-image brightness, contrast and channel-mean "
        "histograms, new data vs reference; the worst feature counts.",
    )
    min_examples_for_drift: int = Field(
        200,
        ge=1,
        le=1_000_000,
        description="Fewer new examples than this: drift is reported but not judged (too noisy).",
    )
    max_duplicate_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Share of new examples that exactly duplicate another (they are dropped either way).",
    )
    max_leakage_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Share of new examples that are near-duplicates of test images (kept out either way).",
    )


class TrainConfig(Section):
    """Model, optimizer, schedule, devices and checkpointing."""

    model: str = Field(
        "resnet20",
        pattern=r"^(tutorial|fast|tiny|resnet[0-9]{1,4})$",
        description="tutorial | resnet{6n+2} | fast | tiny",
    )
    epochs: int = Field(30, ge=1, le=10_000)
    batch_size: int = Field(128, ge=1, le=65_536, description="Global batch size (all replicas).")
    steps_per_epoch: int | None = Field(
        None, ge=1, description="Cap on steps per epoch (smoke runs; the sprint preset's shorter epochs)."
    )
    learning_rate: float = Field(0.1, gt=0, le=100, description="Peak learning rate at batch_size 128.")
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    weight_decay: float = Field(2e-4, ge=0, le=1, description="L2 coefficient on conv/dense kernels.")
    optimizer: Literal["sgd", "muon"] = Field(
        "sgd",
        description="sgd: SGD with momentum on every parameter; muon: Muon on the conv filters (no L2 on them), "
        "SGD on the rest (airbench94_muon).",
    )
    muon_learning_rate: float = Field(
        0.24,
        gt=0,
        le=10,
        description="muon only: the filters' peak step per optimizer step, on filters of unit RMS norm; not scaled "
        "with batch_size (airbench94_muon: 0.24 at batch 2,000).",
    )
    muon_momentum: float = Field(0.6, ge=0, lt=1, description="muon only: momentum of the filters' gradients.")
    schedule: Literal["piecewise", "cosine", "onecycle", "constant"] = "piecewise"
    warmup_epochs: float = Field(0.0, ge=0)
    warmup_initial_factor: float = Field(0.0, ge=0, le=1, description="onecycle: rate at the start, x peak.")
    final_learning_rate_factor: float = Field(0.0, ge=0, le=1, description="onecycle: rate at the end, x peak.")
    bias_learning_rate_multiplier: float = Field(
        1.0, gt=0, le=1000, description="Learning-rate multiplier of batch-norm biases (airbench: 64)."
    )
    decay_biases: bool = Field(
        False, description="Decay biases too, by weight_decay / their multiplier: every parameter shrinks alike."
    )
    lookahead_steps: int | None = Field(
        None, ge=1, le=1000, description="Lookahead every N steps toward a slow copy (airbench: 5); None disables."
    )
    whitening_bias_epochs: float | None = Field(
        None, gt=0, description="Epochs the fast net's whitening bias trains before it freezes (airbench: 3)."
    )
    whitening_bias_learning_rate_multiplier: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="Learning-rate multiplier of the fast net's whitening bias (airbench94: 1; airbench94_muon: "
        "that of the batch-norm biases).",
    )
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    ema_decay: float | None = Field(None, gt=0, lt=1, description="Weight EMA decay; None disables EMA.")
    precise_bn_images: int = Field(
        1024,
        ge=0,
        le=50_000,
        description="Before each validation, batch-norm statistics recomputed from this many training images "
        "(precise BN); 0 keeps the moving averages.",
    )
    augment: bool = True
    crop_padding: int | None = Field(
        None, ge=0, le=15, description="Random-translation padding in pixels; None = 4 for 32x32 inputs."
    )
    padding_mode: Literal["zeros", "reflect"] = Field("zeros", description="How the crop padding is filled.")
    flip: Literal["random", "alternating", "none"] = Field(
        "random", description="random: p=0.5 per image and epoch; alternating: airbench's every-other-epoch flip."
    )
    brightness_jitter: float = Field(
        0.0, ge=0, le=2, description="Largest random brightness shift per image, in pixel standard deviations; 0 = off."
    )
    contrast_jitter: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Largest random contrast change per image, a fraction (0.1: x0.9 to x1.1); 0 = off.",
    )
    cache: bool = Field(True, description="Cache decoded uint8 examples in memory.")
    shuffle_buffer: int = Field(10_000, ge=1)
    use_all_training_data: bool = Field(False, description="Train on train+validation (no model selection).")
    gpus: int | list[int] = Field(0, description="0 = CPU, N = first N GPUs, or an explicit list of GPU ids.")
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Processes of one training (MultiWorkerMirroredStrategy): the chief (this run) and workers - 1 "
        "flow runs of worker_deployment, one per work-pool worker; batch_size stays the global batch.",
    )
    worker_deployment: str = Field(
        "cifar-train-worker/worker",
        pattern=r"^[^/\s]+/[^/\s]+$",
        description="workers > 1: the deployment (flow/name) whose flow runs are workers 1..N-1; its pool places them.",
    )
    gang_timeout_seconds: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description="workers > 1: how long each process waits for the others to join (their data prepared) before "
        "every one of them ends, naming who is missing.",
    )
    precision: Literal["auto", "float32", "mixed_bfloat16", "mixed_float16"] = "auto"
    # auto: the faster on this CPU, timed once; fused on GPUs, multi-worker; a resume: its checkpoint's (performance).
    fused_batchnorm: bool | Literal["auto"] = Field("auto", description="Fused, Keras's, or auto: faster here.")
    fused_gelu: bool | Literal["auto"] = Field("auto", description="The fast net's GELU: XLA-fused, Keras's, or auto.")
    jit_compile: Literal["auto", "on", "off"] = Field("auto", description="XLA; auto = on GPU only.")
    keep_checkpoints: int = Field(3, ge=1, le=1000, description="Last K epoch checkpoints kept (+ the best).")
    resume: bool = Field(True, description="Resume from the last completed epoch; False starts fresh.")
    run_name: SafeName | None = Field(None, description="Training directory name; default derives from the config.")
    deterministic: bool = Field(False, description="Deterministic ops and input order (tests).")

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        parse_model_name(value)
        return value

    @field_validator("gpus")
    @classmethod
    def _gpu_request(cls, value: int | list[int]) -> int | list[int]:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"gpus must be >= 0, got {value}")
        if isinstance(value, list) and (any(index < 0 for index in value) or len(set(value)) != len(value)):
            raise ValueError(f"gpus list must hold distinct non-negative ids, got {value}")
        return value

    @model_validator(mode="after")
    def _warmup_within_run(self) -> TrainConfig:
        if self.warmup_epochs >= self.epochs and self.schedule != "constant":
            raise ValueError(f"warmup_epochs ({self.warmup_epochs}) must be shorter than epochs ({self.epochs})")
        if self.lookahead_steps is not None and self.ema_decay is not None:
            raise ValueError("lookahead_steps and ema_decay both average weights: set at most one of them")
        if self.optimizer != "muon":
            # A Muon setting under SGD would be silently ignored: say so instead.
            for name in ("muon_learning_rate", "muon_momentum"):
                default = type(self).model_fields[name].default
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name} ({getattr(self, name)}) applies to optimizer 'muon' only, but optimizer is "
                        f"{self.optimizer!r}: set optimizer to 'muon' or leave {name} at {default}"
                    )
        return self


class EvaluateConfig(Section):
    """Which checkpoints to evaluate on the test split, and how."""

    checkpoints: Literal["best", "all"] = "best"
    flip_tta: bool = Field(True, description="Also report accuracy with horizontal-flip test-time augmentation.")
    translate_tta: bool = Field(
        False, description="Also report accuracy with flips + 1-pixel translations (airbench's TTA level 2)."
    )
    batch_size: int = Field(500, ge=1, le=65_536)
    misclassified_examples: int = Field(36, ge=0, le=400, description="Images in the misclassified grid.")
    calibration: bool = Field(
        True,
        description="Fit a temperature on the validation split (none when nothing is held out) and report ECE, NLL, "
        "Brier before and after it, with accuracy at 50/80/90/95 % coverage.",
    )
    robustness_images: int | None = Field(
        2_000,
        ge=0,
        le=10_000,
        description="Test images measured under the 15 CIFAR-10-C corruptions at 5 severities (a fixed subset; "
        "0: not measured; None: all of them, for headline figures).",
    )


class ExportConfig(Section):
    """SavedModel export, registry and the promotion gate (cifar.comparison: champion vs challenger, same images)."""

    model_name: SafeName = Field("cifar10", description="Registered model name; also export/<model_name>/.")
    register_model: bool = True
    min_accuracy: float = Field(0.0, ge=0, le=1, description="Test accuracy a model needs to become champion.")
    min_improvement: float = Field(
        0.0,
        ge=-1,
        le=1,
        description="Test accuracy gain over the champion needed to replace it; negative: a tolerated loss; "
        "a positive gain must also be significant.",
    )
    max_class_drop: float = Field(
        0.05, ge=0, le=1, description="Largest loss of one class's accuracy against the champion (0.05 = 5 points)."
    )
    significance: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Level of McNemar's exact test on the images where the models disagree: a challenger "
        "significantly worse is refused whatever the tolerance.",
    )
    max_corruption_drop: float | None = Field(
        0.03,
        ge=0,
        le=1,
        description="Largest loss of mean accuracy under the CIFAR-10-C corruptions against the champion, on the same "
        "corrupted images (0.03 = 3 points; null: reported, not a rule).",
    )
    max_ece_increase: float | None = Field(
        0.03,
        ge=0,
        le=1,
        description="Largest rise of the served probabilities' calibration error (ECE, 15 bins) on the test split "
        "against the champion's (0.03 = 3 points; null: reported, not a rule).",
    )
    # The model card's robustness table: its 5 perturbations cost ~1.8 s per 1,000 images on 2 AMD EPYC cores.
    card_robustness_examples: int | None = Field(2_000, ge=1, description="The first N test images (None: all).")


class PromotionConfig(Section):
    """Who moves the champion once the gate passes a challenger: the gate itself, or a person (cifar.approval)."""

    approval: Literal["auto", "required"] = Field(
        "auto",
        description="auto: the gate's pass moves the alias; required: a person approves or rejects it first "
        '(the run waits without holding a worker; README "Continuous training").',
    )
    approval_timeout_hours: float = Field(
        72.0, gt=0, le=24 * 90, description="Hours a challenger waits for a decision before it expires (not promoted)."
    )


class MonitorConfig(Section):
    """What batch prediction judges drift by (cifar.monitoring): the images it scores and its answers."""

    max_image_drift: float = Field(
        0.05, ge=0, le=1, description="Jensen-Shannon divergence of scored images vs training images, worst feature."
    )
    max_prediction_drift: float = Field(
        0.2, ge=0, le=1, description="L-infinity distance of predicted class frequencies vs the test split's."
    )
    confidence_threshold: float = Field(0.5, gt=0, lt=1, description="An answer below this top probability is unsure.")
    max_low_confidence_increase: float = Field(
        0.15, ge=0, le=1, description="Rise of the unsure answers' share above the test split's (0.15 = 15 points)."
    )
    min_examples: int = Field(200, ge=1, description="Fewer scored images than this: drift is reported, not judged.")


class TrackingConfig(Section):
    """MLflow tracking; None means a SQLite store under the workdir unless MLFLOW_TRACKING_URI is set."""

    tracking_uri: TrackingLocation | None = None
    experiment: SafeName = Field("cifar10", description="MLflow experiment; also mlartifacts/<experiment>/.")
    run_name: SafeName | None = Field(
        None, description="MLflow run name; default: train.run_name, else preset-model-lr-UTC time."
    )
    system_metrics: bool = True


class TrialLink(Section):
    """Set by the `cifar-search` flow on a trial's run: which trial of which Optuna study this run is.

    The run reports its validation accuracy to the study after every epoch, stops early when the
    study's pruner says so, and records its outcome there. Not part of any stage key: the same
    training settings are the same training, whichever trial asks for them.
    """

    storage: str | None = Field(
        None,
        description="The study's storage: a journal file path or a database URL without a password; "
        "None reads CIFAR_SEARCH_STORAGE on the worker (where a password may be kept).",
    )
    study_name: SafeName = Field(description="The Optuna study.")
    number: int = Field(ge=0, description="The trial's number in the study.")


# The section `validate` shadows pydantic's deprecated `BaseModel.validate` classmethod, which nothing here
# calls; the field is what `--set validate.enforce=false` names, so it keeps that name.
warnings.filterwarnings("ignore", message='Field name "validate" in ', category=UserWarning)


class PipelineConfig(Section):
    """Everything a pipeline run needs, validated once and passed down."""

    preset: PresetName = Field("default", description="The named recipe every other field overrides.")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    data: DataConfig = DataConfig()
    validate: ValidateConfig = ValidateConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    export: ExportConfig = ExportConfig()
    promotion: PromotionConfig = PromotionConfig()
    monitor: MonitorConfig = MonitorConfig()
    tracking: TrackingConfig = TrackingConfig()
    trial: TrialLink | None = Field(None, description="Set by `cifar-search` only: the trial this run is.")

    def flat(self) -> dict[str, Any]:
        """Every field as `section.field` -> value, for logging as MLflow params."""
        flat: dict[str, Any] = {"preset": self.preset, "seed": self.seed}
        for section in ("data", "validate", "train", "evaluate", "export", "promotion", "monitor", "tracking"):
            for key, value in getattr(self, section).model_dump().items():
                flat[f"{section}.{key}"] = value
        return flat


# Presets override only what differs from the defaults above. (A table: kept dense, one recipe a block.)
# fmt: off
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    # A few minutes on 2 CPU cores: proves every stage end to end, not accuracy.
    "smoke": {
        "train": {"model": "tutorial", "epochs": 2, "steps_per_epoch": 60, "batch_size": 128,
                  "schedule": "constant", "learning_rate": 0.05, "keep_checkpoints": 2},
        # 20 images under each corruption: the robustness code runs, in about a second; the figure is noise.
        "evaluate": {"flip_tta": False, "robustness_images": 20},
        # Nor does the gate weigh what 20 images and a barely trained net say: reported, not rules.
        "export": {"max_corruption_drop": None, "max_ece_increase": None},
    },
    # The estimator's ResNet recipe: 0.1 at batch 128, x0.1/x0.01/x0.002 at epochs 82/123/300 of ~170.
    "full": {"train": {"model": "resnet56", "epochs": 164, "schedule": "piecewise"}},
    # Time-to-accuracy recipe: airbench94 (Keller Jordan, cifar10-airbench), hyperparameters converted
    # to this pipeline's conventions (mean loss, learning rate quoted at batch 128, L2 through momentum):
    # airbench's lr 11.5 and weight decay 0.0153 "per 1024 examples" with momentum 0.85 are a peak
    # rate of 1.5 at batch 1024 (0.1875 at 128) and an L2 coefficient of 0.0153 / 7.667 / 1.5 = 1.33e-3.
    # airbench trains 9.9 epochs (94% on a GPU); on 2 Xeon cores with AMX 16 epochs (48 steps of 1,024)
    # fit in ~12 minutes (~16.5 on 2 AMD EPYC cores without AMX) and gain ~0.8 points over 10, so the
    # preset trains 16, warming up over 23% of them. `fast-sgd` keeps it reachable by name.
    "fast-sgd": {
        "data": {"validation_size": 0},
        "train": {"model": "fast", "epochs": 16, "batch_size": 1024, "schedule": "onecycle",
                  "learning_rate": 0.1875, "momentum": 0.85, "nesterov": True,
                  "warmup_epochs": 3.68, "warmup_initial_factor": 0.2, "final_learning_rate_factor": 0.07,
                  "weight_decay": 1.33e-3, "decay_biases": True, "bias_learning_rate_multiplier": 64.0,
                  "label_smoothing": 0.2, "lookahead_steps": 5, "whitening_bias_epochs": 3.0,
                  "crop_padding": 2, "padding_mode": "reflect", "flip": "alternating",
                  "shuffle_buffer": 50_000, "use_all_training_data": True},
        "evaluate": {"checkpoints": "best", "flip_tta": True, "translate_tta": True},
    },
}
# fmt: on


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# The fast-sgd recipe cut to under 3 minutes of training on 2 AMX Xeon cores (5.4 on 2 EPYC cores): 3 epochs
# at batch 512 (291 steps, more updates for the same images than batch 1,024), the whitening bias trained
# for the first epoch. `sprint-sgd` keeps it reachable by name.
PRESETS["sprint-sgd"] = _deep_merge(
    PRESETS["fast-sgd"],
    {"train": {"epochs": 3, "batch_size": 512, "warmup_epochs": 0.69, "whitening_bias_epochs": 1.0}},
)
# The Muon recipes (issue 27; airbench94_muon's optimizer retuned on our copy, docs/BENCHMARKS.md "Time to
# accuracy"): Muon on the conv filters, SGD on the rest, fewer epochs. Muon's step has a fixed size per
# update, so the record's filter rate 0.24 (for ~200 updates of 2,000 images) shrinks as updates grow:
# `fast` takes 12 epochs (not 16) of 97 updates of 512 at 0.08, warming up over the same 23 %; `sprint`
# cuts each of its 3 epochs to 73 of 97 updates (about 2.25 epochs of images) at 0.16.
PRESETS["fast"] = _deep_merge(
    PRESETS["fast-sgd"],
    {
        "train": {
            "optimizer": "muon",
            "muon_learning_rate": 0.08,
            "epochs": 12,
            "batch_size": 512,
            "warmup_epochs": 2.76,
        }
    },
)
PRESETS["sprint"] = _deep_merge(
    PRESETS["sprint-sgd"], {"train": {"optimizer": "muon", "muon_learning_rate": 0.16, "steps_per_epoch": 73}}
)


def make_config(preset: str = "default", overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Builds a validated config from a preset name and nested overrides (`{"train": {"epochs": 3}}`)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: expected one of {', '.join(sorted(PRESETS))}")
    values = _deep_merge(PRESETS[preset], overrides or {})
    values["preset"] = preset
    return PipelineConfig.model_validate(values)


FROM_PRESET = "None (the default): from the preset."  # How a form field left alone reads in the Prefect UI.


def _overrides_model(model: type[BaseModel]) -> type[BaseModel]:
    """`model` with every field optional and None by default: what a deployment form submits.

    A form fills every field it shows with its schema default; with the config's own defaults there,
    an untouched "Custom run" of the smoke deployment would override the smoke preset with the default
    one. Here a field left alone is null, and null means "the preset's value". Types, ranges and closed
    sets stay in the schema, so the server rejects a bad value before it creates a run.
    """
    fields: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            section = _overrides_model(annotation)
            title = f"{name.capitalize()} (fields set to None: from the preset)"
            fields[name] = (section, Field(default_factory=section, title=title, description=field.description))
            continue
        constrained = Annotated[(annotation, *field.metadata)] if field.metadata else annotation
        description = f"{field.description} {FROM_PRESET}" if field.description else FROM_PRESET
        # None must stay in the schema: the server validates the form's nulls against it.
        fields[name] = (Optional[constrained], Field(None, description=description))  # noqa: UP045
    return create_model(f"{model.__name__}Overrides", __base__=Section, __doc__=model.__doc__, **fields)


class ConfigOverrides(_overrides_model(PipelineConfig)):  # type: ignore[misc]
    """A preset plus the fields that differ from it: the `config` parameter of every flow."""

    preset: PresetName = Field("default", description="The named recipe; every field left empty comes from it.")

    @model_validator(mode="before")
    @classmethod
    def _from_config(cls, value: Any) -> Any:
        """A complete PipelineConfig is accepted too (Python callers): every field given."""
        return value.model_dump() if isinstance(value, PipelineConfig) else value

    @classmethod
    def of(cls, config: PipelineConfig) -> ConfigOverrides:
        """Overrides that resolve to exactly `config` (every field given)."""
        return cls.model_validate(config.model_dump())

    def resolve(self) -> PipelineConfig:
        """The preset's config with the given (non-empty) fields on top, validated as a whole."""
        return make_config(self.preset, _given(self.model_dump(exclude={"preset"})))


def _given(values: dict[str, Any]) -> dict[str, Any]:
    """`values` without the None leaves (fields left empty) and without sections left wholly empty."""
    given: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            value = _given(value)
            if value:
                given[key] = value
        elif value is not None:
            given[key] = value
    return given


def resolve_workdir(workdir: str | Path) -> Path:
    """The absolute workdir, created if missing; inside `CIFAR_WORKDIR_ROOT` when that is set.

    A worker that runs whatever the deployment form sends sets CIFAR_WORKDIR_ROOT to confine every
    run's files to one tree; a workdir outside it is refused before anything is written.
    """
    text = str(workdir)
    if not text.strip() or any(ord(character) < 32 for character in text):
        raise ValueError(f"workdir must be a path without control characters, got {text!r}")
    path = Path(text).expanduser().resolve()
    root = os.environ.get(WORKDIR_ROOT_ENV)
    if root and not path.is_relative_to(Path(root).expanduser().resolve()):
        raise ValueError(f"workdir {path} is outside {WORKDIR_ROOT_ENV}={root}: choose a workdir inside it")
    path.mkdir(parents=True, exist_ok=True)
    return path
