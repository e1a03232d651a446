"""The pages a person visits in the two UIs, in order: each visitor opens one, waits for it, and shoots it."""

from __future__ import annotations

import json
import re
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from scripts.ui_check.browser import Browser, shrink_png
from scripts.ui_check.checks import SCREENSHOTS, Shot
from scripts.ui_check.runs import deployment
from scripts.ui_check.stack import Stack, StackError, start_endpoint

SHARED_VIEW_TAG = "mlflow.sharedViewState."  # An experiment tag MLflow's UI loads with ?viewStateShareKey=<rest>.


@dataclass
class PageContext:
    """What the visits find on the way, for the pages after."""

    runs: dict[str, dict]  # The flow runs by label: "cifar/smoke", "cifar-sweep/sweep", "challenger".
    mlflow_runs: list[dict] = field(default_factory=list)  # The experiment's runs, as MLflow's REST API gives them.
    smoke_mlflow_run_id: str = ""
    experiment_id: str = ""
    report_mlflow_link: str = ""  # The smoke report's link to its MLflow run.
    report_runs_link: str = ""  # Its "all runs" link.
    archive: Path | None = None  # The CIFAR-10 archive: a real test image for the endpoint's try-it page.


Visitor = Callable[[Browser, Stack, PageContext], Shot]

# The state of the fields a person checks on the custom-run form: "Model: tutorial", "Epochs: (empty)".
FIELD_STATES_JS = """(names) => names.map((name) => {
  const label = [...document.querySelectorAll('label')].find(
    (l) => l.innerText.trim().replace(/\\s*\\(Optional\\)$/, '') === name);
  if (!label) return `${name}: (no such field)`;
  const field = label.closest('.group') || label.parentElement.parentElement;
  const tab = field.querySelector('[role=tab][aria-selected=true]');
  if (tab && tab.innerText.trim() === 'None') return `${name}: (empty)`;
  const input = field.querySelector('input:not([type=hidden]), textarea');
  if (input) return `${name}: ${input.value.trim() || '(empty)'}`;
  const box = field.querySelector('[role=combobox], button[aria-haspopup=listbox]');
  return `${name}: ${box ? box.innerText.trim() || '(empty)' : '(unreadable)'}`;
}).join('\\n')"""


def prefect_ui(stack: Stack, path: str) -> str:
    return f"{stack.prefect_url}/v2{path}"  # V2 is what `/` opens in Prefect 3.8 (PREFECT_SERVER_UI_V2_ENABLED).


