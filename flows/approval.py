"""A person's sign-off inside a flow run (`promotion.approval: required`): Prefect's form, no worker held.

A run whose challenger passed the gate marks the version waiting (cifar.approval), announces it
(`cifar.approval.waiting`, tasks/events.py) and waits for the form on its page: approve or reject, a reason,
the approver's name. A deployment's run *suspends*: its process exits and frees the worker; the answer
reschedules the run, which starts again from the top, reuses every stage's result (nothing trains again)
and reaches the same suspension, which now returns the answer. A run without a deployment (a command line
against a server) cannot be rescheduled, so it *pauses*: its process stays, waiting. The decision may come
from the command line too (`flows/promote.py --approve RUN`), which records it and then resumes the run.

No decision within `promotion.approval_timeout_hours`: a run of `cifar-approval-timeout/approval-timeout`, which
the waiting run scheduled on Prefect for that moment, records the expiry on the version and ends the
waiting run (a paused run records it itself). Prefect's own pause timeout, an hour later, is the backstop.
"""

from __future__ import annotations

import math
import os
from datetime import UTC, datetime
from typing import Literal

from prefect.context import FlowRunContext
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run, suspend_flow_run
from prefect.input import RunInput
from pydantic import Field

from cifar.approval import ApprovalRecord, StaleApprovalError, decide, mark_waiting, waiting_for
from cifar.config import PipelineConfig
from cifar.results import PromotionResult, ValidationResult
from tasks.artifacts import comparison_markdown
from tasks.events import announce_move, announce_waiting

TIMEOUT_DEPLOYMENT = "cifar-approval-timeout/approval-timeout"
BACKSTOP_SECONDS = 3600  # Prefect fails a suspended run this long after our expiry, should that run not happen.
PAUSE_POLL_SECONDS = 5  # A paused (not suspended) run asks the server this often whether it was resumed.
UI_URL_ENV = "PREFECT_UI_URL"  # Where people open the Prefect UI (links in notifications); else the API's host.


class ApprovalForm(RunInput):
    """The form on the waiting run's page (Prefect renders it from this schema)."""

    decision: Literal["approve", "reject"] = Field(description="approve: the challenger becomes the champion.")
    reason: str = Field(min_length=3, max_length=500, description="Why; recorded on the version and in its history.")
    approver: str = Field(
        min_length=1,
        max_length=100,
        description="Your name. Recorded as typed: Prefect's open-source server signs everyone in with one shared "
        "credential, so it cannot tell who you are (the command line records your MLflow account instead).",
    )


def check_approval_reachable(config: PipelineConfig) -> None:
    """A run that waits for a person needs a Prefect server both can reach: not the temporary one of a command."""
    if config.promotion.approval == "required" and not os.environ.get("PREFECT_API_URL"):
        raise ValueError(
            "promotion.approval=required waits for a person's decision on a Prefect server: set PREFECT_API_URL "
            "(make server), or leave promotion.approval at auto for a local run"
        )


def approval_key(version: int) -> str:
    return f"approval-v{version}"


def is_subflow() -> bool:
    context = FlowRunContext.get()
    return bool(context and context.flow_run and context.flow_run.parent_task_run_id)


def flow_run_url(flow_run_id: str) -> str:
    """The run's page in the Prefect UI, where the form is."""
    ui = os.environ.get(UI_URL_ENV) or os.environ.get("PREFECT_API_URL", "http://127.0.0.1:4200/api").removesuffix(
        "/api"
    )
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}"


def pending_decision(config: PipelineConfig, tracking_uri: str) -> ApprovalRecord | None:
    """The approval this very flow run is waiting for, when it runs again after being resumed."""
    context = FlowRunContext.get()
    if config.promotion.approval != "required" or not context or not context.flow_run:
        return None
    return waiting_for(tracking_uri, config.export.model_name, str(context.flow_run.id))


