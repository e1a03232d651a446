"""Where a search's Optuna study lives, and what the search and each trial's run record in it.

One store for the search and every trial: a journal file on one machine, a database URL
(`CIFAR_SEARCH_STORAGE`) across machines. The search asks for trials, records where each runs and fails
the ones whose run died; a trial's run reports its epochs and its own outcome, so it outlives a killed
search (docs/ORCHESTRATION.md, "Studies that survive").
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cifar import compat
from cifar.config import PipelineConfig, TrialLink
from cifar.search.space import OBJECTIVE, SearchSpace
from cifar.workdir import stable_hash

logger = logging.getLogger("cifar.search")

STORAGE_ENV = "CIFAR_SEARCH_STORAGE"  # A database URL for the study, on the search's machine and every worker.
SEARCH_DIR = "search"  # WORKDIR/search/: journal files and the study's plots.

# User attributes: on the study, set once at creation; on each trial, set by the search or the run.
SPACE_ATTR = "space"
PARENT_RUN_ATTR = "mlflow_parent_run_id"
FLOW_RUN_ATTR = "flow_run_id"
STARTED_ATTR = "started"
MLFLOW_RUN_ATTR = "mlflow_run_id"
RUN_NAME_ATTR = "run_name"
FAILURE_ATTR = "failure"


def search_dir(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / SEARCH_DIR


def resolve_storage(storage: str | None, workdir: str | Path, study_name: str) -> str:
    """The given storage, else CIFAR_SEARCH_STORAGE, else the journal file under the workdir."""
    chosen = storage or os.environ.get(STORAGE_ENV)
    if chosen:
        return chosen if is_database(chosen) else str(Path(chosen).expanduser().resolve())
    return str(search_dir(workdir) / f"{study_name}.journal")


def is_database(storage: str) -> bool:
    return "://" in storage


def redact(storage: str) -> str:
    """The storage with any password replaced by `***` (what summaries and logs show)."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", storage)


def link_storage(storage: str) -> str | None:
    """What a trial's run is told about the storage: the storage itself when it holds no secret,
    else None (the worker reads CIFAR_SEARCH_STORAGE)."""
    return None if redact(storage) != storage else storage


def open_storage(storage: str):
    """An Optuna storage: a database URL (RDB), else a journal file shared under a file lock."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    if is_database(storage):
        return optuna.storages.RDBStorage(storage)
    Path(storage).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(storage))


def study_name_for(space: SearchSpace, config: PipelineConfig) -> str:
    """`<space>-<preset>-<digest>`: the same space on the same base settings is the same study."""
    base = config.model_dump(mode="json", exclude={"trial", "tracking"})
    # Without first trials the space digests as it did before they existed: older studies are found.
    settings = space.model_dump(mode="json", exclude=set() if space.first_trials else {"first_trials"})
    digest = stable_hash({"space": settings, "config": base}, 8)
    return f"{space.name}-{config.preset}-{digest}"


def quiet_optuna() -> None:
    """Optuna's own INFO lines (one per trial) and experimental-feature warnings stay out of the logs."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def open_study(storage: str, study_name: str, space: SearchSpace, seed: int):
    """Creates the study (maximising the objective) or loads it; refuses one made for another space.

    Its user attributes keep what must not change between attempts: the search space (hence the pruner
    every trial rebuilds) and the MLflow parent run.
    """
    import optuna

    quiet_optuna()
    study = optuna.create_study(
        study_name=study_name,
        storage=open_storage(storage),
        sampler=space.make_sampler(seed),
        pruner=space.pruner.make_pruner(),
        direction="maximize",
        load_if_exists=True,
    )
    # A restarted search must not replay the random draws of the first attempt: its sampler's seed
    # moves on by the number of trials the study already has.
    study.sampler = space.make_sampler(seed + len(study.get_trials(deepcopy=False)))
    recorded = study.user_attrs.get(SPACE_ATTR)
    if recorded is None:
        study.set_user_attr(SPACE_ATTR, space.model_dump(mode="json"))
        study.set_metric_names([OBJECTIVE])
        for point in space.first_trials:  # Queued once, with the study: a resumed search finds them waiting.
            study.enqueue_trial(point)
    elif SearchSpace.model_validate(recorded) != space:
        raise ValueError(f"study {study_name!r} in {redact(storage)} was made for another search space")
    return study


