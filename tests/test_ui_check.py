"""scripts/ui_check/ without servers or a browser: its check table is consistent and judges as meant.

The check itself (servers, runs, Chromium) runs with `make ui-check`; these tests only keep the
table that the lead edits from drifting out of step with the pages it names.
"""

from __future__ import annotations

import pytest

from scripts.ui_check.browser import js_regex
from scripts.ui_check.checks import CHECKS, SCREENSHOTS, Shot, judge
from scripts.ui_check.main import main
from scripts.ui_check.pages import PAGES


def test_every_check_names_a_visited_page_with_a_screenshot():
    for check in CHECKS:
        assert check.page in PAGES, check
        assert check.page in SCREENSHOTS, check
    names = list(SCREENSHOTS.values())
    assert len(names) == len(set(names)) and all(name.endswith(".png") for name in names)
    assert set(PAGES) <= set(SCREENSHOTS)


def judged(page: str, text: str) -> dict[str, bool]:
    shots = {page: Shot(text=text)}
    return {check.name: passed for check, passed, _ in judge(shots) if check.page == page}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ("Model: (empty)\nEpochs: (empty)", True),  # Empty = from the preset.
        ("Model: tutorial\nEpochs: 2", True),  # The smoke preset's own values.
        ("Model: resnet20\nEpochs: 30", False),  # PipelineConfig's defaults: what a run would NOT use.
        ("Model: (empty)\nEpochs: 30", False),
    ],
)
def test_custom_run_form_check(fields, expected):
    name = next(check.name for check in CHECKS if "resnet20" in check.name)
    assert judged("prefect-custom-run-smoke", f"Parameters\n--- fields\n{fields}")[name] is expected


def test_registry_alias_check_reads_the_alias_not_a_tag():
    alias = 'Version 1\npromotion\n: {"champion": true}\n@\u00a0champion\nPrevious'  # MLflow renders a no-break space.
    tag_only = 'Version 1\npromotion\n: {"champion": true}\nPrevious'
    assert all(judged("mlflow-registry-champion", alias).values())
    assert not any(judged("mlflow-registry-champion", tag_only).values())


def test_a_page_that_failed_to_load_fails_its_checks():
    shots = {"mlflow-run": Shot(text="test_accuracy 0.4", error="TimeoutError: spinner forever")}
    results = [(check, passed) for check, passed, _ in judge(shots) if check.page == "mlflow-run"]
    assert results and not any(passed for _, passed in results)


def test_python_regex_flags_reach_javascript():
    assert js_regex(r"(?m)^smoke$") == ["^smoke$", "m"]
    assert js_regex(r"Run Name") == ["Run Name", ""]


def test_a_missing_archive_exits_2_before_starting_anything(tmp_path, capsys):
    status = main(["--archive", str(tmp_path / "missing.tar.gz"), "--out", str(tmp_path / "shots")])
    assert status == 2
    assert not (tmp_path / "shots").exists()