def wait_for_approval(
    config: PipelineConfig, promotion: PromotionResult, tracking_uri: str, validation: ValidationResult | None = None
) -> ApprovalRecord:
    """Waits (suspended, or paused without a deployment) for the decision on `promotion`'s version; applies it."""
    run = FlowRunContext.get().flow_run
    model_name, version = config.export.model_name, int(promotion.registered_model_version)
    hours = config.promotion.approval_timeout_hours
    record, marked = mark_waiting(tracking_uri, promotion, model_name, str(run.id), hours)
    if record.state != "waiting":  # Decided from the command line, which then resumed this run.
        return record
    if marked:
        details = {"url": flow_run_url(str(run.id)), "expires_at": f"{record.expires_at:%Y-%m-%dT%H:%M:%SZ}",
                   "champion_version": record.champion_version_before, "reason": promotion.reason}  # fmt: skip
        announce_waiting(model_name, version, str(run.id), details)
        if run.deployment_id:
            schedule_expiry(record, config, run.parameters.get("workdir", "./workdir"))
    form = ApprovalForm.with_initial_data(description=approval_markdown(promotion, record, tracking_uri, validation))
    left = seconds_left(record)
    print(f"{record.describe()}; decide on {flow_run_url(str(run.id))} or with flows/promote.py --approve/--reject")
    try:
        if run.deployment_id:
            answer = suspended_for_answer(record, form)
        else:
            answer = pause_flow_run(
                wait_for_input=form, timeout=left, poll_interval=PAUSE_POLL_SECONDS, key=approval_key(version)
            )
    except FlowPauseTimeout:  # Paused in process only; a suspended run is expired by the scheduled run.
        return expire(tracking_uri, record)
    return apply(tracking_uri, record, answer.decision == "approve", answer.reason, answer.approver, "form")


def resume_with_decision(record: ApprovalRecord, tracking_uri: str) -> ApprovalRecord:
    """In a run started again after its suspension: the form's answer (Prefect returns it for the same key)."""
    if record.state != "waiting":  # The command line decided, then resumed the run.
        print(record.describe())
        return record
    answer = suspended_for_answer(record, ApprovalForm)
    return apply(tracking_uri, record, answer.decision == "approve", answer.reason, answer.approver, "form")


def seconds_left(record: ApprovalRecord) -> int:
    return max(1, math.ceil((record.expires_at - datetime.now(UTC)).total_seconds()))


def suspended_for_answer(record: ApprovalRecord, form) -> ApprovalForm:
    """Suspends the run (its process exits); run again after the answer, the same key returns that answer."""
    timeout = seconds_left(record) + BACKSTOP_SECONDS
    return suspend_flow_run(wait_for_input=form, timeout=timeout, key=approval_key(record.version))


def apply(tracking_uri: str, record: ApprovalRecord, approve: bool, reason: str, by: str, via) -> ApprovalRecord:
    """The decision on the version (once), announced when it moved the alias."""
    try:
        decided, move = decide(
            tracking_uri, record.model_name, record.version, approve=approve, reason=reason, by=by, via=via
        )
    except StaleApprovalError as error:
        if via != "form":
            raise
        decided, move = decide(tracking_uri, record.model_name, record.version, approve=False,
                               reason=f"{reason} (approval not applied: {error})", by=by, via=via)  # fmt: skip
    if move is not None:
        announce_move(record.model_name, move)
    print(decided.describe())
    return decided


def expire(tracking_uri: str, record: ApprovalRecord) -> ApprovalRecord:
    stays = f"v{record.champion_version_before}" if record.champion_version_before else "unset"
    reason = f"no decision within {record.timeout_hours:g} h; the champion stays {stays}"
    return apply(tracking_uri, record, False, reason, "timeout", "timeout")


def schedule_expiry(record: ApprovalRecord, config: PipelineConfig, workdir: str) -> None:
    """A run of the approval-timeout deployment at the moment the decision expires (Prefect's scheduler)."""
    from prefect.deployments import run_deployment

    try:
        run_deployment(
            TIMEOUT_DEPLOYMENT,
            parameters={
                "flow_run_id": record.flow_run_id,
                "model_name": record.model_name,
                "workdir": workdir,
                "tracking_uri": config.tracking.tracking_uri,
            },  # fmt: skip
            scheduled_time=record.expires_at,
            flow_run_name=f"approval-timeout-{record.model_name}-v{record.version}",
            timeout=0,  # Scheduled, not awaited.
            as_subflow=False,
        )
    except Exception as error:  # noqa: BLE001 - no such deployment: Prefect's pause timeout still ends the wait.
        print(f"no {TIMEOUT_DEPLOYMENT} run scheduled ({error}); Prefect's pause timeout ends the wait instead")


