"""Champion against challenger on identical images, with the same code: the promotion gate's evidence.

Both models, loaded as serving loads them, score the snapshot's test split (and its `new_data` slice);
`decide` judges the paired results with the thresholds of `export` (README, "The gate").
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

from cifar.config import ExportConfig


class ModelScore(BaseModel):
    """One model's results on the compared images."""

    model_config = ConfigDict(extra="forbid")

    version: int | None
    accuracy: float
    correct: int
    per_class: list[float]  # Accuracy of each class (its recall), by class id.
    new_data_accuracy: float | None = None
    ece: float | None = None  # Calibration error of the served probabilities on the compared images.
    mean_corruption_accuracy: float | None = None  # On the corrupted images both models scored.


class Comparison(BaseModel):
    """The paired comparison and the decision taken on it; recorded on the challenger's version."""

    model_config = ConfigDict(extra="forbid")

    model_name: str
    examples: int  # Test images both models scored.
    new_data_examples: int = 0
    class_names: list[str]
    challenger: ModelScore
    champion: ModelScore | None
    difference: float | None = None  # Challenger minus champion accuracy.
    challenger_only: int = 0  # Images only the challenger gets right.
    champion_only: int = 0  # Images only the champion gets right.
    p_value: float | None = None  # McNemar's exact test, two-sided.
    largest_class_drop: float | None = None
    largest_drop_class: str | None = None
    corruption_examples: int = 0  # Test images both models scored under the 15 corruptions x 5 severities.
    corruption_difference: float | None = None  # Challenger minus champion mean corruption accuracy, paired.
    corruption_interval: tuple[float, float] | None = None  # Its 95 % interval, the images as the units.
    ece_increase: float | None = None  # Challenger minus champion ECE.
    thresholds: dict[str, float]
    promote: bool = False
    # The rule that decided: min_accuracy, class_drop, corruption_drop, calibration, significantly_worse,
    # improvement, passed.
    rule: str = ""
    reason: str = ""
    criteria: dict[str, str] = {}  # Robustness and calibration: each criterion's verdict, decisive or not.

    def per_class_rows(self) -> list[dict[str, object]]:
        """One row per class: the class, both accuracies, the difference."""
        rows = []
        for index, name in enumerate(self.class_names):
            challenger = self.challenger.per_class[index]
            champion = self.champion.per_class[index] if self.champion else None
            difference = challenger - champion if champion is not None else None
            rows.append({"class": name, "champion": champion, "challenger": challenger, "difference": difference})
        return rows


def mcnemar_exact(challenger_only: int, champion_only: int) -> float:
    """Two-sided p-value of McNemar's exact test from the discordant counts (1.0 when there are none).

    A binomial test on the images where the two models disagree: under "equally good", each is a coin flip.
    """
    # Imported here: scipy.stats takes about half a second to import, and most processes that import this
    # module (through cifar.registry: search trials, workers, the command-line tools) never judge a challenger.
    from scipy.stats import binomtest

    discordant = challenger_only + champion_only
    if discordant == 0:
        return 1.0
    return float(binomtest(challenger_only, discordant, 0.5, alternative="two-sided").pvalue)


