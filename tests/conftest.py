"""Shared fixtures: small generated archives in the official layouts, and a quiet TensorFlow."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Measured precision choices (cifar.performance) are remembered for the session, not in the user's ~/.cache;
# the test processes and the pipelines they start share it. Made by the first process (xdist's workers
# inherit it) and removed by that process when the session ends.
if "CIFAR_CACHE_DIR" not in os.environ:
    os.environ["CIFAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cifar-test-cache-")
    atexit.register(shutil.rmtree, os.environ["CIFAR_CACHE_DIR"], ignore_errors=True)

# Prefect's import configures logging (logging.config.dictConfig), which closes every handler there is. The
# handler absl installs when TensorFlow is imported writes to the sys.stderr of that moment: during
# collection, pytest's capture file, which Prefect then closed, and every later test failed ("I/O operation
# on closed file") when a subset of the suite imported TensorFlow before any test imported Prefect.
import prefect.main  # noqa: F401, I001
import pytest

from cifar.data.synthetic import build_archive
from harness.fuzz import load_profile

load_profile()  # Hypothesis' profile for the fuzz suite (tests/test_fuzz_*.py): `ci` unless make fuzz chose `fuzz`.

# Small sizes keep the suite fast: 5 batches x 100 training images, 200 test images.
TRAIN_PER_BATCH = 100
TEST_EXAMPLES = 200


# How `make test` spreads the suite over its processes (`-n 2 --dist loadgroup --no-loadscope-reorder`): the
# tests of a module that share one of its module-scoped fixtures (a server, a search, three pipelines) run
# together on one process; every other test is a unit of its own, free to run on either. Units start in
# the order below, the modules that take minutes first (measured, longest first), so that no long unit
# starts last on an otherwise idle process; other modules keep their order. (xdist's own order, most
# tests first, started the 3-minute search last: 4 minutes of one busy process out of 16.)
SLOWEST_FIRST = (
    "test_search.py",
    "test_reliability.py",
    "test_prefect_server.py",
    "test_approval.py",
    "test_continuous_training.py",
    "test_multiworker.py",
    "test_reuse_pipeline.py",
    "test_flow_local.py",
    "test_resume.py",
    "test_distribute.py",
    "test_train.py",
    "test_predict.py",
)


def pytest_itemcollected(item):
    if not shares_a_module_fixture(item):
        return
    item.add_marker(pytest.mark.xdist_group(item.path.stem))
    # Set by xdist on its workers of `--dist loadgroup` (make test) only: absent in a plain `pytest tests/x.py`.
    if getattr(item.config.option, "loadgroup", False):
        # xdist 3.8 tells its scheduler the group through the node id (`path::test@group`), which it writes to
        # `item._nodeid`; pytest 9.2 keeps node ids in `item._id`, so the group never arrived and every test
        # ran as a unit of its own (a module's fixture made on both processes). Written where pytest reads it.
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{item.path.stem}")


def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # Stable: order within a file kept.


def shares_a_module_fixture(item) -> bool:
    """Whether the test uses a module-scoped fixture of its own module (made once for the module's tests)."""
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None:
        return False
    return any(
        definition.scope == "module" and definition.baseid == item.path.relative_to(item.config.rootpath).as_posix()
        for chain in definitions.name2fixturedefs.values()
        for definition in chain
    )


@pytest.fixture(autouse=True)
def float32_policy_afterwards():
    """A training in this process sets Keras's global precision policy (cifar.performance); every test leaves
    float32 behind, so none depends on which tests ran before it in the same process."""
    yield
    keras = sys.modules.get("keras")
    if keras is not None and keras.mixed_precision.global_policy().name != "float32":
        keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def stopped_after_epoch(monkeypatch):
    """`with stopped_after_epoch(n): train(...)`: the in-process training stops (KeyboardInterrupt) after epoch n's
    checkpoint, before MLflow hears of epoch n, as a kill between the two would; the context expects the stop."""
    from cifar import tracking

    @contextlib.contextmanager
    def stop(epoch: int):
        original = tracking.log_epoch_metrics

        def stops(tracking_uri, run_id, at, metrics):
            if at == epoch:
                raise KeyboardInterrupt(f"stopped after epoch {epoch}'s checkpoint")
            original(tracking_uri, run_id, at, metrics)

        monkeypatch.setattr(tracking, "log_epoch_metrics", stops)
        try:
            with pytest.raises(KeyboardInterrupt):
                yield
        finally:
            monkeypatch.setattr(tracking, "log_epoch_metrics", original)

    return stop


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
