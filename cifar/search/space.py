"""The search space: which training settings a search varies, over what values, sampled and pruned how.

A typed `SearchSpace`, its presets and `load_space`; validated when built and against the base config
(`check_against`), so a value the pipeline would refuse fails before any trial starts, naming the field.
Samplers, pruners and `first_trials`: docs/ORCHESTRATION.md ("Space").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, model_validator

from cifar.config import PipelineConfig, SafeName, TrainConfig
from cifar.text import printable, shortened

# Fields a search never varies: how a run is resumed or named, and the machine it runs on.
FIXED_TRAIN_FIELDS = frozenset({"resume", "run_name", "gpus", "deterministic", "cache"})
OBJECTIVE = "val_accuracy"  # What every trial maximises: the best epoch's validation accuracy.


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Categorical(Spec):
    """One of a list of values (the only kind a grid search takes)."""

    type: Literal["categorical"] = "categorical"
    choices: list[StrictBool | StrictInt | float | str] = Field(min_length=1)

    def bounds(self) -> list[Any]:
        return list(self.choices)

    def refusal(self, value: Any) -> str | None:
        """Why `value` is not one this distribution can take, or None when it is."""
        # True == 1 in Python; a flag is not a number here.
        if any(choice == value and isinstance(choice, bool) == isinstance(value, bool) for choice in self.choices):
            return None
        return f"{value!r} is not one of the choices {self.choices}"


class FloatRange(Spec):
    """A float in [low, high], uniform or (with `log`) log-uniform."""

    type: Literal["float"] = "float"
    low: float
    high: float
    log: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> FloatRange:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs low > 0, got {self.low}")
        return self

    def bounds(self) -> list[Any]:
        return [self.low, self.high]

    def refusal(self, value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{value!r} is not a number"
        return None if self.low <= value <= self.high else f"{value!r} is outside [{self.low}, {self.high}]"


class IntRange(Spec):
    """An integer in [low, high] in steps of `step` (or log-uniform)."""

    type: Literal["int"] = "int"
    low: int
    high: int
    step: int = Field(1, ge=1)
    log: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and (self.low < 1 or self.step != 1):
            raise ValueError("a log range needs low >= 1 and step 1")
        return self

    def bounds(self) -> list[Any]:
        return [self.low, self.high]

    def refusal(self, value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{value!r} is not an integer"
        if not self.low <= value <= self.high:
            return f"{value!r} is outside [{self.low}, {self.high}]"
        if not self.log and (value - self.low) % self.step:
            return f"{value!r} is not on the step {self.step} from {self.low}"
        return None


Distribution = Annotated[Categorical | FloatRange | IntRange, Field(discriminator="type")]


class PrunerSpec(Spec):
    """How hopeless trials are stopped; epochs are the steps every trial reports."""

    kind: Literal["median", "halving", "none"] = Field(
        "median", description="median: stop a trial below the median of finished trials at the same epoch; "
        "halving: successive halving (asynchronous)."
    )  # fmt: skip
    startup_trials: int = Field(
        2, ge=0, description="median: finished trials needed before any trial is pruned (early trials set the bar)."
    )
    min_epochs: int = Field(1, ge=1, description="Epochs every trial trains before it can be pruned.")
    reduction_factor: int = Field(3, ge=2, description="halving: 1 in reduction_factor trials goes on at each rung.")

    def make_pruner(self):
        import optuna

        if self.kind == "median":
            return optuna.pruners.MedianPruner(n_startup_trials=self.startup_trials, n_warmup_steps=self.min_epochs)
        if self.kind == "halving":
            return optuna.pruners.SuccessiveHalvingPruner(
                min_resource=self.min_epochs, reduction_factor=self.reduction_factor
            )
        return optuna.pruners.NopPruner()


class SearchSpace(Spec):
    """Distributions over training settings, the sampler and the pruner of one search."""

    name: SafeName = Field(description="Names the study (with the preset and a digest of the settings).")
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    params: dict[str, Distribution] = Field(min_length=1, description="train.<field> -> its distribution.")
    pruner: PrunerSpec = PrunerSpec()
    first_trials: list[dict[str, StrictBool | StrictInt | float | str]] = Field(
        default_factory=list,
        description="Settings tried first, in order, before the sampler picks (a field left out is sampled).",
    )

    @model_validator(mode="after")
    def _known_fields(self) -> SearchSpace:
        for field in self.params:
            if field not in TrainConfig.model_fields:
                raise ValueError(f"params.{field}: not a train field (see cifar/config.py TrainConfig)")
            if field in FIXED_TRAIN_FIELDS:
                raise ValueError(f"params.{field}: a search does not vary {field}")
        if self.sampler == "grid":
            ranges = [field for field, spec in self.params.items() if not isinstance(spec, Categorical)]
            if ranges:
                raise ValueError(f"params.{ranges[0]}: a grid search takes categorical choices only")
            if self.first_trials:
                raise ValueError(
                    "first_trials: a grid search tries every combination once; first trials are for tpe and random"
                )
        for index, point in enumerate(self.first_trials):
            for field, value in point.items():
                if field not in self.params:
                    raise ValueError(f"first_trials[{index}].{field}: not one of the space's params")
                refusal = self.params[field].refusal(value)
                if refusal:
                    raise ValueError(f"first_trials[{index}].{field}: {refusal}")
        return self

    def check_against(self, config: PipelineConfig) -> None:
        """Raises ValueError naming `space.params.<field>` when a value the space can take is one
        the pipeline would refuse on top of `config` (bounds are checked for ranges)."""
        if config.data.validation_size == 0 or config.train.use_all_training_data:
            raise ValueError(
                f"a search ranks trials by {OBJECTIVE}: it needs a validation split "
                "(data.validation_size > 0 and train.use_all_training_data false)"
            )
        for field, spec in self.params.items():
            for value in spec.bounds():
                refuse_settings(config, {field: value}, f"space.params.{field}: {value!r}")
        for index, point in enumerate(self.first_trials):
            refuse_settings(config, point, f"space.first_trials[{index}]: {point}")

    def grid(self) -> dict[str, list[Any]]:
        """Every categorical choice by field (the grid sampler's search space)."""
        return {field: spec.bounds() for field, spec in self.params.items() if isinstance(spec, Categorical)}

    def grid_size(self) -> int | None:
        """Points in the grid, or None for a sampler that can go on forever."""
        if self.sampler != "grid":
            return None
        size = 1
        for choices in self.grid().values():
            size *= len(choices)
        return size

    def make_sampler(self, seed: int):
        import optuna

        if self.sampler == "grid":
            return optuna.samplers.GridSampler(self.grid(), seed=seed)
        if self.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        # The constant liar counts trials still running as bad, so parallel asks spread out.
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)

    def suggest(self, trial) -> dict[str, Any]:
        """The training settings of an Optuna trial, by field name."""
        values: dict[str, Any] = {}
        for field, spec in self.params.items():
            if isinstance(spec, Categorical):
                values[field] = trial.suggest_categorical(field, spec.choices)
            elif isinstance(spec, FloatRange):
                values[field] = trial.suggest_float(field, spec.low, spec.high, log=spec.log)
            else:
                step = None if spec.log else spec.step
                values[field] = trial.suggest_int(field, spec.low, spec.high, step=step or 1, log=spec.log)
        return values


