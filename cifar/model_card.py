"""A model card for every registered version: what it is for, what it learnt from, how good it is, where it is weak.

Written by the register stage (cifar.registry), in Markdown and HTML, after the gate has judged the version:
intended use, data and its caveats, training, evaluation, robustness, the comparison with the champion.
It lies in WORKDIR/model_cards/<model>/v<version>/ and in the version's run, linked from its description.
"""

from __future__ import annotations

import functools
import html
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from cifar.champion import TrainedWith
from cifar.comparison import Comparison
from cifar.config import PipelineConfig
from cifar.data.manifest import Manifest
from cifar.results import EvaluationMetrics
from cifar.summary import percent
from cifar.trust import TrustReport

PROVENANCE_FILE = "cifar-10-provenance.npz"  # Beside the archive: boolean masks train_exact, test_exact.
CARD_DIR = "model_cards"
PERTURBATIONS = {  # Name -> what it does, one severity each (pixel values on the 0..1 scale).
    "gaussian_noise": "additive Gaussian noise, standard deviation 0.08",
    "blur": "Gaussian blur, sigma 1 pixel (5x5 kernel)",
    "brightness": "brightness +0.25 (tf.image.adjust_brightness)",
    "contrast": "contrast x0.5 (tf.image.adjust_contrast)",
    "jpeg_50": "JPEG compression at quality 50 (tf.image.adjust_jpeg_quality)",
}
BATCH = 500


class Provenance(BaseModel):
    """How many images kept their original pixels and how many were decoded from JPEG, and the test accuracy of each."""

    model_config = ConfigDict(extra="forbid")

    file: str  # The provenance file beside the archive.
    train_original: int
    train_jpeg: int
    test_original: int
    test_jpeg: int
    accuracy_original: float | None
    accuracy_jpeg: float | None


@dataclass(frozen=True)
class CardInputs:
    """Everything the card says, gathered by the register stage."""

    model_name: str
    version: int
    run_id: str | None
    champion: bool
    config: PipelineConfig  # The resolved pipeline config.
    trained_with: TrainedWith
    git_commit: str | None
    manifest: Manifest
    evaluation: EvaluationMetrics
    comparison: Comparison
    robustness: dict[str, float]  # Perturbation -> test accuracy on the robustness images.
    robustness_examples: int  # The first N test images: the table's images.
    robustness_clean_accuracy: float  # Their accuracy unperturbed: what each perturbation changes.
    provenance: Provenance | None  # Counts and accuracies by provenance, when known.
    trust: TrustReport | None = None  # Calibration and CIFAR-10-C robustness, when the evaluation measured them.


def perturbed(images: np.ndarray, name: str, seed: int = 0) -> np.ndarray:
    """`images` (uint8 N,32,32,3) under one perturbation of PERTURBATIONS, back as uint8."""
    import tensorflow as tf

    pixels = tf.image.convert_image_dtype(tf.constant(images), tf.float32)  # 0..1
    if name == "gaussian_noise":
        pixels = pixels + tf.random.stateless_normal(pixels.shape, seed=(seed, 1), stddev=0.08)
    elif name == "blur":
        axis = tf.range(-2, 3, dtype=tf.float32)
        weights = tf.exp(-(axis**2) / 2.0)
        kernel = tf.tensordot(weights, weights, axes=0)
        kernel = kernel / tf.reduce_sum(kernel)
        kernel = tf.tile(kernel[:, :, None, None], [1, 1, 3, 1])
        padded = tf.pad(pixels, [[0, 0], [2, 2], [2, 2], [0, 0]], mode="REFLECT")  # Borders blur, not darken.
        pixels = tf.nn.depthwise_conv2d(padded, kernel, strides=[1, 1, 1, 1], padding="VALID")
    elif name == "brightness":
        pixels = tf.image.adjust_brightness(pixels, 0.25)
    elif name == "contrast":
        pixels = tf.image.adjust_contrast(pixels, 0.5)
    elif name == "jpeg_50":
        pixels = _jpeg_50()(pixels)
    else:
        raise ValueError(f"unknown perturbation {name!r}: expected one of {', '.join(PERTURBATIONS)}")
    return tf.image.convert_image_dtype(tf.clip_by_value(pixels, 0.0, 1.0), tf.uint8, saturate=True).numpy()


