"""The `cifar` flow: the raw archive in; verified shards, a trained model, test metrics and a gated export out.

    python flows/pipeline.py --source ~/cifar-10-python.tar.gz --preset smoke
    python flows/pipeline.py --preset full --set train.epochs=100 --set train.gpus=1
    python flows/pipeline.py --source URL --sha256 HEX --until data --workdir /scratch/cifar

Runs without a server (Prefect's ephemeral mode) or, deployed from prefect.yaml, on a worker. Every
stage reuses its finished output when its key is unchanged (`cifar.reuse`: the content it reads, the
settings that shape it, the code it runs), so running the same command twice re-does nothing
expensive; `--refresh` recomputes everything, `--fresh` trains from scratch instead of resuming.
The end of every run is `WORKDIR/summary.json` (with the resolved config) and a markdown report.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python flows/pipeline.py` from a checkout without the editable install.
    sys.path.insert(0, str(REPO_ROOT))

from prefect import flow  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from cifar.config import PRESETS, STAGES, PipelineConfig, Stage, make_config, resolve_workdir  # noqa: E402
from tasks import faults  # noqa: E402
from tasks.artifacts import mlflow_run_url, publish_report, write_summary  # noqa: E402
from tasks.caching import result_storage  # noqa: E402
from tasks.data import download_archive, prepare_dataset  # noqa: E402
from tasks.evaluation import evaluate_model, export_model, register_model  # noqa: E402
from tasks.training import train_model  # noqa: E402


class Stages:
    """The pipeline's tasks bound to the workdir's result storage; remembers how each run ended (Cached, ...)."""

    def __init__(self, workdir: str, *, refresh: bool, fresh: bool) -> None:
        self.storage = result_storage(workdir)
        self.states: dict[str, str] = {}
        self.download = self._bind(download_archive, refresh)
        self.prepare = self._bind(prepare_dataset, refresh)
        self.train = self._bind(train_model, refresh or fresh)  # Training from scratch never reuses a result.
        self.evaluate = self._bind(evaluate_model, refresh)
        self.export = self._bind(export_model, refresh)
        self.register = self._bind(register_model, refresh)

    def _bind(self, task, refresh: bool):
        configured = task.with_options(result_storage=self.storage, refresh_cache=True if refresh else None)
        forwards_refresh = "refresh" in inspect.signature(task.fn).parameters  # The library recomputes too.

        def run(*args):
            faults.kill_before(task.name)
            keywords = {"refresh": refresh} if forwards_refresh else {}
            state = configured(*args, **keywords, return_state=True)
            result = state.result()  # Raises the task's real error when it failed.
            # "Reused": the task ran, and the library found the stage's finished output under its key.
            self.states[task.name] = (
                "Reused" if state.name == "Completed" and getattr(result, "reused", False) else state.name
            )
            return result

        return run


EVALUATION_FIELDS = {
    "test_accuracy",
    "test_loss",
    "flip_tta_accuracy",
    "tta_accuracy",
    "metrics_path",
    "predictions_path",
}
STAGE_LOGGERS = ("cifar", "tasks")  # PREFECT_LOGGING_EXTRA_LOGGERS=cifar,tasks also sends them to the API.


def show_stage_logs() -> None:
    """Lets the stages' INFO messages through (Prefect's root logger stops at WARNING)."""
    for name in STAGE_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)


def reaches(until: str, stage: str) -> bool:
    """Whether a run that stops after `until` includes `stage`."""
    return STAGES.index(stage) <= STAGES.index(until)


def with_preset(config: PipelineConfig) -> PipelineConfig:
    """The config's preset with the explicitly given fields on top.

    A deployment or the UI passes `{"preset": "smoke", "train": {"epochs": 3}}`; pydantic fills the
    rest with defaults, so without this the smoke preset's own settings would be lost.
    """
    return make_config(config.preset, explicit_fields(config))


def explicit_fields(model) -> dict[str, Any]:
    """The fields set explicitly on a pydantic model (recursively), as plain values."""
    explicit: dict[str, Any] = {}
    for name in model.model_fields_set:
        value = getattr(model, name)
        explicit[name] = explicit_fields(value) if hasattr(value, "model_fields_set") else value
    explicit.pop("preset", None)
    return explicit


@flow(name="cifar", log_prints=True)
def cifar_pipeline(
    config: PipelineConfig = PipelineConfig(),
    workdir: str = "./workdir",
    until: Stage = "export",
    refresh: bool = False,
) -> dict[str, Any]:
    """CIFAR-10 from the archive to a gated, exported model; stops after `until`."""
    show_stage_logs()
    config = with_preset(config)
    workdir = str(resolve_workdir(workdir))
    stages = Stages(workdir, refresh=refresh, fresh=not config.train.resume)

    archive = stages.download(config, workdir)
    dataset = stages.prepare(config, archive, workdir)
    results: dict[str, Any] = {"data": dataset}
    summary: dict[str, Any] = {"preset": config.preset, "until": until, "workdir": workdir}
    summary |= {"config": config.model_dump(mode="json"), "source": archive.source, "source_sha256": archive.sha256}
    summary |= {"manifest": dataset.manifest_path, **dataset.model_dump(include={"data_dir", "counts"})}
    if reaches(until, "train"):
        training = results["train"] = stages.train(config, dataset, workdir)
        summary |= training.model_dump(exclude={"key", "reused"})
        summary["mlflow_run_url"] = mlflow_run_url(training.tracking_uri, training.mlflow_run_id)
    if reaches(until, "evaluate"):
        evaluation = results["evaluate"] = stages.evaluate(config, dataset, training, workdir)
        summary |= evaluation.model_dump(include=EVALUATION_FIELDS) | {"evaluated_epoch": evaluation.epoch}
    if reaches(until, "export"):
        export = results["export"] = stages.export(config, dataset, training, evaluation, workdir)
        summary |= {"export_dir": export.export_dir, "export_version": export.version}
        summary["verified_accuracy"] = export.verified_accuracy
        if config.export.register_model:
            promotion = results["register"] = stages.register(config, training, evaluation, export)
            summary |= promotion.model_dump(exclude={"key", "reused", "test_accuracy", "reason"})
            summary["promotion_reason"] = promotion.reason
    summary["keys"] = {stage: result.key for stage, result in results.items()}
    summary["task_states"] = stages.states
    summary["summary_path"] = write_summary(summary, workdir)
    publish_report(summary)
    return summary


# Command line.


class ConfigError(ValueError):
    """The command line does not describe a valid configuration."""


def parse_value(text: str) -> Any:
    """A --set value: JSON when it parses (numbers, true/false, null, lists), else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_overrides(assignments: Sequence[str]) -> dict[str, Any]:
    """`["train.epochs=3", "seed=1"]` -> `{"train": {"epochs": 3}, "seed": 1}`."""
    overrides: dict[str, Any] = {}
    for assignment in assignments:
        key, separator, text = assignment.partition("=")
        path = key.strip().split(".")
        if not separator or not all(path):
            raise ConfigError(f"--set expects section.field=value, got {assignment!r}")
        target = overrides
        for part in path[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"--set {assignment!r} conflicts with an earlier --set of {part!r}")
        target[path[-1]] = parse_value(text)
    return overrides


