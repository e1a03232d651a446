"""The 15 CIFAR-10-C common corruptions at 5 severities, made from test images, deterministically.

Hendrycks & Dietterich, "Benchmarking Neural Network Robustness to Common Corruptions and Perturbations",
ICLR 2019. Every parameter below is the published one for 32x32 images, from the authors' generator
`ImageNet-C/create_c/make_cifar_c.py` in github.com/hendrycks/robustness (commit ca36008), cited per
corruption as PARAMETERS[name]. The `imagecorruptions` package was not used: it carries ImageNet-C's
parameters (224x224 images) and needs OpenCV, scikit-image and ImageMagick; here it is numpy, scipy and
Pillow only. What differs from the authors' generator, and why:

- Their random draws come from NumPy's global generator, image by image; here one seeded generator per
  (seed, corruption) draws for the whole batch, so the same seed gives the same bytes on every
  machine, but not the bytes of the published CIFAR-10-C files.
- Results are rounded to uint8 (theirs truncate): at zero strength an image comes back unchanged.
- Motion blur (in `motion_blur` and `snow`) was ImageMagick's MotionBlurImage through Wand; here it is the
  same kernel written out: a one-sided Gaussian of width 2 * ceil(radius) + 1 taps along the angle, taps
  rounded to whole pixels, edges repeated (ImageMagick's default virtual pixels).
- Frost blends crops of six frost photographs that are not published with the parameters; here it blends
  crops of a frost-like texture generated from a fixed seed (plasma fractal plus streaks). Its figures
  are therefore ours, and the docs say so where they are reported.
- OpenCV's filters are scipy.ndimage's with the same border rule (`mirror` is OpenCV's REFLECT_101).

Four more corruptions (speckle noise, Gaussian blur, spatter, saturate) are held out by the benchmark for
validation and are not made here.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import numpy as np

CORRUPTIONS = (  # In the benchmark's order: noise, blur, weather, digital.
    "gaussian_noise", "shot_noise", "impulse_noise",
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog",
    "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)  # fmt: skip
SEVERITIES = (1, 2, 3, 4, 5)
SIZE = 32

# make_cifar_c.py's `c` lists, severity 1 to 5, each preceded by the parameters at zero strength (index 0),
# which leave an image unchanged. Tuples name their fields in the comment beside them.
PARAMETERS: dict[str, list] = {
    "gaussian_noise": [0.0, 0.04, 0.06, 0.08, 0.09, 0.10],  # Standard deviation on [0, 1] pixels.
    "shot_noise": [math.inf, 500, 250, 100, 75, 50],  # Poisson photons per unit of intensity.
    "impulse_noise": [0.0, 0.01, 0.02, 0.03, 0.05, 0.07],  # Fraction of values set to 0 or 1.
    "defocus_blur": [(0, None), (0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)],  # Disk radius, its blur.
    "glass_blur": [  # Blur sigma, largest shift (pixels), passes.
        (0.0, 1, 0),
        (0.05, 1, 1),
        (0.25, 1, 1),
        (0.4, 1, 1),
        (0.25, 1, 2),
        (0.4, 1, 2),
    ],
    "motion_blur": [(0, 1), (6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)],  # Radius, sigma (pixels).
    "zoom_blur": [0.0, 0.06, 0.11, 0.16, 0.21, 0.26],  # Zooms 1.00, 1.01, ... below this bound are averaged.
    "snow": [  # Mean, std of flakes; their zoom; threshold; motion radius, sigma; share of the image kept.
        (0.0, 0.0, 1.0, 1.0, 0, 1, 1.0),
        (0.1, 0.2, 1, 0.6, 8, 3, 0.95),
        (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
        (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
        (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
        (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8),
    ],
    "frost": [(1.0, 0.0), (1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)],  # Image, frost weights.
    "fog": [(0.0, 3), (0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)],  # Fog strength, fractal decay.
    "brightness": [0.0, 0.05, 0.1, 0.15, 0.2, 0.3],  # Added to the HSV value.
    "contrast": [1.0, 0.75, 0.5, 0.4, 0.3, 0.15],  # Factor on the distance from each channel's mean.
    # Displacement scale, its smoothing sigma, affine jitter; in pixels: the published fractions of the side.
    "elastic_transform": [
        (0.0, 0.0, 0.0),
        (SIZE * 0, SIZE * 0, SIZE * 0.08),
        (SIZE * 0.05, SIZE * 0.2, SIZE * 0.07),
        (SIZE * 0.08, SIZE * 0.06, SIZE * 0.06),
        (SIZE * 0.1, SIZE * 0.04, SIZE * 0.05),
        (SIZE * 0.1, SIZE * 0.03, SIZE * 0.03),
    ],
    "pixelate": [1.0, 0.95, 0.9, 0.85, 0.75, 0.65],  # Side scale of the box-filtered down-sampling.
    "jpeg_compression": [None, 80, 65, 58, 50, 40],  # JPEG quality (None: not encoded).
}


def corrupt(images: np.ndarray, name: str, severity: int, seed: int = 0) -> np.ndarray:
    """`images` (N, 32, 32, 3) uint8 with corruption `name` at `severity` (0 = unchanged, 1-5), as uint8.

    The same (images, name, severity, seed) always gives the same bytes: the random draws come from one
    generator seeded with (seed, the corruption's index), in a fixed order. Every severity of a seed draws
    the same numbers (angles, noise, crops), so severities differ in strength only.
    """
    if name not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {name!r}: expected one of {', '.join(CORRUPTIONS)}")
    if severity not in (0, *SEVERITIES):
        raise ValueError(f"severity must be 0 (none) to 5, got {severity!r}")
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (SIZE, SIZE, 3):
        raise ValueError(f"expected uint8 images (N, {SIZE}, {SIZE}, 3), got {images.dtype} {images.shape}")
    if len(images) == 0:
        return images.copy()
    rng = np.random.default_rng([seed, CORRUPTIONS.index(name)])
    corrupted = _FUNCTIONS[name](images.astype(np.float64) / 255.0, PARAMETERS[name][severity], rng)
    return _to_uint8(corrupted)


def _to_uint8(pixels: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(pixels, 0.0, 1.0) * 255.0).astype(np.uint8)


# Noise.


def gaussian_noise(x: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
    return x + rng.normal(size=x.shape, scale=scale) if scale > 0 else x


def shot_noise(x: np.ndarray, photons: float, rng: np.random.Generator) -> np.ndarray:
    return rng.poisson(x * photons) / photons if math.isfinite(photons) else x


def impulse_noise(x: np.ndarray, amount: float, rng: np.random.Generator) -> np.ndarray:
    """Salt and pepper per value, half each (scikit-image's random_noise 's&p' as the authors used it)."""
    flipped = rng.random(x.shape) < amount
    salt = rng.random(x.shape) < 0.5
    return np.where(flipped, np.where(salt, 1.0, 0.0), x)


# Blur.


def _gaussian_taps(sigma: float, size: int = 3) -> np.ndarray:
    """OpenCV's getGaussianKernel(size, sigma)."""
    offsets = np.arange(size) - (size - 1) / 2
    taps = np.exp(-(offsets**2) / (2 * sigma**2))
    return taps / taps.sum()


def disk_kernel(radius: float, alias_blur: float | None) -> np.ndarray:
    """A normalised disk on a 17x17 grid (radius <= 8, as every severity is), softened by a 3x3 Gaussian."""
    offsets = np.arange(-8, 9)
    xs, ys = np.meshgrid(offsets, offsets)
    disk = ((xs**2 + ys**2) <= radius**2).astype(np.float64)
    disk /= disk.sum()
    if alias_blur is None:
        return disk
    from scipy.ndimage import correlate

    taps = _gaussian_taps(alias_blur)
    return correlate(disk, np.outer(taps, taps), mode="mirror")


def defocus_blur(x: np.ndarray, parameters: tuple, rng: np.random.Generator) -> np.ndarray:
    from scipy.ndimage import correlate

    kernel = disk_kernel(*parameters)
    return correlate(x, kernel[np.newaxis, :, :, np.newaxis], mode="mirror")


def _gaussian(x: np.ndarray, sigma: float, mode: str = "nearest", truncate: float = 4.0) -> np.ndarray:
    """scikit-image's `gaussian` on each image (batch and channel axes not blurred)."""
    from scipy.ndimage import gaussian_filter

    if sigma == 0:
        return x
    sigmas = (0, sigma, sigma, 0) if x.ndim == 4 else (0, sigma, sigma)
    return gaussian_filter(x, sigma=sigmas, mode=mode, truncate=truncate)


def glass_blur(x: np.ndarray, parameters: tuple, rng: np.random.Generator) -> np.ndarray:
    """Blur, give each pixel a neighbour's value (up to `max_shift` away, bottom-right first), blur again.

    The authors' "swap", `x[h, w], x[h2, w2] = x[h2, w2], x[h, w]` on NumPy views, copies the neighbour into
    the pixel and leaves the neighbour as it was: that copy is CIFAR-10-C's glass blur, and is done here.
    (A true swap would carry a pixel across the image, one step per visit.)"""
    sigma, max_shift, passes = parameters
    pixels = _to_uint8(_gaussian(x, sigma))
    batch = np.arange(len(pixels))
    for _ in range(passes):
        for row in range(SIZE - max_shift, max_shift, -1):
            for column in range(SIZE - max_shift, max_shift, -1):
                # The authors' np.random.randint(-d, d): the upper bound is excluded.
                shift_column, shift_row = rng.integers(-max_shift, max_shift, size=(2, len(pixels)))
                other_row, other_column = row + shift_row, column + shift_column
                pixels[batch, row, column] = pixels[batch, other_row, other_column]
    return _gaussian(pixels / 255.0, sigma)


def motion_kernel(radius: float, sigma: float, angle_degrees: float) -> list[tuple[int, int, float]]:
    """ImageMagick's MotionBlurImage kernel: (row offset, column offset, weight) per tap."""
    width = int(2 * math.ceil(radius) + 1) if radius > 0 else 1
    weights = np.exp(-(np.arange(width, dtype=np.float64) ** 2) / (2 * sigma**2))
    weights /= weights.sum()
    angle = math.radians(angle_degrees)
    return [
        (math.ceil(tap * math.sin(angle) - 0.5), math.ceil(tap * math.cos(angle) - 0.5), float(weight))
        for tap, weight in enumerate(weights)
    ]


def _motion_blur_each(pixels: np.ndarray, radius: float, sigma: float, angles: np.ndarray) -> np.ndarray:
    """Each image (N, H, W[, C]) blurred along its own angle; edges repeated."""
    rows, columns = np.arange(pixels.shape[1]), np.arange(pixels.shape[2])
    blurred = np.zeros(pixels.shape, np.float64)
    for index, angle in enumerate(angles):
        for row_offset, column_offset, weight in motion_kernel(radius, sigma, float(angle)):
            source_rows = np.clip(rows + row_offset, 0, pixels.shape[1] - 1)
            source_columns = np.clip(columns + column_offset, 0, pixels.shape[2] - 1)
            blurred[index] += weight * pixels[index][np.ix_(source_rows, source_columns)]
    return blurred


def motion_blur(x: np.ndarray, parameters: tuple, rng: np.random.Generator) -> np.ndarray:
    radius, sigma = parameters
    angles = rng.uniform(-45, 45, size=len(x))
    # The authors blurred the uint8 image (PNG through ImageMagick) and read a uint8 image back.
    return _to_uint8(_motion_blur_each(_to_uint8(x).astype(np.float64), radius, sigma, angles) / 255.0) / 255.0


def _linear_resize_axis(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    """scipy.ndimage.zoom(order=1) along one axis: output i samples input i * (n - 1) / (size - 1)."""
    length = x.shape[axis]
    positions = np.arange(size) * ((length - 1) / (size - 1)) if size > 1 else np.zeros(1)
    below = np.minimum(np.floor(positions).astype(np.int64), length - 1)
    above = np.minimum(below + 1, length - 1)
    weight_shape = [1] * x.ndim
    weight_shape[axis] = size
    weight = (positions - below).reshape(weight_shape)
    return np.take(x, below, axis=axis) * (1 - weight) + np.take(x, above, axis=axis) * weight


def clipped_zoom(x: np.ndarray, factor: float) -> np.ndarray:
    """Zoom each image (N, H, W, C) about its centre by `factor` >= 1, cropped back to H x W (linear).

    The authors' scipy.ndimage.zoom(order=1) of the centre crop, written as two separable linear resizes
    over the whole batch (the same numbers, ~20x faster than zooming a 4-D array)."""
    side = x.shape[1]
    crop = int(math.ceil(side / factor))
    top = (side - crop) // 2
    zoomed_side = round(crop * factor)
    zoomed = x[:, top : top + crop, top : top + crop]
    zoomed = _linear_resize_axis(_linear_resize_axis(zoomed, 1, zoomed_side), 2, zoomed_side)
    trim = (zoomed_side - side) // 2
    return zoomed[:, trim : trim + side, trim : trim + side]


def zoom_blur(x: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    factors = np.arange(1, 1 + bound, 0.01) if bound > 0 else []  # The authors' np.arange(1, bound, 0.01).
    total = x.copy()
    for factor in factors:
        total += clipped_zoom(x, float(factor))
    return total / (len(factors) + 1)


# Weather.


def plasma_fractal(rng: np.random.Generator, size: int = SIZE, decay: float = 3.0) -> np.ndarray:
    """A diamond-square height map (size a power of two) scaled to [0, 1] (after FLHerne/mapgen)."""
    heights = np.zeros((size, size))
    step, wibble = size, 100.0

    def wibbled_mean(total: np.ndarray) -> np.ndarray:
        return total / 4 + wibble * rng.uniform(-wibble, wibble, total.shape)

    while step >= 2:
        half = step // 2
        corners = heights[0:size:step, 0:size:step]
        squares = corners + np.roll(corners, shift=-1, axis=0)
        squares += np.roll(squares, shift=-1, axis=1)
        heights[half:size:step, half:size:step] = wibbled_mean(squares)
        centres = heights[half:size:step, half:size:step]
        corners = heights[0:size:step, 0:size:step]
        heights[0:size:step, half:size:step] = wibbled_mean(
            centres + np.roll(centres, 1, axis=0) + corners + np.roll(corners, -1, axis=1)
        )
        heights[half:size:step, 0:size:step] = wibbled_mean(
            centres + np.roll(centres, 1, axis=1) + corners + np.roll(corners, -1, axis=0)
        )
        step //= 2
        wibble /= decay
    heights -= heights.min()
    return heights / heights.max()


def _gray(x: np.ndarray) -> np.ndarray:
    """OpenCV's RGB2GRAY, keeping a channel axis."""
    return (x @ np.array([0.299, 0.587, 0.114]))[..., np.newaxis]


def snow(x: np.ndarray, parameters: tuple, rng: np.random.Generator) -> np.ndarray:
    mean, spread, flake_zoom, threshold, radius, sigma, kept = parameters
    flakes = rng.normal(size=x.shape[:3], loc=mean, scale=spread)[..., np.newaxis]
    flakes = clipped_zoom(flakes, flake_zoom) if flake_zoom != 1 else flakes
    flakes[flakes < threshold] = 0
    angles = rng.uniform(-135, -45, size=len(x))
    # As the authors': the layer becomes an 8-bit grey image (truncated), is blurred, and is read back.
    layer = np.clip(flakes[..., 0], 0, 1) * 255
    layer = _to_uint8(_motion_blur_each(layer.astype(np.uint8).astype(np.float64), radius, sigma, angles) / 255.0)
    layer = layer[..., np.newaxis] / 255.0
    x = kept * x + (1 - kept) * np.maximum(x, _gray(x) * 1.5 + 0.5)
    return x + layer + np.rot90(layer, k=2, axes=(1, 2))


_FROST_SEED = 20190506  # The texture is fixed: the same for every seed, as the authors' photographs are.
_FROST_SIDE = 128


def frost_texture() -> np.ndarray:
    """A (128, 128, 3) float frost-like texture in [0, 1]: a blue-white fractal haze and thin crystal streaks."""
    rng = np.random.default_rng(_FROST_SEED)
    haze = plasma_fractal(rng, _FROST_SIDE, decay=1.6)
    streaks = np.zeros((1, _FROST_SIDE, _FROST_SIDE))
    seeds = rng.random((1, _FROST_SIDE, _FROST_SIDE)) > 0.985
    for angle in rng.uniform(0, 180, size=6):
        streaks += _motion_blur_each(seeds.astype(np.float64), 6, 3, np.array([angle]))
    streaks = streaks[0] / streaks.max()
    luminance = np.clip(0.3 + 0.45 * haze + 0.8 * streaks, 0, 1)  # Mostly light, as frosted glass is.
    tint = np.array([0.85, 0.93, 1.0])  # Frost is a little blue.
    return luminance[..., np.newaxis] * tint


def frost(x: np.ndarray, parameters: tuple, rng: np.random.Generator) -> np.ndarray:
    image_weight, frost_weight = parameters
    texture = frost_texture()
    starts = rng.integers(0, _FROST_SIDE - SIZE, size=(len(x), 2))
    crops = np.stack([texture[row : row + SIZE, column : column + SIZE] for row, column in starts])
    return image_weight * x + frost_weight * crops


def fog(x: np.ndarray, parameters: tuple, rng: np.random.Generator) -> np.ndarray:
    strength, decay = parameters
    if strength == 0:
        return x
    peaks = x.max(axis=(1, 2, 3), keepdims=True)
    haze = np.stack([plasma_fractal(rng, SIZE, decay) for _ in range(len(x))])[..., np.newaxis]
    return (x + strength * haze) * peaks / (peaks + strength)


# Digital.


def brightness(x: np.ndarray, added: float, rng: np.random.Generator) -> np.ndarray:
    from matplotlib.colors import hsv_to_rgb, rgb_to_hsv

    if added == 0:
        return x
    hsv = rgb_to_hsv(np.clip(x, 0, 1))
    hsv[..., 2] = np.clip(hsv[..., 2] + added, 0, 1)
    return hsv_to_rgb(hsv)


def contrast(x: np.ndarray, factor: float, rng: np.random.Generator) -> np.ndarray:
    means = x.mean(axis=(1, 2), keepdims=True)
    return (x - means) * factor + means


def _affine(points: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """OpenCV's getAffineTransform: the 2x3 matrix taking three (x, y) points to three others."""
    source = np.hstack([points, np.ones((3, 1))])
    return np.linalg.solve(source, targets).T


def elastic_transform(x: np.ndarray, parameters: tuple, rng: np.random.Generator) -> np.ndarray:
    from scipy.ndimage import affine_transform, map_coordinates

    scale, smoothing, jitter = parameters
    centre, square = np.float64(SIZE // 2), SIZE // 3
    points = np.array([[centre + square] * 2, [centre + square, centre - square], [centre - square] * 2])
    grid_rows, grid_columns = np.meshgrid(np.arange(SIZE), np.arange(SIZE), indexing="ij")
    out = np.empty_like(x)
    for index, image in enumerate(x):
        moved = points + rng.uniform(-jitter, jitter, size=points.shape)
        # OpenCV's warpAffine samples the source at the inverse map of each output pixel, in (x, y).
        inverse = np.linalg.inv(np.vstack([_affine(points, moved), [0, 0, 1]]))
        matrix = np.array([[inverse[1, 1], inverse[1, 0], 0], [inverse[0, 1], inverse[0, 0], 0], [0, 0, 1]])
        offset = np.array([inverse[1, 2], inverse[0, 2], 0])
        warped = affine_transform(image, matrix, offset=offset, order=1, mode="mirror")
        shift_columns = _gaussian(rng.uniform(-1, 1, (1, SIZE, SIZE)), smoothing, "reflect", 3)[0] * scale
        shift_rows = _gaussian(rng.uniform(-1, 1, (1, SIZE, SIZE)), smoothing, "reflect", 3)[0] * scale
        for channel in range(3):
            coordinates = [grid_rows + shift_rows, grid_columns + shift_columns]
            out[index, :, :, channel] = map_coordinates(warped[:, :, channel], coordinates, order=1, mode="reflect")
    return out


def _each_pil(x: np.ndarray, change: Callable) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(change(Image.fromarray(image)), np.float64) / 255.0 for image in _to_uint8(x)])


def pixelate(x: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
    from PIL import Image

    side = int(SIZE * scale)
    return _each_pil(x, lambda image: image.resize((side, side), Image.BOX).resize((SIZE, SIZE), Image.BOX))


def jpeg_compression(x: np.ndarray, quality: int | None, rng: np.random.Generator) -> np.ndarray:
    from PIL import Image

    if quality is None:
        return x

    def encoded(image):
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=quality)
        return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")

    return _each_pil(x, encoded)


_FUNCTIONS: dict[str, Callable[[np.ndarray, object, np.random.Generator], np.ndarray]] = {
    name: globals()[name] for name in CORRUPTIONS
}
