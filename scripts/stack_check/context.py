"""What every check of the stack check is given: the settings, the engine, the stack, and what earlier checks found."""

from __future__ import annotations

import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cifar.summary import PipelineSummary
from harness import REPO_ROOT
from scripts.stack_check.engine import Engine
from scripts.stack_check.report import Report
from scripts.stack_check.shell import Shell
from scripts.stack_check.stack import Stack

# The stack's timings for the drills (docker/env.example; production keeps 10, 30 and 90 s): the same
# mechanisms, waited for sooner. A worker asks for flow runs every second; a killed worker's flow run is
# marked CRASHED 60 s after its last heartbeat (two of Prefect's shortest period, 30 s) instead of 90 s.
DRILL_TIMINGS = {"CIFAR_WORKER_POLL_SECONDS": "1", "CIFAR_HEARTBEAT_SECONDS": "30", "CIFAR_CRASHED_AFTER_SECONDS": "60"}
# The serve container's queue in the stack check (production: 512 images): the serving drill's 8 one-photo clients
# never fill it, its overload's requests of 16 photos do (scripts/stack_check/serving_drill.py).
DRILL_SERVE_SETTINGS = {"CIFAR_SERVE_MAX_QUEUED_IMAGES": "16"}

# Drills whose point is where a gate's pass leads (the remote worker's registry, a sign-off), not the comparison
# (tests/test_comparison.py has that): two 2-epoch smoke models differ by points, per class by tens of points
# (training is not bitwise repeatable), so the gate tolerates any loss. A worse challenger is refused whatever
# the tolerance when McNemar's p is below `significance`: 1e-12 refused one 9 points worse (p = 3e-73,
# 2026-11-28; 1e-102 for 13 points); below 1e-300 it takes about 20 points.
TOLERANT_GATE = {"min_improvement": -1.0, "max_class_drop": 1.0, "significance": 1e-300}
# Those drills' trainings also prove nothing by their length: epochs of 15 steps, not the smoke preset's 60 (~20 CPU-s
# less a training; evaluation and the gate still score all 10,000 test images). The smoke deployment's own run, the
# README's command, trains all 60.
SHORT_EPOCHS = {"steps_per_epoch": 15}


def flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Settings:
    """The run's settings, from the environment (ENGINE, GPU, BASES, KEEP_STACK, CIFAR_ARCHIVE)."""

    engine: str
    gpu: bool
    bases: str  # official, standin or auto: the official base images when they can be pulled.
    keep: bool  # Leave the stack up at the end.
    archive: Path
    project: str  # The throwaway compose project's name.
    scratch: Path  # Its env file and the command log.

    @classmethod
    def from_environment(cls) -> Settings:
        archive = os.environ.get("CIFAR_ARCHIVE", REPO_ROOT.parent / "shared" / "data" / "cifar-10-python.tar.gz")
        project = f"cifar-check-{secrets.token_hex(4)}"
        return cls(
            engine=os.environ.get("ENGINE", "podman"),
            gpu=flag("GPU"),
            bases=os.environ.get("BASES", "auto"),
            keep=flag("KEEP_STACK"),
            archive=Path(archive),
            project=project,
            scratch=Path(tempfile.mkdtemp(prefix=f"{project}-")),
        )


@dataclass
class Findings:
    """What one check finds that a later one reads."""

    smoke_flow_run: str = ""
    smoke_summary: PipelineSummary | None = None  # The smoke run's summary.json.
    mlflow_run_id: str = ""
    champion_version: str = ""
    artifact_files: int = 0  # Files on the mlartifacts volume after the smoke run.
    kill_last_epoch: int = 0  # The last epoch checkpointed before the worker was killed.
    kill_mlflow_run: str | None = None  # The killed training's MLflow run, which the re-runs must continue.
    stop_step: int = 0  # Where the re-run saved when its container was stopped: the step in that epoch,
    stop_epoch: int = 0  # which the next re-run must resume after.
    lost_last_epoch: int = 0  # The 2-worker job's last checkpointed epoch when its worker was killed.
    lost_mlflow_run: str = ""  # That job's MLflow run.
    lost_worker_run: str = ""  # The killed worker's flow run, to be marked CRASHED while the job runs again.
    lost_since_ms: int = 0  # When that job started (MLflow's clock): it and its re-run open one MLflow run.


@dataclass
class Context:
    settings: Settings
    shell: Shell
    report: Report
    findings: Findings = field(default_factory=Findings)
    engine: Engine | None = None  # Once the tools are there.
    bases: dict[str, str] = field(default_factory=dict)  # CIFAR_PYTHON_IMAGE, CIFAR_POSTGRES_IMAGE.
    variables: dict[str, str] = field(default_factory=dict)  # The compose project's env file.
    stack: Stack | None = None  # Once it is started.