@functools.cache
def _jpeg_50():
    """JPEG at quality 50, image by image, as one graph: eagerly, map_fn ran Python per image (0.75 s for 500 images
    on 2 EPYC cores, most of a registration's model card on the real test set); traced once, 0.04 s, the same bytes."""
    import tensorflow as tf

    @tf.function(input_signature=[tf.TensorSpec([None, 32, 32, 3], tf.float32)])
    def compress(pixels):
        return tf.map_fn(lambda image: tf.image.adjust_jpeg_quality(image, 50), pixels)

    return compress


def robustness(predict: Callable[[np.ndarray], np.ndarray], images: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Accuracy of `predict` (uint8 images -> class ids) on the images under each perturbation."""
    results = {}
    for name in PERTURBATIONS:
        predictions = np.concatenate(
            [
                predict(perturbed(images[start : start + BATCH], name, seed=start))
                for start in range(0, len(images), BATCH)
            ]
        )
        results[name] = float(np.mean(predictions == labels))
    return results


def provenance(manifest: Manifest, predictions: np.ndarray, labels: np.ndarray) -> Provenance | None:
    """Counts and test accuracy of the original-pixel and JPEG-decoded images, from a provenance file beside
    the archive (`cifar-10-provenance.npz`: boolean masks `train_exact`, `test_exact`), when there is one."""
    path = Path(manifest.source.location).expanduser().parent / PROVENANCE_FILE
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as masks:
        test_exact, train_exact = masks["test_exact"], masks["train_exact"]
    if len(test_exact) != len(labels):
        return None
    correct = predictions == labels
    return Provenance(
        file=str(path),
        train_original=int(train_exact.sum()),
        train_jpeg=int((~train_exact).sum()),
        test_original=int(test_exact.sum()),
        test_jpeg=int((~test_exact).sum()),
        accuracy_original=float(correct[test_exact].mean()) if test_exact.any() else None,
        accuracy_jpeg=float(correct[~test_exact].mean()) if (~test_exact).any() else None,
    )


def _percent(value: float | None) -> str:
    return percent(value) or "-"


def card_markdown(card: CardInputs) -> str:
    """The model card as Markdown."""
    # Here, not at the top: the contract's module imports MLflow (its error class), which the flows' imports
    # would otherwise pay in every process that never writes a card (dry runs, `prefect deploy`).
    from cifar.serving_contract import CONTRACT

    manifest, evaluation, comparison = card.manifest, card.evaluation, card.comparison
    train = card.config.train
    status = "the champion" if card.champion else "not the champion"
    lines = [
        f"# Model card: {card.model_name} v{card.version}",
        "",
        f"A CIFAR-10 image classifier ({train.model}), {status} at registration ({comparison.rule}).",
        "",
        "## Intended use",
        "",
        "Classifying small natural images into the ten CIFAR-10 classes "
        f"({', '.join(manifest.class_names)}). It was trained and tested on CIFAR-10-like 32x32 photographs; "
        "images unlike them (other sizes resized down, drawings, other classes) get one of the ten classes anyway, "
        "with no notion of 'none of these'. Batch jobs watch for that (cifar-predict's drift checks).",
        "",
        f"**Input contract.** {CONTRACT}",
        "",
        "## Data",
        "",
    ]
    snapshot = manifest.snapshot
    additions = len(snapshot.additions) if snapshot else 0
    counts = {split: manifest.splits[split].num_examples for split in manifest.splits}
    lines += [
        "| | |",
        "|---|---|",
        f"| Data snapshot | {snapshot.key if snapshot else '-'} (archive sha256 {manifest.source.sha256[:16]}..., "
        f"{additions} additions) |",
        f"| Archive | {manifest.source.location} ({manifest.source.layout} layout) |",
        f"| Examples (train / validation / test) | {counts.get('train')} / {counts.get('validation')} / "
        f"{counts.get('test')} |",
        f"| Data key | {manifest.key} |",
        "",
        "**Known caveats.**",
        "",
    ]
    near = manifest.near_duplicate_test_images
    if near is not None:
        lines.append(
            f"- {near:,} of {counts.get('test'):,} test images have a near-duplicate in the training batches "
            f"(similarity >= {manifest.settings.get('near_duplicate_similarity')}); "
            f"`test_accuracy_deduplicated` leaves them out."
        )
    if card.provenance:
        known = card.provenance
        lines.append(
            f"- {known.test_jpeg:,} of {known.test_jpeg + known.test_original:,} test images and "
            f"{known.train_jpeg:,} training images were decoded from JPEG copies (provenance: {known.file}); "
            f"accuracy on the original-pixel test images {_percent(known.accuracy_original)}, on the JPEG-decoded "
            f"ones {_percent(known.accuracy_jpeg)} (the two sets also differ by class)."
        )
    else:
        lines.append("- The provenance of the images (original pixels or re-encoded) is not known for this archive.")
    lines += [
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| Model | {train.model}, {train.epochs} epochs, batch {train.batch_size}, "
        f"learning rate {train.learning_rate} ({train.schedule}) |",
        f"| Preset, seed | {card.config.preset}, {card.config.seed} |",
        f"| Training key | {card.trained_with.training_key} |",
        f"| Code | git {card.git_commit or 'unknown'}; {len(card.trained_with.code or {})} modules of cifar/ "
        "recorded on the version (tag train_code) |",
        "",
        "<details><summary>The full training config</summary>",
        "",
        "```json",
        json.dumps(card.trained_with.train_config, indent=2, sort_keys=True),
        "```",
        "",
        "</details>",
        "",
        "## Evaluation",
        "",
        "| metric | value |",
        "|---|---:|",
        f"| Test accuracy ({evaluation.num_examples:,} images) | {_percent(evaluation.test_accuracy)} |",
        f"| Test accuracy without near-duplicated test images ({evaluation.deduplicated_examples}) | "
        f"{_percent(evaluation.test_accuracy_deduplicated)} |",
        f"| Test accuracy with flip TTA | {_percent(evaluation.flip_tta_accuracy)} |",
        f"| New data accuracy ({evaluation.new_data_examples} images of the additions' validation split"
        f"{', seen in training' if evaluation.new_data_trained_on else ''}) | "
        f"{_percent(evaluation.new_data_accuracy)} |",
        "",
        "| class | precision | recall | support |",
        "|---|---:|---:|---:|",
    ]
    for name, values in evaluation.per_class.items():
        lines.append(f"| {name} | {_percent(values.precision)} | {_percent(values.recall)} | {values.support} |")
    weakest = min(evaluation.per_class.items(), key=lambda item: item[1].recall)
    lines += [
        "",
        f"Weakest class: {weakest[0]} (recall {_percent(weakest[1].recall)}).",
        "",
        "Confusion matrix (rows: true class, columns: predicted):",
        "",
        "| | " + " | ".join(name[:5] for name in evaluation.class_names) + " |",
        "|---|" + "---:|" * len(evaluation.class_names),
    ]
    for name, row in zip(evaluation.class_names, evaluation.confusion_matrix):
        lines.append(f"| {name} | " + " | ".join(str(count) for count in row) + " |")
    lines += [
        "",
        "## Robustness",
        "",
        f"Test accuracy under one perturbation at a time (TensorFlow image ops), on the first "
        f"{card.robustness_examples:,} of the {evaluation.num_examples:,} test images:",
        "",
        "| perturbation | accuracy | change |",
        "|---|---:|---:|",
        f"| none | {_percent(card.robustness_clean_accuracy)} | |",
    ]
    for name, accuracy in card.robustness.items():
        change = 100 * (accuracy - card.robustness_clean_accuracy)
        lines.append(f"| {PERTURBATIONS[name]} | {_percent(accuracy)} | {change:+.2f} points |")
    lines += trust_sections(card.trust)
    lines += ["", "## Against the champion of the day", "", comparison.reason, ""]
    champion = comparison.champion
    if champion:
        lines += [
            f"| | this version (v{card.version}) | champion v{champion.version} |",
            "|---|---:|---:|",
            f"| test accuracy | {_percent(comparison.challenger.accuracy)} | {_percent(champion.accuracy)} |",
            f"| right only for this model | {comparison.challenger_only} | {comparison.champion_only} |",
            "",
            f"McNemar's exact test: p = {comparison.p_value:.4g}; largest class drop "
            f"{comparison.largest_drop_class} {100 * comparison.largest_class_drop:+.2f} points.",
        ]
    for name, verdict in comparison.criteria.items():
        lines += ["", f"- {name}: {verdict}"]
    return "\n".join(lines) + "\n"


def trust_sections(trust: TrustReport | None) -> list[str]:
    """Calibration (before and after the temperature) and the CIFAR-10-C table with its heat map, when measured."""
    import base64

    if trust is None:
        return []
    lines = []
    if trust.calibration_before is not None:
        after = trust.calibration_after
        how = (
            f"a temperature of {trust.temperature:.3f} fitted on the {trust.temperature_images:,} validation images "
            "(the served probabilities are softmax(logits / T))"
            if trust.temperature is not None
            else "no temperature: nothing was held out to fit one on, so the served probabilities are the plain softmax"
        )
        lines += ["", "## Calibration", "", f"On the test split; {how}.", "", "| | softmax | with the temperature |"]
        lines.append("|---|---:|---:|")
        for name, label in (("ece", "ECE (15 bins)"), ("nll", "NLL (nats)"), ("brier", "Brier score")):
            before = trust.calibration_before[name]
            shown = [_percent(before) if name == "ece" else f"{before:.4f}"]
            value = after[name] if after else None
            shown.append("-" if value is None else (_percent(value) if name == "ece" else f"{value:.4f}"))
            lines.append(f"| {label} | {shown[0]} | {shown[1]} |")
        coverages = ", ".join(f"{key} %: {_percent(value)}" for key, value in (trust.selective_accuracy or {}).items())
        lines += ["", f"Accuracy when only the most confident images are answered (coverage): {coverages}."]
    if trust.corruption_accuracy:
        lines += [
            "",
            "## Common corruptions (CIFAR-10-C)",
            "",
            f"Accuracy on a fixed {trust.robustness_images:,} test images under the 15 corruptions of Hendrycks & "
            f"Dietterich (ICLR 2019) at severities 1-5 (cifar/corruptions.py; frost uses our own texture): mean "
            f"{_percent(trust.mean_corruption_accuracy)}, clean {_percent(trust.clean_accuracy)} on the same images.",
            "",
            "| corruption | 1 | 2 | 3 | 4 | 5 | mean |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, values in trust.corruption_accuracy.items():
            cells = " | ".join(f"{100 * value:.1f}" for value in values)
            lines.append(f"| {name.replace('_', ' ')} | {cells} | {100 * float(np.mean(values)):.1f} |")
        if trust.corruptions_plot and Path(trust.corruptions_plot).is_file():
            encoded = base64.b64encode(Path(trust.corruptions_plot).read_bytes()).decode("ascii")
            lines += ["", f"![Accuracy under each corruption and severity](data:image/png;base64,{encoded})"]
    return lines


def card_html(markdown_text: str, title: str) -> str:
    """The card as a standalone HTML page (tables styled, nothing fetched from elsewhere)."""
    import markdown

    body = markdown.markdown(markdown_text, extensions=["tables", "fenced_code", "md_in_html"])
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.45;color:#222}"
        "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:0.25em 0.6em}"
        "th{background:#f3f3f3}code,pre{background:#f6f6f6}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body>{body}</body></html>\n"
    )
