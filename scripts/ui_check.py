"""What a person sees in the Prefect and MLflow UIs after a smoke run and a small sweep, checked in a browser.

    scripts/install_browser.sh                      # once: Debian's chromium + the playwright client
    .venv/bin/python scripts/ui_check.py            # screenshots into docs/images/, exit 1 on a failed check
    .venv/bin/python scripts/ui_check.py --keep     # ... then leave the servers up to look around (Ctrl-C ends)
    .venv/bin/python scripts/ui_check.py --attach TMP   # only the browser part, against a --keep run's servers
    .venv/bin/python scripts/ui_check.py --out /tmp/shots --archive PATH [--sha256 HEX]

Offline, on 127.0.0.1 only, everything under one temporary directory (printed at the start):

1. a Prefect server (scripts/prefect_server.sh, UI on) and an MLflow server (SQLite + local artifacts),
   each on a free port;
2. the `cifar-process` work pool, `prefect --no-prompt deploy --all` of prefect.yaml, one process
   worker started from the repository root, then two deployment runs: `cifar/smoke` on the real archive
   and `cifar-sweep/sweep` (tiny model, learning rates 0.02 and 0.05), both tracking to the MLflow server;
3. headless Chromium (Debian's /usr/bin/chromium through playwright) visits the pages in PAGES, saves
   a screenshot of each and checks the texts in CHECKS; one PASS/FAIL line per check.

Every process it started is stopped at the end (process groups, then anything still carrying this
run's marker in its environment), whatever happens. The temp dir goes when every check passed; else
its logs/ (servers, worker) and page-text/ (what each page showed) stay and its bulk (shards) goes.
Exit status: 0 all checks passed, 1 a check failed, 2 the stack or a run failed before the checks.
Takes ~3-5 minutes on 2 CPU cores (~1.5 of them the two runs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN_DIR = Path(sys.executable).parent  # The venv's bin: prefect, mlflow.
HOST = "127.0.0.1"
DEFAULT_ARCHIVE = REPO_ROOT.parent / "shared" / "data" / "cifar-10-python.tar.gz"
DEFAULT_OUT = REPO_ROOT / "docs" / "images"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
POOL = "cifar-process"
VIEWPORT = {"width": 1400, "height": 900}
MAX_PNG_BYTES = 400_000
RUN_TIMEOUT_S = 480  # For both runs together (they start at once; the `training` limit serialises training).
MARKER_ENV = "CIFAR_UI_CHECK_RUN"  # Every process this script starts carries it: the final sweep for leftovers.
SWEEP_LEARNING_RATES = [0.02, 0.05]


# --------------------------------------------------------------------------------------------------
# What a person must see. One row per check: the page (a key of PAGES below), the screenshot it is
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
)

# Page key (PAGES below) -> screenshot file under --out; a page may save more (SCREENSHOTS_EXTRA).
SCREENSHOTS = {
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
}
SHARED_VIEW_TAG = "mlflow.sharedViewState."  # An experiment tag MLflow's UI loads with ?viewStateShareKey=<rest>.


# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


@dataclass
class Proc:
    """A subprocess in its own process group, logging to `log`."""

    name: str
    process: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-chars:] if self.log.exists() else ""

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)  # The whole group: a server's workers, a worker's flow runs.
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class Stack:
    tmp: Path
    marker: str
    procs: list[Proc] = field(default_factory=list)
    prefect_url: str = ""
    mlflow_url: str = ""
    prefect_env: dict[str, str] = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"{self.prefect_url}/api"

    def spawn(self, name: str, command: Sequence[str], env: dict[str, str], cwd: Path | None = None) -> Proc:
        log = self.tmp / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as handle:
            process = subprocess.Popen(
                list(command),
                env={**env, MARKER_ENV: self.marker},
                cwd=cwd,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        proc = Proc(name, process, log)
        self.procs.append(proc)
        return proc

    def logs(self) -> list[Path]:
        return sorted((self.tmp / "logs").glob("*.log"))

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to every process group, SIGKILL to what is left after `grace` seconds, then leftovers."""
        for proc in self.procs:
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            proc.signal(signal.SIGKILL)  # Children that outlived their leader, too.
            try:
                proc.process.wait(5)
            except subprocess.TimeoutExpired:
                pass
        # Flow-run processes a worker started may sit in groups of their own: end what carries our marker.
        for pid in marked_pids(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when this script dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def marked_pids(marker: str) -> list[int]:
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(
        PYTHONUNBUFFERED="1",
        TF_CPP_MIN_LOG_LEVEL="2",
        MLFLOW_DISABLE_TELEMETRY="true",  # Offline: nothing to send, nothing to wait for.
        DO_NOT_TRACK="true",
        PATH=f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def prefect_env(home: Path, api_url: str, **extra: str) -> dict[str, str]:
    env = base_env()
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_PROFILES_PATH=str(home / "profiles.toml"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_CLI_PROMPT="false",
        PREFECT_API_URL=api_url,
        **extra,
    )
    return env


def wait_http(url: str, proc: Proc, timeout: float, expect: str | None = None) -> None:
    deadline, last = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        if not proc.alive():
            raise StackError(f"{proc.name} exited with {proc.process.returncode}:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = response.read().decode("utf-8", errors="replace")
                if response.status == 200 and (expect is None or expect in body):
                    return
                last = f"HTTP {response.status}: {body[:200]}"
        except (urllib.error.URLError, OSError) as error:
            last = str(error)
        time.sleep(0.5)
    raise StackError(f"{url} not ready after {timeout:.0f}s ({last})")


class StackError(RuntimeError):
    """The servers, the deployment or a run failed: nothing to check in the UIs."""


def api(method: str, url: str, body: object | None = None, timeout: float = 30, attempts: int = 6) -> object:
    """A JSON request; retried like Prefect's own client does on 429/502/503 (SQLite busy on a loaded machine)."""
    data = None if body is None else json.dumps(body).encode()
    for attempt in range(1, attempts + 1):
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            if error.code not in {429, 502, 503} or attempt == attempts:
                raise StackError(f"{method} {url}: HTTP {error.code} {error.read()[:500]!r}") from error
        except (urllib.error.URLError, OSError) as error:
            if attempt == attempts:
                raise StackError(f"{method} {url}: {error}") from error
        time.sleep(min(2**attempt, 10))
    raise AssertionError("unreachable")


def cli(stack: Stack, args: Sequence[str], timeout: float = 300) -> str:
    command = [str(BIN_DIR / args[0]), *args[1:]]
    result = subprocess.run(
        command,
        env={**stack.prefect_env, MARKER_ENV: stack.marker},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise StackError(
            f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result.stdout


def start_stack(stack: Stack) -> None:
    """Both servers (started together: each takes a while on a busy machine), the pool, the deployments, a worker."""
    prefect_port, mlflow_port = free_port(), free_port()
    stack.prefect_url, stack.mlflow_url = f"http://{HOST}:{prefect_port}", f"http://{HOST}:{mlflow_port}"
    home = stack.tmp / "prefect-home"
    server_env = prefect_env(
        home,
        stack.api,
        PREFECT_UI_API_URL=stack.api,  # What the browser calls: this server, not the default :4200.
        PREFECT_UI_URL=stack.prefect_url,
        PREFECT_SERVER_API_HOST=HOST,
        PREFECT_SERVER_API_PORT=str(prefect_port),
        PREFECT_UI_STATIC_DIRECTORY=str(stack.tmp / "prefect-ui"),  # Not the shared site-packages copy.
        PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT="false",
        PYTHON=sys.executable,
    )
    prefect = stack.spawn(
        "prefect-server",
        [str(REPO_ROOT / "scripts" / "prefect_server.sh"), "--host", HOST, "--port", str(prefect_port)],
        server_env,
    )
    mlflow_root = stack.tmp / "mlflow"
    mlflow_root.mkdir(parents=True, exist_ok=True)
    mlflow = stack.spawn(
        "mlflow-server",
        [
            str(BIN_DIR / "mlflow"),
            "server",
            "--host",
            HOST,
            "--port",
            str(mlflow_port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{mlflow_root / 'mlflow.db'}",
            "--artifacts-destination",
            str(mlflow_root / "artifacts"),
        ],
        base_env(),
    )
    wait_http(f"{stack.api}/health", prefect, 240)
    wait_http(f"{stack.mlflow_url}/health", mlflow, 240)
    stack.prefect_env = prefect_env(home, stack.api)
    print(f"prefect  {stack.prefect_url}   mlflow  {stack.mlflow_url}", flush=True)

    cli(stack, ["prefect", "work-pool", "create", POOL, "--type", "process"])
    cli(stack, ["prefect", "concurrency-limit", "create", "training", "1"])
    cli(stack, ["prefect", "--no-prompt", "deploy", "--all"])
    worker = stack.spawn(
        "prefect-worker",
        [str(BIN_DIR / "prefect"), "worker", "start", "--pool", POOL, "--name", "ui-check"],
        {**stack.prefect_env, "PWD": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": ""},
        cwd=REPO_ROOT,
    )
    deadline = time.monotonic() + 120
    while "started!" not in worker.tail(20000):
        if not worker.alive() or time.monotonic() > deadline:
            raise StackError(f"the worker did not start:\n{worker.tail()}")
        time.sleep(0.5)


def deployment(stack: Stack, name: str) -> dict:
    return api("GET", f"{stack.api}/deployments/name/{name}")  # type: ignore[return-value]


def run_deployment(stack: Stack, name: str, parameters: dict) -> str:
    """A flow run of deployment `name` (its parameters merged over the deployment's); returns its id."""
    flow_run = api(
        "POST", f"{stack.api}/deployments/{deployment(stack, name)['id']}/create_flow_run", {"parameters": parameters}
    )
    return flow_run["id"]  # type: ignore[index]


def wait_runs(stack: Stack, flow_run_ids: dict[str, str]) -> dict[str, dict]:
    """Waits until every flow run is terminal; StackError when one did not complete."""
    deadline, done = time.monotonic() + RUN_TIMEOUT_S, {}
    worker = next(proc for proc in stack.procs if proc.name == "prefect-worker")
    shown: dict[str, str] = {}
    while len(done) < len(flow_run_ids):
        for label, run_id in flow_run_ids.items():
            if label in done:
                continue
            flow_run = api("GET", f"{stack.api}/flow_runs/{run_id}")
            state = flow_run["state"]["name"]  # type: ignore[index]
            if shown.get(label) != state:
                print(f"  {time.strftime('%H:%M:%S')} {label}: {state}", flush=True)
                shown[label] = state
            if flow_run["state"]["type"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:  # type: ignore[index]
                done[label] = flow_run
        if not worker.alive():
            raise StackError(f"the worker exited:\n{worker.tail()}")
        if time.monotonic() > deadline:
            raise StackError(f"runs not finished after {RUN_TIMEOUT_S}s: {shown}")
        time.sleep(2)
    failed = {label: run["state"] for label, run in done.items() if run["state"]["type"] != "COMPLETED"}
    if failed:
        raise StackError(f"runs did not complete: {json.dumps(failed, indent=1)[:3000]}")
    return done


def run_pipelines(stack: Stack, archive: Path, sha256: str) -> dict[str, dict]:
    workdir = stack.tmp / "workdir"
    config = {
        "preset": "smoke",
        "data": {"source": str(archive), "sha256": sha256},
        "tracking": {"tracking_uri": stack.mlflow_url},
    }
    smoke = run_deployment(stack, "cifar/smoke", {"config": config, "workdir": str(workdir)})
    sweep = run_deployment(
        stack,
        "cifar-sweep/sweep",
        {"config": config, "models": ["tiny"], "learning_rates": SWEEP_LEARNING_RATES, "workdir": str(workdir)},
    )
    runs = wait_runs(stack, {"cifar/smoke": smoke, "cifar-sweep/sweep": sweep})
    # A challenger (another seed: another model) that the gate compares with the smoke run's champion.
    challenger = run_deployment(stack, "cifar/smoke", {"config": {**config, "seed": 1}, "workdir": str(workdir)})
    return runs | wait_runs(stack, {"challenger": challenger})


# --------------------------------------------------------------------------------------------------
# The browser
# --------------------------------------------------------------------------------------------------


@dataclass
class Shot:
    text: str = ""
    path: Path | None = None
    error: str = ""
    extra: list[Path | None] = field(default_factory=list)


class Browser:
    def __init__(self, out: Path) -> None:
        from playwright.sync_api import sync_playwright

        self.out = out
        self._playwright = sync_playwright().start()
        self._browser = self._playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]
        )
        self.context = self._browser.new_context(viewport=VIEWPORT, device_scale_factor=1, color_scheme="light")
        self.context.set_default_timeout(30_000)
        self.page = self.context.new_page()
        self.console: list[str] = []
        self.page.on("console", lambda msg: msg.type == "error" and self.console.append(msg.text))

    def close(self) -> None:
        try:
            self._browser.close()
        finally:
            self._playwright.stop()

    def goto(self, url: str, *, wait_for: str | None = None, settle: float = 1.0) -> None:
        """Opens `url` and waits until the page shows `wait_for` (a regex on its visible text), then settles."""
        self.page.goto(url, wait_until="domcontentloaded")
        self.idle()
        if wait_for:
            self.wait_text(wait_for)
        self.page.wait_for_timeout(settle * 1000)

    def wait_text(self, pattern: str, timeout: float = 45.0) -> None:
        """Waits until the page's visible text matches `pattern` (spinners and skeletons never do)."""
        self.page.wait_for_function(
            "([source, flags]) => new RegExp(source, flags).test(document.body.innerText)",
            arg=js_regex(pattern),
            timeout=timeout * 1000,
        )
        self.idle(2.0)

    def idle(self, timeout: float = 5.0) -> None:
        """Waits (a little) for the network to settle; pages that poll (both UIs do) never quite go idle."""
        try:
            self.page.wait_for_load_state("networkidle", timeout=timeout * 1000)
        except Exception:  # The text waits decide whether a page is ready.
            pass

    def text(self) -> str:
        return self.page.inner_text("body")

    def shoot(self, key: str, *, full_page: bool = False) -> Shot:
        self.page.evaluate("() => document.activeElement && document.activeElement.blur()")  # No focus rings.
        self.page.mouse.move(0, VIEWPORT["height"] - 1)  # No hover cards.
        path = self.out / SCREENSHOTS[key]
        self.page.screenshot(path=str(path), full_page=full_page)
        shrink_png(path)
        return Shot(text=f"{self.text()}\n--- url\nurl: {self.page.url}", path=path)


def js_regex(pattern: str) -> list[str]:
    """A Python regex with leading inline flags ((?m), (?i)) as [source, flags] for JavaScript's RegExp."""
    match = re.match(r"\(\?([im]+)\)", pattern)
    return [pattern[match.end() :], match.group(1)] if match else [pattern, ""]


def shrink_png(path: Path) -> None:
    """Keeps a screenshot under MAX_PNG_BYTES: fewer colours (visually the same for UI pages)."""
    if path.stat().st_size <= MAX_PNG_BYTES:
        return
    from PIL import Image

    with Image.open(path) as image:
        for colors in (256, 128, 64):
            image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
            if path.stat().st_size <= MAX_PNG_BYTES:
                return


# Each visitor drives the browser to one page and returns what it saw. `ctx` holds ids found on the way.
Visitor = Callable[[Browser, Stack, dict], Shot]

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


def visit_prefect_deployments(b: Browser, stack: Stack, ctx: dict) -> Shot:
    b.goto(f"{stack.prefect_url}/", wait_for=r"Dashboard")  # What a person opens; it redirects to the default UI.
    ctx["prefect_default_ui"] = b.page.url
    b.page.get_by_role("link", name="Deployments", exact=True).first.click()
    b.wait_text(r"(?m)^smoke$")
    return b.shoot("prefect-deployments")


def visit_prefect_nightly(b: Browser, stack: Stack, ctx: dict) -> Shot:
    nightly = deployment(stack, "cifar-retrain/nightly")
    # The schedule card reads "At 02:00 AM" (in the schedule's own time zone); the description names it.
    url = prefect_ui(stack, f"/deployments/deployment/{nightly['id']}?tab=Description")
    b.goto(url, wait_for=r"(?m)^nightly$")
    b.wait_text(r"02:00 UTC")
    return b.shoot("prefect-nightly-schedule")


def visit_prefect_custom_run(b: Browser, stack: Stack, ctx: dict) -> Shot:
    smoke = deployment(stack, "cifar/smoke")
    b.goto(prefect_ui(stack, f"/deployments/deployment/{smoke['id']}"), wait_for=r"(?m)^smoke$")
    b.page.get_by_role("button", name=re.compile(r"^Run")).first.click()  # The deployment page's Run menu...
    b.page.get_by_text("Custom run", exact=True).first.click()  # ...and its "Custom run" item.
    b.page.wait_for_url(re.compile(r"/run(\?|$)"))
    b.wait_text(r"Parameters")
    b.wait_text(r"(?m)^Model( \(Optional\))?$")
    ctx["custom_run_url"] = b.page.url
    top = b.shoot("prefect-custom-run-smoke-top")
    b.page.locator("label", has_text=re.compile(r"^Model( \(Optional\))?$")).first.evaluate(
        "e => e.scrollIntoView({block: 'start'})"
    )
    b.page.mouse.wheel(0, -150)  # The section title above the field stays in view.
    b.page.wait_for_timeout(500)
    train = b.shoot("prefect-custom-run-smoke")
    fields = b.page.evaluate(FIELD_STATES_JS, ["Preset", "Model", "Epochs", "Learning Rate", "Source"])
    return Shot(text=f"{train.text}\n--- fields\n{fields}", path=train.path, extra=[top.path])


def flow_run_id(ctx: dict, label: str) -> str:
    return ctx["runs"][label]["id"]


def visit_prefect_flow_run_logs(b: Browser, stack: Stack, ctx: dict) -> Shot:
    b.goto(prefect_ui(stack, f"/runs/flow-run/{flow_run_id(ctx, 'cifar/smoke')}?tab=Logs"), wait_for=r"(?m)^INFO$")
    # The log list is virtual and starts at the oldest line; a person flips it to see how the run ended.
    b.page.get_by_role("combobox").filter(has_text="Oldest to newest").first.click()
    b.page.get_by_role("option", name="Newest to oldest").click()
    b.wait_text(r"cifar pipeline done")
    b.page.get_by_text(re.compile(r"cifar pipeline done")).first.evaluate("e => e.scrollIntoView({block: 'center'})")
    b.page.wait_for_timeout(500)
    return b.shoot("prefect-flow-run-smoke")


def open_artifact(b: Browser, key: str, flow_run_name: str) -> None:
    """From a flow run's Artifacts tab to its artifact `key`, clicking as a person does.

    The card opens the key's timeline (every run's artifact of that key); there, the entry of this
    flow run opens the artifact itself.
    """
    card = b.page.locator(f'a[href$="/artifacts/key/{key}"]').first
    card.scroll_into_view_if_needed()
    card.click()
    b.page.wait_for_url(re.compile(rf"/artifacts/key/{re.escape(key)}"))
    b.wait_text(rf"Flow run: {re.escape(flow_run_name)}")
    entry = b.page.locator("div", has_text=f"Flow run: {flow_run_name}").filter(
        has=b.page.locator('a[href*="/artifacts/artifact/"]')
    )
    entry.last.locator('a[href*="/artifacts/artifact/"]').first.click()
    b.page.wait_for_url(re.compile(r"/artifacts/artifact/"))
    b.idle()


def visit_prefect_flow_run_artifacts(b: Browser, stack: Stack, ctx: dict) -> Shot:
    b.goto(
        prefect_ui(stack, f"/runs/flow-run/{flow_run_id(ctx, 'cifar/smoke')}?tab=Artifacts"),
        wait_for=r"(?m)^cifar-report$",
    )
    b.page.locator('a[href$="/artifacts/key/cifar-report"]').first.evaluate("e => e.scrollIntoView({block: 'end'})")
    b.page.wait_for_timeout(500)
    return b.shoot("prefect-flow-run-smoke-artifacts")


def visit_prefect_report(b: Browser, stack: Stack, ctx: dict) -> Shot:
    b.goto(
        prefect_ui(stack, f"/runs/flow-run/{flow_run_id(ctx, 'cifar/smoke')}?tab=Artifacts"),
        wait_for=r"(?m)^cifar-report$",
    )
    open_artifact(b, "cifar-report", ctx["runs"]["cifar/smoke"]["name"])
    b.wait_text(r"Test accuracy")
    shot = b.shoot("prefect-smoke-report")
    # The report's links, as "link: <text> -> <href>" lines (a markdown link shows only its text).
    links = b.page.evaluate(
        "() => [...document.querySelectorAll('main a[href], [role=main] a[href], a[href^=http]')]"
        ".map((a) => `link: ${a.innerText.trim()} -> ${a.href}`).join('\\n')"
    )
    found = re.search(r"(?m)^link: .* -> (http\S+/#/experiments/\S+/runs/\w+\?\S+)$", links)
    ctx["report_mlflow_link"] = found.group(1) if found else ""
    found = re.search(r"(?m)^link: all runs -> (http\S+/#/experiments/\d+/runs\?\S+)$", links)
    ctx["report_runs_link"] = found.group(1) if found else ""
    shot.text += f"\n--- links\n{links}"
    return shot


def visit_prefect_sweep_table(b: Browser, stack: Stack, ctx: dict) -> Shot:
    b.goto(
        prefect_ui(stack, f"/runs/flow-run/{flow_run_id(ctx, 'cifar-sweep/sweep')}?tab=Artifacts"),
        wait_for=r"(?m)^cifar-sweep$",
    )
    open_artifact(b, "cifar-sweep", ctx["runs"]["cifar-sweep/sweep"]["name"])
    b.wait_text(r"learning_rate")
    return b.shoot("prefect-sweep-table")


def mlflow_experiment(stack: Stack) -> dict:
    found = api(
        "POST",
        f"{stack.mlflow_url}/api/2.0/mlflow/experiments/search",
        {"max_results": 100, "filter": "name = 'cifar10'"},
    )
    experiments = found.get("experiments", [])  # type: ignore[union-attr]
    if not experiments:
        raise StackError(f"no MLflow experiment cifar10 on {stack.mlflow_url}")
    return experiments[0]


def mlflow_runs(stack: Stack, experiment_id: str) -> list[dict]:
    found = api(
        "POST",
        f"{stack.mlflow_url}/api/2.0/mlflow/runs/search",
        {"experiment_ids": [experiment_id], "max_results": 100},
    )
    return found.get("runs", [])  # type: ignore[union-attr]


def tags(entity: dict) -> dict[str, str]:
    return {tag["key"]: tag["value"] for tag in (entity.get("data", entity).get("tags") or [])}


def close_mlflow_assistant(b: Browser) -> None:
    """MLflow 3.17 opens its "MLflow Assistant" panel on a first visit; a person closes it once."""
    close = b.page.get_by_role("button", name="Close", exact=True)
    if close.count():
        close.first.click()
        b.page.wait_for_timeout(500)


def visit_mlflow_landing(b: Browser, stack: Stack, ctx: dict) -> Shot:
    """The report's "all runs" link: where does a person land?"""
    experiment_id = mlflow_experiment(stack)["experiment_id"]
    fallback = (
        f"{stack.mlflow_url}/#/experiments/{experiment_id}/runs?viewStateShareKey=cifar&workflowType=machine_learning"
    )
    b.goto(ctx.get("report_runs_link") or fallback, wait_for=r"Run Name")
    close_mlflow_assistant(b)
    b.idle()
    b.page.wait_for_timeout(2000)
    return b.shoot("mlflow-experiment-landing")


def visit_mlflow_runs_table(b: Browser, stack: Stack, ctx: dict) -> Shot:
    experiment = mlflow_experiment(stack)
    ctx["experiment_id"] = experiment_id = experiment["experiment_id"]
    # A shared view (experiment tag mlflow.sharedViewState.<key>) is how the project can choose the
    # table's columns for everyone; without one, this is the experiment's plain runs page.
    shared = sorted(key for key in tags(experiment) if key.startswith(SHARED_VIEW_TAG))
    query = f"?viewStateShareKey={shared[0][len(SHARED_VIEW_TAG) :]}&workflowType=machine_learning" if shared else ""
    b.goto(f"{stack.mlflow_url}/#/experiments/{experiment_id}/runs{query}", wait_for=r"Run Name")
    close_mlflow_assistant(b)
    for expander in b.page.locator('[data-component-id*="runnamecellrenderer"]').all():  # Sweep parents: show children.
        expander.click()
        b.page.wait_for_timeout(300)
    children = [run["info"]["run_name"] for run in ctx["mlflow_runs"] if tags(run).get("cifar.sweep") == "child"]
    if children:
        b.wait_text(rf"(?m)^{re.escape(children[0])}")
    b.page.wait_for_timeout(1000)
    return b.shoot("mlflow-runs-table")


def visit_mlflow_run(b: Browser, stack: Stack, ctx: dict) -> Shot:
    url = ctx.get("report_mlflow_link") or (  # The link a person follows from the Prefect report.
        f"{stack.mlflow_url}/#/experiments/{ctx['experiment_id']}/runs/{ctx['smoke_mlflow_run_id']}"
    )
    b.goto(url, wait_for=r"(?m)^test_accuracy$")
    close_mlflow_assistant(b)
    return b.shoot("mlflow-run")


def visit_mlflow_compare(b: Browser, stack: Stack, ctx: dict) -> Shot:
    runs = mlflow_runs(stack, ctx["experiment_id"])
    children = [run["info"]["run_id"] for run in runs if tags(run).get("cifar.sweep") == "child"]
    runs_arg, experiments_arg = (urllib.parse.quote(json.dumps(value)) for value in (children, [ctx["experiment_id"]]))
    b.goto(f"{stack.mlflow_url}/#/compare-runs?runs={runs_arg}&experiments={experiments_arg}", wait_for=r"Run details")
    close_mlflow_assistant(b)
    b.page.wait_for_timeout(1000)
    return b.shoot("mlflow-compare-sweep")


def visit_mlflow_registry(b: Browser, stack: Stack, ctx: dict) -> Shot:
    b.goto(f"{stack.mlflow_url}/#/models/cifar10", wait_for=r"Version 1")
    close_mlflow_assistant(b)
    return b.shoot("mlflow-registry-champion")


def visit_prefect_comparison(b: Browser, stack: Stack, ctx: dict) -> Shot:
    b.goto(
        prefect_ui(stack, f"/runs/flow-run/{flow_run_id(ctx, 'challenger')}?tab=Artifacts"),
        wait_for=r"(?m)^cifar-comparison$",
    )
    # The challenger is a second smoke run, named as the first: the key's timeline lists two entries of
    # one name, so the artifact is opened by its id, the one this flow run made.
    made_by = {"any_": [flow_run_id(ctx, "challenger")]}
    body = {"artifacts": {"key": {"any_": ["cifar-comparison"]}, "flow_run_id": made_by}}
    [artifact] = api("POST", f"{stack.api}/artifacts/filter", body)  # type: ignore[misc]
    b.goto(prefect_ui(stack, f"/artifacts/artifact/{artifact['id']}?tab=Artifact"), wait_for=r"Challenger v2")
    b.wait_text(r"McNemar")
    return b.shoot("prefect-comparison", full_page=True)


def visit_mlflow_version_record(b: Browser, stack: Stack, ctx: dict) -> Shot:
    b.goto(f"{stack.mlflow_url}/#/models/cifar10/versions/2", wait_for=r"Test accuracy")
    close_mlflow_assistant(b)
    b.page.wait_for_timeout(1000)
    return b.shoot("mlflow-version-record", full_page=True)


def visit_mlflow_model_card(b: Browser, stack: Stack, ctx: dict) -> Shot:
    version = api("GET", f"{stack.mlflow_url}/api/2.0/mlflow/model-versions/get?name=cifar10&version=2")
    run_id = version["model_version"]["run_id"]  # type: ignore[index]
    run = api("GET", f"{stack.mlflow_url}/api/2.0/mlflow/runs/get?run_id={run_id}")
    experiment_id = run["run"]["info"]["experiment_id"]  # type: ignore[index]
    b.goto(
        f"{stack.mlflow_url}/#/experiments/{experiment_id}/runs/{run_id}/artifacts/model_card/model_card.html",
        wait_for=r"model_card\.html",
    )
    close_mlflow_assistant(b)
    frame = b.page.frame_locator("iframe").first
    frame.get_by_text("Intended use").first.wait_for(timeout=30_000)
    shot = b.shoot("mlflow-model-card")
    card = frame.locator("body").inner_text(timeout=10_000)  # The card is an HTML page inside an iframe.
    return Shot(text=f"{shot.text}\n--- card\n{card}", path=shot.path)


PAGES: dict[str, Visitor] = {
    "prefect-deployments": visit_prefect_deployments,
    "prefect-custom-run-smoke": visit_prefect_custom_run,
    "prefect-nightly-schedule": visit_prefect_nightly,
    "prefect-flow-run-smoke": visit_prefect_flow_run_logs,
    "prefect-flow-run-smoke-artifacts": visit_prefect_flow_run_artifacts,
    "prefect-smoke-report": visit_prefect_report,
    "prefect-sweep-table": visit_prefect_sweep_table,
    "mlflow-experiment-landing": visit_mlflow_landing,
    "mlflow-runs-table": visit_mlflow_runs_table,
    "mlflow-run": visit_mlflow_run,
    "mlflow-compare-sweep": visit_mlflow_compare,
    "mlflow-registry-champion": visit_mlflow_registry,
    "prefect-comparison": visit_prefect_comparison,
    "mlflow-version-record": visit_mlflow_version_record,
    "mlflow-model-card": visit_mlflow_model_card,
}


def visit_all(stack: Stack, out: Path, runs: dict[str, dict], dump: Path) -> dict[str, Shot]:
    ctx: dict = {"runs": runs}
    experiment = mlflow_experiment(stack)
    smoke = [
        run
        for run in mlflow_runs(stack, experiment["experiment_id"])
        if "cifar.sweep" not in tags(run)
        and {p["key"]: p["value"] for p in run["data"].get("params", [])}.get("train.model") == "tutorial"
    ]
    ctx["smoke_mlflow_run_id"] = smoke[0]["info"]["run_id"] if smoke else ""
    ctx["mlflow_runs"] = mlflow_runs(stack, experiment["experiment_id"])
    shots: dict[str, Shot] = {}
    browser = Browser(out)
    try:
        for key, visitor in PAGES.items():
            started = time.monotonic()
            try:
                shots[key] = visitor(browser, stack, ctx)
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


def judge(shots: dict[str, Shot]) -> list[tuple[Check, bool, str]]:
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


# --------------------------------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def report(shots: dict[str, Shot], results: list[tuple[Check, bool, str]]) -> int:
    """One PASS/FAIL line per check (with the screenshot to look at); returns the number of failures."""

    def shown(path: Path | None) -> str:
        if path is None:
            return "no screenshot"
        return str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)

    print()
    for check, passed, why in results:
        shot = shots.get(check.page)
        print(f"{'PASS' if passed else 'FAIL'}  {check.name}  [{shown(shot.path if shot else None)}]")
        if not passed:
            print(f"      {why}")
    return sum(not passed for _, passed, _ in results)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Prefect + MLflow servers, a smoke run and a sweep, then the UIs checked in headless Chromium."
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="screenshot folder (default: docs/images)")
    parser.add_argument("--keep", action="store_true", help="leave the servers up after the checks (Ctrl-C stops them)")
    parser.add_argument(
        "--archive",
        type=Path,
        default=Path(os.environ.get("CIFAR_ARCHIVE", DEFAULT_ARCHIVE)),
        help=f"the CIFAR-10 python archive (default: $CIFAR_ARCHIVE or {DEFAULT_ARCHIVE})",
    )
    parser.add_argument("--sha256", help="the archive's SHA-256 (computed when left out)")
    parser.add_argument("--tmp", type=Path, help="work in this folder instead of a new temporary one")
    parser.add_argument(
        "--attach",
        type=Path,
        metavar="TMP",
        help="only the browser part, against the servers a --keep run left up in TMP",
    )
    args = parser.parse_args(argv)

    if not Path(CHROMIUM).exists():
        print(f"error: no Chromium at {CHROMIUM}; run scripts/install_browser.sh", file=sys.stderr)
        return 2
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        print("error: the playwright package is missing; run scripts/install_browser.sh", file=sys.stderr)
        return 2
    if not args.attach and not args.archive.is_file():
        print(f"error: no archive at {args.archive} (--archive PATH or CIFAR_ARCHIVE)", file=sys.stderr)
        return 2

    def terminate(signum, frame):  # `kill` stops everything like Ctrl-C does.
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)  # Also when started in the background, where SIGINT is ignored.
    started = time.monotonic()
    tmp = (args.attach or args.tmp or Path(tempfile.mkdtemp(prefix="cifar-ui-check-"))).resolve()
    tmp.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    dump = tmp / "page-text"
    dump.mkdir(exist_ok=True)
    print(f"ui_check: temp dir {tmp}", flush=True)
    stack = Stack(tmp=tmp, marker=uuid.uuid4().hex)
    status = 2
    try:
        if args.attach:
            saved = json.loads((tmp / "stack.json").read_text())
            stack.prefect_url, stack.mlflow_url, runs = saved["prefect_url"], saved["mlflow_url"], saved["runs"]
        else:
            sha256 = args.sha256 or sha256_of(args.archive)
            start_stack(stack)
            print(
                f"  stack up after {time.monotonic() - started:.0f}s; running cifar/smoke and cifar-sweep/sweep",
                flush=True,
            )
            runs = run_pipelines(stack, args.archive, sha256)
            (tmp / "stack.json").write_text(
                json.dumps({"prefect_url": stack.prefect_url, "mlflow_url": stack.mlflow_url, "runs": runs}, indent=1)
            )
            print(f"  runs done after {time.monotonic() - started:.0f}s; visiting pages", flush=True)
        shots = visit_all(stack, out, runs, dump)
        results = judge(shots)
        failed = report(shots, results)
        print(
            f"\n{len(results) - failed}/{len(results)} checks passed in {time.monotonic() - started:.0f}s; "
            f"screenshots in {out}, page texts in {dump}"
        )
        status = 1 if failed else 0
    except StackError as error:
        print(f"\nFAIL  stack: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        status = 130
    except Exception:
        traceback.print_exc()
    finally:
        if status != 0 and stack.logs():
            print("server and worker logs:\n" + "\n".join(f"  {path}" for path in stack.logs()), file=sys.stderr)
        if args.keep and stack.procs and status != 130:
            print(
                f"\n--keep: Prefect {stack.prefect_url}  MLflow {stack.mlflow_url}\n"
                f"        re-check the pages: {Path(sys.executable).name} scripts/ui_check.py --attach {tmp}\n"
                f"        Ctrl-C (or kill {os.getpid()}) stops the servers",
                flush=True,
            )
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        stack.stop()
        if not args.attach:
            tidy(tmp, everything=status == 0 and not args.tmp)
    return status


def tidy(tmp: Path, *, everything: bool) -> None:
    """Frees the temp dir's bulk (shards, checkpoints, the UI copy: ~250 MB); logs and page texts stay
    unless everything passed."""
    for path in [tmp] if everything else [tmp / "workdir", tmp / "prefect-ui"]:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
