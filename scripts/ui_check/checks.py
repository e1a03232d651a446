"""What a person must see in the two UIs: the check table, the screenshot of each page, and the judging."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# --------------------------------------------------------------------------------------------------
# What a person must see. One row per check: the page (a key of pages.PAGES), the screenshot it is
# judged on, what must be visible (every regex in `expect`, searched in the page's visible text plus
# "label: value" lines of its form fields), and what must not be (`forbid`). Adjust freely.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    page: str
    expect: tuple[str, ...] = ()
    forbid: tuple[str, ...] = ()
    any_of: tuple[tuple[str, ...], ...] = ()  # Alternatives: one group whose regexes all match is enough.


CHECKS: tuple[Check, ...] = (
    Check(
        "Prefect UI asks for the auth string, then opens the dashboard",
        "prefect-sign-in",
        expect=(r"(?m)^Login$", r"--- after signing in\n[\s\S]*Dashboard"),
    ),
    Check(
        "MLflow refuses a browser without credentials (401) and shows the viewer the experiments",
        "mlflow-sign-in",
        expect=(r"--- without credentials\nstatus: 401", r"(?i)not authenticated", r"cifar10"),
        forbid=(r"(?i)permission denied",),
    ),
    Check(
        "Prefect UI renders on its non-default port",
        "prefect-deployments",
        expect=(r"(?m)^smoke$", r"(?m)^sweep$", r"(?m)^nightly$"),
        forbid=(r"Can't connect to Server API", r"(?i)unable to connect", r"(?i)failed to fetch"),
    ),
    # (i) The custom run form of cifar/smoke shows the smoke preset's model and epochs, or leaves them
    # empty (= from the preset), never the PipelineConfig defaults (resnet20, 30 epochs).
    Check(
        "custom run form of cifar/smoke: smoke preset's model/epochs or empty, not resnet20/30",
        "prefect-custom-run-smoke",
        forbid=(r"(?m)^Model: resnet", r"(?m)^Epochs: 30$"),
        any_of=(
            (r"(?m)^Model: tutorial$", r"(?m)^Epochs: 2$"),
            (r"(?m)^Model: \(empty\)$", r"(?m)^Epochs: \(empty\)$"),
        ),
    ),
    Check(
        "custom run form of cifar/smoke says empty fields come from the preset",
        "prefect-custom-run-smoke",
        expect=(r"(?m)^Preset( \(Optional\))?: smoke$", r"(?i)from the preset"),
    ),
    Check(
        "the nightly schedule names its time zone (UTC) on the deployment page",
        "prefect-nightly-schedule",
        expect=(r"At 02:00 AM", r"at 02:00 UTC"),
    ),
    Check(
        "smoke flow run's logs end with the pipeline summary",
        "prefect-flow-run-smoke",
        expect=(r"Completed", r"cifar pipeline done", r"registry\s+version \d+, champion"),
    ),
    Check(
        "smoke flow run's Artifacts tab lists the report",
        "prefect-flow-run-smoke-artifacts",
        expect=(r"(?m)^cifar-report$", r"(?m)^MARKDOWN$"),
    ),
    Check(
        "smoke report renders: accuracy, per-class table, MLflow link",
        "prefect-smoke-report",
        expect=(
            r"Test accuracy\s+\d+\.\d+ %",
            r"(?m)^airplane\s",
            r"(?m)^link: .* -> http://\S+/#/experiments/\S+/runs/\w+\?workflowType=machine_learning$",
            r"(?m)^link: all runs -> http://\S+/#/experiments/\d+/runs\?viewStateShareKey=cifar&workflowType=machine_learning$",
        ),
    ),
    Check(
        "sweep's table artifact lists both points with accuracies",
        "prefect-sweep-table",
        expect=(r"tiny", r"0\.02", r"0\.05", r"test_accuracy"),
    ),
    # MLflow 3.17 picks GenAI or model training from the link, not from the experimentKind tag: every link
    # the project prints asks for the model-training view (?workflowType=machine_learning).
    Check(
        "the report's 'all runs' link opens the runs table in the model-training view",
        "mlflow-experiment-landing",
        expect=(r"(?m)^url: \S+#/experiments/\d+/runs\?", r"(?m)^Model registry$", r"(?m)^test_accuracy$"),
    ),
    # (ii) Human run names (smoke-<model>-lr<rate>-<time>) and a test-accuracy column in the runs table.
    Check("MLflow runs table: human run names (smoke-...)", "mlflow-runs-table", expect=(r"(?m)^smoke-",)),
    Check("MLflow runs table: a test_accuracy column", "mlflow-runs-table", expect=(r"(?m)^test_accuracy$",)),
    Check("MLflow run page (the report's link) shows test_accuracy", "mlflow-run", expect=(r"(?m)^test_accuracy\s",)),
    Check(
        "MLflow compare page shows both sweep children's learning rates",
        "mlflow-compare-sweep",
        expect=(r"Comparing 2 Runs", r"0\.02", r"0\.05"),
    ),
    # (iii) The registered model's page shows the alias on a version.
    Check(
        "registry page of cifar10 shows the champion alias", "mlflow-registry-champion", expect=(r"(?m)^@\s*champion$",)
    ),
    # (iv) The gate's comparison of a challenger with the champion: in Prefect, and recorded on the version.
    Check(
        "the challenger's comparison artifact: both models, McNemar's test, the per-class table",
        "prefect-comparison",
        expect=(r"Challenger v2", r"champion", r"McNemar", r"(?m)^airplane\s"),
    ),
    Check(
        "MLflow's page of version 2 records the decision, the comparison and the model card link",
        "mlflow-version-record",
        expect=(r"Test accuracy \d+\.\d+ %", r"Model card: runs:/\w+/model_card/model_card\.html", r"promotion"),
    ),
    Check(
        "the model card renders in MLflow with every section",
        "mlflow-model-card",
        expect=(r"Model card: cifar10 v2", r"Intended use", r"Robustness", r"Against the champion of the day"),
    ),
    Check(
        "the endpoint's try-it page classifies an uploaded test image: three classes as bars and the version",
        "endpoint-try-it",
        expect=(r"answered by cifar10 version \d+", r"(?m)^\d+\.\d %$", r"Served: cifar10 version \d+", r"model card"),
    ),
    Check(
        "a run waiting for approval: its Resume form shows the comparison and asks decision, reason, name",
        "prefect-approval-form",
        expect=(
            r"Approve cifar10 v\d+ as champion\?",
            r"95 % interval",
            r"McNemar",
            r"--- fields[\s\S]*(?m:^Decision$)",
            r"--- fields[\s\S]*(?m:^Reason$)",
            r"--- fields[\s\S]*(?m:^Approver$)",
        ),  # fmt: skip
    ),
)

# Page key (pages.PAGES) -> screenshot file under --out; a page may save more (SCREENSHOTS_EXTRA).
SCREENSHOTS = {
    "prefect-sign-in": "prefect-sign-in.png",
    "mlflow-sign-in": "mlflow-sign-in.png",
    "prefect-deployments": "prefect-deployments.png",
    "prefect-custom-run-smoke": "prefect-custom-run-smoke-train.png",
    "prefect-custom-run-smoke-top": "prefect-custom-run-smoke.png",
    "prefect-nightly-schedule": "prefect-nightly-schedule.png",
    "prefect-flow-run-smoke": "prefect-flow-run-smoke-logs.png",
    "prefect-flow-run-smoke-artifacts": "prefect-flow-run-smoke-artifacts.png",
    "prefect-smoke-report": "prefect-smoke-report.png",
    "prefect-sweep-table": "prefect-sweep-table.png",
    "mlflow-experiment-landing": "mlflow-experiment-landing.png",
    "mlflow-runs-table": "mlflow-runs-table.png",
    "mlflow-run": "mlflow-run.png",
    "mlflow-compare-sweep": "mlflow-compare-sweep.png",
    "mlflow-registry-champion": "mlflow-registry-champion.png",
    "prefect-comparison": "prefect-comparison.png",
    "mlflow-version-record": "mlflow-version-record.png",
    "mlflow-model-card": "mlflow-model-card.png",
    "endpoint-try-it": "endpoint-try-it.png",
    "prefect-approval-form": "prefect-approval-form.png",
    "prefect-approval-form-fields": "prefect-approval-form-fields.png",
}


@dataclass
class Shot:
    """What a page showed: its visible text (plus "label: value" lines of form fields), its screenshot, or why not."""

    text: str = ""
    path: Path | None = None
    error: str = ""
    extra: list[Path | None] = field(default_factory=list)


def judge(shots: dict[str, Shot]) -> list[tuple[Check, bool, str]]:
    """Each check against the shot of its page: (check, passed, what was wrong)."""
    results = []
    for check in CHECKS:
        shot = shots.get(check.page, Shot(error="page not visited"))
        problems = [f"page: {shot.error}"] if shot.error else []
        problems += [f"missing /{pattern}/" for pattern in check.expect if not re.search(pattern, shot.text)]
        problems += [f"shows /{pattern}/" for pattern in check.forbid if re.search(pattern, shot.text)]
        if check.any_of and not any(all(re.search(p, shot.text) for p in group) for group in check.any_of):
            problems.append("none of " + " | ".join("+".join(f"/{p}/" for p in group) for group in check.any_of))
        results.append((check, not problems, "; ".join(problems)))
    return results
