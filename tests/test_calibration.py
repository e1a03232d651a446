"""Calibration and selective prediction against values worked out by hand, and the temperature fit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cifar import calibration

# Four images, three classes. Top probabilities 0.9, 0.6, 0.55, 0.95; the second and third are wrong.
PROBABILITIES = np.array([[0.90, 0.05, 0.05], [0.60, 0.30, 0.10], [0.20, 0.55, 0.25], [0.02, 0.03, 0.95]])
LABELS = np.array([0, 1, 2, 2])


def test_ece_nll_and_brier_match_the_hand_computed_values():
    # 15 bins of width 1/15: 0.9 -> bin 13, 0.6 -> bin 8, 0.55 -> bin 8, 0.95 -> bin 14.
    # Bin 8: accuracy 0, confidence 0.575, weight 2/4; bin 13: 1 vs 0.9, 1/4; bin 14: 1 vs 0.95, 1/4.
    expected_ece = 0.5 * 0.575 + 0.25 * 0.1 + 0.25 * 0.05
    assert calibration.expected_calibration_error(PROBABILITIES, LABELS) == pytest.approx(expected_ece)
    expected_nll = -(math.log(0.9) + math.log(0.3) + math.log(0.25) + math.log(0.95)) / 4
    assert calibration.negative_log_likelihood(PROBABILITIES, LABELS) == pytest.approx(expected_nll)
    squared = [
        0.1**2 + 0.05**2 + 0.05**2,
        0.6**2 + 0.7**2 + 0.1**2,
        0.2**2 + 0.55**2 + 0.75**2,
        0.02**2 + 0.03**2 + 0.05**2,
    ]
    assert calibration.brier_score(PROBABILITIES, LABELS) == pytest.approx(sum(squared) / 4)

    bins = calibration.reliability_bins(PROBABILITIES, LABELS)
    assert bins.counts[8] == 2 and bins.counts[13] == 1 and bins.counts[14] == 1 and sum(bins.counts) == 4
    assert bins.accuracy[8] == 0 and bins.confidence[8] == pytest.approx(0.575)
    assert math.isnan(bins.accuracy[0])  # Empty bins have no accuracy, and weigh nothing in the ECE.


def test_a_confidence_on_a_bin_edge_falls_in_the_lower_bin():
    # Right-closed bins (i/M, (i+1)/M]: exactly 0.2 with 5 bins is in the first bin, not the second.
    probabilities = np.array([[0.2, 0.2, 0.2, 0.2, 0.2]])
    bins = calibration.reliability_bins(probabilities, np.array([0]), bins=5)
    assert bins.counts == (1, 0, 0, 0, 0)


def test_selective_prediction_answers_the_most_confident_first():
    selective = calibration.selective_prediction(PROBABILITIES, LABELS, coverages=(0.25, 0.5, 0.75, 1.0))
    # Most confident first: 0.95 (right), 0.9 (right), 0.6 (wrong), 0.55 (wrong).
    assert selective.accuracy == (1.0, 1.0, pytest.approx(2 / 3), 0.5)
    assert selective.curve_risk.tolist() == pytest.approx([0.0, 0.0, 1 / 3, 0.5])
    assert selective.area_under_risk_coverage == pytest.approx((1 / 3 + 0.5) / 4)
    with pytest.raises(ValueError, match="coverages must be in"):
        calibration.selective_prediction(PROBABILITIES, LABELS, coverages=(0.0,))


def test_the_temperature_fit_recovers_a_known_temperature():
    # Labels drawn from softmax(logits / 2.5): the NLL-minimising temperature of the logits is ~2.5.
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=6.0, size=(20_000, 10))
    true_probabilities = calibration.softmax(logits, 2.5)
    labels = (true_probabilities.cumsum(axis=1) < rng.random((len(logits), 1))).sum(axis=1)  # One draw per row.
    temperature = calibration.fit_temperature(logits, labels)
    assert temperature == pytest.approx(2.5, rel=0.05)
    # Scaling changes no decision, and makes these probabilities better calibrated than the raw ones.
    report = calibration.calibration_report(logits, labels, temperature)
    assert report.after["ece"] < report.before["ece"] / 3 and report.after["nll"] < report.before["nll"]
    assert set(report.metrics()) >= {"calibration.ece", "calibration.ece_before", "selective.accuracy_at_90"}
    # A net that learned nothing (every logit tied) keeps T = 1; a bad temperature is refused.
    assert calibration.fit_temperature(np.zeros((5, 10)), np.arange(5)) == 1.0
    with pytest.raises(ValueError, match="temperature must be > 0"):
        calibration.softmax(logits, 0.0)


def test_inputs_that_do_not_fit_are_refused_with_one_clear_error():
    with pytest.raises(ValueError, match="labels must be class indices below 3"):
        calibration.expected_calibration_error(PROBABILITIES, np.array([0, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"expected probabilities \(N, classes\) and labels \(N,\)"):
        calibration.brier_score(PROBABILITIES, LABELS[:2])
    with pytest.raises(ValueError, match="no examples"):
        calibration.negative_log_likelihood(np.zeros((0, 3)), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="logits must be finite"):
        calibration.fit_temperature(np.array([[np.inf, 0.0]]), np.array([0]))