def refuse_settings(config: PipelineConfig, values: dict[str, Any], what: str) -> None:
    """Raises ValueError starting with `what` when `config.train` with `values` is refused."""
    try:
        config.train.model_validate({**config.train.model_dump(), **values})
    except ValidationError as error:
        detail = "; ".join(item["msg"].removeprefix("Value error, ") for item in error.errors())
        raise ValueError(f"{what} is refused: {detail}") from None


def log_range(low: float, high: float) -> FloatRange:
    return FloatRange(low=low, high=high, log=True)


# fmt: off
SPACE_PRESETS: dict[str, SearchSpace] = {
    # Minutes on 2 CPU cores with the smoke preset: two small nets, the rates that matter at 2-3
    # epochs (0.003 is nearly hopeless there, 0.3 often diverges), decay and smoothing, 2-3 epochs.
    "smoke": SearchSpace(
        name="smoke",
        params={
            "model": Categorical(choices=["tiny", "tutorial"]),
            "learning_rate": log_range(0.003, 0.3),
            "weight_decay": log_range(1e-5, 1e-3),
            "batch_size": Categorical(choices=[64, 128]),
            "epochs": Categorical(choices=[2, 3]),
            "label_smoothing": FloatRange(low=0.0, high=0.2),
        },
        pruner=PrunerSpec(kind="median", startup_trials=2, min_epochs=1),
    ),
    # The ResNet recipe (default preset: 30 epochs, piecewise schedule) on GPUs: depth, peak rate,
    # decay, batch and smoothing. Half the epochs warm up before the median pruner may stop a trial.
    "resnet": SearchSpace(
        name="resnet",
        params={
            "model": Categorical(choices=["resnet20", "resnet32", "resnet44"]),
            "learning_rate": log_range(0.02, 0.4),
            "weight_decay": log_range(5e-5, 1e-3),
            "batch_size": Categorical(choices=[128, 256]),
            "label_smoothing": FloatRange(low=0.0, high=0.15),
        },
        pruner=PrunerSpec(kind="median", startup_trials=5, min_epochs=10),
    ),
    # flows/sweep.py's default grid as a search: every (model, learning rate) once, no pruning.
    "grid": SearchSpace(
        name="grid",
        sampler="grid",
        params={"model": Categorical(choices=["tiny", "tutorial"]), "learning_rate": Categorical(choices=[0.02, 0.05])},
        pruner=PrunerSpec(kind="none"),
    ),
}
# fmt: on


