"""Fuzzing the archive door (`--source`): any tar, in any compression, with any members, pickles and headers.

Given a generated archive, expect the dataset it holds read exactly, or one ValueError of the project's
own kinds whose single line names the archive, the member or the split at fault; nothing extracted on a
refusal; no code run from a pickle, and no module that unpickles untrusted bytes with plain pickle.
"""

from __future__ import annotations

import ast
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from fuzz_files import archives, batch_files
from fuzz_strategies import budget, one_line
from hypothesis import given

from cifar.data.archive import (
    CorruptArchiveError,
    InvalidDatasetError,
    UnknownLayoutError,
    UnsafeArchiveError,
    UnsafePickleError,
    parse_python_batch,
    read_archive,
    safe_extract,
)
from harness import REPO_ROOT

# A warning is a line on a person's terminal too: any the readers let out fails the property.
pytestmark = pytest.mark.filterwarnings("error")

MARKER = Path(tempfile.gettempdir()) / f"cifar-fuzz-archive-ran-code-{os.getpid()}"  # A pickle that ran makes it.
REFUSALS = (UnsafeArchiveError, CorruptArchiveError, UnsafePickleError, UnknownLayoutError, InvalidDatasetError)


@budget(3)
@given(archive=archives(MARKER))
def test_an_archive_is_read_exactly_or_refused_in_one_line(archive):
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "cifar-10.tar.gz"
        path.write_bytes(archive.data)
        try:
            dataset = read_archive(path)
        except REFUSALS as error:
            message = str(error)
            assert one_line(message), message
            assert "archive" in message or "cifar-10-batches" in message or message.startswith(("train", "test"))
        else:
            assert dataset.train_images.dtype == np.uint8 and dataset.train_images.shape[1:] == (32, 32, 3)
            assert len(dataset.train_labels) == len(dataset.train_images) and len(dataset.class_names) == 10
            assert set(dataset.train_labels.tolist()) <= set(range(10))
            if archive.expected is not None:
                for name, value in archive.expected.items():
                    np.testing.assert_array_equal(getattr(dataset, name), value)
        target = Path(scratch) / "extracted"
        try:
            safe_extract(path, target)
        except (*REFUSALS, ValueError) as error:
            assert one_line(str(error)) and not target.exists()  # Nothing written on a refusal.
        else:
            inside = [item.resolve().is_relative_to(target.resolve()) for item in target.rglob("*")]
            assert all(inside) and not any(item.is_symlink() for item in target.rglob("*"))
    assert not MARKER.exists(), "a pickle in the archive ran code"


@budget(3)
@given(batch=batch_files(MARKER))
def test_a_batch_pickle_is_read_exactly_or_refused_and_never_runs_code(batch):
    try:
        rows, labels = parse_python_batch(batch.data, "data_batch_6")
    except (UnsafePickleError, InvalidDatasetError) as error:
        assert batch.rows is None, f"a valid batch was refused: {error}"
        assert one_line(str(error)) and str(error).startswith("data_batch_6: ")
    else:
        assert rows.dtype == np.uint8 and rows.ndim == 2 and rows.shape[1] == 3072
        assert labels.dtype == np.int64 and len(labels) == len(rows) and set(labels.tolist()) <= set(range(10))
        if batch.rows is not None:
            np.testing.assert_array_equal(rows, batch.rows)
            np.testing.assert_array_equal(labels, batch.labels)
    assert not MARKER.exists(), "a pickle ran code"


UNPICKLING_CALLS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "cloudpickle.load", "cloudpickle.loads",
                    "joblib.load", "dill.load", "dill.loads", "marshal.load", "marshal.loads", "yaml.load",
                    "yaml.unsafe_load", "yaml.full_load", "torch.load"}  # fmt: skip


def test_no_module_unpickles_untrusted_bytes_with_plain_pickle():
    """Every reader of a person's files goes through cifar.data.archive's restricted unpickler; NumPy never pickles."""
    found = []
    for package in ("cifar", "tasks", "flows"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Call):
                    continue
                name = ast.unparse(node.func)
                keywords = {keyword.arg: ast.unparse(keyword.value) for keyword in node.keywords}
                if name in UNPICKLING_CALLS or (name.endswith("np.load") and keywords.get("allow_pickle") != "False"):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {name}")
    assert found == []
