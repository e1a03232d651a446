"""scripts/ui_check.py without servers or a browser: its check table is consistent and judges as meant.

The harness itself (servers, runs, Chromium) runs with `make ui-check`; these tests only keep the
table that the lead edits from drifting out of step with the pages it names.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ui_check():
    spec = importlib.util.spec_from_file_location("ui_check", REPO_ROOT / "scripts" / "ui_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ui_check"] = module  # dataclasses look their module up by name.
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("ui_check", None)


def test_every_check_names_a_visited_page_with_a_screenshot(ui_check):
    for check in ui_check.CHECKS:
        assert check.page in ui_check.PAGES, check
        assert check.page in ui_check.SCREENSHOTS, check
    names = list(ui_check.SCREENSHOTS.values())
    assert len(names) == len(set(names)) and all(name.endswith(".png") for name in names)
    assert set(ui_check.PAGES) <= set(ui_check.SCREENSHOTS)


def judged(ui_check, page: str, text: str) -> dict[str, bool]:
    shots = {page: ui_check.Shot(text=text)}
    return {check.name: passed for check, passed, _ in ui_check.judge(shots) if check.page == page}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ("Model: (empty)\nEpochs: (empty)", True),  # Empty = from the preset.
        ("Model: tutorial\nEpochs: 2", True),  # The smoke preset's own values.
        ("Model: resnet20\nEpochs: 30", False),  # PipelineConfig's defaults: what a run would NOT use.
        ("Model: (empty)\nEpochs: 30", False),
    ],
)
def test_custom_run_form_check(ui_check, fields, expected):
    name = next(check.name for check in ui_check.CHECKS if "resnet20" in check.name)
    assert judged(ui_check, "prefect-custom-run-smoke", f"Parameters\n--- fields\n{fields}")[name] is expected


def test_registry_alias_check_reads_the_alias_not_a_tag(ui_check):
    alias = 'Version 1\npromotion\n: {"champion": true}\n@\u00a0champion\nPrevious'  # MLflow renders a no-break space.
    tag_only = 'Version 1\npromotion\n: {"champion": true}\nPrevious'
    assert all(judged(ui_check, "mlflow-registry-champion", alias).values())
    assert not any(judged(ui_check, "mlflow-registry-champion", tag_only).values())


def test_a_page_that_failed_to_load_fails_its_checks(ui_check):
    shots = {"mlflow-run": ui_check.Shot(text="test_accuracy 0.4", error="TimeoutError: spinner forever")}
    results = [(check, passed) for check, passed, _ in ui_check.judge(shots) if check.page == "mlflow-run"]
    assert results and not any(passed for _, passed in results)


def test_python_regex_flags_reach_javascript(ui_check):
    assert ui_check.js_regex(r"(?m)^smoke$") == ["^smoke$", "m"]
    assert ui_check.js_regex(r"Run Name") == ["Run Name", ""]


def test_a_missing_archive_exits_2_before_starting_anything(ui_check, tmp_path, capsys):
    status = ui_check.main(["--archive", str(tmp_path / "missing.tar.gz"), "--out", str(tmp_path / "shots")])
    assert status == 2
    assert not (tmp_path / "shots").exists()
