"""Shared fixtures: small generated archives in the official layouts, and a quiet TensorFlow."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Measured precision choices (cifar.performance) are remembered for the session, not in the user's ~/.cache;
# the test processes and the pipelines they start share it. Made by the first process (xdist's workers
# inherit it) and removed by that process when the session ends.
if "CIFAR_CACHE_DIR" not in os.environ:
    os.environ["CIFAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cifar-test-cache-")
    atexit.register(shutil.rmtree, os.environ["CIFAR_CACHE_DIR"], ignore_errors=True)

import pytest

from cifar.data.synthetic import build_archive
from harness.fuzz import load_profile

load_profile()  # Hypothesis' profile for the fuzz suite (tests/test_fuzz_*.py): `ci` unless make fuzz chose `fuzz`.

# Small sizes keep the suite fast: 5 batches x 100 training images, 200 test images.
TRAIN_PER_BATCH = 100
TEST_EXAMPLES = 200


# The files that take minutes (measured: a real server, a worker, many pipeline processes), longest first:
# under `pytest -n 2 --dist loadfile` (make test) each file runs on one process, so starting these first
# keeps one long file from starting last on an otherwise idle process. Other files keep their order.
SLOWEST_FIRST = (
    "test_reliability.py",
    "test_prefect_server.py",
    "test_search.py",
    "test_multiworker.py",
    "test_continuous_training.py",
    "test_reuse_pipeline.py",  # One test of 70-110 s: started after the others, it ran last and alone.
    "test_flow_local.py",
    "test_postgres_stack.py",
    "test_resume.py",
    "test_distribute.py",
    "test_train.py",
    "test_predict.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # Stable: order within a file kept.


@pytest.fixture(scope="session")
def python_archive(tmp_path_factory) -> str:
    """A learnable CIFAR-10 look-alike in the official python-pickle layout."""
    path = tmp_path_factory.mktemp("archives") / "cifar-10-python.tar.gz"
    return str(build_archive(path, train_per_batch=TRAIN_PER_BATCH, test_examples=TEST_EXAMPLES))


@pytest.fixture(scope="session")
def binary_archive(tmp_path_factory) -> str:
    """The same images in the official binary layout."""
    path = tmp_path_factory.mktemp("archives") / "cifar-10-binary.tar.gz"
    return str(build_archive(path, train_per_batch=TRAIN_PER_BATCH, test_examples=TEST_EXAMPLES, layout="binary"))
