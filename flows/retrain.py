"""The `cifar-retrain` flow: scheduled retraining that can only replace the champion through the gate.

Deployed as `cifar-retrain/nightly` (prefect.yaml, cron in UTC). Each run trains into its own
directory (`train.run_name = retrain-<UTC time>-<flow run id>`), so it never resumes or clobbers
another run's checkpoints; data preparation is shared and cached; exports take the next free version
atomically; the register stage moves the `champion` alias only when the new model passes the gate
(`export.min_accuracy`, `export.tolerance`). The `training` tag limit keeps two trainings off one device.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from prefect import flow  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402

from cifar.config import ConfigOverrides  # noqa: E402
from flows.pipeline import cifar_pipeline  # noqa: E402


def retrain_run_name(flow_run_id: str | None, now: datetime | None = None) -> str:
    """A training directory name no other run uses: the UTC start time plus the flow run id."""
    now = now or datetime.now(UTC)
    suffix = (flow_run_id or "local").replace("-", "")[:8]
    return f"retrain-{now:%Y%m%d-%H%M%S}-{suffix}"


@flow(name="cifar-retrain", log_prints=True)
def retrain(config: ConfigOverrides = ConfigOverrides(preset="full"), workdir: str = "./workdir") -> dict[str, Any]:
    """Retrains from scratch into a new run directory, then evaluates, exports and gates the model."""
    config = config.resolve()
    run_name = retrain_run_name(flow_run.get_id())
    config = config.model_copy(update={"train": config.train.model_copy(update={"run_name": run_name})})
    summary = cifar_pipeline(config=ConfigOverrides.of(config), workdir=workdir, until="export")
    if summary.get("dry_run"):
        return summary
    print(
        f"Retrained {run_name}: test accuracy {summary['test_accuracy']:.4f}, "
        f"champion={summary.get('champion')} ({summary.get('promotion_reason')})"
    )
    return summary


if __name__ == "__main__":
    retrain()
