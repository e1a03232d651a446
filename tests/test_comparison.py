"""The promotion gate's decision rule on known tables: McNemar's exact test and each rule in its turn."""

from __future__ import annotations

import numpy as np
import pytest

from cifar.comparison import compare, mcnemar_exact
from cifar.config import ExportConfig

CLASSES = [f"class{index}" for index in range(10)]


def test_mcnemar_exact_on_known_tables():
    # The exact test is the two-sided binomial test on the discordant pairs (b, c) with p = 1/2.
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(7, 3) == pytest.approx(0.34375)  # 2 * P(X <= 3), X ~ Bin(10, 1/2) = 2 * 176/1024.
    assert mcnemar_exact(10, 0) == pytest.approx(2 / 1024)
    assert mcnemar_exact(3, 7) == mcnemar_exact(7, 3)
    assert mcnemar_exact(25, 5) == pytest.approx(0.000324, rel=1e-2)


def predictions(labels: np.ndarray, wrong: np.ndarray) -> np.ndarray:
    """`labels` with the images at `wrong` misclassified (as the next class)."""
    predicted = labels.copy()
    predicted[wrong] = (labels[wrong] + 1) % 10
    return predicted


LABELS = np.arange(1000) % 10  # 100 images per class.


def decide(challenger_wrong, champion_wrong, **gate):
    return compare(
        "m",
        CLASSES,
        LABELS,
        (2, predictions(LABELS, np.asarray(challenger_wrong, int))),
        (1, predictions(LABELS, np.asarray(champion_wrong, int))) if champion_wrong is not None else None,
        ExportConfig(**gate),
    )


def test_a_first_champion_needs_only_the_minimum_accuracy():
    assert decide(range(300), None, min_accuracy=0.6).promote
    refused = decide(range(500), None, min_accuracy=0.6)
    assert (
        not refused.promote and refused.rule == "min_accuracy" and "below export.min_accuracy 60.00 %" in refused.reason
    )


def test_each_rule_decides_in_turn():
    spread = list(range(0, 1000, 7))[:100]  # 100 errors spread over every class.
    # A tie: same errors, p = 1, promoted (min_improvement 0).
    tie = decide(spread, spread)
    assert tie.promote and tie.rule == "passed" and tie.p_value == 1.0 and tie.difference == 0.0

    # 30 more errors, all in class 3: a class drop of 30 points decides before anything else.
    class_three = [index for index in range(1000) if index % 10 == 3][:30]
    challenger_errors = set(spread) | set(class_three)
    dropped = decide(sorted(challenger_errors), spread)
    new_class_three_errors = len(challenger_errors - set(spread))  # All of them in class 3.
    assert not dropped.promote and dropped.rule == "class_drop" and dropped.largest_drop_class == "class3"
    assert dropped.largest_class_drop == pytest.approx(new_class_three_errors / 100)

    # 30 more errors spread over the classes (no class loses more than 5 points): significantly worse.
    unused = [index for index in range(1000) if index not in set(spread)]
    more = [index for class_id in range(10) for index in [i for i in unused if i % 10 == class_id][:3]]
    worse = decide(sorted(set(spread) | set(more)), spread)
    assert worse.champion_only == 30 and worse.challenger_only == 0 and worse.p_value < 0.05
    assert not worse.promote and worse.rule == "significantly_worse"

    # 3 more errors: not significant, but below a required improvement of 0 ...
    slightly = decide(sorted(set(spread) | set(more[:3])), spread)
    assert slightly.p_value > 0.05 and not slightly.promote and slightly.rule == "improvement"
    # ... and within a tolerance of 0.5 points.
    assert decide(sorted(set(spread) | set(more[:3])), spread, min_improvement=-0.005).promote

    # A gain must be significant when one is required: 3 fewer errors is not, 30 fewer is.
    better = decide(spread[3:], spread, min_improvement=0.001)
    assert not better.promote and better.rule == "improvement" and "not significant" in better.reason
    much_better = decide(spread[30:], spread, min_improvement=0.001)
    assert much_better.promote and much_better.challenger_only == 30 and much_better.p_value < 0.05


