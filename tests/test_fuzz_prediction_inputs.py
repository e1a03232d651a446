"""Fuzzing the prediction door (`flows/predict.py --input`): folders, batch files, .npy arrays and TFRecord shards.

Given a generated input, expect it opened and every image read exactly (a folder: every file read or listed
as skipped), or refused with one ValueError line naming it: `open_source` before any work, the readers
while reading (`read_usable`, the scoring loop's reader, refuses an input without one readable image).
No code runs from a pickle; a TFRecord header stating gigabytes never reaches TensorFlow.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from fuzz_files import batch_files, npy_files, tfrecord_files
from fuzz_strategies import budget, files_under, image_trees, one_line, write_tree
from hypothesis import given
from hypothesis import strategies as st

from cifar.data.additions import RESIZE_METHODS
from cifar.data.archive import rows_to_images
from cifar.predict import input_digest, open_source, read_usable

# A warning is a line on a person's terminal too: any the readers let out fails the property.
pytestmark = pytest.mark.filterwarnings("error")

MARKER = Path(tempfile.gettempdir()) / f"cifar-fuzz-prediction-ran-code-{os.getpid()}"
CHUNK_SIZES = st.sampled_from([1, 2, 1000])


def read_all(path: Path, resize: str | None, chunk_size: int) -> tuple[np.ndarray, list[str], list] | None:
    """(images, names, problems) of the input, or None when it was refused in one line naming it."""
    try:
        source = open_source(path, resize=resize)
        input_digest(source)
        images, names, problems = [], [], []
        for chunk, _profile in read_usable(source, chunk_size):
            assert chunk.images.dtype == np.uint8 and chunk.images.shape[1:] == (32, 32, 3)
            assert len(chunk.images) <= chunk_size and len(chunk.names) == len(chunk.images)
            images.append(chunk.images)
            names += chunk.names
            problems += chunk.problems
    except ValueError as error:  # NoUsableImagesError, InvalidDatasetError, UnsafePickleError, a .npy's own.
        assert one_line(str(error)), str(error)
        assert str(path.name) in str(error) or str(path) in str(error), str(error)
        return None
    assert len(set(names)) == len(names) and names
    return np.concatenate(images), names, problems


@budget(3)
@given(entries=image_trees, resize=st.sampled_from([None, None, *RESIZE_METHODS]), chunk_size=CHUNK_SIZES)
def test_a_folder_is_read_file_by_file_or_refused_in_one_line(entries, resize, chunk_size):
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "incoming"
        write_tree(root, entries)
        result = read_all(root, resize, chunk_size)
        if result is not None:
            _, names, problems = result
            files = {problem.file for problem in problems}
            assert set(names) | files == files_under(root) and not set(names) & files
            by_path = {"/".join(entry.path): entry for entry in entries if entry.kind == "file"}
            for name, image in zip(names, result[0]):
                if name in by_path and by_path[name].content.pixels is not None:
                    np.testing.assert_array_equal(image, by_path[name].content.pixels)


@budget(3)
@given(kind=st.sampled_from(["batch_file", "npy"]), data=st.data(), chunk_size=CHUNK_SIZES)
def test_a_batch_file_or_array_is_read_exactly_or_refused_in_one_line(kind, data, chunk_size):
    sample = data.draw(batch_files(MARKER) if kind == "batch_file" else npy_files())
    expected = getattr(sample, "images", None)
    if kind == "batch_file" and sample.rows is not None:
        expected = rows_to_images([sample.rows])
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / ("test_batch" if kind == "batch_file" else "images.npy")
        path.write_bytes(sample.data)
        result = read_all(path, None, chunk_size)
    if expected is not None and len(expected):
        assert result is not None, f"a valid {kind} was refused"
        np.testing.assert_array_equal(result[0], expected)
        assert result[1] == [f"{path.name}#{index}" for index in range(len(expected))]
    assert not MARKER.exists(), "a pickle in the input ran code"


@budget(1)
@given(shard=tfrecord_files(), chunk_size=CHUNK_SIZES)
def test_a_tfrecord_shard_is_read_exactly_or_skipped_or_refused_in_one_line(shard, chunk_size):
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "incoming.tfrecord"
        path.write_bytes(shard.data)
        result = read_all(path, None, chunk_size)
    if shard.images is not None and len(shard.images):
        assert result is not None, "a valid shard was refused"
        np.testing.assert_array_equal(result[0], shard.images)
    if result is not None:  # One shard is read whole or skipped whole, never in part; skipped, nothing is left.
        assert result[2] == []
