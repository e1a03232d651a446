"""Near-duplicate images: the same picture after a small shift or crop, a colour change or JPEG noise.

Fingerprints (low DCT frequencies of the luma) find candidates; aligned views verify them. The method,
its speed and how the threshold was chosen: docs/DATA.md ("Near-duplicates").
"""

from __future__ import annotations

import functools

import numpy as np
from pydantic import BaseModel, ConfigDict

from cifar.data.drift import LUMA_WEIGHTS

SIDE = 32  # Images are 32 x 32.
FREQUENCIES = 8  # DCT frequencies per axis kept: 8 x 8 - 1 (the mean) = 63 coefficients.
DIMENSIONS = FREQUENCIES * FREQUENCIES - 1
MIN_DETAIL = 32.0  # Low-frequency AC norm (luma units) below which an image is flat: no fingerprint.
CANDIDATE_SIMILARITY = 0.75  # Plain-fingerprint similarity a pair needs to be verified at all.
CANDIDATES = 8  # Most similar pool images verified per query.
QUERY_CHUNK = 512  # Query rows per similarity block: 512 x 50,000 float32 = 100 MB at most.
SHIFTS = (
    (0, 0),
    (1, 0),
    (-1, 0),
    (0, 1),
    (0, -1),
    (1, 1),
    (-1, -1),
    (1, -1),
    (-1, 1),
    (2, 0),
    (-2, 0),
    (0, 2),
    (0, -2),
)
ZOOMS = (28, 26)  # Centre crops (pixels) resized back to 32: a 14 % and a 23 % zoom.


class NearDuplicates(BaseModel):
    """Pairs (query index, pool index, similarity) at or above a threshold, most similar first."""

    model_config = ConfigDict(extra="forbid")

    threshold: float
    query: list[int] = []
    pool: list[int] = []
    similarity: list[float] = []

    def queries(self) -> set[int]:
        """The query indices with at least one near-duplicate."""
        return set(self.query)

    def at(self, threshold: float) -> NearDuplicates:
        """The pairs at or above a higher threshold."""
        if threshold < self.threshold:
            raise ValueError(f"pairs were found at {self.threshold}, so none below it are known (asked {threshold})")
        keep = [index for index, value in enumerate(self.similarity) if value >= threshold]
        return NearDuplicates(
            threshold=threshold,
            query=[self.query[index] for index in keep],
            pool=[self.pool[index] for index in keep],
            similarity=[self.similarity[index] for index in keep],
        )


def _dct_basis() -> np.ndarray:
    """(SIDE, FREQUENCIES) orthonormal DCT-II basis vectors along one axis."""
    positions = np.arange(SIDE)
    basis = np.cos(np.pi * (2 * positions[:, None] + 1) * np.arange(FREQUENCIES)[None, :] / (2 * SIDE))
    basis[:, 0] *= np.sqrt(1 / SIDE)
    basis[:, 1:] *= np.sqrt(2 / SIDE)
    return basis


def _resize_matrix(source: int, target: int = SIDE) -> np.ndarray:
    """(target, source) linear interpolation with half-pixel centres (what bilinear resizing does per axis)."""
    matrix = np.zeros((target, source))
    centres = (np.arange(target) + 0.5) * source / target - 0.5
    for row, centre in enumerate(np.clip(centres, 0, source - 1)):
        low = int(np.floor(centre))
        high = min(low + 1, source - 1)
        matrix[row, low] += 1 - (centre - low)
        matrix[row, high] += centre - low
    return matrix


def _axis_maps() -> dict[str, list[np.ndarray]]:
    """Per-axis linear maps (SIDE, SIDE) of each view: reflect-padded shifts and centre zooms."""
    identity = np.eye(SIDE)
    padded = np.pad(identity, ((2, 2), (0, 0)), mode="reflect")  # (SIDE + 4, SIDE): row r of the padded axis.

    def shift(offset: int) -> np.ndarray:
        return padded[2 - offset : 2 - offset + SIDE]  # Output pixel i reads input pixel i - offset.

    def zoom(size: int) -> np.ndarray:
        start = (SIDE - size) // 2
        return _resize_matrix(size) @ identity[start : start + size]

    return {
        "shifts": [np.stack([shift(rows), shift(columns)]) for rows, columns in SHIFTS],
        "zooms": [np.stack([identity, identity])] + [np.stack([zoom(size), zoom(size)]) for size in ZOOMS],
    }