def visit_prefect_sign_in(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    """The Prefect UI asks for the server's auth string; a person types it (masked) and lands on the dashboard."""
    browser.goto(f"{stack.prefect_url}/", wait_for=r"(?m)^Login$")
    browser.page.get_by_placeholder("admin:pass").fill(stack.secrets["PREFECT_AUTH_STRING"])
    shot = browser.shoot("prefect-sign-in")
    browser.page.get_by_role("button", name="Login").click()
    browser.wait_text(r"Dashboard")
    shot.text += f"\n--- after signing in\n{browser.text()}\nurl: {browser.page.url}"
    return shot


def visit_mlflow_sign_in(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    """MLflow asks through the browser's own basic-auth prompt, which headless Chromium neither draws nor lets a
    page show (a navigation without credentials ends in ERR_INVALID_AUTH_CREDENTIALS): the refusal is read as a
    request without credentials; the screenshot is what the viewer sees once signed in."""
    anonymous = browser.new_context()
    try:
        response = anonymous.request.get(f"{stack.mlflow_url}/")
        refusal = f"status: {response.status}\n{response.text()}"
    finally:
        anonymous.close()
    browser.goto(f"{stack.mlflow_url}/#/experiments", wait_for=r"cifar10")
    close_mlflow_assistant(browser)
    shot = browser.shoot("mlflow-sign-in")
    shot.text += f"\n--- without credentials\n{refusal}"
    return shot


def visit_prefect_deployments(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    browser.goto(f"{stack.prefect_url}/", wait_for=r"Dashboard")  # What a person opens; it redirects to the default UI.
    browser.page.get_by_role("link", name="Deployments", exact=True).first.click()
    browser.wait_text(r"(?m)^smoke$")
    return browser.shoot("prefect-deployments")


def visit_prefect_nightly(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    nightly = deployment(stack, "cifar-retrain/nightly")
    # The schedule card reads "At 02:00 AM" (in the schedule's own time zone); the description names it.
    url = prefect_ui(stack, f"/deployments/deployment/{nightly['id']}?tab=Description")
    browser.goto(url, wait_for=r"(?m)^nightly$")
    browser.wait_text(r"02:00 UTC")
    return browser.shoot("prefect-nightly-schedule")


def visit_prefect_custom_run(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    smoke = deployment(stack, "cifar/smoke")
    browser.goto(prefect_ui(stack, f"/deployments/deployment/{smoke['id']}"), wait_for=r"(?m)^smoke$")
    browser.page.get_by_role("button", name=re.compile(r"^Run")).first.click()  # The deployment page's Run menu...
    browser.page.get_by_text("Custom run", exact=True).first.click()  # ...and its "Custom run" item.
    browser.page.wait_for_url(re.compile(r"/run(\?|$)"))
    browser.wait_text(r"Parameters")
    browser.wait_text(r"(?m)^Model( \(Optional\))?$")
    top = browser.shoot("prefect-custom-run-smoke-top")
    browser.page.locator("label", has_text=re.compile(r"^Model( \(Optional\))?$")).first.evaluate(
        "e => e.scrollIntoView({block: 'start'})"
    )
    browser.page.mouse.wheel(0, -150)  # The section title above the field stays in view.
    browser.page.wait_for_timeout(500)
    train = browser.shoot("prefect-custom-run-smoke")
    fields = browser.page.evaluate(FIELD_STATES_JS, ["Preset", "Model", "Epochs", "Learning Rate", "Source"])
    return Shot(text=f"{train.text}\n--- fields\n{fields}", path=train.path, extra=[top.path])


def flow_run_id(context: PageContext, label: str) -> str:
    return context.runs[label]["id"]


def visit_prefect_flow_run_logs(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    browser.goto(
        prefect_ui(stack, f"/runs/flow-run/{flow_run_id(context, 'cifar/smoke')}?tab=Logs"), wait_for=r"(?m)^INFO$"
    )
    # The log list is virtual and starts at the oldest line; a person flips it to see how the run ended.
    browser.page.get_by_role("combobox").filter(has_text="Oldest to newest").first.click()
    browser.page.get_by_role("option", name="Newest to oldest").click()
    browser.wait_text(r"cifar pipeline done")
    browser.page.get_by_text(re.compile(r"cifar pipeline done")).first.evaluate(
        "e => e.scrollIntoView({block: 'center'})"
    )
    browser.page.wait_for_timeout(500)
    return browser.shoot("prefect-flow-run-smoke")


def open_artifact(browser: Browser, key: str, flow_run_name: str) -> None:
    """From a flow run's Artifacts tab to its artifact `key`, clicking as a person does.

    The card opens the key's timeline (every run's artifact of that key); there, the entry of this
    flow run opens the artifact itself.
    """
    card = browser.page.locator(f'a[href$="/artifacts/key/{key}"]').first
    card.scroll_into_view_if_needed()
    card.click()
    browser.page.wait_for_url(re.compile(rf"/artifacts/key/{re.escape(key)}"))
    browser.wait_text(rf"Flow run: {re.escape(flow_run_name)}")
    entry = browser.page.locator("div", has_text=f"Flow run: {flow_run_name}").filter(
        has=browser.page.locator('a[href*="/artifacts/artifact/"]')
    )
    entry.last.locator('a[href*="/artifacts/artifact/"]').first.click()
    browser.page.wait_for_url(re.compile(r"/artifacts/artifact/"))
    browser.idle()


def visit_prefect_flow_run_artifacts(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    browser.goto(
        prefect_ui(stack, f"/runs/flow-run/{flow_run_id(context, 'cifar/smoke')}?tab=Artifacts"),
        wait_for=r"(?m)^cifar-report$",
    )
    browser.page.locator('a[href$="/artifacts/key/cifar-report"]').first.evaluate(
        "e => e.scrollIntoView({block: 'end'})"
    )
    browser.page.wait_for_timeout(500)
    return browser.shoot("prefect-flow-run-smoke-artifacts")


def open_run_artifact(browser: Browser, stack: Stack, context: PageContext, label: str, key: str) -> None:
    """The Artifacts tab of flow run `label`, then its artifact `key`."""
    browser.goto(
        prefect_ui(stack, f"/runs/flow-run/{flow_run_id(context, label)}?tab=Artifacts"), wait_for=rf"(?m)^{key}$"
    )
    open_artifact(browser, key, context.runs[label]["name"])


def visit_prefect_report(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    open_run_artifact(browser, stack, context, "cifar/smoke", "cifar-report")
    browser.wait_text(r"Test accuracy")
    shot = browser.shoot("prefect-smoke-report")
    # The report's links, as "link: <text> -> <href>" lines (a markdown link shows only its text).
    links = browser.page.evaluate(
        "() => [...document.querySelectorAll('main a[href], [role=main] a[href], a[href^=http]')]"
        ".map((a) => `link: ${a.innerText.trim()} -> ${a.href}`).join('\\n')"
    )
    found = re.search(r"(?m)^link: .* -> (http\S+/#/experiments/\S+/runs/\w+\?\S+)$", links)
    context.report_mlflow_link = found.group(1) if found else ""
    found = re.search(r"(?m)^link: all runs -> (http\S+/#/experiments/\d+/runs\?\S+)$", links)
    context.report_runs_link = found.group(1) if found else ""
    shot.text += f"\n--- links\n{links}"
    return shot


def visit_prefect_sweep_table(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    open_run_artifact(browser, stack, context, "cifar-sweep/sweep", "cifar-sweep")
    browser.wait_text(r"learning_rate")
    return browser.shoot("prefect-sweep-table")


def mlflow_experiment(stack: Stack) -> dict:
    found = stack.call(
        "POST",
        f"{stack.mlflow_url}/api/2.0/mlflow/experiments/search",
        {"max_results": 100, "filter": "name = 'cifar10'"},
    )
    experiments = found.get("experiments", [])  # type: ignore[union-attr]
    if not experiments:
        raise StackError(f"no MLflow experiment cifar10 on {stack.mlflow_url}")
    return experiments[0]


def mlflow_runs(stack: Stack, experiment_id: str) -> list[dict]:
    found = stack.call(
        "POST",
        f"{stack.mlflow_url}/api/2.0/mlflow/runs/search",
        {"experiment_ids": [experiment_id], "max_results": 100},
    )
    return found.get("runs", [])  # type: ignore[union-attr]


def tags(entity: dict) -> dict[str, str]:
    return {tag["key"]: tag["value"] for tag in (entity.get("data", entity).get("tags") or [])}


def close_mlflow_assistant(browser: Browser) -> None:
    """MLflow 3.17 opens its "MLflow Assistant" panel on a first visit; a person closes it once."""
    close = browser.page.get_by_role("button", name="Close", exact=True)
    if close.count():
        close.first.click()
        browser.page.wait_for_timeout(500)


def visit_mlflow_landing(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    """The report's "all runs" link: where does a person land?"""
    experiment_id = mlflow_experiment(stack)["experiment_id"]
    fallback = (
        f"{stack.mlflow_url}/#/experiments/{experiment_id}/runs?viewStateShareKey=cifar&workflowType=machine_learning"
    )
    browser.goto(context.report_runs_link or fallback, wait_for=r"Run Name")
    close_mlflow_assistant(browser)
    browser.idle()
    browser.page.wait_for_timeout(2000)
    return browser.shoot("mlflow-experiment-landing")


def visit_mlflow_runs_table(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    experiment = mlflow_experiment(stack)
    context.experiment_id = experiment_id = experiment["experiment_id"]
    # A shared view (experiment tag mlflow.sharedViewState.<key>) is how the project can choose the
    # table's columns for everyone; without one, this is the experiment's plain runs page.
    shared = sorted(key for key in tags(experiment) if key.startswith(SHARED_VIEW_TAG))
    query = f"?viewStateShareKey={shared[0][len(SHARED_VIEW_TAG) :]}&workflowType=machine_learning" if shared else ""
    browser.goto(f"{stack.mlflow_url}/#/experiments/{experiment_id}/runs{query}", wait_for=r"Run Name")
    close_mlflow_assistant(browser)
    expanders = browser.page.locator('[data-component-id*="runnamecellrenderer"]').all()
    for expander in expanders:  # Sweep parents: show their children.
        expander.click()
        browser.page.wait_for_timeout(300)
    children = [run["info"]["run_name"] for run in context.mlflow_runs if tags(run).get("cifar.sweep") == "child"]
    if children:
        browser.wait_text(rf"(?m)^{re.escape(children[0])}")
    browser.page.wait_for_timeout(1000)
    return browser.shoot("mlflow-runs-table")


def visit_mlflow_run(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    url = context.report_mlflow_link or (  # The link a person follows from the Prefect report.
        f"{stack.mlflow_url}/#/experiments/{context.experiment_id}/runs/{context.smoke_mlflow_run_id}"
    )
    browser.goto(url, wait_for=r"(?m)^test_accuracy$")
    close_mlflow_assistant(browser)
    return browser.shoot("mlflow-run")


def visit_mlflow_compare(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    runs = mlflow_runs(stack, context.experiment_id)
    children = [run["info"]["run_id"] for run in runs if tags(run).get("cifar.sweep") == "child"]
    runs_arg, experiments_arg = (urllib.parse.quote(json.dumps(value)) for value in (children, [context.experiment_id]))
    browser.goto(
        f"{stack.mlflow_url}/#/compare-runs?runs={runs_arg}&experiments={experiments_arg}", wait_for=r"Run details"
    )
    close_mlflow_assistant(browser)
    browser.page.wait_for_timeout(1000)
    return browser.shoot("mlflow-compare-sweep")


def visit_mlflow_registry(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    browser.goto(f"{stack.mlflow_url}/#/models/cifar10", wait_for=r"Version 1")
    close_mlflow_assistant(browser)
    return browser.shoot("mlflow-registry-champion")


def visit_prefect_comparison(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    browser.goto(
        prefect_ui(stack, f"/runs/flow-run/{flow_run_id(context, 'challenger')}?tab=Artifacts"),
        wait_for=r"(?m)^cifar-comparison$",
    )
    # The challenger is a second smoke run, named as the first: the key's timeline lists two entries of
    # one name, so the artifact is opened by its id, the one this flow run made.
    made_by = {"any_": [flow_run_id(context, "challenger")]}
    body = {"artifacts": {"key": {"any_": ["cifar-comparison"]}, "flow_run_id": made_by}}
    [artifact] = stack.call("POST", f"{stack.api}/artifacts/filter", body)  # type: ignore[misc]
    browser.goto(prefect_ui(stack, f"/artifacts/artifact/{artifact['id']}?tab=Artifact"), wait_for=r"Challenger v2")
    browser.wait_text(r"McNemar")
    return browser.shoot("prefect-comparison", full_page=True)


def visit_mlflow_version_record(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    browser.goto(f"{stack.mlflow_url}/#/models/cifar10/versions/2", wait_for=r"Test accuracy")
    close_mlflow_assistant(browser)
    browser.page.wait_for_timeout(1000)
    return browser.shoot("mlflow-version-record", full_page=True)


def visit_mlflow_model_card(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    version = stack.call("GET", f"{stack.mlflow_url}/api/2.0/mlflow/model-versions/get?name=cifar10&version=2")
    run_id = version["model_version"]["run_id"]  # type: ignore[index]
    run = stack.call("GET", f"{stack.mlflow_url}/api/2.0/mlflow/runs/get?run_id={run_id}")
    experiment_id = run["run"]["info"]["experiment_id"]  # type: ignore[index]
    browser.goto(
        f"{stack.mlflow_url}/#/experiments/{experiment_id}/runs/{run_id}/artifacts/model_card/model_card.html",
        wait_for=r"model_card\.html",
    )
    close_mlflow_assistant(browser)
    frame = browser.page.frame_locator("iframe").first
    frame.get_by_text("Intended use").first.wait_for(timeout=30_000)
    shot = browser.shoot("mlflow-model-card")
    card = frame.locator("body").inner_text(timeout=10_000)  # The card is an HTML page inside an iframe.
    return Shot(text=f"{shot.text}\n--- card\n{card}", path=shot.path)


def visit_endpoint_try_it(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    """The endpoint's page with a real test image chosen, as a person uploads a photo."""
    from PIL import Image

    from cifar.data.archive import read_archive

    if context.archive is None:
        raise StackError("no archive to take a test image from")
    photo = stack.tmp / "test-image-0.png"
    Image.fromarray(read_archive(context.archive).test_images[0]).resize((128, 128)).save(photo)
    url = start_endpoint(stack)
    browser.goto(f"{url}/", wait_for=r"Drop a photo here")
    browser.page.set_input_files("#file", str(photo))
    browser.wait_text(r"answered by cifar10 version \d+")
    return browser.shoot("endpoint-try-it")


def visit_prefect_approval(browser: Browser, stack: Stack, context: PageContext) -> Shot:
    """The waiting run's page, then its Resume form: what to decide on, approve or reject, a reason, a name."""
    browser.goto(prefect_ui(stack, f"/runs/flow-run/{flow_run_id(context, 'waiting')}"), wait_for=r"Suspended")
    browser.page.get_by_role("button", name="Open menu").click()  # The run's menu: Resume, for a paused run.
    browser.page.get_by_role("menuitem", name="Resume").click()
    browser.wait_text(r"Approve cifar10 v\d+ as champion\?")
    top = browser.shoot("prefect-approval-form")
    browser.page.get_by_text(re.compile(r"^Decision$")).first.evaluate("e => e.scrollIntoView({block: 'start'})")
    browser.page.wait_for_timeout(500)
    fields = browser.shoot("prefect-approval-form-fields")  # The end of the comparison, then the three fields.
    return Shot(text=f"{top.text}\n--- fields\n{fields.text}", path=top.path, extra=[fields.path])


PAGES: dict[str, Visitor] = {
    "prefect-sign-in": visit_prefect_sign_in,
    "prefect-deployments": visit_prefect_deployments,
    "prefect-custom-run-smoke": visit_prefect_custom_run,
    "prefect-nightly-schedule": visit_prefect_nightly,
    "prefect-flow-run-smoke": visit_prefect_flow_run_logs,
    "prefect-flow-run-smoke-artifacts": visit_prefect_flow_run_artifacts,
    "prefect-smoke-report": visit_prefect_report,
    "prefect-sweep-table": visit_prefect_sweep_table,
    "mlflow-sign-in": visit_mlflow_sign_in,
    "mlflow-experiment-landing": visit_mlflow_landing,
    "mlflow-runs-table": visit_mlflow_runs_table,
    "mlflow-run": visit_mlflow_run,
    "mlflow-compare-sweep": visit_mlflow_compare,
    "mlflow-registry-champion": visit_mlflow_registry,
    "prefect-comparison": visit_prefect_comparison,
    "mlflow-version-record": visit_mlflow_version_record,
    "mlflow-model-card": visit_mlflow_model_card,
    "endpoint-try-it": visit_endpoint_try_it,
    "prefect-approval-form": visit_prefect_approval,
}


def visit_all(
    stack: Stack, out: Path, runs: dict[str, dict], dump: Path, archive: Path | None = None
) -> dict[str, Shot]:
    context = PageContext(runs, archive=archive)
    experiment = mlflow_experiment(stack)
    smoke = [
        run
        for run in mlflow_runs(stack, experiment["experiment_id"])
        if "cifar.sweep" not in tags(run)
        and {p["key"]: p["value"] for p in run["data"].get("params", [])}.get("train.model") == "tutorial"
    ]
    context.smoke_mlflow_run_id = smoke[0]["info"]["run_id"] if smoke else ""
    context.mlflow_runs = mlflow_runs(stack, experiment["experiment_id"])
    shots: dict[str, Shot] = {}
    viewer, password = stack.account("viewer")  # A person comparing runs signs in to MLflow as the viewer.
    browser = Browser(out, {"username": viewer, "password": password, "origin": stack.mlflow_url})
    try:
        for key, visitor in PAGES.items():
            started = time.monotonic()
            try:
                shots[key] = visitor(browser, stack, context)
            except Exception as error:  # One page failing must not hide the others.
                path = out / SCREENSHOTS[key]
                try:
                    browser.page.screenshot(path=str(path))
                    shrink_png(path)
                    text = browser.text()
                except Exception:
                    path, text = None, ""
                shots[key] = Shot(text=text, path=path, error=f"{type(error).__name__}: {str(error).splitlines()[0]}")
            (dump / f"{key}.txt").write_text(shots[key].text, encoding="utf-8")
            state = f"error: {shots[key].error}" if shots[key].error else "ok"
            print(f"  page {key}: {time.monotonic() - started:.1f}s {state}  {browser.page.url}", flush=True)
    finally:
        browser.close()
    return shots
