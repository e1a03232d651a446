"""The images: official base images or stand-ins built from Debian's packages, then every image compose builds."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness import REPO_ROOT
from harness.compose import COMPOSE_FILE, DOCKER_DIR, interpolate
from scripts.stack_check.engine import Engine
from scripts.stack_check.report import ImageRow, Report, Row
from scripts.stack_check.shell import StepError, last_line

STANDIN_SCRIPT = REPO_ROOT / "scripts" / "standin_images.sh"
STANDIN_DEBIAN = "localhost/cifar-standin/debian:bookworm"
OFFICIAL_BASES = {
    "CIFAR_PYTHON_IMAGE": "docker.io/library/python:3.11-slim-bookworm",
    "CIFAR_POSTGRES_IMAGE": "docker.io/library/postgres:15-bookworm",
    "CIFAR_DEBIAN_IMAGE": "docker.io/library/debian:bookworm-slim",  # The proxy's base.
}
STANDIN_BASES = {
    "CIFAR_PYTHON_IMAGE": "localhost/cifar-standin/python:3.11-slim-bookworm",
    "CIFAR_POSTGRES_IMAGE": "localhost/cifar-standin/postgres:15-bookworm",
    "CIFAR_DEBIAN_IMAGE": STANDIN_DEBIAN,
}


def human_size(size: float) -> str:
    if size >= 1e9:
        return f"{size / 1e9:.2f} GB"
    if size >= 1e6:
        return f"{size / 1e6:.0f} MB"
    return f"{size / 1e3:.0f} KB"


def official_bases_pulled(engine: Engine, mode: str) -> bool:
    """Whether the official base images are here or could be pulled; BASES=official fails when not."""
    if all(engine.image_id(image) for image in OFFICIAL_BASES.values()):
        return True
    for image in OFFICIAL_BASES.values():
        result = engine("pull", "--quiet", image, check=False, timeout=120 if mode == "official" else 25)
        if result.returncode != 0:
            if mode == "official":
                raise StepError(f"cannot pull the official base images: {last_line(result.stderr)}")
            return False
    return True


def choose_bases(engine: Engine, mode: str, report: Report, row: Row) -> dict[str, str]:
    """The base images (OFFICIAL_BASES' variables): official if they can be had, else stand-ins built by
    scripts/standin_images.sh under the same contract (BASES=official|standin|auto)."""
    if mode not in ("auto", "official", "standin"):
        raise StepError(f"BASES must be auto, official or standin, not {mode!r}")
    if mode != "standin":
        if official_bases_pulled(engine, mode):
            row.detail = "official: " + ", ".join(OFFICIAL_BASES.values())
            for image in OFFICIAL_BASES.values():
                report.images.append(ImageRow(image, "registry", human_size(engine.image_size(image)), None))
            return dict(OFFICIAL_BASES)
        row.detail = "stand-ins: the official images cannot be pulled here"
    else:
        row.detail = "stand-ins (BASES=standin)"
    started = time.monotonic()
    result = engine.shell.run(["bash", STANDIN_SCRIPT], env=engine.env, timeout=1200)
    seconds = time.monotonic() - started
    engine.shell.write(result.stdout)
    sources = {
        STANDIN_DEBIAN: "mmdebstrap --variant=minbase bookworm",
        STANDIN_BASES["CIFAR_PYTHON_IMAGE"]: "docker/standins/python.Dockerfile",
        STANDIN_BASES["CIFAR_POSTGRES_IMAGE"]: "docker/standins/postgres.Dockerfile",
    }
    for index, (image, source) in enumerate(sources.items()):
        note = "all three by scripts/standin_images.sh" if index == 0 else ""
        report.images.append(
            ImageRow(image, source, human_size(engine.image_size(image)), seconds if index == 0 else None, note)
        )
    row.detail += f" ({seconds:.0f} s)"
    return dict(STANDIN_BASES)


@dataclass
class ImageBuild:
    image: str
    dockerfile: Path
    target: str | None
    args: dict[str, str]
    context: Path
    services: list[str]


def compose_builds(variables: dict[str, str]) -> list[ImageBuild]:
    """Each image docker/compose.yaml builds, from the services' own build sections (deduplicated by tag)."""
    services = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))["services"]
    builds: dict[str, ImageBuild] = {}
    for name, service in services.items():
        build = service.get("build")
        if not build:
            continue
        image = interpolate(service["image"], variables)
        context = (DOCKER_DIR / build.get("context", ".")).resolve()
        dockerfile, target = context / build["dockerfile"], build.get("target")
        args = {key: interpolate(str(value), variables) for key, value in (build.get("args") or {}).items()}
        if image in builds:
            known = builds[image]
            if (known.dockerfile, known.target, known.args) != (dockerfile, target, args):
                raise StepError(f"services {known.services[0]} and {name} build {image} differently")
            known.services.append(name)
            continue
        builds[image] = ImageBuild(image, dockerfile, target, args, context, [name])
    return list(builds.values())