def wilson(accuracy: float, examples: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson interval of an accuracy measured on `examples` images."""
    if examples <= 0:
        return (math.nan, math.nan)
    center = (accuracy + z * z / (2 * examples)) / (1 + z * z / examples)
    half = (
        z * math.sqrt(accuracy * (1 - accuracy) / examples + z * z / (4 * examples * examples)) / (1 + z * z / examples)
    )
    return (center - half, center + half)


def approval_markdown(
    promotion: PromotionResult, record: ApprovalRecord, tracking_uri: str, validation: ValidationResult | None
) -> str:
    """What the person decides on: both models on the same images, the data's drift, the links."""
    comparison = promotion.comparison or {}
    examples = comparison.get("examples", 0)
    lines = [
        f"# Approve {record.model_name} v{record.version} as champion?",
        "",
        f"The gate passed it: {promotion.reason}. Nothing moves until you decide; without a decision by "
        f"{record.expires_at:%Y-%m-%d %H:%M} UTC it expires and the champion stays "
        f"{'v' + str(record.champion_version_before) if record.champion_version_before else 'unset'}.",
        "",
        "| | test accuracy | 95 % interval |",
        "|---|---:|---:|",
    ]
    for role in ("challenger", "champion"):
        model = comparison.get(role)
        if model:
            low, high = wilson(model["accuracy"], examples)
            lines.append(
                f"| {role} v{model['version']} | {100 * model['accuracy']:.2f} % | {100 * low:.1f}-{100 * high:.1f} % |"
            )
    if validation is not None:
        drift = ", ".join(
            f"{name.removeprefix('data_')} {value:.4g}" for name, value in validation.metrics.items() if "drift" in name
        )
        lines += ["", f"Data: snapshot {validation.snapshot} against {validation.reference}: {validation.summary}" +
                  (f" (drift: {drift})" if drift else "")]  # fmt: skip
    links = version_links(tracking_uri, record.model_name, [record.version, record.champion_version_before])
    if promotion.model_card:
        links.append(f"challenger's model card file: `{promotion.model_card}`")
    if links:
        lines += ["", "Links: " + "; ".join(links)]
    if comparison:
        lines += ["", "---", "", comparison_markdown(comparison).replace("# Challenger", "## The gate: challenger", 1)]
    return "\n".join(lines) + "\n"


def version_links(tracking_uri: str, model_name: str, versions: list[int | None]) -> list[str]:
    """Markdown links to each version's model card in the MLflow UI, and to both runs side by side."""
    from cifar.summary import MlflowRunLink
    from cifar.tracking import mlflow_client

    client, links, runs = mlflow_client(tracking_uri), [], []
    for number in [version for version in versions if version]:
        try:
            run_id = client.get_model_version(model_name, str(number)).run_id
            link = MlflowRunLink.lookup(tracking_uri, run_id)
        except Exception:  # noqa: BLE001 - a missing link must not stop the question being asked.
            continue
        if link is None:
            continue
        page = link.url.split("?")[0]
        links.append(f"[v{number} model card]({page}/artifacts/model_card/model_card.html)")
        runs.append((run_id, page.split("/experiments/")[1].split("/")[0] if "/experiments/" in page else None))
    if len(runs) == 2 and all(experiment for _, experiment in runs):
        ui = links[0].split("(", 1)[1].split("/#/")[0]
        ids = ",".join(f'"{run_id}"' for run_id, _ in runs)
        experiments = ",".join(sorted({f'"{experiment}"' for _, experiment in runs}))
        links.append(f"[both runs compared in MLflow]({ui}/#/compare-runs?runs=[{ids}]&experiments=[{experiments}])")
    return links
