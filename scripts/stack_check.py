"""`make stack-check`: the production stack of docker/compose.yaml, built and run for real, end to end.

    make stack-check                 # Podman (installed with apt when missing), as CI runs it
    ENGINE=docker make stack-check   # Docker Engine with the compose plugin
    GPU=1 make stack-check           # also builds docker/Dockerfile.gpu's CUDA layer (~2.7 GB of wheels)

What it does, in order, and what each line of its closing table means:

1. Tools: podman, runc, netavark, aardvark-dns, iptables, catatonit and mmdebstrap from apt when missing,
   and podman-compose (PyPI) in its own venv, `.venv/stack-tools`. Podman's settings are the project's
   (docker/podman/containers.conf, through CONTAINERS_CONF); nothing in /etc changes.
2. Base images: the official ones when they can be pulled, else stand-ins built from Debian's packages
   (scripts/standin_images.sh) under the same contract (BASES=official|standin|auto, default auto).
3. Images: every image docker/compose.yaml builds, with its own build sections (Dockerfile, target,
   args); pip trusts the host's CA bundle through a build secret that never reaches a layer
   (CA_BUNDLE, default /etc/ssl/certs/ca-certificates.crt; empty to pass none). Size and build time.
4. The stack: docker/compose.yaml itself, as a throwaway compose project (its own containers, volumes
   and network) with a generated password, free 127.0.0.1 ports and the archive's directory as the
   workers' read-only /data. Health checks are run by this script where the engine does not run them
   (Podman without systemd), and services start in dependency order, each once the ones it needs are
   healthy (podman-compose does not wait for `service_healthy`).
5. The checks, all through the containers and the servers' APIs: the smoke deployment on the real
   archive; its flow run in Prefect's PostgreSQL database, its MLflow run, metrics, `champion` alias and
   artifacts on the `mlartifacts` volume; the stack stopped and started again; the champion served by
   the runtime image (the compose `serve` profile) answering 3 real test images as the SavedModel does;
   a worker killed in the middle of training (the run ends CRASHED, a re-run resumes from its last
   checkpoint); two workers running a 4-trial search two at a time; every process unprivileged and
   only 127.0.0.1 ports published.
6. Teardown of everything the run made (containers, volumes, networks, pods), also after a failure,
   and a check that nothing is left. Images stay: they are the build cache of the next run.

A failed step ends the run (the rest is marked "not run"); the full command log is kept and its path
printed. KEEP_STACK=1 leaves the stack up for a look (then: podman-compose -p NAME down -v).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCKER_DIR = REPO_ROOT / "docker"
COMPOSE_FILE = DOCKER_DIR / "compose.yaml"
PODMAN_CONF = DOCKER_DIR / "podman" / "containers.conf"
STANDIN_SCRIPT = REPO_ROOT / "scripts" / "standin_images.sh"
TOOLS_VENV = REPO_ROOT / ".venv" / "stack-tools"
PODMAN_COMPOSE_SPEC = "podman-compose==1.6.0"
APT_PACKAGES = ("podman", "runc", "netavark", "aardvark-dns", "iptables", "catatonit", "mmdebstrap")

OFFICIAL_BASES = {
    "CIFAR_PYTHON_IMAGE": "docker.io/library/python:3.11-slim-bookworm",
    "CIFAR_POSTGRES_IMAGE": "docker.io/library/postgres:15-bookworm",
}
STANDIN_BASES = {
    "CIFAR_PYTHON_IMAGE": "localhost/cifar-standin/python:3.11-slim-bookworm",
    "CIFAR_POSTGRES_IMAGE": "localhost/cifar-standin/postgres:15-bookworm",
}
STANDIN_DEBIAN = "localhost/cifar-standin/debian:bookworm"

DATA_MOUNT = "/data"  # Where compose mounts CIFAR_DATA_DIR in the workers.
WORKDIR = "/app/workdir"  # The `workdir` volume in the workers.
ARTIFACTS = "/srv/mlartifacts"  # The `mlartifacts` volume in the MLflow server.
MODEL_NAME = "cifar10"
EXPERIMENT = "cifar10"
KILL_RUN_NAME = "stack-check-kill"
ZOMBIE_AUTOMATION = "cifar: crash flow runs whose heartbeats stopped"
UNPRIVILEGED = {"cifar", "postgres"}  # Users the images run as (uid 1000 and the postgres image's 999).

CHECKS = (
    "tools",
    "base images",
    "images built",
    "stack up, every service healthy",
    "cifar/smoke on the archive, through the worker",
    "flow run in Prefect's PostgreSQL",
    "MLflow run, metrics, champion, artifacts",
    "stack stopped and started: all still there",
    "served champion = reloaded SavedModel",
    "worker killed mid-training: CRASHED",
    "re-run resumes from the last checkpoint",
    "2 workers: 4-trial search, parallel 2",
    "processes unprivileged, ports on 127.0.0.1",
    "teardown: nothing left behind",
)


class StepError(RuntimeError):
    """A step of the check that did not do what it must; its message goes into the table."""


# --- Running commands, with a log -----------------------------------------------------------------------


class Log:
    """Every command, its output and exit status, with secrets redacted."""

    def __init__(self, path: Path):
        self.path = path
        self.handle = open(path, "w", encoding="utf-8")
        os.chmod(path, 0o600)
        self.secrets: list[str] = []

    def write(self, text: str) -> None:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        self.handle.write(text)
        self.handle.flush()


LOG: Log


def run(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 600,
    input: str | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    argv = [str(word) for word in argv]
    started = time.monotonic()
    LOG.write(f"\n[{datetime.now():%H:%M:%S}] $ {shlex.join(argv)}\n")
    try:
        result = subprocess.run(
            argv, env=env, cwd=cwd, input=input, capture_output=True, text=True, timeout=timeout, errors="replace"
        )
    except subprocess.TimeoutExpired as error:
        LOG.write(f"{error.stdout or ''}{error.stderr or ''}[timed out after {timeout:.0f}s]\n")
        raise StepError(f"`{short(argv)}` did not finish in {timeout:.0f}s") from None
    LOG.write(f"{result.stdout}{result.stderr}[exit {result.returncode}, {time.monotonic() - started:.1f}s]\n")
    if check and result.returncode != 0:
        raise StepError(f"`{short(argv)}` exited {result.returncode}: {last_line(result.stderr or result.stdout)}")
    return result


def short(argv: list[str]) -> str:
    text = shlex.join(argv[:6]) + (" ..." if len(argv) > 6 else "")
    return text if len(text) < 140 else text[:137] + "..."


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def wait_until(what: str, probe, timeout: float, interval: float = 2.0):
    """Calls `probe()` until it returns something truthy; that value, or StepError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise StepError(f"{what}: not after {timeout:.0f}s")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def human_size(size: float) -> str:
    if size >= 1e9:
        return f"{size / 1e9:.2f} GB"
    if size >= 1e6:
        return f"{size / 1e6:.0f} MB"
    return f"{size / 1e3:.0f} KB"


