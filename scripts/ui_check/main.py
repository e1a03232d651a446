"""The UI check's run: servers, runs, pages, one PASS/FAIL line per check; exit 0 passed, 1 failed, 2 no stack."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path

from harness import REPO_ROOT
from harness.digests import file_digest
from scripts.ui_check.browser import CHROMIUM
from scripts.ui_check.checks import Check, Shot, judge
from scripts.ui_check.pages import visit_all
from scripts.ui_check.runs import run_pipelines
from scripts.ui_check.stack import Stack, StackError, start_stack

DEFAULT_ARCHIVE = REPO_ROOT.parent / "shared" / "data" / "cifar-10-python.tar.gz"
DEFAULT_OUT = REPO_ROOT / "docs" / "images"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
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
    return parser.parse_args(argv)


def missing_prerequisite(args: argparse.Namespace) -> str | None:
    """What is missing before anything can start (Chromium, playwright, the archive), or None."""
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM}; run scripts/install_browser.sh"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing; run scripts/install_browser.sh"
    if not args.attach and not args.archive.is_file():
        return f"no archive at {args.archive} (--archive PATH or CIFAR_ARCHIVE)"
    return None


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


def start_and_run(stack: Stack, args: argparse.Namespace, started: float) -> dict[str, dict]:
    """The stack started and the runs done; what --attach needs later is saved in stack.json."""
    sha256 = args.sha256 or file_digest(args.archive)
    start_stack(stack)
    print(f"  stack up after {time.monotonic() - started:.0f}s; running cifar/smoke and cifar-sweep/sweep", flush=True)
    runs = run_pipelines(stack, args.archive, sha256)
    saved = {"prefect_url": stack.prefect_url, "mlflow_url": stack.mlflow_url, "runs": runs, "secrets": stack.secrets}
    saved_path = stack.tmp / "stack.json"
    saved_path.touch(mode=0o600)  # It holds the servers' generated passwords.
    saved_path.write_text(json.dumps(saved, indent=1))
    print(f"  runs done after {time.monotonic() - started:.0f}s; visiting pages", flush=True)
    return runs


def attach(stack: Stack) -> dict[str, dict]:
    """The servers and runs a --keep run left up, from its stack.json."""
    saved = json.loads((stack.tmp / "stack.json").read_text())
    stack.prefect_url, stack.mlflow_url, stack.secrets = saved["prefect_url"], saved["mlflow_url"], saved["secrets"]
    return saved["runs"]


def check_uis(stack: Stack, args: argparse.Namespace, out: Path, dump: Path, started: float) -> int:
    """Every page visited and every check judged; the exit status (0 all passed, 1 a check failed)."""
    runs = attach(stack) if args.attach else start_and_run(stack, args, started)
    shots = visit_all(stack, out, runs, dump, args.archive if args.archive.is_file() else None)
    results = judge(shots)
    failed = report(shots, results)
    print(
        f"\n{len(results) - failed}/{len(results)} checks passed in {time.monotonic() - started:.0f}s; "
        f"screenshots in {out}, page texts in {dump}"
    )
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problem = missing_prerequisite(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
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
        status = check_uis(stack, args, out, dump, started)
    except StackError as error:
        print(f"\nFAIL  stack: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        status = 130
    except Exception:
        traceback.print_exc()
    finally:
        wrap_up(stack, args, status)
    return status


def wrap_up(stack: Stack, args: argparse.Namespace, status: int) -> None:
    """Names the logs after a failure, keeps the servers up with --keep, then stops every process and tidies."""
    if status != 0 and stack.logs():
        print("server and worker logs:\n" + "\n".join(f"  {path}" for path in stack.logs()), file=sys.stderr)
    if args.keep and stack.processes and status != 130:
        print(
            f"\n--keep: Prefect {stack.prefect_url}  MLflow {stack.mlflow_url}\n"
            f"        re-check the pages: {Path(sys.executable).name} -m scripts.ui_check --attach {stack.tmp}\n"
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
        tidy(stack.tmp, everything=status == 0 and not args.tmp)


def tidy(tmp: Path, *, everything: bool) -> None:
    """Frees the temp dir's bulk (shards, checkpoints, the UI copy: ~250 MB); logs and page texts stay
    unless everything passed."""
    for path in [tmp] if everything else [tmp / "workdir", tmp / "prefect-ui"]:
        shutil.rmtree(path, ignore_errors=True)
