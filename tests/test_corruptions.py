"""The CIFAR-10-C corruptions: unchanged at zero strength, deterministic per seed, stronger with severity."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.ndimage import gaussian_filter

from cifar import corruptions

# Where the published parameters do not order the mean pixel change by severity (checked on the real
# CIFAR-10 test images as well), and why; every other corruption must change more at each severity.
NOT_ORDERED_BY_PIXEL_CHANGE = {
    # Each pixel takes a neighbour's value; sigmas 0.05 and 0.25 (severities 1, 2) blur by less than a grey
    # level, and the larger blur of severities 3 and 5 smooths some of that jitter out again.
    "glass_blur": (2, 3, 5),
    # Severities 3-5 keep less of the image (0.9, 0.85, 0.75) and add only a little more frost.
    "frost": (3, 4, 5),
    # Severity 1 is a 2.6-pixel affine jitter; later ones jitter less and warp locally instead.
    "elastic_transform": (2, 3, 4, 5),
    # Severities 3 and 4 share sigma 2 (radius 6, then 8): the longer kernel's extra taps weigh ~1e-9.
    "motion_blur": (4,),
}


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    """48 photo-like images: smooth colour fields with edges, so blurs and warps have something to change."""
    rng = np.random.default_rng(7)
    fields = gaussian_filter(rng.random((48, 32, 32, 3)), sigma=(0, 2.5, 2.5, 0))
    fields = (fields - fields.min()) / np.ptp(fields)
    edges = (np.arange(32)[None, :, None, None] > rng.integers(8, 24, (48, 1, 1, 1))).astype(float)
    return np.rint(np.clip(0.7 * fields + 0.3 * edges, 0, 1) * 255).astype(np.uint8)


@pytest.mark.parametrize("name", corruptions.CORRUPTIONS)
def test_each_corruption_is_the_identity_at_zero_strength_and_repeatable(images, name):
    assert np.array_equal(corruptions.corrupt(images, name, 0, seed=3), images)
    first = corruptions.corrupt(images, name, 3, seed=11)
    assert first.dtype == np.uint8 and first.shape == images.shape
    assert np.array_equal(first, corruptions.corrupt(images, name, 3, seed=11))  # Same seed, same bytes.
    assert not np.array_equal(first, images)
    # A single image gets what it would get in a batch only from the deterministic corruptions; every
    # corruption is deterministic per (images, seed), which is what caching and comparing need.
    changes = [np.abs(corruptions.corrupt(images, name, severity, seed=1).astype(float) - images).mean()
               for severity in corruptions.SEVERITIES]  # fmt: skip
    assert min(changes) > 0, changes
    unordered = NOT_ORDERED_BY_PIXEL_CHANGE.get(name, ())
    for severity in corruptions.SEVERITIES[1:]:
        if severity not in unordered:
            assert changes[severity - 1] > changes[severity - 2], (name, changes)


def test_random_corruptions_differ_between_seeds_and_the_deterministic_ones_do_not(images):
    for name in ("gaussian_noise", "glass_blur", "snow", "fog", "elastic_transform", "frost"):
        assert not np.array_equal(
            corruptions.corrupt(images, name, 2, seed=0), corruptions.corrupt(images, name, 2, seed=1)
        )
    for name in ("defocus_blur", "zoom_blur", "brightness", "contrast", "pixelate", "jpeg_compression"):
        assert np.array_equal(
            corruptions.corrupt(images, name, 2, seed=0), corruptions.corrupt(images, name, 2, seed=1)
        )


def test_the_batch_zoom_is_scipys_zoom_of_each_centre_crop(images):
    from scipy.ndimage import zoom

    pixels = images[:4] / 255.0
    for factor in (1.01, 1.13, 1.26, 2.25):
        crop = int(np.ceil(32 / factor))
        top = (32 - crop) // 2
        expected = zoom(pixels[:, top : top + crop, top : top + crop], (1, factor, factor, 1), order=1)
        trim = (expected.shape[1] - 32) // 2
        expected = expected[:, trim : trim + 32, trim : trim + 32]
        assert np.allclose(corruptions.clipped_zoom(pixels, factor), expected, atol=1e-9), factor


def test_published_parameters_and_kernels():
    assert len(corruptions.CORRUPTIONS) == 15
    assert all(len(corruptions.PARAMETERS[name]) == 6 for name in corruptions.CORRUPTIONS)
    assert corruptions.PARAMETERS["gaussian_noise"][1:] == [0.04, 0.06, 0.08, 0.09, 0.10]
    assert corruptions.PARAMETERS["jpeg_compression"][1:] == [80, 65, 58, 50, 40]
    # The disk sums to 1; ImageMagick's motion kernel is one-sided along the angle with 2 * ceil(r) + 1 taps.
    assert corruptions.disk_kernel(1.5, 0.1).sum() == pytest.approx(1.0)
    taps = corruptions.motion_kernel(6, 2, 0.0)
    assert len(taps) == 13 and [tap[:2] for tap in taps[:3]] == [(0, 0), (0, 1), (0, 2)]
    assert sum(tap[2] for tap in taps) == pytest.approx(1.0) and taps[0][2] > taps[-1][2]
    assert [tap[:2] for tap in corruptions.motion_kernel(2, 1, 90.0)] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)]


def test_bad_requests_are_refused_naming_the_problem(images):
    with pytest.raises(ValueError, match="unknown corruption 'rain'"):
        corruptions.corrupt(images, "rain", 1)
    with pytest.raises(ValueError, match="severity must be 0"):
        corruptions.corrupt(images, "fog", 6)
    with pytest.raises(ValueError, match=r"expected uint8 images \(N, 32, 32, 3\)"):
        corruptions.corrupt(images.astype(np.float32), "fog", 1)
    assert corruptions.corrupt(images[:0], "fog", 1).shape == (0, 32, 32, 3)