# --- The report -----------------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    status: str = "not run"
    detail: str = ""
    seconds: float | None = None


@dataclass
class ImageRow:
    image: str
    source: str
    size: str
    seconds: float | None
    note: str = ""


@dataclass
class Report:
    engine: str
    checks: dict[str, Check] = field(default_factory=lambda: {name: Check(name) for name in CHECKS})
    images: list[ImageRow] = field(default_factory=list)
    facts: list[tuple[str, str]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @contextlib.contextmanager
    def check(self, name: str) -> Iterator[Check]:
        entry = self.checks[name]
        started = time.monotonic()
        print(f"[{datetime.now():%H:%M:%S}] {name} ...", flush=True)
        try:
            yield entry
        except BaseException as error:
            entry.status = "FAILED"
            message = str(error) or type(error).__name__
            entry.detail = f"{entry.detail}; {message}" if entry.detail else message
            raise
        else:
            entry.status = "ok"
        finally:
            entry.seconds = time.monotonic() - started
            print(f"[{datetime.now():%H:%M:%S}]   {entry.status}: {entry.detail}", flush=True)

    def render(self) -> str:
        lines = [f"make stack-check ({self.engine}): {time.monotonic() - self.started:.0f} s in all", ""]
        if self.images:
            rows = [("image", "built from", "size", "build time", "")]
            for image in self.images:
                seconds = f"{image.seconds:.0f} s" if image.seconds is not None else "-"
                rows.append((image.image, image.source, image.size, seconds, image.note))
            lines += table(rows) + [""]
        rows = [("check", "result", "time", "detail")]
        for entry in self.checks.values():
            seconds = f"{entry.seconds:.0f} s" if entry.seconds is not None else ""
            rows.append((entry.name, entry.status, seconds, entry.detail))
        lines += table(rows)
        if self.answers:
            lines += ["", "Served answers (3 CIFAR-10 test images):"]
            rows = [("test image", "label", "served", "SavedModel", "served p", "SavedModel p")]
            for answer in self.answers:
                rows.append(
                    (
                        f"#{answer['index']}",
                        answer["label"],
                        answer["served"],
                        answer["saved_model"],
                        f"{answer['served_p']:.6f}",
                        f"{answer['saved_model_p']:.6f}",
                    )
                )
            lines += table(rows)
        if self.facts:
            lines += [""] + [f"{name}: {value}" for name, value in self.facts]
        return "\n".join(lines)


def table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    widths[-1] = 0  # The last column runs on.
    out = []
    for index, row in enumerate(rows):
        out.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if index == 0:
            out.append("  ".join("-" * max(width, len(cell)) for cell, width in zip(row, widths)))
    return out


# --- The engine -----------------------------------------------------------------------------------------


class Engine:
    """`podman` or `docker`, with the project's settings."""

    def __init__(self, name: str):
        if name not in ("podman", "docker"):
            raise StepError(f"ENGINE must be podman or docker, not {name!r}")
        self.name = name
        self.env = dict(os.environ)
        if name == "podman":
            self.env.setdefault("CONTAINERS_CONF", str(PODMAN_CONF))
        else:
            self.env["DOCKER_BUILDKIT"] = "1"  # Build secrets need BuildKit.

    def __call__(self, *args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return run([self.name, *args], env=kwargs.pop("env", self.env), **kwargs)

    def compose_command(self) -> list[str]:
        if self.name == "podman":
            return [str(TOOLS_VENV / "bin" / "podman-compose")]
        return ["docker", "compose"]

    def image_id(self, image: str) -> str | None:
        result = self("image", "inspect", "--format", "{{.Id}}", image, check=False, timeout=60)
        return result.stdout.strip() if result.returncode == 0 else None

    def image_size(self, image: str) -> int:
        return int(self("image", "inspect", "--format", "{{.Size}}", image, timeout=60).stdout.strip())


def dpkg_installed(package: str) -> bool:
    if not shutil.which("dpkg-query"):
        return False
    result = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return result.returncode == 0 and "install ok installed" in result.stdout


def install_tools(engine: Engine, entry: Check, need_mmdebstrap: bool) -> None:
    installed = []
    if engine.name == "podman":
        wanted = [package for package in APT_PACKAGES if package != "mmdebstrap" or need_mmdebstrap]
        missing = [package for package in wanted if not dpkg_installed(package)]
        if missing and shutil.which("podman") and not shutil.which("apt-get"):
            missing = []  # Not Debian: podman is there; trust the machine's own packaging.
        if missing:
            if os.geteuid() != 0 or not shutil.which("apt-get"):
                raise StepError(f"missing {' '.join(missing)}: install them (apt-get install) or run as root")
            apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            run(["apt-get", "update", "-qq"], env=apt_env, timeout=600)
            run(["apt-get", "install", "-y", "-qq", *missing], env=apt_env, timeout=1200)
            installed += missing
        if not (TOOLS_VENV / "bin" / "podman-compose").is_file():
            run([sys.executable, "-m", "venv", TOOLS_VENV], timeout=300)
            run([TOOLS_VENV / "bin" / "pip", "install", "--quiet", PODMAN_COMPOSE_SPEC], timeout=600)
            installed.append(PODMAN_COMPOSE_SPEC)
        version = engine("--version", timeout=60).stdout.strip()
        compose_version = run([*engine.compose_command(), "--version"], env=engine.env, timeout=60)
        compose_version = compose_version.stdout.strip().splitlines()[0]
        entry.detail = f"{version}, {compose_version}, runtime runc (docker/podman/containers.conf)"
    else:
        if engine("info", check=False, timeout=60).returncode != 0:
            raise StepError("`docker info` fails: start the Docker daemon (ENGINE=docker needs Docker Engine)")
        version = engine("version", "--format", "{{.Server.Version}}", timeout=60).stdout.strip()
        compose_version = engine("compose", "version", "--short", timeout=60).stdout.strip()
        entry.detail = f"Docker {version}, compose {compose_version}"
        if need_mmdebstrap and not shutil.which("mmdebstrap"):
            if os.geteuid() != 0 or not shutil.which("apt-get"):
                raise StepError("mmdebstrap is missing (needed for the stand-in base images)")
            apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            run(["apt-get", "update", "-qq"], env=apt_env, timeout=600)
            run(["apt-get", "install", "-y", "-qq", "mmdebstrap"], env=apt_env, timeout=1200)
            installed.append("mmdebstrap")
    if installed:
        entry.detail += f"; installed {', '.join(installed)}"


def choose_bases(engine: Engine, mode: str, report: Report, entry: Check) -> dict[str, str]:
    """The base images for CIFAR_PYTHON_IMAGE / CIFAR_POSTGRES_IMAGE: official if they can be had, else stand-ins."""
    if mode not in ("auto", "official", "standin"):
        raise StepError(f"BASES must be auto, official or standin, not {mode!r}")
    if mode != "standin":
        present = all(engine.image_id(image) for image in OFFICIAL_BASES.values())
        pulled = present
        if not present:
            reasons = []
            for image in OFFICIAL_BASES.values():
                result = engine("pull", "--quiet", image, check=False, timeout=120 if mode == "official" else 25)
                if result.returncode != 0:
                    reasons.append(last_line(result.stderr))
                    break
            pulled = not reasons
            if not pulled and mode == "official":
                raise StepError(f"cannot pull the official base images: {reasons[0]}")
        if pulled:
            entry.detail = "official: " + ", ".join(OFFICIAL_BASES.values())
            for image in OFFICIAL_BASES.values():
                report.images.append(ImageRow(image, "registry", human_size(engine.image_size(image)), None))
            return dict(OFFICIAL_BASES)
        entry.detail = "stand-ins: the official images cannot be pulled here"
    else:
        entry.detail = "stand-ins (BASES=standin)"
    started = time.monotonic()
    result = run(["bash", STANDIN_SCRIPT], env=engine.env, timeout=1200)
    seconds = time.monotonic() - started
    LOG.write(result.stdout)
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
    entry.detail += f" ({seconds:.0f} s)"
    return dict(STANDIN_BASES)


# --- The compose file -----------------------------------------------------------------------------------


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-?])([^}]*))?\}")


