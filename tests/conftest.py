"""Shared fixtures: small generated archives in the official layouts, and a quiet TensorFlow."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

from cifar.data.synthetic import build_archive

# Small sizes keep the suite fast: 5 batches x 100 training images, 200 test images.
TRAIN_PER_BATCH = 100
TEST_EXAMPLES = 200


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
