"""The worker's setup deploys again only when the code differs (flows/worker_setup.py); against a real server in
tests/test_approval.py (its fixture), here what the digest covers."""

from __future__ import annotations

import shutil

from flows.worker_setup import CODE_DIRECTORIES, code_digest, declared_deployments
from harness import REPO_ROOT


def copy_code(target):
    shutil.copy2(REPO_ROOT / "prefect.yaml", target / "prefect.yaml")
    for name in CODE_DIRECTORIES:
        shutil.copytree(REPO_ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def test_the_digest_follows_the_code_prefect_yaml_and_the_pool_and_nothing_else(tmp_path):
    root = copy_code(tmp_path)
    digest = code_digest(root, pool="cifar-process")
    assert digest == code_digest(root, pool="cifar-process")
    assert digest != code_digest(root, pool="gpu-pool")
    (root / "README.md").write_text("not code")  # Outside what a deployment is made from.
    (root / "flows" / "__pycache__").mkdir(exist_ok=True)
    (root / "flows" / "__pycache__" / "pipeline.cpython-311.pyc").write_bytes(b"\0")
    assert code_digest(root, pool="cifar-process") == digest
    config = root / "cifar" / "config.py"  # The parameters' form is made from it.
    config.write_text(config.read_text() + "\n# a comment\n")
    changed = code_digest(root, pool="cifar-process")
    assert changed != digest
    (root / "prefect.yaml").write_text((root / "prefect.yaml").read_text().replace("0 2 * * *", "0 3 * * *"))
    assert code_digest(root, pool="cifar-process") != changed


def test_the_declared_deployments_are_prefect_yamls():
    names = declared_deployments()
    assert {"smoke", "full", "nightly", "approval-timeout", "worker"} <= names