def interpolate(text: str, variables: dict[str, str]) -> str:
    def substitute(match: re.Match) -> str:
        name, operator, argument = match.groups()
        value = variables.get(name)
        if value:
            return value
        if operator == "-":
            return argument
        if operator == "?":
            raise StepError(f"{name} is required: {argument}")
        return ""

    return _VARIABLE.sub(substitute, text)


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
        image = service["image"]
        context = (DOCKER_DIR / build.get("context", ".")).resolve()
        args = {key: interpolate(str(value), variables) for key, value in (build.get("args") or {}).items()}
        if image in builds:
            known = builds[image]
            if (known.dockerfile, known.target, known.args) != (
                context / build["dockerfile"],
                build.get("target"),
                args,
            ):
                raise StepError(f"services {known.services[0]} and {name} build {image} differently")
            known.services.append(name)
            continue
        builds[image] = ImageBuild(image, context / build["dockerfile"], build.get("target"), args, context, [name])
    return list(builds.values())


def build_images(engine: Engine, variables: dict[str, str], gpu: bool, report: Report, entry: Check) -> None:
    ca_bundle = os.environ.get("CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    secret = ["--secret", f"id=ca,src={ca_bundle}"] if ca_bundle and Path(ca_bundle).is_file() else []
    notes = []
    for build in compose_builds(variables):
        gpu_image = "gpu" in build.dockerfile.name
        target = build.target
        tag = build.image
        if gpu_image and not gpu:
            # Everything but the CUDA layer and the code: the stages shared with the CPU image.
            target, tag = "dependencies", build.image.replace(":latest", ":dependencies")
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
        if gpu_image and not gpu:
            note = "CUDA layer and code not built (GPU=1 builds them)"
            notes.append(f"{build.image}: to stage `dependencies` only")
        elif gpu_image:
            note = f"{gpu_probe(engine, tag)}; not run on a GPU"
        report.images.append(ImageRow(tag, source, human_size(engine.image_size(tag)), seconds, note))
    entry.detail = f"{len(report.images)} images; CA bundle as build secret: {'yes' if secret else 'no'}" + (
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


# --- The stack ------------------------------------------------------------------------------------------


class Stack:
    """One compose project of docker/compose.yaml, its containers, and the servers' APIs."""

    def __init__(self, engine: Engine, project: str, env_file: Path, variables: dict[str, str]):
        self.engine = engine
        self.project = project
        self.env_file = env_file
        self.variables = variables
        self.prefect_url = f"http://127.0.0.1:{variables['PREFECT_HOST_PORT']}/api"
        self.mlflow_url = f"http://127.0.0.1:{variables['MLFLOW_HOST_PORT']}"
        self.serve_url = f"http://127.0.0.1:{variables['SERVE_HOST_PORT']}"

    def set_variable(self, name: str, value: str) -> None:
        """Changes one variable of the compose project's env file (the next `up` recreates what it changes)."""
        self.variables[name] = value
        write_env_file(self.env_file, self.variables)

    def compose(self, *args: str, profiles: tuple[str, ...] = (), timeout: float = 900, check: bool = True):
        argv = [*self.engine.compose_command(), "--env-file", self.env_file, "-p", self.project, "-f", COMPOSE_FILE]
        for profile in profiles:
            argv += ["--profile", profile]
        return run([*argv, *args], env=self.engine.env, timeout=timeout, check=check, cwd=REPO_ROOT)

    def containers(self, service: str | None = None, all: bool = True) -> list[str]:
        argv = ["ps", "--format", "{{.Names}}", "--filter", f"label=com.docker.compose.project={self.project}"]
        if all:
            argv.append("-a")
        if service:
            argv += ["--filter", f"label=com.docker.compose.service={service}"]
        return sorted(line for line in self.engine(*argv, timeout=60).stdout.split() if line)

    def container(self, service: str, index: int = 0) -> str:
        names = self.containers(service)
        if len(names) <= index:
            raise StepError(f"no container {index + 1} of service {service}")
        return names[index]

    def exec(self, service: str, *argv: str, index: int = 0, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        interactive = ["-i"] if kwargs.get("input") is not None else []
        return self.engine("exec", *interactive, self.container(service, index), *argv, **kwargs)

    def state(self, container: str) -> str:
        result = self.engine("inspect", "--format", "{{.State.Status}}", container, check=False, timeout=60)
        return result.stdout.strip() if result.returncode == 0 else "missing"

    def healthy(self, container: str) -> bool:
        if self.engine.name == "podman":  # No systemd timers here: run the container's health check now.
            return self.engine("healthcheck", "run", container, check=False, timeout=60).returncode == 0
        status = self.engine("inspect", "--format", "{{.State.Health.Status}}", container, check=False, timeout=60)
        return status.stdout.strip() == "healthy"

    def wait_healthy(self, services: list[str], timeout: float) -> None:
        containers = [name for service in services for name in self.containers(service)]
        if not containers:
            raise StepError(f"no containers for {', '.join(services)}")
        deadline = time.monotonic() + timeout
        waiting = list(containers)
        while waiting:
            for container in list(waiting):
                if self.healthy(container):
                    waiting.remove(container)
                elif self.state(container) in ("exited", "dead", "missing"):
                    logs = self.engine("logs", "--tail", "30", container, check=False, timeout=60)
                    raise StepError(f"{container} stopped: {last_line(logs.stdout + logs.stderr)}")
            if waiting and time.monotonic() > deadline:
                raise StepError(f"not healthy after {timeout:.0f}s: {', '.join(waiting)}")
            if waiting:
                time.sleep(3)

    def up(self) -> float:
        """Starts the stack in dependency order, each service once the ones it needs are healthy."""
        started = time.monotonic()
        self.compose("up", "-d", "postgres")
        self.wait_healthy(["postgres"], 180)
        self.compose("up", "-d", "prefect-server", "mlflow")
        self.wait_healthy(["prefect-server", "mlflow"], 420)
        self.compose("up", "-d", "worker")
        self.wait_healthy(["worker"], 600)
        return time.monotonic() - started

    def down(self, volumes: bool = False) -> None:
        args = ["down", "--timeout", "20"] + (["-v"] if volumes else [])
        self.compose(*args, profiles=("serve",), timeout=600)

    # The servers' REST APIs, on their published 127.0.0.1 ports.

    def http(self, method: str, url: str, body: Any = None, timeout: float = 60) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read().decode("utf-8")
        except urllib.error.HTTPError as error:
            raise StepError(f"{method} {url}: HTTP {error.code} {error.read()[:300]!r}") from None
        return json.loads(text) if text else None

    def prefect(self, method: str, path: str, body: Any = None) -> Any:
        return self.http(method, self.prefect_url + path, body)

    def mlflow(self, path: str, **query: str) -> Any:
        return self.http("GET", f"{self.mlflow_url}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(query)}")

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        return self.prefect("GET", f"/flow_runs/{flow_run_id}")

    def flow_run_logs(self, flow_run_id: str) -> list[str]:
        messages, offset = [], 0
        while True:
            page = self.prefect(
                "POST",
                "/logs/filter",
                {
                    "logs": {"flow_run_id": {"any_": [flow_run_id]}},
                    "sort": "TIMESTAMP_ASC",
                    "limit": 200,
                    "offset": offset,
                },
            )
            messages += [entry["message"] for entry in page]
            if len(page) < 200:
                return messages
            offset += 200

    def psql(self, database: str, sql: str) -> list[list[str]]:
        user = self.variables.get("POSTGRES_USER") or "cifar"
        result = self.exec("postgres", "psql", "-U", user, "-d", database, "-tAqF", "\t", "-c", sql, timeout=60)
        return [line.split("\t") for line in result.stdout.splitlines() if line.strip()]

    def read_json(self, service: str, path: str, index: int = 0) -> Any:
        result = self.exec(service, "cat", path, index=index, check=False, timeout=60)
        if result.returncode != 0:
            return None
        try:
            return json.loads(result.stdout)
        except json.JSONDecodeError:
            return None

    def deployment_run(
        self, deployment: str, parameters: dict[str, Any], *, watch: bool, timeout: float = 1500, index: int = 0
    ) -> str:
        """`prefect deployment run` inside a worker container; the flow run's id."""
        argv = ["prefect", "deployment", "run", deployment, "--params", json.dumps(parameters)]
        if watch:
            argv += ["--watch", "--watch-timeout", str(int(timeout))]
        result = self.exec("worker", *argv, index=index, check=False, timeout=timeout + 120)
        found = re.search(r"UUID:\s*([0-9a-f-]{36})", result.stdout)
        if not found:
            raise StepError(f"`prefect deployment run {deployment}` made no flow run: {last_line(result.stderr)}")
        return found.group(1)

    def wait_flow_run(self, flow_run_id: str, states: set[str], timeout: float) -> dict[str, Any]:
        final = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}

        def probe():
            run = self.flow_run(flow_run_id)
            state = run["state"]["type"]
            if state in states:
                return run
            if state in final:
                raise StepError(f"flow run {run['name']} ended {state}: {run['state'].get('message')}")
            return None

        return wait_until(f"flow run {flow_run_id} in {'/'.join(sorted(states))}", probe, timeout, interval=3)


# --- The checks -----------------------------------------------------------------------------------------


def archive_parameters(archive: Path) -> dict[str, Any]:
    return {"source": f"{DATA_MOUNT}/{archive.name}", "sha256": archive_sha256(archive)}


def archive_sha256(archive: Path) -> str:
    recorded = archive.with_name(archive.name + ".sha256")
    if recorded.is_file():
        return recorded.read_text(encoding="utf-8").split()[0]
    import hashlib

    digest = hashlib.sha256()
    with open(archive, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def test_images(archive: Path, count: int) -> tuple[np.ndarray, list[int], list[str]]:
    """The first `count` images of the archive's test batch (uint8 [N, 32, 32, 3]), their labels, class names.

    Read as the pipeline reads archives: the restricted unpickler, shapes and labels checked.
    """
    from cifar.data.archive import read_archive

    raw = read_archive(archive)
    labels = [int(label) for label in raw.test_labels[:count]]
    return np.ascontiguousarray(raw.test_images[:count]), labels, list(raw.class_names)


SAVED_MODEL_PREDICT = """
import json, sys
import numpy as np, tensorflow as tf
from cifar.export import INPUT_NAME, SERVING_SIGNATURE
request = json.load(sys.stdin)
serve = tf.saved_model.load(request["export_dir"]).signatures[SERVING_SIGNATURE]
outputs = serve(**{INPUT_NAME: tf.constant(np.array(request["images"], dtype=np.uint8))})
print(json.dumps({"class_ids": outputs["class_ids"].numpy().tolist(),
                  "probabilities": outputs["probabilities"].numpy().tolist()}))
"""


def check_smoke_run(stack: Stack, archive: Path, entry: Check, context: dict[str, Any]) -> None:
    parameters = {"config": {"preset": "smoke", "data": archive_parameters(archive)}}
    started = time.monotonic()
    flow_run_id = stack.deployment_run("cifar/smoke", parameters, watch=True)
    run = stack.wait_flow_run(flow_run_id, {"COMPLETED"}, timeout=120)
    summary = stack.read_json("worker", f"{WORKDIR}/summary.json")
    if not summary or summary.get("preset") != "smoke":
        raise StepError("no smoke summary.json on the workdir volume")
    context.update(smoke_flow_run=flow_run_id, smoke_summary=summary)
    entry.detail = (
        f"flow run {run['name']} COMPLETED in {time.monotonic() - started:.0f} s; "
        f"test accuracy {summary['test_accuracy']:.4f}, export v{summary['export_version']}, "
        f"registry v{summary.get('registered_model_version')} champion={summary.get('champion')}"
    )


def check_prefect_database(stack: Stack, entry: Check, context: dict[str, Any]) -> None:
    flow_run_id = context["smoke_flow_run"]
    api_state = stack.flow_run(flow_run_id)["state"]["type"]
    database = stack.variables.get("CIFAR_PREFECT_DB") or "prefect"
    rows = stack.psql(
        database,
        "SELECT fr.state_type, f.name, d.name FROM flow_run fr JOIN flow f ON f.id = fr.flow_id "
        f"JOIN deployment d ON d.id = fr.deployment_id WHERE fr.id = '{flow_run_id}'",
    )
    if api_state != "COMPLETED" or rows != [["COMPLETED", "cifar", "smoke"]]:
        raise StepError(f"API says {api_state}, PostgreSQL has {rows}")
    automations = stack.prefect("POST", "/automations/filter", {})
    if not any(automation["name"] == ZOMBIE_AUTOMATION for automation in automations):
        raise StepError("the worker did not create the zombie flow run automation")
    entry.detail = f"API and table flow_run in database {database}: COMPLETED (cifar/smoke); zombie automation present"


def check_mlflow(stack: Stack, entry: Check, context: dict[str, Any], report: Report) -> None:
    summary = context["smoke_summary"]
    run_id = summary["mlflow_run_id"]
    run = stack.mlflow("runs/get", run_id=run_id)["run"]
    metrics = {metric["key"]: metric["value"] for metric in run["data"].get("metrics", [])}
    if run["info"]["status"] != "FINISHED" or "test_accuracy" not in metrics:
        raise StepError(f"MLflow run {run_id}: {run['info']['status']}, metrics {sorted(metrics)}")
    if abs(metrics["test_accuracy"] - summary["test_accuracy"]) > 1e-6:
        raise StepError(
            f"MLflow has test_accuracy {metrics['test_accuracy']}, the run wrote {summary['test_accuracy']}"
        )
    champion = stack.mlflow("registered-models/alias", name=MODEL_NAME, alias="champion")["model_version"]
    if champion["run_id"] != run_id:
        raise StepError(f"champion v{champion['version']} is from run {champion['run_id']}, not {run_id}")
    artifacts = stack.mlflow("artifacts/list", run_id=run_id).get("files", [])
    if not artifacts:
        raise StepError("the run lists no artifacts")
    experiment_id = run["info"]["experiment_id"]
    database = stack.variables.get("CIFAR_MLFLOW_DB") or "mlflow"
    stored = stack.psql(database, f"SELECT value FROM metrics WHERE run_uuid = '{run_id}' AND key = 'test_accuracy'")
    aliased = stack.psql(database, f"SELECT version FROM registered_model_aliases WHERE name = '{MODEL_NAME}'")
    if not stored or abs(float(stored[0][0]) - metrics["test_accuracy"]) > 1e-6 or aliased != [[champion["version"]]]:
        raise StepError(f"PostgreSQL database {database} holds {stored} and alias {aliased}")
    files = stack.exec("mlflow", "find", f"{ARTIFACTS}/{experiment_id}", "-type", "f", timeout=60).stdout.split()
    model_files = [path for path in files if path.endswith(("/MLmodel", "/saved_model.pb"))]
    run_files = [path for path in files if f"/{run_id}/" in path]
    if len(model_files) < 2 or not run_files:
        raise StepError(f"{ARTIFACTS} on the volume holds {len(files)} files, no logged model or run artifacts")
    context.update(mlflow_run_id=run_id, champion_version=champion["version"], artifact_files=len(files))
    accuracy = f"{metrics['test_accuracy']:.4f}"
    report.facts.append(("Smoke run's test accuracy, read back from the containerised MLflow", accuracy))
    entry.detail = (
        f"run {run['info']['run_name']} FINISHED, test_accuracy {metrics['test_accuracy']:.4f} (also in "
        f"PostgreSQL), champion v{champion['version']}, {len(artifacts)} run artifact entries, {len(files)} files "
        f"on the mlartifacts volume (MLmodel + saved_model.pb)"
    )


def check_restart(stack: Stack, entry: Check, context: dict[str, Any]) -> None:
    started = time.monotonic()
    stack.down()
    if stack.containers():
        raise StepError(f"containers left after down: {stack.containers()}")
    stack.up()
    pause_nightly(stack)
    run = stack.flow_run(context["smoke_flow_run"])
    mlflow_run = stack.mlflow("runs/get", run_id=context["mlflow_run_id"])["run"]
    champion = stack.mlflow("registered-models/alias", name=MODEL_NAME, alias="champion")["model_version"]
    experiment_id = mlflow_run["info"]["experiment_id"]
    files = stack.exec("mlflow", "find", f"{ARTIFACTS}/{experiment_id}", "-type", "f", timeout=60).stdout.split()
    if (
        run["state"]["type"] != "COMPLETED"
        or mlflow_run["info"]["status"] != "FINISHED"
        or champion["version"] != context["champion_version"]
        or len(files) != context["artifact_files"]
        or not stack.read_json("worker", f"{WORKDIR}/summary.json")
    ):
        raise StepError("something is missing after the restart")
    entry.detail = (
        f"down (containers removed, volumes kept) and up again in {time.monotonic() - started:.0f} s: flow run "
        f"COMPLETED, MLflow run FINISHED, champion v{champion['version']}, {len(files)} artifact files, workdir"
    )


def check_serving(stack: Stack, archive: Path, entry: Check, context: dict[str, Any], report: Report) -> None:
    started = time.monotonic()
    stack.compose("up", "-d", "serve", profiles=("serve",))
    images, labels, names = test_images(archive, 100)
    export_dir = context["smoke_summary"]["export_dir"]
    request = json.dumps({"export_dir": export_dir, "images": images.tolist()})
    reloaded = json.loads(stack.exec("worker", "python", "-c", SAVED_MODEL_PREDICT, input=request, timeout=300).stdout)
    correct = [index for index in range(len(labels)) if reloaded["class_ids"][index] == labels[index]]
    if len(correct) < 3:
        raise StepError(f"the SavedModel gets only {len(correct)} of the first 100 test images right")
    chosen = correct[:3]
    stack.wait_healthy(["serve"], 420)
    body = {"inputs": images[chosen].tolist()}
    served = stack.http("POST", f"{stack.serve_url}/invocations", body)
    predictions = served.get("predictions", served)
    for position, index in enumerate(chosen):
        served_id = int(predictions["class_ids"][position])
        served_p = float(predictions["probabilities"][position][served_id])
        saved_p = float(reloaded["probabilities"][index][served_id])
        report.answers.append(
            {
                "index": index,
                "label": names[labels[index]],
                "served": str(predictions["class_names"][position]),
                "saved_model": names[reloaded["class_ids"][index]],
                "served_p": served_p,
                "saved_model_p": saved_p,
            }
        )
        if (
            served_id != reloaded["class_ids"][index]
            or served_id != labels[index]
            or predictions["class_names"][position] != names[served_id]
        ):
            raise StepError(f"test image #{index}: served {served_id}, SavedModel {reloaded['class_ids'][index]}")
        gap = max(abs(a - b) for a, b in zip(predictions["probabilities"][position], reloaded["probabilities"][index]))
        if gap > 1e-4:
            raise StepError(f"test image #{index}: probabilities differ by {gap}")
    entry.detail = (
        f"`mlflow models serve` of models:/{MODEL_NAME}@champion in the runtime image (compose profile serve), "
        f"test images #{', #'.join(map(str, chosen))}: served = SavedModel {export_dir.rsplit('/', 1)[-1]} "
        f"= label ({time.monotonic() - started:.0f} s)"
    )


def kill_parameters(archive: Path) -> dict[str, Any]:
    config = {"preset": "smoke", "data": archive_parameters(archive), "train": {"epochs": 4, "run_name": KILL_RUN_NAME}}
    return {"config": config, "until": "train"}


def check_kill(stack: Stack, archive: Path, entry: Check, context: dict[str, Any]) -> None:
    run_dir = f"{WORKDIR}/runs/{KILL_RUN_NAME}"
    flow_run_id = stack.deployment_run("cifar/smoke", kill_parameters(archive), watch=False)
    stack.wait_flow_run(flow_run_id, {"RUNNING"}, timeout=300)

    def first_checkpoint():
        index = stack.read_json("worker", f"{run_dir}/checkpoints/index.json")
        return index if index and index.get("entries") else None

    wait_until("the first checkpoint of the drill", first_checkpoint, timeout=600, interval=1)
    state_before = stack.read_json("worker", f"{run_dir}/state.json") or {}
    worker = stack.container("worker")
    stack.engine("kill", worker, timeout=60)  # SIGKILL: the worker and its flow run's process die at once.
    killed_at = time.monotonic()
    if stack.state(worker) != "running":  # restart: unless-stopped may already have started it again.
        stack.engine("start", worker, timeout=120)
    stack.wait_healthy(["worker"], 600)
    pause_nightly(stack)
    index = stack.read_json("worker", f"{run_dir}/checkpoints/index.json")
    last_epoch = max(item["epoch"] for item in index["entries"])
    if last_epoch >= 4:
        raise StepError("training had finished before the kill: nothing to resume")
    run = stack.wait_flow_run(flow_run_id, {"CRASHED"}, timeout=420)
    crashed_after = time.monotonic() - killed_at
    context.update(
        kill_flow_run=flow_run_id, kill_last_epoch=last_epoch, kill_mlflow_run=state_before.get("mlflow_run_id")
    )
    entry.detail = (
        f"container killed after epoch {last_epoch} of 4 was checkpointed; flow run {run['name']} CRASHED "
        f"{crashed_after:.0f} s later ({run['state'].get('message')})"
    )


def check_resume(stack: Stack, archive: Path, entry: Check, context: dict[str, Any]) -> None:
    flow_run_id = stack.deployment_run("cifar/smoke", kill_parameters(archive), watch=True)
    stack.wait_flow_run(flow_run_id, {"COMPLETED"}, timeout=120)
    last_epoch = context["kill_last_epoch"]
    wanted = f"resuming {KILL_RUN_NAME} after epoch {last_epoch}"

    def logged():
        return any(wanted in message for message in stack.flow_run_logs(flow_run_id))

    wait_until(f"the log line '{wanted}'", logged, timeout=60, interval=3)
    run_dir = f"{WORKDIR}/runs/{KILL_RUN_NAME}"
    history = stack.read_json("worker", f"{run_dir}/history.json") or {}
    state = stack.read_json("worker", f"{run_dir}/state.json") or {}
    if history.get("epoch") != [1, 2, 3, 4] or state.get("status") != "completed":
        raise StepError(f"history epochs {history.get('epoch')}, state {state.get('status')}")
    if state.get("mlflow_run_id") != context["kill_mlflow_run"]:
        raise StepError("the re-run opened a new MLflow run instead of continuing the killed one")
    entry.detail = (
        f"re-run logged '{wanted}', trained epochs {last_epoch + 1}-4 only, history 1-4 once each, same MLflow run"
    )


def check_search(stack: Stack, archive: Path, entry: Check) -> None:
    """Two workers, one flow run each (CIFAR_WORKER_LIMIT=1); the search runs beside them and spreads its trials.

    The search is started from the command line in a worker container (`python flows/search.py` with the
    container's PREFECT_API_URL: the `cifar-search` flow on the server, trials on its pool). Through the
    `cifar-search/search` deployment the search's own flow run would take a worker: with a limit of 1 that
    worker could run no trial, and without a limit one worker may take both trials.
    """
    started = time.monotonic()
    stack.set_variable("CIFAR_WORKER_LIMIT", "1")
    stack.compose("up", "-d", "--scale", "worker=2", "worker")  # Recreates worker 1 with the limit too.
    stack.wait_healthy(["worker"], 600)
    workers = stack.containers("worker")
    if len(workers) != 2:
        raise StepError(f"{len(workers)} worker containers, not 2")
    pause_nightly(stack)
    stack.exec("worker", "prefect", "concurrency-limit", "create", "training", "2", timeout=120)
    source = archive_parameters(archive)
    command = ["python", "flows/search.py", "--source", source["source"], "--sha256", source["sha256"]]
    command += ["--preset", "smoke", "--space", "smoke", "--trials", "4", "--parallel", "2", "--until", "train"]
    # The smoke space on the smoke preset with shorter epochs: the point is where and when trials run.
    command += ["--set", "train.steps_per_epoch=20"]
    stack.exec("worker", *command, timeout=1800)
    summaries = [stack.read_json("worker", f"{WORKDIR}/search-summary.json", index=index) for index in (0, 1)]
    if not summaries[0] or summaries[0] != summaries[1]:
        raise StepError("the two workers do not see the same search-summary.json")
    trials = summaries[0]["trials"]
    if len(trials) != 4 or any(trial["state"] not in ("COMPLETE", "PRUNED") for trial in trials):
        raise StepError(f"trials: {[(trial['number'], trial['state']) for trial in trials]}")
    searches = stack.prefect("POST", "/flow_runs/filter", {"flows": {"name": {"any_": ["cifar-search"]}}})
    if [run["state"]["type"] for run in searches] != ["COMPLETED"]:
        raise StepError(f"cifar-search flow runs: {[run['state']['type'] for run in searches]}")
    # Which container ran which trial: each worker's own log names the flow runs it submitted. Both
    # workers may try the same run; the server lets one have it and the other logs "Aborted submission".
    submitted = {name: submitted_flow_runs(logs_of(stack, name)) for name in workers}
    spans = []
    for trial in trials:
        run = stack.flow_run(trial["flow_run_id"])
        ran_in = [name for name in workers if trial["flow_run_id"] in submitted[name]]
        if len(ran_in) != 1:
            raise StepError(f"trial {trial['number']} was submitted by {ran_in or 'no worker'}")
        spans.append((ran_in[0], parse_time(run["start_time"]), parse_time(run["end_time"]), trial["number"]))
    if {container for container, *_ in spans} != set(workers):
        raise StepError(f"all trials ran in {spans[0][0]}")
    overlaps = [
        f"#{a[3]}+#{b[3]}"
        for position, a in enumerate(spans)
        for b in spans[position + 1 :]
        if a[0] != b[0] and a[1] < b[2] and b[1] < a[2]
    ]
    if not overlaps:
        raise StepError("no two trials ran at the same time in different containers")
    placement = ", ".join(f"#{number} {container[len(stack.project) + 1 :]}" for container, _, _, number in spans)
    entry.detail = (
        f"cifar-search COMPLETED in {time.monotonic() - started:.0f} s, {summaries[0]['counts']}; trials "
        f"{placement}; in both containers at once: {', '.join(overlaps)}; one study journal and "
        f"search-summary.json on the shared workdir volume"
    )


def submitted_flow_runs(worker_log: str) -> set[str]:
    """The flow runs a worker submitted: those it tried, less those the server gave another worker."""
    tried = set(re.findall(r"submitting flow run '([0-9a-f-]{36})'", worker_log))
    return tried - set(re.findall(r"Aborted submission of flow run '([0-9a-f-]{36})'", worker_log))


def logs_of(stack: Stack, container: str) -> str:
    result = stack.engine("logs", container, check=False, timeout=120)
    return result.stdout + result.stderr


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def check_privileges(stack: Stack, entry: Check) -> None:
    processes, users = 0, set()
    for container in stack.containers(all=False):
        if stack.engine.name == "podman":  # The user inside the container, by name.
            result = stack.engine("top", container, "user", "pid", "args", timeout=60)
        else:  # `docker top` runs ps on the host: numeric uids (the host may name them otherwise).
            result = stack.engine("top", container, "-eo", "uid,pid,args", timeout=60)
        for line in result.stdout.splitlines()[1:]:
            words = line.split()
            if not words:
                continue
            processes += 1
            users.add(words[0])
            if words[0] not in UNPRIVILEGED and not (words[0].isdigit() and words[0] != "0"):
                raise StepError(f"{container} runs {' '.join(words[2:])[:80]} as {words[0]}")
    published = 0
    for container in stack.containers(all=False):
        ports = stack.engine("inspect", "--format", "{{json .HostConfig.PortBindings}}", container, timeout=60)
        for bindings in (json.loads(ports.stdout) or {}).values():
            for binding in bindings or []:
                published += 1
                if binding.get("HostIp") != "127.0.0.1":
                    raise StepError(f"{container} publishes {binding} beyond 127.0.0.1")
    containers = len(stack.containers(all=False))
    entry.detail = (
        f"{processes} processes in {containers} containers, as {', '.join(sorted(users))}, none as root; "
        f"{published} published ports, all on 127.0.0.1"
    )


def pause_nightly(stack: Stack) -> None:
    """Pauses the nightly schedule (a full training at 02:00 UTC would compete with the checks)."""
    with contextlib.suppress(StepError):
        deployment = stack.prefect("GET", "/deployments/name/cifar/nightly")
        if not deployment.get("paused"):
            stack.prefect("PATCH", f"/deployments/{deployment['id']}", {"paused": True})


# --- Teardown -------------------------------------------------------------------------------------------


def leftovers(engine: Engine, project: str) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={project}"
    found = {
        "containers": engine("ps", "-a", "--format", "{{.Names}}", "--filter", label, timeout=60).stdout.split(),
        "volumes": engine("volume", "ls", "--format", "{{.Name}}", "--filter", label, timeout=60).stdout.split(),
        "networks": [
            name
            for name in engine("network", "ls", "--format", "{{.Name}}", timeout=60).stdout.split()
            if name.startswith(project)
        ],
    }
    if engine.name == "podman":
        pods = engine("pod", "ls", "--format", "{{.Name}}", timeout=60).stdout.split()
        found["pods"] = [name for name in pods if project in name]
    return {kind: names for kind, names in found.items() if names}


def teardown(engine: Engine, stack: Stack | None, project: str, entry: Check) -> None:
    if stack is not None:
        with contextlib.suppress(StepError):
            # podman-compose 1.6's `down` knows only the first container of a scaled service: the others
            # (worker 2) would keep the services they depend on, and their volumes, from being removed.
            for container in stack.containers() if engine.name == "podman" else []:
                if not container.endswith("_1"):
                    engine("rm", "-f", container, timeout=120)
            stack.down(volumes=True)
    left = leftovers(engine, project)
    if left:  # Whatever `down` missed (a failed start, a half-made container): removed one by one.
        for name in left.get("containers", []):
            engine("rm", "-f", "-v", name, check=False, timeout=120)
        for name in left.get("pods", []):
            engine("pod", "rm", "-f", name, check=False, timeout=120)
        for name in left.get("volumes", []):
            engine("volume", "rm", "-f", name, check=False, timeout=120)
        for name in left.get("networks", []):
            engine("network", "rm", "-f", name, check=False, timeout=120)
    remaining = leftovers(engine, project)
    if remaining:
        raise StepError(f"still there: {remaining}")
    entry.detail = f"no container, volume, network or pod of {project} left" + (
        f" (removed after `down`: {left})" if left else ""
    )


# --- Main -----------------------------------------------------------------------------------------------


def main() -> int:
    global LOG
    engine_name = os.environ.get("ENGINE", "podman")
    gpu = os.environ.get("GPU", "0") not in ("", "0", "false", "no")
    bases_mode = os.environ.get("BASES", "auto")
    keep = os.environ.get("KEEP_STACK", "0") not in ("", "0", "false", "no")
    archive = Path(os.environ.get("CIFAR_ARCHIVE", REPO_ROOT.parent / "shared" / "data" / "cifar-10-python.tar.gz"))
    project = f"cifar-check-{secrets.token_hex(4)}"
    scratch = Path(tempfile.mkdtemp(prefix=f"{project}-"))
    LOG = Log(scratch / "stack-check.log")
    report = Report(engine_name)
    context: dict[str, Any] = {}
    stack: Stack | None = None
    engine: Engine | None = None
    failed = False
    print(f"stack-check {project}: log {LOG.path}", flush=True)
    try:
        if not archive.is_file():
            raise StepError(f"no archive at {archive} (set CIFAR_ARCHIVE)")
        with report.check("tools") as entry:
            engine = Engine(engine_name)
            install_tools(engine, entry, need_mmdebstrap=bases_mode != "official")
        with report.check("base images") as entry:
            bases = choose_bases(engine, bases_mode, report, entry)
        password = secrets.token_urlsafe(24)
        LOG.secrets.append(password)
        variables = {
            "POSTGRES_PASSWORD": password,
            "PREFECT_HOST_PORT": str(free_port()),
            "MLFLOW_HOST_PORT": str(free_port()),
            "SERVE_HOST_PORT": str(free_port()),
            "CIFAR_DATA_DIR": str(archive.resolve().parent),
            **bases,
        }
        with report.check("images built") as entry:
            build_images(engine, variables, gpu, report, entry)
        env_file = scratch / "stack.env"
        write_env_file(env_file, variables)
        stack = Stack(engine, project, env_file, variables)
        with report.check("stack up, every service healthy") as entry:
            seconds = stack.up()
            pause_nightly(stack)
            entry.detail = (
                f"project {project}: postgres, prefect-server, mlflow, worker healthy in {seconds:.0f} s "
                f"(Prefect 127.0.0.1:{variables['PREFECT_HOST_PORT']}, "
                f"MLflow 127.0.0.1:{variables['MLFLOW_HOST_PORT']})"
            )
        with report.check("cifar/smoke on the archive, through the worker") as entry:
            check_smoke_run(stack, archive, entry, context)
        with report.check("flow run in Prefect's PostgreSQL") as entry:
            check_prefect_database(stack, entry, context)
        with report.check("MLflow run, metrics, champion, artifacts") as entry:
            check_mlflow(stack, entry, context, report)
        with report.check("stack stopped and started: all still there") as entry:
            check_restart(stack, entry, context)
        with report.check("served champion = reloaded SavedModel") as entry:
            check_serving(stack, archive, entry, context, report)
        with report.check("worker killed mid-training: CRASHED") as entry:
            check_kill(stack, archive, entry, context)
        with report.check("re-run resumes from the last checkpoint") as entry:
            check_resume(stack, archive, entry, context)
        with report.check("2 workers: 4-trial search, parallel 2") as entry:
            check_search(stack, archive, entry)
        with report.check("processes unprivileged, ports on 127.0.0.1") as entry:
            check_privileges(stack, entry)
    except Exception as error:  # Reported, logged with its traceback; the teardown below still runs.
        failed = True
        LOG.write("\n" + traceback.format_exc())
        print(f"stack-check: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        if stack is not None:
            save_container_logs(stack)
    except KeyboardInterrupt:
        failed = True
        print("stack-check: interrupted", file=sys.stderr)
    finally:
        if engine is not None and not keep:
            try:
                with report.check("teardown: nothing left behind") as entry:
                    teardown(engine, stack, project, entry)
            except StepError:
                failed = True
        elif keep:
            report.checks["teardown: nothing left behind"].detail = f"KEEP_STACK=1: {project} left running"
    statuses = [entry.status for entry in report.checks.values()]
    passed, failures, skipped = statuses.count("ok"), statuses.count("FAILED"), statuses.count("not run")
    print("\n" + report.render() + f"\n\nFull log: {LOG.path}", flush=True)
    print(f"stack-check: {passed} passed, {failures} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed or failures or skipped else 0


def write_env_file(path: Path, variables: dict[str, str]) -> None:
    path.touch(mode=0o600)
    path.write_text("".join(f"{key}={value}\n" for key, value in variables.items()), encoding="utf-8")


def save_container_logs(stack: Stack) -> None:
    """Each container's last log lines beside the command log (the stack is about to be removed)."""
    with contextlib.suppress(StepError):
        for container in stack.containers():
            result = stack.engine("logs", "--tail", "200", container, check=False, timeout=60)
            LOG.write(f"\n===== logs of {container} =====\n{result.stdout}{result.stderr}")


if __name__ == "__main__":
    sys.exit(main())
