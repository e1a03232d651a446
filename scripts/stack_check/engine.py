"""The container engine (Podman or Docker) with the project's settings, and the tools it needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

from harness import REPO_ROOT
from scripts.stack_check.report import Row
from scripts.stack_check.shell import Shell, StepError

PODMAN_CONF = REPO_ROOT / "docker" / "podman" / "containers.conf"
TOOLS_VENV = REPO_ROOT / ".venv" / "stack-tools"
PODMAN_COMPOSE_SPEC = "podman-compose==1.6.0"
APT_PACKAGES = ("podman", "runc", "netavark", "aardvark-dns", "iptables", "catatonit", "mmdebstrap")


class Engine:
    """`podman` or `docker`, with the project's settings, its commands run through `shell`."""

    def __init__(self, shell: Shell, name: str):
        if name not in ("podman", "docker"):
            raise StepError(f"ENGINE must be podman or docker, not {name!r}")
        self.shell = shell
        self.name = name
        self.env = dict(os.environ)
        if name == "podman":
            # The project's settings (docker/podman/containers.conf); nothing in /etc changes.
            self.env.setdefault("CONTAINERS_CONF", str(PODMAN_CONF))
        else:
            self.env["DOCKER_BUILDKIT"] = "1"  # Build secrets need BuildKit.

    def __call__(self, *args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.shell.run([self.name, *args], env=kwargs.pop("env", self.env), **kwargs)

    def compose_command(self) -> list[str]:
        if self.name == "podman":
            bundled = TOOLS_VENV / "bin" / "podman-compose"  # The stack check's; else the machine's own.
            return [str(bundled) if bundled.is_file() or not shutil.which("podman-compose") else "podman-compose"]
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


def apt_install(shell: Shell, packages: list[str]) -> None:
    apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    shell.run(["apt-get", "update", "-qq"], env=apt_env, timeout=600)
    shell.run(["apt-get", "install", "-y", "-qq", *packages], env=apt_env, timeout=1200)


def install_tools(engine: Engine, row: Row, need_mmdebstrap: bool) -> None:
    """Podman and its helpers from apt and podman-compose (PyPI) in its own venv, when missing; or a
    running Docker. mmdebstrap builds the stand-in base images."""
    installed = []
    if engine.name == "podman":
        installed += install_podman(engine, need_mmdebstrap)
        version = engine("--version", timeout=60).stdout.strip()
        compose_version = engine.shell.run([*engine.compose_command(), "--version"], env=engine.env, timeout=60)
        compose_version = compose_version.stdout.strip().splitlines()[0]
        row.detail = f"{version}, {compose_version}, runtime runc (docker/podman/containers.conf)"
    else:
        if engine("info", check=False, timeout=60).returncode != 0:
            raise StepError("`docker info` fails: start the Docker daemon (ENGINE=docker needs Docker Engine)")
        version = engine("version", "--format", "{{.Server.Version}}", timeout=60).stdout.strip()
        compose_version = engine("compose", "version", "--short", timeout=60).stdout.strip()
        row.detail = f"Docker {version}, compose {compose_version}"
        if need_mmdebstrap and not shutil.which("mmdebstrap"):
            if os.geteuid() != 0 or not shutil.which("apt-get"):
                raise StepError("mmdebstrap is missing (needed for the stand-in base images)")
            apt_install(engine.shell, ["mmdebstrap"])
            installed.append("mmdebstrap")
    if installed:
        row.detail += f"; installed {', '.join(installed)}"


def install_podman(engine: Engine, need_mmdebstrap: bool) -> list[str]:
    """What was missing and is now installed: apt packages, then podman-compose in .venv/stack-tools."""
    installed = []
    wanted = [package for package in APT_PACKAGES if package != "mmdebstrap" or need_mmdebstrap]
    missing = [package for package in wanted if not dpkg_installed(package)]
    if missing and shutil.which("podman") and not shutil.which("apt-get"):
        missing = []  # Not Debian: podman is there; trust the machine's own packaging.
    if missing:
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            raise StepError(f"missing {' '.join(missing)}: install them (apt-get install) or run as root")
        apt_install(engine.shell, missing)
        installed += missing
    if not (TOOLS_VENV / "bin" / "podman-compose").is_file():
        engine.shell.run([sys.executable, "-m", "venv", TOOLS_VENV], timeout=300)
        engine.shell.run([TOOLS_VENV / "bin" / "pip", "install", "--quiet", PODMAN_COMPOSE_SPEC], timeout=600)
        installed.append(PODMAN_COMPOSE_SPEC)
    return installed