def load_trial_study(link: TrialLink):
    """The study of a trial's run, with the pruner its search space names."""
    import optuna

    quiet_optuna()
    storage = link.storage or os.environ.get(STORAGE_ENV)
    if not storage:
        raise ValueError(f"trial {link.number} of {link.study_name}: no storage given and {STORAGE_ENV} is not set")
    study = optuna.load_study(study_name=link.study_name, storage=open_storage(storage))
    study.pruner = SearchSpace.model_validate(study.user_attrs[SPACE_ATTR]).pruner.make_pruner()
    return study


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# --- The search's side. ------------------------------------------------------------------------


def finished_states():
    from optuna.trial import TrialState

    return (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def count_finished(study) -> int:
    return len(study.get_trials(deepcopy=False, states=finished_states()))


def running_trials(study) -> dict[int, str | None]:
    """Trial number -> the flow run it was dispatched as (None: asked, never dispatched)."""
    from optuna.trial import TrialState

    return {
        trial.number: trial.user_attrs.get(FLOW_RUN_ATTR)
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    }


def ask_trial(study, space: SearchSpace) -> tuple[int, dict[str, Any]]:
    """A new trial: its number and its training settings."""
    trial = study.ask()
    return trial.number, space.suggest(trial)


def trial_params(study, number: int) -> dict[str, Any]:
    return dict(study.trials[number].params)


def record_dispatch(study, number: int, flow_run_id: str) -> None:
    """Remembers which flow run runs the trial (so a restarted search finds it again)."""
    compat.optuna_trial(study, number).set_user_attr(FLOW_RUN_ATTR, flow_run_id)


def fail_trial(study, number: int, reason: str) -> None:
    """Ends a trial whose run died without telling its outcome as FAIL, with the reason."""
    from optuna.trial import TrialState

    if study.trials[number].state.is_finished():
        return
    compat.optuna_trial(study, number).set_user_attr(FAILURE_ATTR, reason[:2000])
    study.tell(number, state=TrialState.FAIL, skip_if_finished=True)


# --- A trial's run. ------------------------------------------------------------------------------


class TrialReporter:
    """Reports a trial's per-epoch objective to its study and asks the pruner whether to go on."""

    def __init__(self, link: TrialLink) -> None:
        self.link = link
        self.study = load_trial_study(link)
        self.trial = compat.optuna_trial(self.study, link.number)

    def report(self, epoch: int, value: float) -> bool:
        """Records `value` at `epoch`; True when the trial should stop (pruned)."""
        self.trial.report(float(value), step=int(epoch))
        return bool(self.trial.should_prune())


def start_trial(link: TrialLink) -> None:
    """Records when the trial's run started (the first attempt's time is kept)."""
    study = load_trial_study(link)
    if STARTED_ATTR not in study.trials[link.number].user_attrs and not study.trials[link.number].state.is_finished():
        compat.optuna_trial(study, link.number).set_user_attr(STARTED_ATTR, now_iso())


def finish_trial(
    link: TrialLink, *, value: float | None, pruned: bool, mlflow_run_id: str | None, run_name: str
) -> str:
    """Tells the study how the trial ended (COMPLETE with its value, or PRUNED); returns the state's name.

    Idempotent: a trial already finished (a re-run of the same flow run) keeps its first outcome.
    """
    from optuna.trial import TrialState

    study = load_trial_study(link)
    frozen = study.trials[link.number]
    if frozen.state.is_finished():
        return frozen.state.name
    trial = compat.optuna_trial(study, link.number)
    if mlflow_run_id:
        trial.set_user_attr(MLFLOW_RUN_ATTR, mlflow_run_id)
    trial.set_user_attr(RUN_NAME_ATTR, run_name)
    if pruned:
        study.tell(link.number, state=TrialState.PRUNED, skip_if_finished=True)
    elif value is None:
        trial.set_user_attr(FAILURE_ATTR, f"the run reported no {OBJECTIVE}")
        study.tell(link.number, state=TrialState.FAIL, skip_if_finished=True)
    else:
        study.tell(link.number, float(value), skip_if_finished=True)
    return study.trials[link.number].state.name