def load_space(name_or_path: str | Path | SearchSpace | dict[str, Any]) -> SearchSpace:
    """A preset by name, a JSON or YAML file of a `SearchSpace`, or the spec itself (validated). A file:

    {"name": "lr-only", "sampler": "tpe",
     "params": {"learning_rate": {"type": "float", "low": 0.001, "high": 0.5, "log": true}},
     "pruner": {"kind": "median", "startup_trials": 2, "min_epochs": 1},
     "first_trials": [{"learning_rate": 0.05}]}
    """
    if isinstance(name_or_path, SearchSpace):
        return name_or_path
    if isinstance(name_or_path, dict):
        return SearchSpace.model_validate(name_or_path)
    text = str(name_or_path)
    if text in SPACE_PRESETS:
        return SPACE_PRESETS[text]
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(f"space: {text!r} is neither a preset ({', '.join(sorted(SPACE_PRESETS))}) nor a file")
    values = _read_document(path)
    if not isinstance(values, dict):
        raise ValueError(f"space: {path} must hold a mapping, got {type(values).__name__}")
    return SearchSpace.model_validate(values)


MAX_DOCUMENT_VALUES = 10_000  # A space holds tens; YAML aliases can make 300 bytes stand for billions.


def _read_document(path: Path) -> Any:
    """The JSON or YAML (by suffix) value of a space file; ValueError naming the file when it cannot be read, or
    when it stands for more than MAX_DOCUMENT_VALUES values once its aliases are expanded."""
    import yaml

    kind = "YAML" if path.suffix.lower() in (".yaml", ".yml") else "JSON"
    try:
        text = path.read_text(encoding="utf-8")
        values = yaml.safe_load(text) if kind == "YAML" else json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, yaml.YAMLError) as error:
        reason = " ".join(str(error).split()) or type(error).__name__  # YAML's messages span lines.
        raise ValueError(f"space: {path} is not a readable {kind} file: {shortened(printable(reason))}") from None
    pending, count = [values], 0
    while pending:  # Counts what validating it would visit, shared (aliased) values as often as they appear.
        value = pending.pop()
        count += 1
        if count > MAX_DOCUMENT_VALUES:
            raise ValueError(f"space: {path} stands for more than {MAX_DOCUMENT_VALUES:,} values (YAML aliases)")
        if isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return values