def describe_validation_error(error: ValidationError) -> str:
    """One line per invalid field: `train.epochs: Input should be greater than or equal to 1 (got 0)`."""
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "config"
        shown = "" if item["type"] == "missing" else f" (got {item.get('input')!r})"
        lines.append(f"{field}: {item['msg']}{shown}")
    return "invalid configuration: " + "; ".join(lines)


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    """The validated config of a command line; raises ConfigError naming the bad field."""
    overrides = parse_overrides(args.set or [])
    data = overrides.setdefault("data", {})
    if not isinstance(data, dict):
        raise ConfigError("--set data=... must name a field: data.source=..., data.sha256=...")
    for field in ("source", "sha256", "md5"):
        if getattr(args, field) is not None:
            data[field] = getattr(args, field)
    if args.fresh:
        overrides.setdefault("train", {})["resume"] = False
    try:
        return make_config(args.preset, overrides)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python flows/pipeline.py",
        description="CIFAR-10 from the raw archive to a served model (Prefect flow `cifar`).",
        epilog="Example: python flows/pipeline.py --source cifar-10-python.tar.gz --preset smoke "
        "--set train.epochs=3 --until evaluate",
    )
    add = parser.add_argument
    add("--source", help="http(s)/file:// URL or local path of the archive (default: the official one)")
    add("--sha256", help="expected SHA-256 of the archive (hex)")
    add("--md5", help="expected MD5 of the archive (hex); official URLs default to the published one")
    add("--workdir", default="./workdir", help="where data, runs, exports and summary.json go")
    add("--preset", default="default", choices=sorted(PRESETS), help="named set of settings")
    add("--until", default="export", choices=STAGES, help="last stage to run (export includes registering)")
    add("--refresh", action="store_true", help="recompute every stage, even where finished work exists")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="continue the training run (the default)")
    resume.add_argument("--fresh", action="store_true", help="discard the run's checkpoints (train.resume=false)")
    help_set = "override one config field, e.g. --set train.epochs=3 (repeatable; values parse as JSON)"
    add("--set", action="append", metavar="SECTION.FIELD=VALUE", help=help_set)
    return parser


