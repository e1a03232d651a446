"""Accuracy under the corruptions, measured through any logits function, with the corrupted images cached."""

from __future__ import annotations

import numpy as np
import pytest

from cifar import corruptions, robustness


def channel_classifier(images: np.ndarray) -> np.ndarray:
    """A 3-class 'model': the brightest colour channel of the central 2x2 pixels wins. Logits (N, 3)."""
    return images[:, 15:17, 15:17].reshape(len(images), -1, 3).mean(axis=1)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, 60)
    images = np.repeat(rng.integers(40, 120, (60, 32, 32, 1)), 3, axis=3)  # Grey, with pixel noise.
    # The labelled channel is brighter by a margin that grows along the batch: some images are easy,
    # some are close calls that noise or a colour change can flip.
    images[np.arange(60), :, :, labels] += np.linspace(4, 100, 60).astype(np.int64)[:, None, None]
    return images.astype(np.uint8), labels


def test_accuracy_per_corruption_and_severity_their_mean_and_the_drop(data, tmp_path):
    images, labels = data
    names = ("gaussian_noise", "contrast", "jpeg_compression")
    report = robustness.measure(channel_classifier, images, labels, names=names, cache_dir=tmp_path)
    assert report.clean_accuracy == 1.0 and report.images == 60
    for name in names:  # Scored by hand, from the same corrupted bytes.
        variants = np.stack([corruptions.corrupt(images, name, severity) for severity in corruptions.SEVERITIES])
        expected = [float(np.mean(channel_classifier(v).argmax(axis=1) == labels)) for v in variants]
        assert report.accuracy[name] == expected
    assert report.accuracy["gaussian_noise"][-1] < 1.0  # Severity 5 noise flips the close calls.
    assert report.mean_corruption_accuracy == pytest.approx(np.mean([np.mean(report.accuracy[n]) for n in names]))
    assert report.drop == pytest.approx(1.0 - report.mean_corruption_accuracy)
    metrics = report.metrics()
    assert metrics["robustness.contrast.s5"] == report.accuracy["contrast"][4]
    assert metrics["robustness.mean_corruption_accuracy"] == report.mean_corruption_accuracy
    assert report.correct["contrast"].shape == (5, 60)  # Per image, for paired comparisons.


def test_corrupted_images_are_cached_under_their_content_and_a_damaged_cache_is_remade(data, tmp_path):
    images, _ = data
    made = robustness.corrupted_images(images, "fog", seed=0, cache_dir=tmp_path)
    [cached] = tmp_path.glob("*-fog.npy")
    assert np.array_equal(np.load(cached), made)
    cached.write_bytes(b"\x93NUMPY half a file")  # Damaged: made again and replaced.
    assert np.array_equal(robustness.corrupted_images(images, "fog", seed=0, cache_dir=tmp_path), made)
    assert np.array_equal(np.load(cached), made)
    np.save(cached, np.zeros((2, 2), np.uint8))  # The wrong shape: made again, not trusted.
    assert np.array_equal(robustness.corrupted_images(images, "fog", seed=0, cache_dir=tmp_path), made)
    # Other pixels or another seed: another key.
    assert robustness.cache_key(images, 0) != robustness.cache_key(images[::-1], 0)
    assert robustness.cache_key(images, 0) != robustness.cache_key(images, 1)


def test_the_subset_is_fixed_sorted_and_all_when_asked():
    first = robustness.subset_indices(10_000, 2_000)
    assert len(first) == 2_000 and np.all(np.diff(first) > 0)
    assert np.array_equal(first, robustness.subset_indices(10_000, 2_000))
    assert np.array_equal(robustness.subset_indices(500, None), np.arange(500))
    assert np.array_equal(robustness.subset_indices(500, 2_000), np.arange(500))
    with pytest.raises(ValueError, match="at least one image"):
        robustness.subset_indices(500, 0)