def build_images(engine: Engine, variables: dict[str, str], gpu: bool, report: Report, row: Row) -> None:
    """Builds every image with its own build section; pip trusts the host's CA bundle through a build secret
    that never reaches a layer (CA_BUNDLE, default /etc/ssl/certs/ca-certificates.crt; empty: none)."""
    ca_bundle = os.environ.get("CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    secret = ["--secret", f"id=ca,src={ca_bundle}"] if ca_bundle and Path(ca_bundle).is_file() else []
    notes = []
    for build in compose_builds(variables):
        gpu_image = "gpu" in build.dockerfile.name
        target, tag = build.target, build.image
        if gpu_image and not gpu:
            # No stage of it runs here (the GPU worker is a compose profile of its own), and its dependency
            # stage cost 282 s of a Zen 3's CI. tests/test_docker_config.py checks its Dockerfile's contract.
            report.images.append(ImageRow(tag, f"{build.dockerfile.relative_to(REPO_ROOT)}", "-", None,
                                          "not built: GPU=1 builds it"))  # fmt: skip
            notes.append(f"{build.image}: not built (GPU=1)")
            continue
        argv = ["build", "-f", build.dockerfile, "-t", tag, *secret]
        if target:
            argv += ["--target", target]
        for key, value in build.args.items():
            argv += ["--build-arg", f"{key}={value}"]
        previous = engine.image_id(tag)
        started = time.monotonic()
        engine(*argv, build.context, timeout=3600)
        seconds = time.monotonic() - started
        current = engine.image_id(tag)
        if previous and current and previous != current:
            engine("rmi", previous, check=False, timeout=120)  # The superseded image; its shared layers stay.
        source = f"{build.dockerfile.relative_to(REPO_ROOT)}" + (f" --target {target}" if target else "")
        note = "cached" if previous == current else ""
        if gpu_image:
            note = f"{gpu_probe(engine, tag)}; not run on a GPU"
        report.images.append(ImageRow(tag, source, human_size(engine.image_size(tag)), seconds, note))
    row.detail = f"{len(report.images)} images; CA bundle as build secret: {'yes' if secret else 'no'}" + (
        f"; {'; '.join(notes)}" if notes else ""
    )


GPU_PROBE = """
import tensorflow as tf
info = tf.sysconfig.get_build_info()
print(f"TensorFlow {tf.__version__} for CUDA {info['cuda_version']}, cuDNN {info['cudnn_version']}; "
      f"{len(tf.config.list_physical_devices('GPU'))} GPUs visible")
"""


def gpu_probe(engine: Engine, image: str) -> str:
    """What the GPU image's TensorFlow was built for, and how many GPUs it sees (none without a GPU)."""
    result = engine("run", "--rm", "--network", "none", image, "python", "-c", GPU_PROBE, timeout=300)
    return last_line(result.stdout)