def per_class_accuracy(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> list[float]:
    """Share of each class's images predicted correctly (0 for a class without images)."""
    accuracies = []
    for class_id in range(num_classes):
        mask = labels == class_id
        accuracies.append(float(np.mean(predicted[mask] == class_id)) if mask.any() else 0.0)
    return accuracies


def score(version: int | None, labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> ModelScore:
    correct = int(np.sum(predicted == labels))
    return ModelScore(
        version=version,
        accuracy=correct / len(labels),
        correct=correct,
        per_class=per_class_accuracy(labels, predicted, num_classes),
    )


def compare(
    model_name: str,
    class_names: list[str],
    labels: np.ndarray,
    challenger: tuple[int | None, np.ndarray],
    champion: tuple[int, np.ndarray] | None,
    gate: ExportConfig,
    new_data: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None,
) -> Comparison:
    """The paired comparison of the predicted classes of both models on the same labelled images, decided.

    `challenger` and `champion` are (version, predicted classes); `new_data` is (labels, challenger's
    predictions, champion's predictions or None) on the `new_data` slice.
    """
    num_classes = len(class_names)
    challenger_score = score(challenger[0], labels, challenger[1], num_classes)
    comparison = Comparison(
        model_name=model_name,
        examples=len(labels),
        class_names=list(class_names),
        challenger=challenger_score,
        champion=None,
        thresholds=_thresholds(gate),
    )
    if champion is not None:
        champion_score = score(champion[0], labels, champion[1], num_classes)
        challenger_right, champion_right = challenger[1] == labels, champion[1] == labels
        drops = np.asarray(champion_score.per_class) - np.asarray(challenger_score.per_class)
        worst = int(np.argmax(drops))
        comparison = comparison.model_copy(
            update={
                "champion": champion_score,
                "difference": challenger_score.accuracy - champion_score.accuracy,
                "challenger_only": int(np.sum(challenger_right & ~champion_right)),
                "champion_only": int(np.sum(champion_right & ~challenger_right)),
                "largest_class_drop": float(drops[worst]),
                "largest_drop_class": class_names[worst],
            }
        )
        comparison.p_value = mcnemar_exact(comparison.challenger_only, comparison.champion_only)
    if new_data is not None and len(new_data[0]):
        new_labels, challenger_new, champion_new = new_data
        comparison.new_data_examples = len(new_labels)
        comparison.challenger.new_data_accuracy = float(np.mean(challenger_new == new_labels))
        if comparison.champion is not None and champion_new is not None:
            comparison.champion.new_data_accuracy = float(np.mean(champion_new == new_labels))
    return decide(comparison, gate)


def _thresholds(gate: ExportConfig) -> dict[str, float]:
    thresholds = {
        "min_accuracy": gate.min_accuracy,
        "min_improvement": gate.min_improvement,
        "max_class_drop": gate.max_class_drop,
        "significance": gate.significance,
    }
    for name in ("max_corruption_drop", "max_ece_increase"):  # Absent: reported, not a rule.
        if getattr(gate, name) is not None:
            thresholds[name] = getattr(gate, name)
    return thresholds


def add_trust_evidence(
    comparison: Comparison,
    eces: tuple[float, float | None],
    corrupted: tuple[np.ndarray, np.ndarray | None] | None,
    gate: ExportConfig,
) -> Comparison:
    """The comparison with calibration and robustness added, then decided again.

    `eces`: (challenger, champion or None) on the compared images. `corrupted`: per image, the share of its
    75 corrupted versions (15 corruptions x 5 severities) each model got right, (challenger, champion or
    None), on the same corrupted bytes; None when robustness was not measured. The paired difference's
    interval takes the images as the units (an image's versions are not independent of each other)."""
    challenger_ece, champion_ece = eces
    comparison = comparison.model_copy(deep=True, update={"thresholds": _thresholds(gate)})
    comparison.challenger.ece = challenger_ece
    if comparison.champion is not None and champion_ece is not None:
        comparison.champion.ece = champion_ece
        comparison.ece_increase = challenger_ece - champion_ece
    if corrupted is not None:
        challenger_shares, champion_shares = corrupted
        comparison.corruption_examples = len(challenger_shares)
        comparison.challenger.mean_corruption_accuracy = float(np.mean(challenger_shares))
        if comparison.champion is not None and champion_shares is not None:
            comparison.champion.mean_corruption_accuracy = float(np.mean(champion_shares))
            differences = challenger_shares - champion_shares
            mean = float(np.mean(differences))
            spread = float(np.std(differences, ddof=1) / np.sqrt(len(differences))) if len(differences) > 1 else 0.0
            comparison.corruption_difference = mean
            comparison.corruption_interval = (mean - 1.96 * spread, mean + 1.96 * spread)
    return decide(comparison, gate)


def trust_criteria(comparison: Comparison, gate: ExportConfig) -> dict[str, str]:
    """Each robustness and calibration criterion's verdict, in words (passed, refused, or why not judged)."""
    criteria = {}
    champion = comparison.champion
    if comparison.corruption_difference is not None and champion is not None:
        low, high = comparison.corruption_interval
        measured = (
            f"mean accuracy under corruptions {100 * comparison.challenger.mean_corruption_accuracy:.2f} % vs the "
            f"champion's {100 * champion.mean_corruption_accuracy:.2f} % on the same "
            f"{comparison.corruption_examples:,} images x 75 corruptions "
            f"({100 * comparison.corruption_difference:+.2f} points, 95 % interval "
            f"{100 * low:+.2f} to {100 * high:+.2f})"
        )
        limit = gate.max_corruption_drop
        if limit is None:
            criteria["corruption_drop"] = f"reported (export.max_corruption_drop is not set): {measured}"
        else:
            refused = -comparison.corruption_difference > limit
            verdict = "refused" if refused else "passed"
            bound = "more than" if refused else "within"
            criteria["corruption_drop"] = f"{verdict}: {measured}, {bound} export.max_corruption_drop {100 * limit:.2f}"
    elif champion is not None:
        criteria["corruption_drop"] = "not judged: robustness was not measured on the same images for both models"
    if comparison.ece_increase is not None:
        measured = (
            f"ECE {100 * comparison.challenger.ece:.2f} % vs the champion's {100 * champion.ece:.2f} % "
            f"({100 * comparison.ece_increase:+.2f} points)"
        )
        limit = gate.max_ece_increase
        if limit is None:
            criteria["calibration"] = f"reported (export.max_ece_increase is not set): {measured}"
        else:
            refused = comparison.ece_increase > limit
            verdict, bound = ("refused", "more than") if refused else ("passed", "within")
            criteria["calibration"] = f"{verdict}: {measured}, {bound} export.max_ece_increase {100 * limit:.2f}"
    return criteria


def decide(comparison: Comparison, gate: ExportConfig) -> Comparison:
    """Applies the rules in order; the first that refuses decides, else the challenger is promoted.

    min_accuracy (the only rule for a first champion), class_drop (`max_class_drop`), corruption_drop
    (`max_corruption_drop`), calibration (`max_ece_increase`), significantly_worse
    (worse with p < `significance`, whatever the tolerance), improvement (the difference must reach
    `min_improvement`, negative: a tolerated loss; a required gain must also be significant).
    """
    comparison = comparison.model_copy(update={"criteria": trust_criteria(comparison, gate)})
    challenger, champion = comparison.challenger, comparison.champion
    accuracy = f"test accuracy {100 * challenger.accuracy:.2f} %"
    if challenger.accuracy < gate.min_accuracy:
        return _decided(comparison, False, "min_accuracy", f"{accuracy} is below export.min_accuracy "
                        f"{100 * gate.min_accuracy:.2f} %")  # fmt: skip
    if champion is None:
        return _decided(comparison, True, "passed", f"first champion: {accuracy} >= export.min_accuracy "
                        f"{100 * gate.min_accuracy:.2f} %")  # fmt: skip
    versus = (
        f"{accuracy} vs the champion v{champion.version}'s {100 * champion.accuracy:.2f} % on the same "
        f"{comparison.examples:,} images ({comparison.challenger_only} right only for the challenger, "
        f"{comparison.champion_only} only for the champion; McNemar p = {comparison.p_value:.3g})"
    )
    drop = comparison.largest_class_drop or 0.0
    if drop > gate.max_class_drop:
        return _decided(comparison, False, "class_drop", f"class {comparison.largest_drop_class} drops "
                        f"{100 * drop:.2f} points, more than export.max_class_drop {100 * gate.max_class_drop:.2f}; "
                        f"{versus}")  # fmt: skip
    for rule in ("corruption_drop", "calibration"):  # Robustness, then calibration: refused by the first that fails.
        if comparison.criteria.get(rule, "").startswith("refused"):
            return _decided(comparison, False, rule, f"{comparison.criteria[rule]}; {versus}")
    significant = comparison.p_value is not None and comparison.p_value < gate.significance
    difference = comparison.difference or 0.0
    if difference < 0 and significant:
        return _decided(comparison, False, "significantly_worse", f"significantly worse (p < {gate.significance:g}): "
                        f"{versus}")  # fmt: skip
    if difference < gate.min_improvement:
        return _decided(comparison, False, "improvement", f"a change of {100 * difference:+.2f} points is below "
                        f"export.min_improvement {100 * gate.min_improvement:+.2f}: {versus}")  # fmt: skip
    if gate.min_improvement > 0 and not significant:
        return _decided(comparison, False, "improvement", f"the gain of {100 * difference:+.2f} points is not "
                        f"significant (p >= {gate.significance:g}): {versus}")  # fmt: skip
    return _decided(comparison, True, "passed", f"{100 * difference:+.2f} points, every rule passed: {versus}")


def _decided(comparison: Comparison, promote: bool, rule: str, reason: str) -> Comparison:
    return comparison.model_copy(update={"promote": promote, "rule": rule, "reason": reason})