@functools.cache
def _view_bases() -> dict[str, np.ndarray]:
    """Fingerprint bases (SIDE*SIDE, views * DIMENSIONS) of the query views and the pool views.

    A view maps the luma image G to A G B^T (A, B per axis); the DCT coefficient (u, v) of the view
    is d_u^T A G B^T d_v = <G, (A^T d_u)(B^T d_v)^T>, so each view's fingerprints are one product.
    """
    dct = _dct_basis()  # (SIDE, FREQUENCIES)
    pairs = [(u, v) for u in range(FREQUENCIES) for v in range(FREQUENCIES) if (u, v) != (0, 0)]
    bases = {}
    maps = _axis_maps()
    query_views = [view for view in maps["shifts"]] + maps["zooms"][1:]
    for name, views in (("query", query_views), ("pool", maps["zooms"])):
        columns = []
        for rows_map, columns_map in views:
            left, right = rows_map.T @ dct, columns_map.T @ dct  # (SIDE, FREQUENCIES) each
            columns.append(np.stack([np.outer(left[:, u], right[:, v]).ravel() for u, v in pairs], axis=1))
        bases[name] = np.concatenate(columns, axis=1).astype(np.float32)
    return bases


def fingerprints(images: np.ndarray, views: str = "plain") -> np.ndarray:
    """Unit fingerprints float32 (N, V, DIMENSIONS) of uint8 images (N, 32, 32, 3); flat images get zeros.

    `views`: "plain" (V = 1), "query" (the shifted and zoomed views) or "pool" (plain and zoomed).
    """
    if images.dtype != np.uint8 or images.shape[1:] != (SIDE, SIDE, 3):
        raise ValueError(f"expected uint8 images (N, {SIDE}, {SIDE}, 3), got {images.dtype} {images.shape}")
    basis = _view_bases()["pool" if views == "plain" else views]
    if views == "plain":
        basis = basis[:, :DIMENSIONS]
    result = np.empty((len(images), basis.shape[1] // DIMENSIONS, DIMENSIONS), np.float32)
    for start in range(0, len(images), 2048):
        chunk = images[start : start + 2048]
        gray = chunk.reshape(len(chunk), -1, 3).astype(np.float32) @ LUMA_WEIGHTS  # (n, SIDE*SIDE)
        coefficients = (gray @ basis).reshape(len(chunk), -1, DIMENSIONS)
        norms = np.linalg.norm(coefficients, axis=2, keepdims=True)
        result[start : start + len(chunk)] = np.where(norms >= MIN_DETAIL, coefficients / np.maximum(norms, 1e-6), 0)
    return result


def _candidates(queries: np.ndarray, pool: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(query index, pool index) pairs: per query its CANDIDATES most similar pool fingerprints above the floor."""
    rows, columns = [], []
    for start in range(0, len(queries), QUERY_CHUNK):
        similarity = queries[start : start + QUERY_CHUNK] @ pool.T  # (n, M)
        row, column = np.nonzero(similarity >= CANDIDATE_SIMILARITY)
        if not len(row):
            continue
        score = similarity[row, column]
        order = np.lexsort((-score, row))  # By query, most similar first.
        row, column = row[order], column[order]
        first = np.searchsorted(row, row)  # Index of each query's first pair.
        keep = np.arange(len(row)) - first < CANDIDATES
        rows.append(row[keep] + start)
        columns.append(column[keep])
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(rows), np.concatenate(columns)


def find_near_duplicates(
    query_images: np.ndarray, pool_images: np.ndarray, threshold: float, *, pool_plain: np.ndarray | None = None
) -> NearDuplicates:
    """Every (query, pool) pair of near-duplicates at or above `threshold`, most similar first.

    `pool_plain` are the pool's plain fingerprints when the caller already has them (N, DIMENSIONS).
    """
    if len(query_images) == 0 or len(pool_images) == 0:
        return NearDuplicates(threshold=threshold)
    pool_plain = fingerprints(pool_images)[:, 0] if pool_plain is None else pool_plain
    query_plain = fingerprints(query_images)[:, 0]
    query_index, pool_index = _candidates(query_plain, pool_plain)
    if not len(query_index):
        return NearDuplicates(threshold=threshold)
    # Views only of the images that have candidates.
    queries_needed, query_slot = np.unique(query_index, return_inverse=True)
    pool_needed, pool_slot = np.unique(pool_index, return_inverse=True)
    query_views = fingerprints(query_images[queries_needed], "query")  # (q, Vq, D)
    pool_views = fingerprints(pool_images[pool_needed], "pool")  # (p, Vp, D)
    similarity = np.full(len(query_index), -1.0, np.float32)
    for start in range(0, len(query_index), 8192):
        block = slice(start, start + 8192)
        scores = np.einsum("nqd,npd->nqp", query_views[query_slot[block]], pool_views[pool_slot[block]])
        similarity[block] = scores.reshape(len(scores), -1).max(axis=1)
    found = similarity >= threshold
    order = np.argsort(-similarity[found], kind="stable")
    return NearDuplicates(
        threshold=threshold,
        query=query_index[found][order].tolist(),
        pool=pool_index[found][order].tolist(),
        similarity=[round(float(value), 5) for value in similarity[found][order]],
    )
