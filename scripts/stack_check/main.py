"""The stack check's run: each step in order until one fails (the rest "not run"), then the teardown and the table."""

from __future__ import annotations

import sys
import traceback

from scripts.stack_check.checks import CHECKS, TEARDOWN
from scripts.stack_check.context import Context, Settings
from scripts.stack_check.report import Report
from scripts.stack_check.shell import Shell, StepError


def main() -> int:
    settings = Settings.from_environment()
    shell = Shell(settings.scratch / "stack-check.log")
    context = Context(settings, shell, Report(settings.engine, [step.name for step in (*CHECKS, TEARDOWN)]))
    print(f"stack-check {settings.project}: log {shell.path}", flush=True)
    failed = False
    try:
        if not settings.archive.is_file():
            raise StepError(f"no archive at {settings.archive} (set CIFAR_ARCHIVE)")
        for step in CHECKS:
            with context.report.check(step.name) as row:
                step.run(context, row)
    except Exception as error:  # Reported, logged with its traceback; the teardown below still runs.
        failed = True
        shell.write("\n" + traceback.format_exc())
        print(f"stack-check: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        if context.stack is not None:
            context.stack.record_logs()
    except KeyboardInterrupt:
        failed = True
        print("stack-check: interrupted", file=sys.stderr)
    finally:
        failed = tear_down(context) or failed
    passed, failures, skipped = context.report.counts()
    print("\n" + context.report.render() + f"\n\nFull log: {shell.path}", flush=True)
    print(f"stack-check: {passed} passed, {failures} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed or failures or skipped else 0


def tear_down(context: Context) -> bool:
    """Removes what the run made (unless KEEP_STACK=1); whether that failed."""
    if context.settings.keep:
        context.report.rows[TEARDOWN.name].detail = f"KEEP_STACK=1: {context.settings.project} left running"
    elif context.engine is not None:
        try:
            with context.report.check(TEARDOWN.name) as row:
                TEARDOWN.run(context, row)
        except StepError:
            return True
    return False
