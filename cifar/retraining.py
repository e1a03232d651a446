"""Continuous training: would a retrain change anything, and if so, what changed?

A retrain would train on the latest data snapshot with the retrain's config and today's code: its
training key (cifar.reuse) says exactly that. When a registered version was trained under that key
(the champion, or a challenger the gate already refused), training again would make the same model:
nothing changed. Otherwise the champion's record (cifar.champion.TrainedWith) says what differs:
the data snapshot (which additions), the training fields, the modules of the training code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cifar.champion import TRAINING_KEY_TAG, Champion, TrainedWith, find_champion, training_config
from cifar.config import PipelineConfig
from cifar.data.snapshots import DataStore, SnapshotNotFoundError
from cifar.results import ArchiveInfo, RetrainPlan
from cifar.reuse import code_files, data_key, training_key


def plan_retrain(config: PipelineConfig, archive: ArchiveInfo, workdir: str | Path, tracking_uri: str) -> RetrainPlan:
    """The retrain's keys on the latest snapshot, compared with the registry's versions and champion."""
    store = DataStore(workdir)
    snapshot = store.resolve(config.data.snapshot, archive.sha256, config.data.source)
    data = data_key(config.data, archive.sha256, snapshot.additions)
    training = training_key(config, data)
    model_name = config.export.model_name
    champion = find_champion(tracking_uri, model_name)
    judged = _version_trained_under(tracking_uri, model_name, training)
    plan = {
        "snapshot": snapshot.key,
        "additions": len(snapshot.additions),
        "data_key": data,
        "training_key": training,
        "champion_version": champion.version if champion else None,
    }
    if judged is not None:
        number, reason = judged
        if champion is not None and number == champion.version:
            summary = f"nothing changed: champion v{number} is current (snapshot {snapshot.key}, same config and code)"
        else:
            summary = (
                f"nothing changed since v{number} was trained on snapshot {snapshot.key} with this config and "
                f"code and judged: {reason} (force=true retrains with a new seed)"
            )
        return RetrainPlan(
            **plan, judged_version=number, judged_reason=reason, nothing_changed=True, changes=[], summary=summary
        )
    changes = describe_changes(champion, store, snapshot.key, snapshot.additions, config, data)
    summary = "retraining: " + "; ".join(changes)
    return RetrainPlan(**plan, nothing_changed=False, changes=changes, summary=summary)


def _version_trained_under(tracking_uri: str, model_name: str, key: str) -> tuple[int, str] | None:
    """(version, its decision's reason) of the newest registered version trained under `key`, or None."""
    from mlflow.exceptions import MlflowException

    from cifar.registry import DECISION_TAG, recorded_decision
    from cifar.tracking import mlflow_client

    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
        return None  # No store, so no registry yet.
    try:
        versions = mlflow_client(tracking_uri).search_model_versions(f"name = '{model_name}'")
    except MlflowException:
        return None
    matches = [version for version in versions if version.tags.get(TRAINING_KEY_TAG) == key]
    if not matches:
        return None
    newest = max(matches, key=lambda version: int(version.version))
    decision = recorded_decision(newest, "") if DECISION_TAG in newest.tags else None
    return int(newest.version), (decision.reason if decision else "no decision recorded yet")


def describe_changes(
    champion: Champion | None, store: DataStore, snapshot: str, additions: list[str], config: PipelineConfig, data: str
) -> list[str]:
    """What a retrain would do differently from the champion's training, one line per kind of change."""
    if champion is None:
        return ["no champion yet: training the first one"]
    recorded: TrainedWith = champion.trained_with
    name = f"champion v{champion.version}"
    changes = []
    if recorded.snapshot != snapshot:
        changes.append(_snapshot_change(store, recorded.snapshot, snapshot, additions))
    elif recorded.data_key is not None and recorded.data_key != data:
        changes.append("data preparation: the shard settings or the data code changed (same snapshot)")
    if recorded.train_config is not None:
        differences = _differences(recorded.train_config, training_config(config))
        if differences:
            changes.append("config: " + ", ".join(differences))
    if recorded.code is not None:
        current = {path: digest[:12] for path, digest in code_files("train").items()}
        modules = sorted(
            path for path in set(current) | set(recorded.code) if current.get(path) != recorded.code.get(path)
        )
        if modules:
            changes.append("code: " + ", ".join(f"cifar/{path}" for path in modules))
    if not changes:
        changes.append(f"{name} records no training key this retrain matches (registered before it was recorded)")
    return changes


def _snapshot_change(store: DataStore, old: str | None, new: str, additions: list[str]) -> str:
    if old is None:
        return f"data snapshot {new} (the champion records none)"
    try:
        previous = set(store.snapshot(old).additions)
    except SnapshotNotFoundError:
        return f"data snapshot {old} -> {new} ({old} is not in this workdir)"
    added = [digest for digest in additions if digest not in previous]
    removed = [digest for digest in previous if digest not in set(additions)]
    images = sum(store.addition(digest).count for digest in added)
    parts = []
    if added:
        parts.append(f"+{len(added)} additions ({images:,} images: {', '.join(digest[:12] for digest in added)})")
    if removed:
        parts.append(f"-{len(removed)} additions ({', '.join(digest[:12] for digest in removed)})")
    return f"new data snapshot {old} -> {new}: {'; '.join(parts) or 'same additions'}"


def _differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    names = sorted(set(before) | set(after))
    return [
        f"{'seed' if name == 'seed' else 'train.' + name} {before.get(name)!r} -> {after.get(name)!r}"
        for name in names
        if before.get(name) != after.get(name)
    ]
