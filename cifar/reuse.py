"""The one rule for reusing work: a stage's key, and what the same key means.

A key hashes the content a stage reads, the config fields that shape its output and the code of every
`cifar` module it executes (found by reading the imports). Same key: the stored result, no work; another
key: a new place; `refresh`: the work again (docs/ARCHITECTURE.md, "Reuse: one rule"). Free of TensorFlow.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cifar.config import DataConfig, PipelineConfig
from cifar.data.manifest import FORMAT_VERSION
from cifar.workdir import stable_hash

PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGE = PACKAGE_DIR.name
KEY_LENGTH = 16  # Hex characters of a stage key: 64 bits, no collision among any workdir's runs.
PARSE_LOCK = threading.Lock()  # See parse_source.

# The module each stage runs; everything it imports from this package is found from there.
STAGE_MODULES = {
    "download": "cifar.data.download",
    "data": "cifar.data.prepare",
    "train": "cifar.train",
    "evaluate": "cifar.evaluate",
    "export": "cifar.export",
    "register": "cifar.registry",
    "analysis": "cifar.data.analysis",  # Not a stage: the per-part analysis the data stage and the gate keep.
}
# Training fields that do not change what is trained: how to get there, and what the folder is called.
TRAIN_FIELDS_IGNORED = {"resume", "run_name", "worker_deployment", "gang_timeout_seconds"}  # How, not what.


def module_path(module: str) -> Path | None:
    """The source file of a `cifar` module or package, or None when there is none."""
    parts = module.split(".")[1:]
    candidates = [PACKAGE_DIR.joinpath(*parts[:-1], f"{parts[-1]}.py")] if parts else []
    for candidate in (*candidates, PACKAGE_DIR.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def parse_source(source: bytes, filename: str) -> ast.Module:
    """The syntax tree of a source file, safe from threads.

    CPython 3.11 keeps the AST constructor's recursion depth per interpreter, not per thread
    (python/cpython#106905): two threads parsing at once (Prefect runs tasks in threads; TensorFlow's
    autograph parses too) can fail with `SystemError: AST constructor recursion depth mismatch`, which
    made a task's cache key fail in CI. Ours parse one at a time, and once more if another library's
    parse still raced this one (the depth is reset at the start of every parse).
    """
    with PARSE_LOCK:
        try:
            return ast.parse(source, filename=filename)
        except SystemError:
            return ast.parse(source, filename=filename)


def imported_modules(path: Path, module: str) -> set[str]:
    """The `cifar` modules a source file imports anywhere (top level or inside functions)."""
    return set(_imports_in_source(path.read_bytes(), str(path), module, path.name == "__init__.py"))


@functools.lru_cache(maxsize=512)
def _imports_in_source(source: bytes, filename: str, module: str, is_package: bool) -> frozenset[str]:
    """`imported_modules` of these bytes, remembered by content: a run asks for a key per stage, each over
    the same few dozen files (parsing them every time was ~0.5 s of every pipeline run's CPU)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(parse_source(source, filename)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # A relative import, resolved against this module's package.
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from cifar import io`.
    return frozenset(name for name in found if name == PACKAGE or name.startswith(f"{PACKAGE}."))


def module_closure(module: str) -> dict[str, Path]:
    """A module and every `cifar` module it imports, transitively, with their parent packages."""
    closure: dict[str, Path] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        path = module_path(name)
        if name in closure or path is None:
            continue
        closure[name] = path
        parents = [name.rsplit(".", depth)[0] for depth in range(1, name.count(".") + 1)]
        pending.extend([*imported_modules(path, name), *parents])
    return closure


def code_files(stage: str) -> dict[str, str]:
    """Every project module `stage` executes: its path in the package -> the SHA-256 of its source."""
    return {
        path.relative_to(PACKAGE_DIR).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in module_closure(STAGE_MODULES[stage]).values()
    }


def code_version(stage: str) -> str:
    """A hash of the source of every project module `stage` executes (their paths and bytes)."""
    return stable_hash(code_files(stage), KEY_LENGTH)


def stage_key(stage: str, **material: Any) -> str:
    """The key of `stage`: its material (content read, config fields) and its code version."""
    return stable_hash({"stage": stage, "code": code_version(stage), **material}, KEY_LENGTH)


def data_settings(data: DataConfig) -> dict[str, int | float]:
    """The data settings that shape the shards (recorded in the manifest)."""
    return {
        "validation_size": data.validation_size,
        "train_shards": data.train_shards,
        "validation_shards": data.validation_shards,
        "test_shards": data.test_shards,
        "near_duplicate_similarity": data.near_duplicate_similarity,
    }


def snapshot_key(base_sha256: str, additions: Iterable[str]) -> str:
    """A data snapshot's identity: its base archive's SHA-256 and its additions' digests, in any order."""
    return stable_hash({"base": base_sha256, "additions": sorted(set(additions))}, KEY_LENGTH)


def data_key(data: DataConfig, archive_sha256: str, additions: Iterable[str] = ()) -> str:
    """The data stage: the snapshot's content (archive and additions), the shard settings, the format and the code."""
    return stage_key(
        "data",
        archive_sha256=archive_sha256,
        additions=sorted(set(additions)),
        settings=data_settings(data),
        format=FORMAT_VERSION,
    )


def training_key(config: PipelineConfig, data_key: str) -> str:
    """The training stage: the prepared data, every training field that shapes the model, the seed."""
    train_fields = config.train.model_dump(mode="json", exclude=TRAIN_FIELDS_IGNORED)
    return stage_key("train", data=data_key, train=train_fields, seed=config.seed)


def finished_training_key(config: PipelineConfig, data_key: str) -> str:
    """Where a finished training is looked up: its key, plus the folder's name when the run is named.

    An unnamed run's folder is derived from its key; a named one (`train.run_name`) is that folder,
    and `cifar.train` reuses only a run finished there. A cache keyed on the training key alone would
    hand a named run another folder's training and leave its own folder empty.
    """
    key = training_key(config, data_key)
    return f"{key}-{config.train.run_name}" if config.train.run_name else key


def evaluation_key(config: PipelineConfig, data_key: str, checkpoints_sha256: str) -> str:
    """The evaluate stage: the test data, the checkpoints it scores (their index's digest), its settings."""
    return stage_key(
        "evaluate", data=data_key, checkpoints=checkpoints_sha256, evaluate=config.evaluate.model_dump(mode="json")
    )


def export_key(config: PipelineConfig, evaluation_key: str) -> str:
    """The export stage: the evaluated checkpoint (through the evaluation's key) and the model name."""
    return stage_key("export", evaluation=evaluation_key, model_name=config.export.model_name)


def registration_key(config: PipelineConfig, export_key: str, tracking_uri: str) -> str:
    """The register stage: the export it registers, the gate, who moves the alias and where the registry is."""
    gate = config.export.model_dump(mode="json")
    return stage_key(
        "register", export=export_key, gate=gate, approval=config.promotion.approval, tracking_uri=tracking_uri
    )