def format_summary(summary: dict[str, Any]) -> str:
    """A few human lines about what the run produced."""
    states = summary.get("task_states", {})

    def state(*names: str) -> str:
        shown = [f"{name} {states[name].lower()}" for name in names if name in states]
        return f"  [{', '.join(shown)}]" if shown else ""

    def percent(value: Any) -> str:
        return "-" if value is None else f"{100 * value:.2f} %"

    counts = summary.get("counts", {})
    lines = [
        f"cifar pipeline done (preset {summary['preset']}, until {summary['until']})",
        f"  data       {summary['data_dir']}  train/validation/test "
        f"{counts.get('train')}/{counts.get('validation')}/{counts.get('test')}{state('download', 'prepare')}",
    ]
    if "run_name" in summary:
        lines.append(
            f"  training   {summary['run_name']}: {summary['epochs_completed']} epochs, best epoch "
            f"{summary['best_epoch']}, validation accuracy {percent(summary['val_accuracy'])}{state('train')}"
        )
    if "test_accuracy" in summary:
        tta = [
            f"{name} {percent(summary[key])}"
            for key, name in (("flip_tta_accuracy", "flip TTA"), ("tta_accuracy", "flip+translate TTA"))
            if summary.get(key) is not None
        ]
        lines.append(
            f"  test       accuracy {percent(summary['test_accuracy'])}, loss {summary['test_loss']:.4f}"
            f"{''.join(', ' + item for item in tta)}{state('evaluate')}"
        )
    if "export_dir" in summary:
        lines.append(f"  export     {summary['export_dir']}{state('export')}")
    if "registered_model_version" in summary:
        verdict = "champion" if summary.get("champion") else "not promoted"
        lines.append(
            f"  registry   version {summary['registered_model_version']}, {verdict}: "
            f"{summary.get('promotion_reason')}{state('register')}"
        )
    if summary.get("mlflow_run_url"):
        lines.append(f"  mlflow     {summary['mlflow_run_url']}")
    lines.append(f"  summary    {summary['summary_path']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as error:
        parser.error(str(error))  # Exits with status 2 before any work.
    try:
        summary = cifar_pipeline(config=config, workdir=args.workdir, until=args.until, refresh=args.refresh)
    except Exception as error:
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
