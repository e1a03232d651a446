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

import inspect
import logging
import os
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python flows/pipeline.py` from a checkout without the editable install.
    sys.path.insert(0, str(REPO_ROOT))
from cifar.quiet import quiet_environment  # noqa: E402

quiet_environment()  # Before TensorFlow, MLflow or Prefect start: CIFAR_VERBOSE=1 turns it off.

from prefect import flow  # noqa: E402
from prefect.runtime import deployment, flow_run  # noqa: E402
from prefect.states import Completed  # noqa: E402

from cifar import failpoints  # noqa: E402
from cifar.config import STAGES, ConfigOverrides, PipelineConfig, Stage, resolve_workdir  # noqa: E402
from cifar.io import atomic_write_json  # noqa: E402
from cifar.preflight import check_request  # noqa: E402
from tasks.artifacts import format_summary, mlflow_run_link, publish_report, write_summary  # noqa: E402
from tasks.caching import result_storage  # noqa: E402
from tasks.data import download_archive, prepare_dataset, resolve_snapshot  # noqa: E402
from tasks.data_gate import log_validation, validate_data  # noqa: E402
from tasks.evaluation import evaluate_model, export_model, register_model  # noqa: E402
from tasks.search import finish_trial, start_trial  # noqa: E402
from tasks.training import train_model  # noqa: E402


class Stages:
    """The pipeline's tasks bound to the workdir's result storage; remembers how each run ended (Cached, ...)."""

    def __init__(self, workdir: str, *, refresh: bool, fresh: bool) -> None:
        self.storage = result_storage(workdir)
        self.states: dict[str, str] = {}
        self.download = self._bind(download_archive, refresh)
        self.snapshot = self._bind(resolve_snapshot, refresh)
        self.prepare = self._bind(prepare_dataset, refresh)
        self.validate = self._bind(validate_data, refresh)
        self.train = self._bind(train_model, refresh or fresh)  # Training from scratch never reuses a result.
        self.evaluate = self._bind(evaluate_model, refresh)
        self.export = self._bind(export_model, refresh)
        self.register = self._bind(register_model, refresh)

    def _bind(self, task, refresh: bool):
        configured = task.with_options(result_storage=self.storage, refresh_cache=True if refresh else None)
        forwards_refresh = "refresh" in inspect.signature(task.fn).parameters  # The library recomputes too.

        def run(*args):
            failpoints.reached(f"before:{task.name}")
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
    "test_accuracy_deduplicated",
    "deduplicated_examples",
    "new_data_accuracy",
    "new_data_examples",
    "metrics_path",
    "predictions_path",
}
DRY_RUN_ENV = "CIFAR_DRY_RUN"  # A directory: each flow run writes its resolved plan there and runs nothing.
STAGE_LOGGERS = ("cifar", "tasks")  # PREFECT_LOGGING_EXTRA_LOGGERS=cifar,tasks also sends them to the API.


def show_stage_logs() -> None:
    """Lets the stages' INFO messages through (Prefect's root logger stops at WARNING)."""
    for name in STAGE_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)


def dry_run_plan(flow_name: str, config: PipelineConfig | None, workdir: str, **details: Any) -> dict[str, Any] | None:
    """With CIFAR_DRY_RUN=DIR set on the worker: the run's resolved plan, written to DIR/<flow run id>/summary.json.

    A worker started this way checks what deployments and forms would run (their resolved config,
    validated and through the pre-flight checks) without downloading, training or writing to a workdir.
    Without the variable this returns None and the flow runs as usual.
    """
    directory = os.environ.get(DRY_RUN_ENV)
    if not directory:
        return None
    run_id = flow_run.get_id() or "local"
    plan = {"dry_run": True, "flow": flow_name, "flow_run_id": run_id, "workdir": str(Path(workdir).resolve())}
    plan["deployment_id"] = deployment.get_id() or flow_run.get_parent_deployment_id()
    if config is not None:
        plan |= {"preset": config.preset, "config": config.model_dump(mode="json")}
    plan |= details
    plan["summary_path"] = str(atomic_write_json(Path(directory) / run_id / "summary.json", plan))
    print(f"Dry run ({DRY_RUN_ENV}): the resolved plan of {flow_name} written to {plan['summary_path']}")
    return plan


def reaches(until: str, stage: str) -> bool:
    """Whether a run that stops after `until` includes `stage`."""
    return STAGES.index(stage) <= STAGES.index(until)


def human_flow_run_name() -> str:
    """The flow run's name in the Prefect UI: what it trains (`smoke-tutorial-lr0.05`), not a random one."""
    overrides = flow_run.parameters.get("config")
    try:
        config = ConfigOverrides.model_validate(overrides or {}).resolve()
    except ValueError:  # The run fails on the same config with the full message; the name stays plain.
        return "cifar-invalid-config"
    return f"{config.preset}-{config.train.model}-lr{config.train.learning_rate:g}"


@flow(name="cifar", log_prints=True, flow_run_name=human_flow_run_name)
def cifar_pipeline(
    config: ConfigOverrides = ConfigOverrides(),
    workdir: str = "./workdir",
    until: Stage = "export",
    refresh: bool = False,
) -> dict[str, Any]:
    """CIFAR-10 from the archive to a gated, exported model; stops after `until`.

    `config` is a preset plus the fields that differ from it; a field left empty comes from the preset.
    """
    show_stage_logs()
    config = config.resolve()
    check_request(config)  # Devices, batch and memory: an impossible request fails before any work.
    plan = dry_run_plan("cifar", config, workdir, until=until)
    if plan:
        return plan
    workdir = str(resolve_workdir(workdir))
    stages = Stages(workdir, refresh=refresh, fresh=not config.train.resume)
    if config.trial is not None:  # A trial of a search (flows/search.py): its study learns when it started.
        start_trial(config)

    archive = stages.download(config, workdir)
    snapshot = stages.snapshot(config, archive, workdir)
    dataset = stages.prepare(config, archive, snapshot, workdir)
    results: dict[str, Any] = {"data": dataset}
    summary: dict[str, Any] = {"preset": config.preset, "until": until, "workdir": workdir}
    summary |= {"config": config.model_dump(mode="json"), "source": archive.source, "source_sha256": archive.sha256}
    summary |= {"manifest": dataset.manifest_path, **dataset.model_dump(include={"data_dir", "counts", "snapshot"})}
    validation = stages.validate(config, archive, dataset, workdir)  # Raises, before training, when data fails.
    summary["data_validation"] = validation.model_dump(exclude={"metrics"})
    if reaches(until, "train"):
        training = results["train"] = stages.train(config, dataset, workdir)
        log_validation(validation, training)
        summary |= training.model_dump(exclude={"key", "reused"})
        summary |= mlflow_run_link(training.tracking_uri, training.mlflow_run_id)
        if config.trial is not None:  # The study learns the outcome; a pruned trial goes no further.
            summary["trial_state"] = finish_trial(config, training)
            until = "train" if summary["trial_state"] == "PRUNED" else until
    if reaches(until, "evaluate"):
        evaluation = results["evaluate"] = stages.evaluate(config, dataset, training, workdir)
        summary |= evaluation.model_dump(include=EVALUATION_FIELDS) | {"evaluated_epoch": evaluation.epoch}
    if reaches(until, "export"):
        export = results["export"] = stages.export(config, dataset, training, evaluation, workdir)
        summary |= {"export_dir": export.export_dir, "export_version": export.version}
        summary["verified_accuracy"] = export.verified_accuracy
        if config.export.register_model:
            promotion = results["register"] = stages.register(config, dataset, training, evaluation, export)
            summary |= promotion.model_dump(exclude={"key", "reused", "test_accuracy", "reason"})
            summary["promotion_reason"] = promotion.reason
    summary["keys"] = {stage: result.key for stage, result in results.items()}
    summary["task_states"] = stages.states
    summary["summary_path"] = write_summary(summary, workdir)
    publish_report(summary)
    print(format_summary(summary))  # The same lines as the command line's, in the flow run's logs (log_prints).
    if summary.get("trial_state") == "PRUNED":  # Completed, named so the UI and the search tell it apart.
        return Completed(name="Pruned", message=f"pruned after epoch {summary['epochs_completed']}", data=summary)
    return summary


if __name__ == "__main__":
    from flows.cli import main  # The command line: validation, logs, a supervisor that leaves no orphans.

    sys.exit(main())
