"""Fuzzing the additions door (`flows/ingest.py --add`): folders of any files under any names, and batch files.

Given a generated folder (images of every format, mode and size, headers that lie, broken files, links,
fifos, names in any encoding) or batch file, expect every file either read exactly or named with why it
was left out, or the whole addition refused with one line naming the source; an image whose header
states another size is refused from the header; nothing stored unless accepted; no code run.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from fuzz_files import batch_files
from fuzz_strategies import budget, files_under, image_trees, one_line, write_tree
from hypothesis import given
from hypothesis import strategies as st

from cifar.config import make_config
from cifar.data.additions import MAX_DECODED_PIXELS, RESIZE_METHODS, NoUsableImagesError, read_addition
from cifar.data.archive import InvalidDatasetError, UnsafePickleError, rows_to_images
from cifar.data.ingest import ingest_addition
from cifar.data.synthetic import CLASS_NAMES
from cifar.io import file_digests
from cifar.results import ArchiveInfo

# A warning is a line on a person's terminal too: any the readers let out fails the property.
pytestmark = pytest.mark.filterwarnings("error")

MARKER = Path(tempfile.gettempdir()) / f"cifar-fuzz-addition-ran-code-{os.getpid()}"
RESIZES = st.sampled_from([None, None, None, *RESIZE_METHODS])


def check_folder_addition(root: Path, entries, resize: str | None) -> None:
    """The properties of one folder read as an addition (shared by the reader's and the ingest's tests)."""
    listed = files_under(root)
    try:
        addition = read_addition(root, list(CLASS_NAMES), resize=resize)
    except NoUsableImagesError as error:
        assert one_line(str(error)) and str(error).startswith(f"no usable image in {root}: ")
        assert {problem.file for problem in error.problems} == listed  # Every file named with its reason.
        return
    names, problems = set(addition.names), {problem.file: problem for problem in addition.problems}
    assert len(names) == len(addition.names) == len(addition.images) == len(addition.labels) > 0
    assert names | set(problems) == listed and not names & set(problems)  # Each file read, or named as left out.
    assert addition.images.dtype == np.uint8 and addition.images.shape[1:] == (32, 32, 3)
    for name, label in zip(addition.names, addition.labels.tolist()):
        assert CLASS_NAMES[label] == name.split("/")[0] and name.count("/") == 1
    by_path = {"/".join(entry.path): entry for entry in entries}
    for name, image in zip(addition.names, addition.images):
        content = by_path[name].content if name in by_path else None
        if content is not None and content.pixels is not None:
            np.testing.assert_array_equal(image, content.pixels)  # A lossless 32x32 image, exactly.
    for name, problem in problems.items():
        entry = by_path.get(name)
        declared = entry.content.declared if entry is not None and entry.kind == "file" else None
        in_class_folder = name.count("/") == 1 and name.split("/")[0] in CLASS_NAMES
        if declared and in_class_folder and (resize is None or declared[0] * declared[1] > MAX_DECODED_PIXELS):
            assert problem.problem == "size", problem  # Judged from the header, never decoded.
    addition.digest  # noqa: B018 - computing it must work for any names.


@pytest.mark.slow
@budget(3)
@given(entries=image_trees, resize=RESIZES)
def test_a_folder_is_read_file_by_file_or_refused_naming_every_file(entries, resize):
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "new-labels"
        write_tree(root, entries)
        check_folder_addition(root, entries, resize)


@budget(2)
@given(batch=batch_files(MARKER))
def test_a_batch_file_is_read_exactly_or_refused_naming_it(batch):
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "data_batch_6"
        path.write_bytes(batch.data)
        try:
            addition = read_addition(path, list(CLASS_NAMES))
        except (UnsafePickleError, InvalidDatasetError, NoUsableImagesError) as error:
            assert one_line(str(error)) and str(error).startswith(("data_batch_6: ", f"no usable image in {path}"))
        else:
            assert batch.rows is None or np.array_equal(addition.images, rows_to_images([batch.rows]))
            assert batch.labels is None or np.array_equal(addition.labels, batch.labels)
            assert addition.names == [f"data_batch_6#{row}" for row in range(len(addition.labels))]
    assert not MARKER.exists(), "a pickle in the batch file ran code"


def store_state(workdir: Path) -> dict[str, str]:
    """Every file of the data store (additions, snapshots) with its digest: what a refusal must leave as it was."""
    files = sorted((workdir / "data").glob("additions/**/*")) + sorted((workdir / "data").glob("snapshots/*"))
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in files if path.is_file()}


@pytest.fixture(scope="module")
def store(python_archive, tmp_path_factory):
    """One workdir all examples ingest into (the archive's analysis is made once), with its config and archive."""
    digests = file_digests(python_archive)
    archive = ArchiveInfo(path=python_archive, sha256=digests["sha256"], md5=digests["md5"], source=python_archive)
    data = {"source": python_archive, "expect_official_counts": False, "validation_size": 100}
    return tmp_path_factory.mktemp("fuzz-ingest"), make_config("smoke", {"data": data}), archive


@budget(0.5)
@given(entries=image_trees)
def test_an_ingest_stores_what_it_accepts_and_nothing_else(store, entries):
    workdir, config, archive = store
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "new-labels"
        write_tree(root, entries)
        before = store_state(workdir)
        try:
            result, _ = ingest_addition(config, root, workdir, archive, None)
        except ValueError as error:  # NoUsableImagesError, DataValidationError (the gate), ...
            assert one_line(str(error)), str(error)
            assert store_state(workdir) == before
        else:
            added = set(store_state(workdir)) - set(before)
            assert all(result.addition in path or "snapshots" in path for path in added)
            assert (workdir / "data" / "additions" / result.addition).is_dir()