def test_the_comparison_reports_both_models_per_class_and_on_new_data():
    new_labels = np.array([0, 1, 2, 3])
    comparison = compare(
        "m",
        CLASSES,
        LABELS,
        (2, LABELS.copy()),
        (1, predictions(LABELS, np.arange(0, 1000, 10))),  # The champion gets every class-0 image wrong.
        ExportConfig(),
        new_data=(new_labels, new_labels.copy(), np.array([0, 0, 0, 3])),
    )
    rows = comparison.per_class_rows()
    assert rows[0] == {"class": "class0", "champion": 0.0, "challenger": 1.0, "difference": 1.0}
    assert comparison.challenger.new_data_accuracy == 1.0 and comparison.champion.new_data_accuracy == 0.5
    assert comparison.new_data_examples == 4 and comparison.difference == pytest.approx(0.1)


def test_the_comparison_reads_as_a_person_reads_it():
    from tasks.artifacts import comparison_markdown

    spread = list(range(0, 1000, 7))[:100]
    class_three = [index for index in range(1000) if index % 10 == 3][:30]
    dropped = comparison_markdown(decide(sorted(set(spread) | set(class_three)), spread).model_dump(mode="json"))
    assert "# Challenger v2: not promoted (class_drop)" in dropped
    assert "| version | v2 | v1 |" in dropped and "McNemar's exact test on the" in dropped
    assert "Largest class drop: class3, 2" in dropped and "+2" not in dropped.split("Largest class drop")[1][:20]
    better = comparison_markdown(decide(spread[30:], spread).model_dump(mode="json"))
    assert "No class lost accuracy." in better


def test_as_accurate_but_less_robust_or_worse_calibrated_is_refused_naming_the_criterion():
    from cifar.comparison import add_trust_evidence

    spread = list(range(0, 1000, 7))[:100]
    tie = decide(spread, spread)  # As accurate, image for image: the accuracy rules pass it.
    assert tie.promote
    rng = np.random.default_rng(0)
    champion_shares = rng.uniform(0.5, 0.9, 400)  # Per image: its 75 corrupted versions' share answered right.
    fragile = np.clip(champion_shares - 0.05, 0, 1)  # Five points worse under corruption, image for image.
    gate = ExportConfig()  # max_corruption_drop 3 points, max_ece_increase 3 points.

    refused = add_trust_evidence(tie, (0.02, 0.02), (fragile, champion_shares), gate)
    assert not refused.promote and refused.rule == "corruption_drop"
    assert refused.corruption_difference == pytest.approx(-0.05, abs=1e-3) and refused.corruption_examples == 400
    low, high = refused.corruption_interval
    assert low <= refused.corruption_difference <= high < 0  # Paired: every image is worse by the same 5 points.
    assert refused.reason.startswith("refused: mean accuracy under corruptions")
    assert "more than export.max_corruption_drop 3.00" in refused.criteria["corruption_drop"]
    assert refused.criteria["calibration"].startswith("passed: ECE 2.00 % vs the champion's 2.00 %")

    overconfident = add_trust_evidence(tie, (0.09, 0.02), (champion_shares, champion_shares), gate)
    assert not overconfident.promote and overconfident.rule == "calibration"
    assert "ECE 9.00 % vs the champion's 2.00 % (+7.00 points), more than export.max_ece_increase 3.00" in (
        overconfident.reason
    )
    assert overconfident.criteria["corruption_drop"].startswith("passed")

    # Within the limits, or with the limits unset (reported, not rules): promoted, each verdict recorded.
    slightly = add_trust_evidence(tie, (0.03, 0.02), (champion_shares - 0.01, champion_shares), gate)
    assert slightly.promote and slightly.rule == "passed"
    assert set(slightly.criteria) == {"corruption_drop", "calibration"}
    unset = ExportConfig(max_corruption_drop=None, max_ece_increase=None)
    reported = add_trust_evidence(tie, (0.09, 0.02), (fragile, champion_shares), unset)
    assert reported.promote and reported.criteria["corruption_drop"].startswith("reported (export.max_corruption_drop")
    assert "max_corruption_drop" not in reported.thresholds
    # Robustness the challenger's evaluation did not measure cannot be weighed: said, not guessed.
    unmeasured = add_trust_evidence(tie, (0.02, 0.02), None, gate)
    assert unmeasured.promote and unmeasured.criteria["corruption_drop"].startswith("not judged")

    from tasks.artifacts import comparison_markdown

    shown = comparison_markdown(refused.model_dump(mode="json"))
    assert "# Challenger v2: not promoted (corruption_drop)" in shown
    assert "| mean accuracy under 15 corruptions x 5 severities (400 images) |" in shown
    assert "| calibration error (ECE, 15 bins) | 2.00 % | 2.00 % |" in shown
    assert "- **corruption_drop**: refused:" in shown and "- **calibration**: passed:" in shown
